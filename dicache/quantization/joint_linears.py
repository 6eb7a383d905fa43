"""Bias-free linears that read one input, joined into one GEMM over their weights stacked along the outputs.

A model module declares which of its linears may be joined (`joinable`: tuples of child names that always receive
the same input) and computes them through `linear_outputs(module, x, names)`, which runs each joint linear once and
hands every name its slice, or runs the plain child where nothing is joined. `join_linears(module, parts)` does the
joining, in place (the parts are removed, so the weights are not held twice). The values are the parts' own up to the
GEMM's rounding: each output channel is the same dot product, computed in another kernel.

Why: a joint GEMM launches once and, for the narrow projections (Krea-2's 6144 -> 1536 key and value), fills the GPU
better; under FP8 the shared input is quantised once (benchmarks/RESULTS.md, `probe_fp8_block_compile.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

JOINT_SEPARATOR = "__"
"""A joint linear's child name is its parts' names joined by this (e.g. `to_q__to_gate`)."""


class JointLinear(nn.Linear):
    """`nn.Linear` whose output is the concatenation of named parts; calling it returns one tensor per part.

    part_names: the joined children's names, in output order; part_sizes: their output features.
    """

    def __init__(self, part_names: Sequence[str], part_sizes: Sequence[int], in_features: int, **factory) -> None:
        super().__init__(in_features, sum(part_sizes), bias=False, **factory)
        self.part_names, self.part_sizes = tuple(part_names), tuple(int(s) for s in part_sizes)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return super().forward(x).split(self.part_sizes, dim=-1)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, parts={dict(zip(self.part_names, self.part_sizes))}"


def joint_name(parts: Sequence[str]) -> str:
    """The child name of the joint linear of `parts`."""
    return JOINT_SEPARATOR.join(parts)


def join_linears(module: nn.Module, parts: Sequence[str]) -> JointLinear:
    """Replace the children `parts` of `module` (bias-free `nn.Linear`s of one input width, dtype and device) by one
    `JointLinear` registered as `joint_name(parts)`; returns it. Raises ValueError for parts that cannot be joined."""
    linears = [module._modules.get(name) for name in parts]
    bad = [n for n, m in zip(parts, linears) if not _joinable(m)]
    if len(parts) < 2 or bad:
        raise ValueError(
            f"join_linears({type(module).__name__}, {list(parts)}): need two or more bias-free nn.Linear children "
            f"with plain (not yet quantised) weights; not such: {bad}"
        )
    first = linears[0].weight
    if any(m.weight.shape[1] != first.shape[1] or m.weight.dtype != first.dtype for m in linears):
        raise ValueError(f"join_linears: {list(parts)} differ in input width or dtype")
    joint = JointLinear(parts, [m.out_features for m in linears], first.shape[1], device="meta", dtype=first.dtype)
    joint.weight = nn.Parameter(torch.cat([m.weight.detach() for m in linears]), requires_grad=first.requires_grad)
    for name in parts:
        delattr(module, name)
    module.add_module(joint_name(parts), joint)
    return joint


def _joinable(module: nn.Module | None) -> bool:
    """A plain bias-free `nn.Linear` whose weight is an ordinary tensor (not yet quantised)."""
    return type(module) is nn.Linear and module.bias is None and type(module.weight.data) is torch.Tensor


def _joint_holding(module: nn.Module, name: str) -> JointLinear | None:
    """The `JointLinear` child of `module` that computes the part `name`, if any."""
    return next((m for m in module.children() if isinstance(m, JointLinear) and name in m.part_names), None)


def linear_outputs(module: nn.Module, x: torch.Tensor, names: Sequence[str]) -> tuple[torch.Tensor, ...]:
    """`tuple(getattr(module, n)(x) for n in names)`, except that a joined part is read from its joint linear's output,
    each joint linear running once."""
    found: dict[str, torch.Tensor] = {}
    for name in names:
        if name in found:
            continue
        child = module._modules.get(name)
        if child is not None:
            found[name] = child(x)
            continue
        joint = _joint_holding(module, name)
        if joint is None:
            raise AttributeError(f"{type(module).__name__} has no linear {name!r}, joined or not")
        found.update(zip(joint.part_names, joint(x)))
    return tuple(found[name] for name in names)


def linear_computing(model: nn.Module, qualified_name: str) -> nn.Linear:
    """The linear of `model` that computes the output named `qualified_name` (e.g. `blocks.0.attn.to_q`): the plain
    child or the joint linear that holds it."""
    parent_name, _, name = qualified_name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    found = parent._modules.get(name)
    found = found if found is not None else _joint_holding(parent, name)
    if found is not None:
        return found
    raise AttributeError(f"{type(model).__name__} has no linear {qualified_name!r}, joined or not")


def joinable_groups(model: nn.Module) -> list[tuple[str, nn.Module, tuple[str, ...]]]:
    """Every group a module of `model` declares in `joinable` whose parts are all present and joinable (plain,
    bias-free, not yet quantised linears): (the module's qualified name, the module, the parts)."""
    groups = []
    for prefix, module in model.named_modules():
        for parts in getattr(module, "joinable", ()):
            if all(_joinable(module._modules.get(p)) for p in parts):
                groups.append((prefix, module, tuple(parts)))
    return groups
