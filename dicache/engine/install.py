"""Attaching the cache to a model: the only code that changes `nn.Module`s (docs/architecture.md §1).

`install` puts a model's `BlockStackRunner` (`dicache.engine.hooks`) in place, in one of two ways, both reversible:
- seam: the model runs its stack through a method (`run_blocks`); the runner replaces it on the instance;
- iteration: each block list's `ModuleList` yields the runner's block proxies in place of its blocks while a
  transformer call is active, so the model's own loops (`for i, block in enumerate(self.blocks): ...`) call the
  runner once per block, over every list of the stack.
Blocks themselves are never modified, so their own hooks and `torch.compile` keep working. The owner's forward is
wrapped to give each call its (step, branch), declared by the pipeline or derived from the timestep, and (iteration)
to delimit the call. A stack cached as several groups (`lists="separate"`: each block list its own cache, as
cache-dit does for some families) gets one runner per group. `observe_blocks` attaches a `BlockObserver` to the
runner of a one-group stack, with or without caching.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..blocks.stack import StackSpec
from ..errors import ConfigError, UnsupportedModelError
from .block_plan import BlockObserver
from .hooks import BlockStackRunner, KernelTap
from .session import CacheSession


class _StackIteration:
    """Mixin for a hooked `ModuleList`: while a call is active, iterating yields the runner's proxies of its blocks."""

    def __iter__(self):
        runner = self.__dict__.get("_dicache_runner")
        if runner is not None and runner.active():
            start = self.__dict__["_dicache_start"]
            return iter(runner.proxies[start : start + len(self)])
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
    """The runners of a model's stack (one per cache group; one for a joined stack), shared by its cache sessions and
    its observers; `undo` takes them out."""

    runners: list[BlockStackRunner]
    undo: list[Callable[[], None]]

    def unused(self) -> bool:
        return all(runner.session is None and not runner.observers for runner in self.runners)


_ATTACHMENTS: weakref.WeakKeyDictionary[nn.Module, _Attachment] = weakref.WeakKeyDictionary()


def _redirect_iteration(runner: BlockStackRunner, undo: list[Callable[[], None]]) -> None:
    for block_list, start in zip(runner.spec.lists, runner.spec.starts):
        blocks = block_list.blocks
        base = type(blocks)
        blocks.__class__ = _iteration_class(base)
        blocks.__dict__["_dicache_runner"] = runner
        blocks.__dict__["_dicache_start"] = start

        def restore(blocks: nn.ModuleList = blocks, base: type = base) -> None:
            blocks.__class__ = base
            blocks.__dict__.pop("_dicache_runner", None)
            blocks.__dict__.pop("_dicache_start", None)

        undo.append(restore)


def _wrap_forward(specs: Sequence[StackSpec], runners: list[BlockStackRunner], undo: list[Callable[[], None]]) -> None:
    """The owner's forward: its call's (step, branch) in every attached cache session, and (iteration) the scope in
    which the model's loops reach the runners."""
    owner = specs[0].owner
    original_forward = owner.forward
    timestep = specs[0].timestep
    delimited = [runner for runner, spec in zip(runners, specs) if spec.seam is None]

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        derived = []
        key: float | None = None
        for runner in runners:
            session = runner.session
            if session is None:
                continue
            current = session.current_call()
            if current is not None and current.explicit:
                continue
            request = session.active_request()
            if request is not None and request.key_source is not None:
                this_key = request.key_source()
            else:
                key = _timestep_key(timestep(args, kwargs)) if key is None else key
                this_key = key
            derived.append((session, session.derive_call(this_key)))
        try:
            calls = [call for runner in runners if (call := runner.output_call(args, kwargs)) is not None]
            if calls and len(runners) > 1:
                raise ConfigError(
                    "cached_step_method='fitted' predicts the whole transformer's output: it needs the stack cached "
                    f"as one group (lists='joined'), not {len(runners)}"
                )
            if calls and calls[0].answer is not None:
                return calls[0].answer
            with contextlib.ExitStack() as scopes:
                for runner in delimited:
                    scopes.enter_context(runner.scope())
                output = original_forward(*args, **kwargs)
            if calls:
                calls[0].computed(output)
            return output
        finally:
            for session, token in reversed(derived):
                session.end_call(token)

    _set_instance_attr(owner, "forward", forward, undo)


