"""A module's weights packed into one flat byte buffer, and pointing the module at any copy of that buffer.

`PackedWeights(module)` finds every plain tensor behind the module's parameters and buffers (tensor subclasses that
wrap plain tensors, e.g. quantized weights, are unwrapped), lays them out at 512-byte aligned offsets with their own
strides, and copies them once into a host buffer (page-locked when asked, without the power-of-two rounding of
PyTorch's pinned allocator). `point_to(buffer)` makes the module's tensors views of `buffer`, the host one or a device
copy of it; one `copy_` of the whole buffer then moves the module.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

ALIGN = 512


@dataclass(frozen=True)
class _Leaf:
    assign: Callable[[torch.Tensor], None]
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    nbytes: int


def _span_bytes(t: torch.Tensor) -> int:
    if t.numel() == 0:
        return 0
    return (1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))) * t.element_size()


def _plain_tensors(tensor: torch.Tensor, assign: Callable[[torch.Tensor], None], out: list) -> None:
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:

            def set_inner(value: torch.Tensor, owner=tensor, name=name) -> None:
                setattr(owner, name, value)

            _plain_tensors(getattr(tensor, name), set_inner, out)
    else:
        out.append((tensor, assign))


def module_tensors(module: nn.Module) -> list[tuple[torch.Tensor, Callable[[torch.Tensor], None]]]:
    """Every plain tensor of `module`'s parameters and buffers, with a function that replaces it in place."""
    found: list = []
    seen: set[int] = set()
    for sub in module.modules():
        for param in sub._parameters.values():
            if param is None or id(param) in seen:
                continue
            seen.add(id(param))
            if is_traceable_wrapper_subclass(param):
                _plain_tensors(param, None, found)
            else:

                def set_param(value: torch.Tensor, p=param) -> None:
                    p.data = value

                found.append((param, set_param))
        for name, buffer in sub._buffers.items():
            if buffer is None or id(buffer) in seen:
                continue
            seen.add(id(buffer))

            def set_buffer(value: torch.Tensor, owner=sub, key=name) -> None:
                owner._buffers[key] = value

            _plain_tensors(buffer, set_buffer, found)
    return found


def module_bytes(module: nn.Module) -> int:
    """Bytes of the plain tensors behind `module`'s parameters and buffers (as stored, after any quantization)."""
    return sum(_span_bytes(t) for t, _ in module_tensors(module))


def packed_bytes(module: nn.Module) -> int:
    """Size of `module`'s packed buffer (each tensor at a 512-byte aligned offset)."""
    total = 0
    for tensor, _ in module_tensors(module):
        total = -(-total // ALIGN) * ALIGN + _span_bytes(tensor)
    return total


class PackedWeights:
    """`module`'s weights in one flat `uint8` host buffer, `host` (the module is left pointing at it).

    Args:
        module: its parameters and buffers may sit on any device; afterwards they are views of `host`.
        pin: page-lock `host` (CUDA only) so copies from it run asynchronously at full speed.
    """

    def __init__(self, module: nn.Module, pin: bool = False) -> None:
        leaves, offset, sources = [], 0, []
        for tensor, assign in module_tensors(module):
            if assign is None:  # a parameter that is itself a wrapper subclass: its inner tensors carry the setters
                continue
            offset = -(-offset // ALIGN) * ALIGN
            nbytes = _span_bytes(tensor)
            leaves.append(_Leaf(assign, offset, tensor.dtype, tuple(tensor.shape), tuple(tensor.stride()), nbytes))
            sources.append(tensor)
            offset += nbytes
        self.leaves: list[_Leaf] = leaves
        self.nbytes = offset
        self.host = torch.empty(offset, dtype=torch.uint8)
        for leaf, tensor in zip(leaves, sources):
            self.view(self.host, leaf).copy_(tensor)
        self.pinned = False
        if pin and torch.cuda.is_available() and offset:
            self.pinned = _register(self.host)
            if not self.pinned:
                self.host = self.host.pin_memory()
                self.pinned = True
        self.point_to(self.host)

    @staticmethod
    def view(buffer: torch.Tensor, leaf: _Leaf) -> torch.Tensor:
        region = buffer[leaf.offset : leaf.offset + leaf.nbytes]
        if not leaf.shape:
            return region.view(leaf.dtype).view(())
        return region.view(leaf.dtype).as_strided(leaf.shape, leaf.stride)

    def point_to(self, buffer: torch.Tensor) -> None:
        """Make the module's tensors views of `buffer` (`uint8`, at least `nbytes` long, any device)."""
        for leaf in self.leaves:
            leaf.assign(self.view(buffer, leaf))

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
    import ctypes
    import os

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
