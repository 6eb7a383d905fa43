"""Faults injected into a real Krea-2 pipeline through torch's module hooks (no mock of the server): an out-of-memory
error raised inside a phase, non-finite values in a module's output, and weak references to the tensors a request
makes, to check that none outlives its request."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch

INJECTED = "CUDA out of memory. Tried to allocate 20.00 GiB (injected by a test)"


def phase_modules(pipe: Any) -> dict[str, torch.nn.Module]:
    """A module each phase of a generation calls through `__call__`: the text encoder's model (encode), a middle
    transformer block (denoise), the VAE's decoder (decode)."""
    blocks = pipe.transformer.transformer_blocks
    return {"encode": pipe.text_encoder.text_encoder, "denoise": blocks[len(blocks) // 2], "decode": pipe.vae.decoder}


@contextlib.contextmanager
def out_of_memory_in(
    module: torch.nn.Module, after: int = 0, times: int = 1, error: Exception | None = None
) -> Iterator[list[int]]:
    """Raise `error` (default: `torch.OutOfMemoryError(INJECTED)`) from a forward pre-hook of `module`: its first
    `after` calls pass, the next `times` raise; yields a list that counts the errors raised."""
    raised: list[int] = []
    calls = [0]

    def hook(mod: torch.nn.Module, args: Any) -> None:
        calls[0] += 1
        if calls[0] > after and len(raised) < times:
            raised.append(1)
            raise error if error is not None else torch.OutOfMemoryError(INJECTED)

    handle = module.register_forward_pre_hook(hook)
    try:
        yield raised
    finally:
        handle.remove()


@contextlib.contextmanager
def non_finite_output(module: torch.nn.Module, value: float, items: tuple[int, ...] | None = None) -> Iterator[None]:
    """`module`'s output (a tensor) with every value of batch `items` (None: all) replaced by `value` (NaN, inf)."""

    def hook(mod: torch.nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        spoiled = output.clone()
        if items is None:
            spoiled.fill_(value)
        else:
            spoiled[list(items)] = value
        return spoiled

    handle = module.register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


class TensorWatch:
    """Weak references to tensors a request makes in each phase: the text encoder's last hidden state, each denoising
    call's image stream entering the first block, the latents entering the VAE decoder. `alive()` lists the ones
    still referenced by anything."""

    def __init__(self, pipe: Any) -> None:
        self.refs: list[tuple[str, weakref.ref]] = []
        blocks = pipe.transformer.transformer_blocks
        self._handles = [
            pipe.text_encoder.text_encoder.register_forward_hook(self._text_output),
            blocks[0].register_forward_pre_hook(self._first_argument("denoise")),
            pipe.vae.decoder.register_forward_pre_hook(self._first_argument("decode")),
        ]

    def _text_output(self, module: Any, args: Any, output: Any) -> None:
        self.refs.append(("encode", weakref.ref(output.hidden_states[-1])))

    def _first_argument(self, phase: str):
        def hook(module: Any, args: Any) -> None:
            self.refs.append((phase, weakref.ref(args[0])))

        return hook

    def phases(self) -> set[str]:
        return {phase for phase, _ in self.refs}

    def alive(self) -> list[str]:
        return [phase for phase, ref in self.refs if ref() is not None]

    def __enter__(self) -> TensorWatch:
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
