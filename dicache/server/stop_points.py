"""Stop points inside one generation, so that an abandoned request frees its worker within one block's time.

`install_stop_points(modules, check)` registers a forward pre-hook on each of `modules` (before each transformer
call) and on every child of every `nn.ModuleList` found in them (the transformer's blocks, the VAE decoder's resnet /
attention / up-sampling blocks). The hook calls `check()`, which raises to abandon the generation. Modules are not
modified, only their hook lists (so a cache engine swapping a `forward` leaves the hooks in place); the hooks are
removed by the returned handle's `remove()`.

Under `torch.compile` the hook is traced as a no-op (`torch.compiler.is_compiling()`), so a compiled block keeps a
single graph; compiled blocks are then interrupted before each (uncompiled) transformer call and at the pipeline's
step-end callback (`backend`) only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


class StopPoints:
    """Handle of the installed hooks; `len()` is the number of stop points."""

    def __init__(self, handles: list[Any]) -> None:
        self._handles = handles

    def __len__(self) -> int:
        return len(self._handles)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def install_stop_points(modules: Iterable[nn.Module | None], check: Callable[[], None]) -> StopPoints:
    """A pre-hook calling `check()` before each of `modules` (None: skipped) and each block of each `nn.ModuleList`
    inside them."""

    def before_block(module: nn.Module, args: Any) -> None:
        if not torch.compiler.is_compiling():
            check()

    handles = []
    for root in modules:
        if root is None:
            continue
        handles.append(root.register_forward_pre_hook(before_block))
        for module in root.modules():
            if isinstance(module, nn.ModuleList):
                handles += [block.register_forward_pre_hook(before_block) for block in module]
    return StopPoints(handles)
