"""What an adapter tells the hook layer about a model: where the block stack is and how a block is called."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

Streams = tuple[torch.Tensor, ...]


class BlockForm(Protocol):
    """How one block of the stack is called. The hook layer only ever sees residual *streams*.

    `split(args, kwargs)` takes the arguments the model passes to a block and returns the streams (the tensors a
    block updates) and the remaining arguments, passed unchanged to every block. `call` runs a block on streams,
    `join` turns streams back into what the model expects a block to return.
    """

    num_streams: int

    def split(self, args: tuple, kwargs: dict) -> tuple[Streams, tuple, dict]: ...

    def call(self, block: nn.Module, streams: Streams, args: tuple, kwargs: dict) -> Streams: ...

    def join(self, streams: Streams) -> Any: ...


class SingleStream:
    """`block(hidden_states, *args, **kwargs) -> hidden_states` (Krea-2, DiT, PixArt-style blocks)."""

    num_streams = 1

    def __init__(self, name: str = "hidden_states") -> None:
        self.name = name

    def split(self, args: tuple, kwargs: dict) -> tuple[Streams, tuple, dict]:
        if args:
            return (args[0],), args[1:], kwargs
        kwargs = dict(kwargs)
        return (kwargs.pop(self.name),), (), kwargs

    def call(self, block: nn.Module, streams: Streams, args: tuple, kwargs: dict) -> Streams:
        return (block(streams[0], *args, **kwargs),)

    def join(self, streams: Streams) -> Any:
        return streams[0]


class DualStream:
    """`block(a, b, *args, **kwargs) -> (a, b)`: two streams updated together (e.g. image and text in MMDiT)."""

    num_streams = 2

    def __init__(self, names: tuple[str, str] = ("hidden_states", "encoder_hidden_states")) -> None:
        self.names = names

    def split(self, args: tuple, kwargs: dict) -> tuple[Streams, tuple, dict]:
        kwargs = dict(kwargs)
        args = list(args)
        streams = []
        for name in self.names:
            streams.append(args.pop(0) if args else kwargs.pop(name))
        return tuple(streams), tuple(args), kwargs

    def call(self, block: nn.Module, streams: Streams, args: tuple, kwargs: dict) -> Streams:
        return tuple(block(*streams, *args, **kwargs))

    def join(self, streams: Streams) -> Any:
        return tuple(streams)


@dataclass
class ModelSpec:
    """Where a model's block stack is and how to hook it.

    Attributes:
        owner: the module whose forward is one transformer call.
        blocks: the block stack.
        form: how a block is called.
        seam: name of the owner's method that runs the whole stack (`run_blocks(hidden, *block_args)`) when the
            model provides one; otherwise the stack's iteration is redirected (the model must loop
            `for block in blocks: x = block(x, ...)` with the same arguments for every block).
        timestep: extracts the timestep from `owner.forward`'s (args, kwargs), for step derivation.
    """

    owner: nn.Module
    blocks: nn.ModuleList
    form: BlockForm
    seam: str | None
    timestep: Callable[[tuple, dict], Any]
