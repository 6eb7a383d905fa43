"""Any `nn.Module` whose blocks sit in one `nn.ModuleList`: the fallback for models no family entry describes.

The block list is a known attribute name, else the largest list of identical modules; its form is `h -> h` unless
`form=` says otherwise. `apply_forms` is how a `form=` value overrides the forms of a stack's lists.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn

from ..errors import BlockFormError, UnsupportedModelError
from .forms import H_TO_H, BlockForm, form_named
from .stack import BlockList, StackSpec

BLOCK_LIST_NAMES = ("transformer_blocks", "blocks", "layers")

FormArg = BlockForm | str | Sequence[BlockForm | str] | Mapping[str, BlockForm | str] | None
"""What `dicache.enable(form=...)` takes: one form (or label) for every block list, one per list, or a mapping from
block-list attribute to form, which declares the lists (in the order the forward runs them)."""


def find_block_list(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's block list and its attribute path: a known attribute name, else the largest ModuleList of
    identical modules."""
    for name in BLOCK_LIST_NAMES:
        candidate = getattr(model, name, None)
        if isinstance(candidate, nn.ModuleList) and len(candidate) > 0:
            return name, candidate
    best: tuple[str, nn.ModuleList] | None = None
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            kinds = {type(m) for m in module}
            if len(kinds) == 1 and (best is None or len(module) > len(best[1])):
                best = (path, module)
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


def apply_forms(lists: Sequence[tuple[str, nn.ModuleList, BlockForm]], form: FormArg) -> tuple[BlockList, ...]:
    """The block lists with the forms `form` gives (None: each list's own): one form for all, or one per list (a
    mapping declares the lists itself: see `declared_lists`)."""
    if form is None:
        forms = [f for _, _, f in lists]
    elif isinstance(form, BlockForm | str):
        forms = [_named(form)] * len(lists)
    else:
        given = list(form)
        if len(given) != len(lists):
            paths = ", ".join(path for path, _, _ in lists)
            raise BlockFormError(
                f"form= lists {len(given)} forms, and the model has {len(lists)} block lists ({paths}); "
                "give one form for all lists or one per list"
            )
        forms = [_named(f) for f in given]
    return tuple(BlockList(path, blocks, f) for (path, blocks, _), f in zip(lists, forms))


def declared_lists(model: nn.Module, form: Mapping[str, BlockForm | str]) -> tuple[BlockList, ...]:
    """The block lists a `form=` mapping declares: each key an attribute (dotted path) of `model` holding a non-empty
    `nn.ModuleList`, in the order the forward runs them."""
    if not form:
        raise BlockFormError("form= is an empty mapping; name at least one block list and its form")
    lists = []
    for path, value in form.items():
        blocks: Any = model
        for part in str(path).split("."):
            blocks = getattr(blocks, part, None)
        if not isinstance(blocks, nn.ModuleList) or len(blocks) == 0:
            raise BlockFormError(
                f"form= names {path!r}, which is not a non-empty nn.ModuleList of {type(model).__name__}; the keys "
                "of a form= mapping are the attributes holding its block lists"
            )
        lists.append(BlockList(str(path), blocks, _named(value)))
    return tuple(lists)


def _named(value: BlockForm | str) -> BlockForm:
    try:
        return form_named(value)
    except ValueError as exc:
        raise BlockFormError(str(exc)) from None


def generic_spec(model: nn.Module, form: FormArg = None) -> StackSpec:
    """A `StackSpec` for a model we have no family entry for: its one block list, `h -> h` unless `form` says (a
    `form=` mapping declares the lists instead)."""
    if isinstance(form, Mapping):
        lists = declared_lists(model, form)
    else:
        path, blocks = find_block_list(model)
        lists = apply_forms([(path, blocks, H_TO_H)], form)
    seam = "run_blocks" if len(lists) == 1 and callable(getattr(model, "run_blocks", None)) else None
    return StackSpec(owner=model, lists=lists, seam=seam, timestep=timestep_getter(model))
