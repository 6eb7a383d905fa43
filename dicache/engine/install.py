"""Attaching the cache to a model: the only code that changes `nn.Module`s (docs/architecture.md §1).

`install` puts a model's `BlockStackRunner` (`dicache.engine.hooks`) in place, in one of two ways, both reversible:
- seam: the model runs its stack through a method (`run_blocks`); the runner replaces it on the instance;
- iteration: the stack's `ModuleList` yields the runner in place of its blocks while a transformer call is active,
  so a model looping `for block in blocks: x = block(x, ...)` calls the runner once per forward.
Blocks themselves are never modified, so their own hooks and `torch.compile` keep working. The owner's forward is
wrapped to give each call its (step, branch): declared by the pipeline, or derived from the timestep.
`observe_blocks` attaches a `BlockObserver` to the same runner, with or without caching.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..errors import UnsupportedModelError
from .adapters.base import ModelSpec
from .block_plan import BlockObserver
from .hooks import BlockStackRunner
from .session import CacheSession


class _StackIteration:
    """Mixin for a hooked `ModuleList`: while a call is active, iterating yields the runner instead of the blocks."""

    def __iter__(self):
        runner = self.__dict__.get("_dicache_runner")
        if runner is not None and runner.session is not None and runner.session.current_call() is not None:
            return iter((runner,))
        return super().__iter__()


_ITERATION_CLASSES: dict[type, type] = {}


def _iteration_class(base: type) -> type:
    cls = _ITERATION_CLASSES.get(base)
    if cls is None:
        cls = type(base.__name__, (_StackIteration, base), {"__module__": base.__module__})
        _ITERATION_CLASSES[base] = cls
    return cls


def _timestep_key(value: Any) -> float:
    if isinstance(value, torch.Tensor):
        return float(value.reshape(-1)[0])  # a host sync on GPU; pipelines we know avoid it with a key source
    if isinstance(value, int | float):
        return float(value)
    raise TypeError(f"dicache: cannot derive the denoising step from a timestep of type {type(value).__name__}")


@dataclass
class InstalledHooks:
    """What `install` changed on a model; `remove()` restores it exactly."""

    _undo: list[Callable[[], None]] = field(default_factory=list)

    def remove(self) -> None:
        while self._undo:
            self._undo.pop()()


def _set_instance_attr(obj: Any, name: str, value: Any, undo: list[Callable[[], None]]) -> None:
    had, previous = name in obj.__dict__, obj.__dict__.get(name)

    def restore() -> None:
        if had:
            obj.__dict__[name] = previous
        else:
            obj.__dict__.pop(name, None)

    obj.__dict__[name] = value
    undo.append(restore)


@dataclass
class _Attachment:
    """The one runner of a model's stack, shared by its cache session and its observers; `undo` takes it out."""

    runner: BlockStackRunner
    undo: list[Callable[[], None]]


_ATTACHMENTS: weakref.WeakKeyDictionary[nn.Module, _Attachment] = weakref.WeakKeyDictionary()


def _attach(spec: ModelSpec) -> BlockStackRunner:
    """The runner of `spec.owner`'s stack, put in place (seam or iteration) on first use."""
    owner, blocks = spec.owner, spec.blocks
    attachment = _ATTACHMENTS.get(owner)
    if attachment is not None:
        return attachment.runner
    undo: list[Callable[[], None]] = []
    if spec.seam is not None:
        runner = BlockStackRunner(spec, plain=getattr(owner, spec.seam))
        _set_instance_attr(owner, spec.seam, runner, undo)
    else:

        def plain(*args: Any, **kwargs: Any) -> Any:
            streams, rest, kw = spec.form.split(args, kwargs)
            for block in nn.ModuleList.__iter__(blocks):
                streams = spec.form.call(block, streams, rest, kw)
            return spec.form.join(streams)

        runner = BlockStackRunner(spec, plain=plain)
        base = type(blocks)
        blocks.__class__ = _iteration_class(base)
        blocks.__dict__["_dicache_runner"] = runner

        def restore_iteration() -> None:
            blocks.__class__ = base
            blocks.__dict__.pop("_dicache_runner", None)

        undo.append(restore_iteration)
    _ATTACHMENTS[owner] = _Attachment(runner, undo)
    return runner


def _detach_if_unused(owner: nn.Module) -> None:
    attachment = _ATTACHMENTS.get(owner)
    if attachment is None or attachment.runner.session is not None or attachment.runner.observers:
        return
    del _ATTACHMENTS[owner]
    while attachment.undo:
        attachment.undo.pop()()


def observe_blocks(spec: ModelSpec, observer: BlockObserver) -> Callable[[], None]:
    """Tell `observer` about every call of `spec`'s stack, with or without caching; returns the function that stops
    it (and takes the runner out when nothing else uses it). Needs a model with a block-stack seam (`run_blocks`)."""
    if spec.seam is None:
        raise UnsupportedModelError(
            f"{type(spec.owner).__name__} runs its blocks without a block-stack seam (a `run_blocks` method); block "
            "observers such as layerwise offload need one (dicache's native Krea-2 transformer has it)"
        )
    runner = _attach(spec)
    runner.observers.append(observer)

    def stop() -> None:
        if observer in runner.observers:
            runner.observers.remove(observer)
        _detach_if_unused(spec.owner)

    return stop


def install(spec: ModelSpec, session: CacheSession) -> InstalledHooks:
    """Attach a `BlockStackRunner` serving `session` and a call-deriving forward wrapper to `spec.owner`."""
    owner = spec.owner
    runner = _attach(spec)
    if runner.session is not None:
        raise RuntimeError(f"dicache: {type(owner).__name__} already has cache hooks; remove them first")
    runner.session = session
    undo: list[Callable[[], None]] = []

    def release_runner() -> None:
        runner.session = None
        _detach_if_unused(owner)

    undo.append(release_runner)
    original_forward = owner.forward

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        current = session.current_call()
        if current is not None and current.explicit:
            return original_forward(*args, **kwargs)
        request = session.active_request()
        if request is not None and request.key_source is not None:
            key = request.key_source()
        else:
            key = _timestep_key(spec.timestep(args, kwargs))
        token = session.derive_call(key)
        try:
            return original_forward(*args, **kwargs)
        finally:
            session.end_call(token)

    _set_instance_attr(owner, "forward", forward, undo)
    return InstalledHooks(undo)
