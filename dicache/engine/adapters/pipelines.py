"""Pipeline attachment: connect a pipeline's calls to the `CacheSession` of each of its transformers (request scope,
step and branch of each call). This module patches pipelines and schedulers, never modules (docs/architecture.md §1).

- Pipelines we control (the native Krea-2 pipeline) expose two neutral seams, `request_scope(num_steps, sigmas)`
  and `call_scope(step, branch, sigma)`, and declare every call's step and branch explicitly.
- Pipelines we do not control (diffusers pipelines) get a request scope around `__call__` for every cached
  transformer (Wan 2.2 has two, each with its own state, warm-up and stats), and each transformer call's step and
  branch is derived from a key: the scheduler's sigma at its current step index, else its timestep there (schedulers
  without sigmas, e.g. DDIM), both read on the host; a scheduler without a step index leaves the key to the
  forward's timestep argument. The k-th call at one key is branch k (diffusers calls cond first, then uncond).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from ...blocks.families import find_family
from ..session import CacheSession


class NativePipelineAdapter:
    """Pipelines with `request_scope` / `call_scope` seams (ours)."""

    def matches(self, obj: Any) -> bool:
        return all(hasattr(obj, name) for name in ("request_scope", "call_scope", "transformer"))

    def transformers(self, obj: Any) -> list[Any]:
        return [obj.transformer]

    def attach(self, obj: Any, sessions: Sequence[CacheSession]) -> Callable[[], None]:
        (session,) = sessions
        saved = {name: obj.__dict__.get(name, _MISSING) for name in ("request_scope", "call_scope")}

        def request_scope(num_steps: int | None = None, sigmas: list[float] | None = None):
            return session.request(num_steps=num_steps, sigmas=sigmas)

        def call_scope(step: int, branch: str, sigma: float | None = None):
            return session.call(step, branch, sigma)

        obj.request_scope = request_scope
        obj.call_scope = call_scope

        def detach() -> None:
            for name, value in saved.items():
                if value is _MISSING:
                    obj.__dict__.pop(name, None)
                else:
                    obj.__dict__[name] = value

        return detach


class DiffusersPipelineAdapter:
    """diffusers pipelines: a request per `__call__` for each cached transformer, steps derived from the scheduler."""

    def matches(self, obj: Any) -> bool:
        return (
            isinstance(getattr(obj, "transformer", None), nn.Module)
            and hasattr(obj, "scheduler")
            and callable(obj)
            and not isinstance(obj, nn.Module)
        )

    def transformers(self, obj: Any) -> list[Any]:
        """The pipeline's transformers to cache: those its family names (`transformer`, Wan 2.2's `transformer_2`)
        that are set, in that order."""
        family = find_family(obj.transformer)
        names = family.transformers if family is not None else ("transformer",)
        return [getattr(obj, n) for n in names if isinstance(getattr(obj, n, None), nn.Module)]

    def attach(self, obj: Any, sessions: Sequence[CacheSession]) -> Callable[[], None]:
        base = type(obj)

        @functools.wraps(base.__call__)
        def __call__(pipe, *args: Any, **kwargs: Any) -> Any:
            with contextlib.ExitStack() as scopes:
                for session in sessions:
                    scopes.enter_context(session.request())
                return base.__call__(pipe, *args, **kwargs)

        obj.__class__ = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
        scheduler = obj.scheduler
        own = {name: scheduler.__dict__.get(name, _MISSING) for name in ("set_timesteps", "step")}
        counter = None
        if needs_step_count(scheduler, self.transformers(obj)):
            counter = StepCounter(scheduler, "step", scheduler.step)
            scheduler.step = counter

        def on_schedule() -> None:
            if counter is not None:
                counter.taken = 0
            requests = [r for r in (s.active_request() for s in sessions) if r is not None]
            if requests:
                taken = (lambda: counter.taken) if counter is not None else None
                num_steps, sigmas, key_source = read_schedule(scheduler, taken)  # once per request
                for request in requests:
                    request.set_schedule(num_steps=num_steps, sigmas=sigmas)
                    request.key_source = key_source

        scheduler.set_timesteps = ScheduleTap(scheduler, "set_timesteps", scheduler.set_timesteps, on_schedule)

        def detach() -> None:
            obj.__class__ = base
            for name, value in own.items():
                if value is not _MISSING:
                    setattr(scheduler, name, value)
                else:
                    scheduler.__dict__.pop(name, None)

        return detach


class SchedulerTap:
    """A scheduler method (`name`) wrapped while a pipeline is attached. A deep copy of the scheduler (LTX-2 copies
    its scheduler for the audio latents) gets its class's plain method instead, so the copy runs on its own and only
    the attached scheduler feeds the requests."""

    def __init__(self, scheduler: Any, name: str, original: Callable[..., Any]) -> None:
        self.scheduler, self.name, self.original = scheduler, name, original
        functools.update_wrapper(self, original)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.original(*args, **kwargs)

    def __deepcopy__(self, memo: dict) -> Any:
        copy = memo.get(id(self.scheduler))
        if copy is None:  # the tap copied on its own, not as part of its scheduler
            return self
        return getattr(type(copy), self.name).__get__(copy)


class ScheduleTap(SchedulerTap):
    """`set_timesteps`: runs the original, then `on_schedule()` (which reads the new schedule)."""

    def __init__(self, scheduler: Any, name: str, original: Callable[..., Any], on_schedule: Callable[[], None]):
        super().__init__(scheduler, name, original)
        self.on_schedule = on_schedule

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.original(*args, **kwargs)
        self.on_schedule()
        return result


class StepCounter(SchedulerTap):
    """`step` of a scheduler that keeps no step index, for a transformer that takes no timestep (aMUSEd's): counts
    the steps taken since the last `set_timesteps`, which then index the schedule."""

    taken = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.original(*args, **kwargs)
        self.taken += 1
        return result


def needs_step_count(scheduler: Any, transformers: Sequence[nn.Module]) -> bool:
    """Whether steps can come neither from the scheduler's step index nor from a `timestep` argument of the
    transformers' forwards, so the scheduler's `step` calls are counted."""
    if hasattr(scheduler, "step_index"):
        return False
    return any("timestep" not in inspect.signature(t.forward).parameters for t in transformers)


def read_schedule(
    scheduler: Any, steps_taken: Callable[[], int] | None = None
) -> tuple[int, list[float] | None, Callable[[], float] | None]:
    """The step count, the sigmas (None when the scheduler has none) and the key source of a scheduler whose
    `set_timesteps` just ran. Keys are its sigmas, else its timesteps, at its host-side step index, else at
    `steps_taken()`; without either there is no key source (the forward's timestep argument is the key)."""
    timesteps = [float(t) for t in scheduler.timesteps.detach().float().cpu()]
    count = len(timesteps)
    raw = getattr(scheduler, "sigmas", None)
    sigmas = None
    if raw is not None and hasattr(raw, "__len__") and len(raw) >= count:
        sigmas = [float(s) for s in (raw.detach().float().cpu() if hasattr(raw, "detach") else raw)][:count]
    keys = sigmas if sigmas is not None else timesteps
    if not hasattr(scheduler, "step_index"):
        if steps_taken is None:
            return count, sigmas, None
        return count, sigmas, lambda: keys[min(steps_taken(), len(keys) - 1)]
    return count, sigmas, _scheduler_key(scheduler, keys)


def _scheduler_key(scheduler: Any, keys: list[float]) -> Callable[[], float]:
    """The current step's key from the scheduler's host-side step index."""

    def key() -> float:
        index = getattr(scheduler, "step_index", None)
        if index is None:
            index = getattr(scheduler, "begin_index", None) or 0
        return keys[min(index, len(keys) - 1)]

    return key


_MISSING = object()
PIPELINE_ADAPTERS = (NativePipelineAdapter(), DiffusersPipelineAdapter())


def find_pipeline_adapter(obj: Any):
    for adapter in PIPELINE_ADAPTERS:
        if adapter.matches(obj):
            return adapter
    return None
