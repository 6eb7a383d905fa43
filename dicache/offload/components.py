"""Whole-component offload: a component kept on the host and brought to the device only for the phase that uses it.

SGLang's `--text-encoder-cpu-offload`, `--vae-cpu-offload` and `--dit-cpu-offload`. Each component's weights are
packed once into a host buffer (page-locked when asked); entering a phase copies the components it needs into one
device buffer each (one asynchronous copy on the compute stream, so later kernels see the weights) and points the
other offloaded components back at their host copies, freeing their device memory for this phase.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from .packing import PackedWeights


@dataclass
class _Component:
    packed: PackedWeights
    device_copy: torch.Tensor | None = None


class ComponentOffloader:
    """Components by name, each on the host until a phase that needs it starts.

    Args:
        device: where components run.
        pin_memory: page-lock the host copies (CUDA).
    """

    def __init__(self, device: torch.device | str, pin_memory: bool = True) -> None:
        self.device = torch.device(device)
        self.pin = pin_memory and self.device.type == "cuda"
        self.components: dict[str, _Component] = {}
        self.bytes_in = 0

    def add(self, name: str, module: nn.Module) -> None:
        """Keep `module` on the host from now on (its weights move into a packed host buffer)."""
        self.components[name] = _Component(PackedWeights(module, pin=self.pin))

    def on_device(self, name: str) -> bool:
        return self.components[name].device_copy is not None

    def enter(self, needed: Iterable[str]) -> None:
        """A phase starts that uses `needed`: release the other components' device copies, then bring those in."""
        needed = set(needed)
        for name, component in self.components.items():
            if name not in needed and component.device_copy is not None:
                component.packed.point_to(component.packed.host)
                component.device_copy = None
        for name in needed & set(self.components):
            component = self.components[name]
            if component.device_copy is None:
                copy = torch.empty(component.packed.nbytes, dtype=torch.uint8, device=self.device)
                copy.copy_(component.packed.host, non_blocking=self.pin)
                component.packed.point_to(copy)
                component.device_copy = copy
                self.bytes_in += component.packed.nbytes

    def close(self) -> None:
        """Leave every component on the host (pageable) and stop managing them."""
        self.enter(())
        for component in self.components.values():
            component.packed.release()
        self.components = {}
