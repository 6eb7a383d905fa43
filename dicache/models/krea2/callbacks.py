"""The per-step callback of `Krea2Pipeline.__call__`, with diffusers' `callback_on_step_end` contract.

`callback(pipe, step_index, timestep, callback_kwargs) -> dict` runs after each denoising step, once the step's
latents are computed. `callback_kwargs` maps each name of `callback_on_step_end_tensor_inputs` to the current tensor;
an entry of the returned dict replaces that tensor for the rest of the run (None or `{}`: nothing changes). An object
with a `tensor_inputs` list (diffusers' `PipelineCallback` / `MultiPipelineCallbacks`) names its own inputs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

StepCallback = Callable[[Any, int, torch.Tensor, dict[str, torch.Tensor]], dict[str, torch.Tensor] | None]
"""`callback_on_step_end(pipe, step_index, timestep, callback_kwargs) -> dict`."""


def callback_inputs(callback: StepCallback | None, names: Sequence[str], allowed: Sequence[str]) -> list[str]:
    """The tensor names `callback` receives: its own `tensor_inputs` when it has them, else `names`; each must be in
    `allowed` (else `ValueError` naming the accepted ones). No callback: none."""
    if callback is None:
        return []
    names = list(getattr(callback, "tensor_inputs", None) or names)
    unknown = [name for name in names if name not in allowed]
    if unknown:
        raise ValueError(
            f"callback_on_step_end_tensor_inputs={names!r} is invalid: {unknown} are not in {list(allowed)}"
        )
    return names


def run_callback(
    callback: StepCallback,
    pipe: Any,
    step: int,
    timestep: torch.Tensor,
    inputs: Sequence[str],
    tensors: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    """Call `callback` with the `inputs` among `tensors`; return `tensors` with the entries it returned replaced."""
    returned = callback(pipe, step, timestep, {name: tensors[name] for name in inputs})
    if returned is None:
        return tensors
    if not isinstance(returned, dict):
        raise TypeError(f"callback_on_step_end must return a dict of tensors (or None); it returned {returned!r}")
    return {**tensors, **{name: value for name, value in returned.items() if name in tensors}}
