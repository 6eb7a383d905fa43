"""The one-call API: `enable`, `disable`, `stats`, `request`, `step`."""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .engine.adapters import BlockForm, find_pipeline_adapter, generic_spec
from .engine.install import InstalledHooks, install
from .engine.session import CacheSession
from .engine.state import RequestState
from .engine.stats import RequestStats
from .errors import NotEnabledError, UnsupportedModelError
from .settings.cache_config import CacheConfig


@dataclass
class _Handle:
    session: CacheSession
    hooks: InstalledHooks | None = None  # set on the transformer's handle
    detach: list = field(default_factory=list)  # pipeline detach functions
    pipelines: int = 0  # pipelines sharing this transformer's hooks


_HANDLES: weakref.WeakKeyDictionary[Any, _Handle] = weakref.WeakKeyDictionary()


def _as_config(config: CacheConfig | Mapping[str, Any] | None, base: CacheConfig | None, caller: str) -> CacheConfig:
    """What the public functions accept, as one validated config: a config as it is, a dict of override keys over
    `base` (None: the environment), None as `base` (None: the environment)."""
    if isinstance(config, CacheConfig):
        return config
    if config is None or isinstance(config, Mapping):
        overrides = dict(config or {})
        return base.merged(overrides) if base is not None else CacheConfig.from_env(**overrides)
    raise TypeError(
        f"dicache.{caller}: config must be a dicache.CacheConfig, a dict of override keys or None, "
        f"not {type(config).__name__}"
    )


def enable(obj: Any, config: CacheConfig | Mapping[str, Any] | None = None, *, form: BlockForm | None = None) -> Any:
    """Turn step caching on for a pipeline or a transformer, in place; returns `obj`.

    Args:
        obj: our `Krea2Pipeline`, a diffusers pipeline with a `transformer` (e.g. `Krea2Pipeline`), or a bare
            transformer module whose blocks sit in an `nn.ModuleList`.
        config: a `CacheConfig`, a dict of override keys merged over the environment, or None for the
            environment (`SGLANG_CACHE_DIT_*`). Caching is on whatever `SGLANG_CACHE_DIT_ENABLED` says.
        form: how blocks are called, for models other than single-stream `block(hidden, *args) -> hidden`.

    Enabling an already enabled object replaces its settings.
    """
    resolved = _as_config(config, None, "enable")
    if obj in _HANDLES:
        disable(obj)
    adapter = find_pipeline_adapter(obj)
    transformer = adapter.transformer(obj) if adapter is not None else obj
    if not isinstance(transformer, nn.Module):
        raise UnsupportedModelError(
            f"dicache.enable expects a pipeline with a `transformer` or an nn.Module, got {type(obj).__name__}"
        )
    handle = _HANDLES.get(transformer)
    if handle is None:
        spec = generic_spec(transformer, form)
        session = CacheSession(resolved, num_blocks=len(spec.blocks), num_streams=spec.form.num_streams)
        handle = _Handle(session=session, hooks=install(spec, session))
        _HANDLES[transformer] = handle
    elif config is not None:
        handle.session.configure(resolved)
    if adapter is not None:
        pipe_handle = _Handle(session=handle.session, detach=[adapter.attach(obj, handle.session)])
        handle.pipelines += 1
        _HANDLES[obj] = pipe_handle
    return obj


def disable(obj: Any) -> Any:
    """Remove everything `enable` installed on `obj` (and on its transformer); forwards are restored exactly."""
    handle = _HANDLES.pop(obj, None)
    if handle is None:
        return obj
    for detach in handle.detach:
        detach()
    adapter = find_pipeline_adapter(obj)
    if adapter is not None:
        transformer = adapter.transformer(obj)
        inner = _HANDLES.get(transformer)
        if inner is not None:
            inner.pipelines -= 1
            if inner.pipelines <= 0:
                _HANDLES.pop(transformer, None)
                inner.hooks.remove()
    elif handle.hooks is not None:
        handle.hooks.remove()
    return obj


def is_enabled(obj: Any) -> bool:
    return obj in _HANDLES


def session_of(obj: Any) -> CacheSession:
    """The `CacheSession` `dicache.enable` attached to `obj`; `NotEnabledError` if there is none."""
    handle = _HANDLES.get(obj)
    if handle is None:
        raise NotEnabledError(
            f"dicache: caching is not enabled on this {type(obj).__name__} (never enabled, or disabled since); "
            "call dicache.enable(obj) first"
        )
    return handle.session


def stats(obj: Any) -> RequestStats | None:
    """Cache statistics of the last request run through `obj` in this context (else in any context)."""
    return session_of(obj).stats()


@contextmanager
def request(
    obj: Any,
    num_inference_steps: int | None = None,
    config: CacheConfig | Mapping[str, Any] | None = None,
    sigmas: list[float] | None = None,
) -> Iterator[RequestState]:
    """Delimit one request explicitly, optionally with its own settings: a dict of override keys (merged over the
    model's settings) or a whole `CacheConfig` (whose `enable_cache` says whether this request caches).

    Calls inside share one request state; pipeline calls inside refine it rather than open a new one.
    """
    session = session_of(obj)
    own = None if config is None else session.fit(_as_config(config, session.config, "request"))
    with session.request(num_steps=num_inference_steps, sigmas=sigmas, config=own) as state:
        yield state


@contextmanager
def step(obj: Any, index: int, branch: str = "cond", sigma: float | None = None) -> Iterator[None]:
    """Declare the step and branch (cond / uncond / batched) of the transformer calls inside (explicit API)."""
    with session_of(obj).call(index, branch, sigma):
        yield