def _attach(specs: Sequence[StackSpec]) -> list[BlockStackRunner]:
    """The runners of the owner's stack, one per spec (cache group), put in place (seam or iteration) on first use;
    a model already attached with other groups is an error."""
    owner = specs[0].owner
    attachment = _ATTACHMENTS.get(owner)
    if attachment is not None:
        if [_paths(r.spec) for r in attachment.runners] != [_paths(s) for s in specs]:
            attached = [_paths(r.spec) for r in attachment.runners]
            raise UnsupportedModelError(
                f"dicache: {type(owner).__name__} is already hooked with the block lists grouped as {attached}; "
                f"it cannot also be hooked as {[_paths(s) for s in specs]} (disable it first)"
            )
        return attachment.runners
    undo: list[Callable[[], None]] = []
    runners = []
    for spec in specs:
        if spec.seam is not None:
            runner = BlockStackRunner(spec, plain=getattr(owner, spec.seam))
            _set_instance_attr(owner, spec.seam, runner.run_seam, undo)
        else:
            runner = BlockStackRunner(spec)
            _redirect_iteration(runner, undo)
        if all(_attention_of(block) is not None for block in spec.blocks):
            runner.tap_kernels = functools.partial(_tap_kernels, runner, undo)
        runners.append(runner)
    _wrap_forward(specs, runners, undo)
    _ATTACHMENTS[owner] = _Attachment(runners, undo)
    return runners


def _attention_of(block: nn.Module) -> nn.Module | None:
    """The block's attention module when it has an `attn.kernel` seam (`cached_step_method=tokens`), else None."""
    attn = getattr(block, "attn", None)
    return attn if isinstance(attn, nn.Module) and callable(getattr(attn, "kernel", None)) else None


def _tap_kernels(runner: BlockStackRunner, undo: list[Callable[[], None]]) -> None:
    """Put a `KernelTap` on each block's attention kernel (reversibly, on the instance); the first token-subset
    call asks for it, once."""
    for block in runner.spec.blocks:
        attn = _attention_of(block)
        _set_instance_attr(attn, "kernel", KernelTap(attn.kernel), undo)


def _paths(spec: StackSpec) -> tuple[str, ...]:
    return tuple(block_list.path for block_list in spec.lists)


def _detach_if_unused(owner: nn.Module) -> None:
    attachment = _ATTACHMENTS.get(owner)
    if attachment is None or not attachment.unused():
        return
    del _ATTACHMENTS[owner]
    while attachment.undo:
        attachment.undo.pop()()


def observe_blocks(spec: StackSpec, observer: BlockObserver) -> Callable[[], None]:
    """Tell `observer` about every call of `spec`'s stack (block indices over all its lists), with or without
    caching; returns the function that stops it (and takes the runner out when nothing else uses it). The stack must
    be hooked as one cache group (not `lists="separate"`)."""
    (runner,) = _attach([spec])
    runner.observers.append(observer)

    def stop() -> None:
        if observer in runner.observers:
            runner.observers.remove(observer)
        _detach_if_unused(spec.owner)

    return stop


def install(specs: Sequence[StackSpec], sessions: Sequence[CacheSession]) -> InstalledHooks:
    """Attach one `BlockStackRunner` per spec (cache group), each serving its session, to the specs' owner (and the
    call-deriving forward wrapper)."""
    owner = specs[0].owner
    runners = _attach(specs)
    if any(runner.session is not None for runner in runners):
        raise RuntimeError(f"dicache: {type(owner).__name__} already has cache hooks; remove them first")
    for runner, session in zip(runners, sessions):
        runner.session = session

    def release_runners() -> None:
        for runner in runners:
            runner.session = None
        _detach_if_unused(owner)

    return InstalledHooks([release_runners])
