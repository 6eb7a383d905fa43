"""Any `nn.Module` whose blocks sit in an `nn.ModuleList` and are called `block(hidden_states, *args) -> hidden`."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ...errors import UnsupportedModelError
from .base import BlockForm, ModelSpec, SingleStream

BLOCK_LIST_NAMES = ("transformer_blocks", "blocks", "layers")


def find_block_list(model: nn.Module) -> nn.ModuleList:
    """The model's block stack: a known attribute name, else the largest ModuleList of identical modules."""
    for name in BLOCK_LIST_NAMES:
        candidate = getattr(model, name, None)
        if isinstance(candidate, nn.ModuleList) and len(candidate) > 0:
            return candidate
    best = None
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and (best is None or len(module) > len(best)):
                best = module
    if best is None:
        raise UnsupportedModelError(
            f"dicache.enable: {type(model).__name__} has no nn.ModuleList of transformer blocks "
            f"(looked for attributes {', '.join(BLOCK_LIST_NAMES)} and for any list of identical modules)"
        )
    return best


def timestep_getter(model: nn.Module, name: str = "timestep") -> Callable[[tuple, dict], Any]:
    """Reads the `timestep` argument of `model.forward` from a call's (args, kwargs)."""
    params = list(inspect.signature(model.forward).parameters)
    position = params.index(name) if name in params else None

    def get(args: tuple, kwargs: dict) -> Any:
        if name in kwargs:
            return kwargs[name]
        if position is not None and position < len(args):
            return args[position]
        raise UnsupportedModelError(
            f"dicache: {type(model).__name__}.forward was called without a '{name}' argument, so the denoising step "
            "cannot be derived; pass it, or declare steps with dicache.request/dicache.step"
        )

    return get


def generic_spec(model: nn.Module, form: BlockForm | None = None) -> ModelSpec:
    """A `ModelSpec` for a model we have no dedicated adapter for."""
    seam = "run_blocks" if callable(getattr(model, "run_blocks", None)) else None
    return ModelSpec(
        owner=model,
        blocks=find_block_list(model),
        form=form or SingleStream(),
        seam=seam,
        timestep=timestep_getter(model),
    )
