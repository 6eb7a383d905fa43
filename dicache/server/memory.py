"""Where a served pipeline's GPU memory goes: weights per component and the caching allocator's counters.

`memory_breakdown(pipe)` (in GB, 1e9 bytes) for a pipeline on a CUDA device, None elsewhere:
- `weights_GB`: bytes of the parameters and buffers of each component on the device (`transformer`,
  `text_encoder`, `vae`), FP8 weights counted at their stored size (a tensor subclass counts its inner tensors);
- `allocated_GB` / `peak_allocated_GB`: tensors alive now / at most since the last `reset_peak` (torch's counters);
- `activations_peak_GB`: `peak_allocated_GB` minus all weights: the largest working set of the requests;
- `reserved_GB` / `peak_reserved_GB`: what the caching allocator holds from the driver (allocated + its reserve),
  now / at most;
- `reserve_GB`: `reserved_GB − allocated_GB`, memory held but unused right now.

What `nvidia-smi` shows for the process is `peak_reserved_GB` plus the CUDA context (driver, kernels, cuBLAS and
cuDNN workspaces outside the allocator): a client reading both gets the context as the difference.
"""

from __future__ import annotations

from typing import Any

import torch

GB = 1e9
COMPONENTS = ("transformer", "text_encoder", "vae")


def tensor_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` stores: for a wrapper subclass (torchao's FP8 weights, parameters included) the sum over its
    inner tensors."""
    if type(tensor) not in (torch.Tensor, torch.nn.Parameter) and hasattr(tensor, "__tensor_flatten__"):
        names, _ = tensor.__tensor_flatten__()
        return sum(tensor_bytes(getattr(tensor, name)) for name in names)
    return tensor.numel() * tensor.element_size()


def module_bytes(module: Any, device: torch.device) -> int:
    """Bytes of `module`'s parameters and buffers on `device` (0 for None or a non-module)."""
    if not isinstance(module, torch.nn.Module):
        return 0
    tensors = [*module.parameters(), *module.buffers()]
    return sum(tensor_bytes(t) for t in tensors if t.device == device)


def component_modules(pipe: Any) -> dict[str, Any]:
    """The pipeline's components as modules (the text encoder wrapper's model inside)."""
    text = getattr(pipe, "text_encoder", None)
    return {
        "transformer": getattr(pipe, "transformer", None),
        "text_encoder": getattr(text, "text_encoder", text),
        "vae": getattr(pipe, "vae", None),
    }


def memory_breakdown(pipe: Any) -> dict[str, Any] | None:
    """The breakdown described in the module docstring, or None when the pipeline is not on a CUDA device."""
    device = getattr(pipe, "device", None)
    if device is None or torch.device(device).type != "cuda":
        return None
    device = torch.device(device)
    if device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    weights = {name: module_bytes(module, device) for name, module in component_modules(pipe).items()}
    allocated, reserved = torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
    peak_allocated = torch.cuda.max_memory_allocated(device)
    return {
        "weights_GB": {name: round(b / GB, 3) for name, b in weights.items()},
        "allocated_GB": round(allocated / GB, 3),
        "peak_allocated_GB": round(peak_allocated / GB, 3),
        "activations_peak_GB": round((peak_allocated - sum(weights.values())) / GB, 3),
        "reserved_GB": round(reserved / GB, 3),
        "peak_reserved_GB": round(torch.cuda.max_memory_reserved(device) / GB, 3),
        "reserve_GB": round((reserved - allocated) / GB, 3),
    }


def release_cached_memory(device: Any) -> None:
    """Hand the allocator's unused blocks back to the driver and start the peak counters afresh (after loading and
    after the warm-up, so that the serving peak is what the requests need). No-op off CUDA."""
    if device is not None and torch.device(device).type == "cuda" and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
