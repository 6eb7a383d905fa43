"""The one-call API: `enable`, `disable`, `stats`, `request`, `step`."""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .blocks.families import stack_specs
from .blocks.generic import FormArg
from .engine.adapters import find_pipeline_adapter
from .engine.install import InstalledHooks, install
from .engine.session import CacheSession
from .engine.state import RequestState
from .engine.stats import RequestStats
from .errors import NotEnabledError, UnsupportedModelError
from .settings.cache_config import CacheConfig
from .settings.profiles import Profile


@dataclass
class _Handle:
    sessions: list[CacheSession]  # a transformer's own session, or a pipeline's transformers' sessions in order
    hooks: InstalledHooks | None = None  # set on a transformer's handle
    detach: list = field(default_factory=list)  # pipeline detach functions
    pipelines: int = 0  # pipelines sharing this transformer's hooks
    transformers: list = field(default_factory=list)  # a pipeline's cached transformers

    @property
    def session(self) -> CacheSession:
        """The primary session: the transformer's, or the pipeline's first transformer's."""
        return self.sessions[0]


_HANDLES: weakref.WeakKeyDictionary[Any, _Handle] = weakref.WeakKeyDictionary()


def _as_config(
    config: CacheConfig | Profile | Mapping[str, Any] | None, base: CacheConfig | None, caller: str
) -> CacheConfig:
    """What the public functions accept, as one validated config: a config as it is, a dict of override keys over
    `base` (None: the environment), None as `base` (None: the environment)."""
    if isinstance(config, CacheConfig):
        return config
    if isinstance(config, Profile):  # what dicache.calibrate returns
        return config.config
    if config is None or isinstance(config, Mapping):
        overrides = dict(config or {})
        return base.merged(overrides) if base is not None else CacheConfig.from_env(**overrides)
    raise TypeError(
        f"dicache.{caller}: config must be a dicache.CacheConfig, a dict of override keys or None, "
        f"not {type(config).__name__}"
    )


def enable(
    obj: Any,
    config: CacheConfig | Profile | Mapping[str, Any] | None = None,
    *,
    form: FormArg = None,
    lists: str = "joined",
) -> Any:
    """Turn step caching on for a pipeline or a transformer, in place; returns `obj`.

    Args:
        obj: our `Krea2Pipeline`, a diffusers pipeline of a registered family (`dicache.adapters.FAMILIES`) or any
            diffusers pipeline with a `transformer`, or a bare transformer module whose blocks sit in
            `nn.ModuleList`s. Every transformer of a pipeline (Wan 2.2: `transformer` and `transformer_2`) gets its
            own cache state, warm-up and stats (`dicache.stats(pipe.transformer_2)`).
        config: a `CacheConfig`, a `Profile` (what `dicache.calibrate` returns), a dict of override keys merged over
            the environment, or None for the environment (`SGLANG_CACHE_DIT_*`). Caching is on whatever
            `SGLANG_CACHE_DIT_ENABLED` says.
        form: how blocks are called, when the registered (or, for unknown models, `h -> h`) form is not right: a
            `BlockForm` or a label such as `"(h, e) -> (e, h)"` for every block list, one per list, or a mapping
            from block-list attribute to form (which declares the lists of a model without a family entry). The
            first call checks the forms against what the blocks return and raises `BlockFormError` on a mismatch.
        lists: `"joined"` (default): a transformer's block lists are one stack, one decision per call, Fn / Bn
            counted over the whole stack; `"separate"`: each list is its own cache (cache-dit's layout for most
            multi-list families: HunyuanVideo, Chroma, HiDream, Flux.2, …); `dicache.stats` then reports the first
            list's.

    Enabling an already enabled object replaces its settings.
    """
    resolved = _as_config(config, None, "enable")
    if obj in _HANDLES:
        disable(obj)
    adapter = find_pipeline_adapter(obj)
    transformers = adapter.transformers(obj) if adapter is not None else [obj]
    for transformer in transformers:
        if not isinstance(transformer, nn.Module):
            raise UnsupportedModelError(
                f"dicache.enable expects a pipeline with a `transformer` or an nn.Module, got {type(obj).__name__}"
            )
    sessions, created = [], []
    try:
        for transformer in transformers:
            handle = _HANDLES.get(transformer)
            if handle is None:
                specs = stack_specs(transformer, form, lists)
                own = [CacheSession(resolved, num_blocks=s.num_blocks, boundaries=s.boundaries) for s in specs]
                handle = _Handle(own, hooks=install(specs, own))
                _HANDLES[transformer] = handle
                created.append(transformer)
            elif config is not None:
                for session in handle.sessions:
                    session.configure(resolved)
            sessions.extend(handle.sessions)
    except BaseException:
        for transformer in created:
            _HANDLES.pop(transformer).hooks.remove()
        raise
    if adapter is not None:
        for transformer in transformers:
            _HANDLES[transformer].pipelines += 1
        _HANDLES[obj] = _Handle(sessions, detach=[adapter.attach(obj, sessions)], transformers=list(transformers))
    return obj


def disable(obj: Any) -> Any:
    """Remove everything `enable` installed on `obj` (and on its transformers); forwards are restored exactly."""
    handle = _HANDLES.pop(obj, None)
    if handle is None:
        return obj
    for detach in handle.detach:
        detach()
    for transformer in handle.transformers:
        inner = _HANDLES.get(transformer)
        if inner is not None:
            inner.pipelines -= 1
            if inner.pipelines <= 0:
                _HANDLES.pop(transformer, None)
                inner.hooks.remove()
    if handle.hooks is not None:
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
    """Cache statistics of the last request run through `obj` in this context (else in any context). For a pipeline
    with several transformers, its first transformer's (`dicache.stats(pipe.transformer_2)` for the second)."""
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

    Calls inside share one request state; pipeline calls inside refine it rather than open a new one. On a pipeline
    with several transformers, each opens its request (the first one's state is yielded).
    """
    sessions = _sessions_of(obj)
    owns = [None if config is None else s.fit(_as_config(config, s.config, "request")) for s in sessions]
    with contextlib.ExitStack() as scopes:
        states = [
            scopes.enter_context(s.request(num_steps=num_inference_steps, sigmas=sigmas, config=own))
            for s, own in zip(sessions, owns)
        ]
        yield states[0]


@contextmanager
def step(obj: Any, index: int, branch: str = "cond", sigma: float | None = None) -> Iterator[None]:
    """Declare the step and branch (cond / uncond / batched) of the transformer calls inside (explicit API)."""
    with contextlib.ExitStack() as scopes:
        for session in _sessions_of(obj):
            scopes.enter_context(session.call(index, branch, sigma))
        yield


def _sessions_of(obj: Any) -> list[CacheSession]:
    session_of(obj)  # NotEnabledError when not enabled
    return _HANDLES[obj].sessions
