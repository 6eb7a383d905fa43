"""Pipeline adapters: connect a pipeline's calls to a `CacheSession` (request scope, step and branch of each call).

- Pipelines we control (the native Krea-2 pipeline) expose two neutral seams, `request_scope(num_steps, sigmas)`
  and `call_scope(step, branch, sigma)`, and declare every call's step and branch explicitly.
- Pipelines we do not control (diffusers' `Krea2Pipeline`, and any diffusers pipeline with a flow-match style
  scheduler) get a request scope around `__call__`, and each transformer call's step and branch is derived from its
  timestep: the scheduler's sigma at its current step index (read on the host, no device sync), the k-th call at
  one timestep being branch k (diffusers calls cond first, then uncond).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

from ..session import CacheSession


class NativePipelineAdapter:
    """Pipelines with `request_scope` / `call_scope` seams (ours)."""

    def matches(self, obj: Any) -> bool:
        return all(hasattr(obj, name) for name in ("request_scope", "call_scope", "transformer"))

    def transformer(self, obj: Any) -> nn.Module:
        return obj.transformer

    def attach(self, obj: Any, session: CacheSession) -> Callable[[], None]:
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
    """diffusers pipelines (e.g. `Krea2Pipeline`): a request per `__call__`, steps derived from the scheduler."""

    def matches(self, obj: Any) -> bool:
        return (
            isinstance(getattr(obj, "transformer", None), nn.Module)
            and hasattr(obj, "scheduler")
            and callable(obj)
            and not isinstance(obj, nn.Module)
        )

    def transformer(self, obj: Any) -> nn.Module:
        return obj.transformer

    def attach(self, obj: Any, session: CacheSession) -> Callable[[], None]:
        base = type(obj)

        @functools.wraps(base.__call__)
        def __call__(pipe, *args: Any, **kwargs: Any) -> Any:
            with session.request():
                return base.__call__(pipe, *args, **kwargs)

        obj.__class__ = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__})
        scheduler = obj.scheduler
        had_own = "set_timesteps" in scheduler.__dict__
        original = scheduler.set_timesteps

        @functools.wraps(original)
        def set_timesteps(*args: Any, **kwargs: Any) -> Any:
            result = original(*args, **kwargs)
            request = session.active_request()
            if request is not None:
                count = len(scheduler.timesteps)
                sigmas = [float(s) for s in scheduler.sigmas.detach().float().cpu()[:count]]  # once per request
                request.set_schedule(num_steps=count, sigmas=sigmas)
                request.key_source = _scheduler_key(scheduler, sigmas)
            return result

        scheduler.set_timesteps = set_timesteps

        def detach() -> None:
            obj.__class__ = base
            if had_own:
                scheduler.set_timesteps = original
            else:
                scheduler.__dict__.pop("set_timesteps", None)

        return detach


def _scheduler_key(scheduler: Any, sigmas: list[float]) -> Callable[[], float]:
    """The current step's sigma from the scheduler's host-side step index."""

    def key() -> float:
        index = getattr(scheduler, "step_index", None)
        if index is None:
            index = getattr(scheduler, "begin_index", None) or 0
        return sigmas[min(index, len(sigmas) - 1)]

    return key


_MISSING = object()
PIPELINE_ADAPTERS = (NativePipelineAdapter(), DiffusersPipelineAdapter())


def find_pipeline_adapter(obj: Any):
    for adapter in PIPELINE_ADAPTERS:
        if adapter.matches(obj):
            return adapter
    return None
