"""A module's weights packed into one flat byte buffer, and pointing the module at any copy of that buffer.

`PackedWeights(module)` finds every plain tensor behind the module's parameters and buffers (tensor subclasses that
wrap plain tensors, such as torchao's FP8 weights, are flattened into their inner tensors and rebuilt around the
views), lays them out at 512-byte aligned offsets with their own strides, and copies them once into a host buffer
(page-locked when asked, without the power-of-two rounding of PyTorch's pinned allocator). `point_to(buffer)` makes
the module's tensors views of `buffer`, the host one or a device copy of it: one `copy_` of the whole buffer then
moves the module.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

ALIGN = 512

Rebuild = Callable[[list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class _Place:
    """Where one plain tensor sits in the packed buffer."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class _Entry:
    """One parameter or buffer: its plain tensors' places and how to put it back together from views of them."""

    places: tuple[_Place, ...]
    assign: Callable[[list[torch.Tensor]], None]


def _span_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _flatten(tensor: torch.Tensor) -> tuple[list[torch.Tensor], Rebuild]:
    """The plain tensors behind `tensor` and the function that rebuilds an equal tensor from replacements of them."""
    if not is_traceable_wrapper_subclass(tensor):
        return [tensor], lambda views: views[0]
    names, context = tensor.__tensor_flatten__()
    parts = [_flatten(getattr(tensor, name)) for name in names]
    size, stride, cls = tensor.size(), tensor.stride(), type(tensor)

    def rebuild(views: list[torch.Tensor]) -> torch.Tensor:
        inner, start = {}, 0
        for name, (plain, rebuild_inner) in zip(names, parts):
            inner[name] = rebuild_inner(views[start : start + len(plain)])
            start += len(plain)
        return cls.__tensor_unflatten__(inner, context, size, stride)

    return [p for plain, _ in parts for p in plain], rebuild


def module_tensors(module: nn.Module) -> list[tuple[list[torch.Tensor], Callable[[list[torch.Tensor]], None]]]:
    """Each parameter and buffer of `module`: its plain tensors and a function that replaces it in the module by the
    tensor rebuilt from replacements of them (a plain parameter keeps its identity: only its `.data` changes)."""
    found: list = []
    seen: set[int] = set()
    for sub in module.modules():
        for key, param in sub._parameters.items():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            plain, rebuild = _flatten(param)
            if is_traceable_wrapper_subclass(param):

                def assign(views, owner=sub, key=key, rebuild=rebuild, grad=param.requires_grad) -> None:
                    owner._parameters[key] = nn.Parameter(rebuild(views), requires_grad=grad)

            else:

                def assign(views, p=param) -> None:
                    p.data = views[0]

            found.append((plain, assign))
        for key, buffer in sub._buffers.items():
            if buffer is None or id(buffer) in seen:
                continue
            seen.add(id(buffer))
            plain, rebuild = _flatten(buffer)

            def assign_buffer(views, owner=sub, key=key, rebuild=rebuild) -> None:
                owner._buffers[key] = rebuild(views)

            found.append((plain, assign_buffer))
    return found


def module_bytes(module: nn.Module) -> int:
    """Bytes of the plain tensors behind `module`'s parameters and buffers (as stored, after any quantization)."""
    return sum(_span_bytes(t) for plain, _ in module_tensors(module) for t in plain)


def packed_bytes(module: nn.Module) -> int:
    """Size of `module`'s packed buffer (each plain tensor at a 512-byte aligned offset)."""
    total = 0
    for plain, _ in module_tensors(module):
        for tensor in plain:
            total = -(-total // ALIGN) * ALIGN + _span_bytes(tensor)
    return total


class PackedWeights:
    """`module`'s weights in one flat `uint8` host buffer, `host` (the module is left pointing at it).

    Args:
        module: its parameters and buffers may sit on any device; afterwards they are views of `host`.
        pin: page-lock `host` (CUDA only) so copies from it run asynchronously at full speed.
    """

    def __init__(self, module: nn.Module, pin: bool = False) -> None:
        entries, sources, offset = [], [], 0
        for plain, assign in module_tensors(module):
            places = []
            for tensor in plain:
                offset = -(-offset // ALIGN) * ALIGN
                nbytes = _span_bytes(tensor)
                places.append(_Place(offset, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), nbytes))
                sources.append(tensor)
                offset += nbytes
            entries.append(_Entry(tuple(places), assign))
        self.entries: list[_Entry] = entries
        self.nbytes = offset
        self.host = torch.empty(offset, dtype=torch.uint8)
        for place, tensor in zip((p for e in entries for p in e.places), sources):
            self.view(self.host, place).copy_(tensor)
        self.pinned = False
        if pin and torch.cuda.is_available() and offset:
            self.pinned = _register(self.host)
            if not self.pinned:
                self.host = self.host.pin_memory()
                self.pinned = True
        self.point_to(self.host)

    @staticmethod
    def view(buffer: torch.Tensor, place: _Place) -> torch.Tensor:
        region = buffer[place.offset : place.offset + place.nbytes]
        if not place.shape:
            return region.view(place.dtype).view(())
        return region.view(place.dtype).as_strided(place.shape, place.stride)

    def point_to(self, buffer: torch.Tensor) -> None:
        """Make the module's tensors views of `buffer` (`uint8`, at least `nbytes` long, any device)."""
        for entry in self.entries:
            entry.assign([self.view(buffer, place) for place in entry.places])

    def release(self) -> None:
        """Unpin the host buffer (the module keeps pointing at it, now pageable)."""
        if self.pinned and _registered(self.host):
            torch.cuda.cudart().cudaHostUnregister(self.host.data_ptr())
        self.pinned = False

    def __del__(self) -> None:  # never leave freed memory registered with the driver
        with contextlib.suppress(Exception):  # interpreter shutdown
            self.release()


_REGISTERED: set[int] = set()


def _register(buffer: torch.Tensor) -> bool:
    """Page-lock exactly `buffer`'s bytes with cudaHostRegister; False if the driver refuses."""
    try:
        code = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    except (AttributeError, RuntimeError):
        return False
    if code == 0:
        _REGISTERED.add(buffer.data_ptr())
    else:
        _clear_cuda_error()
    return code == 0


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a refused registration, so that the next kernel launch check does
    not report it (best effort: the runtime library PyTorch already loaded)."""
    for name in ("libcudart.so.13", "libcudart.so.12", "libcudart.so"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def _registered(buffer: torch.Tensor) -> bool:
    if buffer.data_ptr() in _REGISTERED:
        _REGISTERED.discard(buffer.data_ptr())
        return True
    return False
