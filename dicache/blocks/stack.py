"""The block stack of one transformer (pure description): its block lists in run order, each with its block form.

A transformer may run several block lists one after the other (Flux: double-stream then single-stream blocks). They
form one stack: block indices run over all lists (the first list's blocks are 0 … n₀−1, the next list's follow),
Fn / middle / Bn are counted over the whole stack, and the block plan and the offload plan use the same indices.
Between lists the model may reshape its streams (Chroma concatenates text and image), so the middle is cut at every
list boundary and each list's part keeps its own residuals (`boundaries`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .forms import BlockForm


@dataclass(frozen=True)
class BlockList:
    """One `nn.ModuleList` of blocks: the owner's attribute `path` holding it, and how its blocks are called."""

    path: str
    blocks: nn.ModuleList
    form: BlockForm


@dataclass
class StackSpec:
    """Where a transformer's block stack is and how to hook it.

    Attributes:
        owner: the module whose forward is one transformer call.
        lists: the block lists, in the order a call runs them.
        seam: name of the owner's method that runs the whole stack (`run_blocks(hidden, *block_args)`) when the
            model provides one (one list only); otherwise each list's iteration is redirected, so the model's own
            loop calls the hook layer once per block.
        timestep: extracts the timestep from `owner.forward`'s (args, kwargs), for step derivation.
        family: the registered family the stack comes from, or "generic".
    """

    owner: nn.Module
    lists: tuple[BlockList, ...]
    seam: str | None
    timestep: Callable[[tuple, dict], Any]
    family: str = "generic"
    starts: tuple[int, ...] = field(init=False)
    blocks: tuple[nn.Module, ...] = field(init=False)
    list_index: tuple[int, ...] = field(init=False)
    """For each stack block, the position in `lists` of its list."""

    def __post_init__(self) -> None:
        if not self.lists:
            raise ValueError("a block stack needs at least one block list")
        if self.seam is not None and len(self.lists) > 1:
            raise ValueError("a `run_blocks` seam runs one block list")
        starts, total = [], 0
        for block_list in self.lists:
            starts.append(total)
            total += len(block_list.blocks)
        self.starts = tuple(starts)
        self.blocks = tuple(block for block_list in self.lists for block in block_list.blocks)
        self.list_index = tuple(i for i, block_list in enumerate(self.lists) for _ in block_list.blocks)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Stack indices where a list other than the first begins."""
        return self.starts[1:]

    def list_of(self, index: int) -> int:
        """Which list (position in `lists`) holds stack block `index`."""
        return self.list_index[index]

    def where(self, index: int) -> str:
        """`FluxTransformer2DModel.single_transformer_blocks[3]`: stack block `index` as the model names it."""
        position = self.list_of(index)
        return f"{type(self.owner).__name__}.{self.lists[position].path}[{index - self.starts[position]}]"

    @property
    def forms_label(self) -> str:
        """The form of each list, as `form=` would take them."""
        labels = [block_list.form.label for block_list in self.lists]
        return repr(labels[0]) if len(set(labels)) == 1 else "[" + ", ".join(repr(x) for x in labels) + "]"
