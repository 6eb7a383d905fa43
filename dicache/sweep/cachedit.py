"""The cache-dit side of a sweep: diffusers' `Krea2Pipeline` cached by cache-dit 1.5.3 with the equivalent settings.

cache-dit is an optional benchmark dependency (`pip install "dicache[bench]"`); it is imported only here, lazily.
Mapping of our settings (docs/architecture.md §2) to cache-dit's `DBCacheConfig`: Fn, Bn, W, RDT, MC and
max_cached_steps carry over by name; a step-mask preset or explicit bins become the same 0/1 `steps_computation_mask`
our policy uses at that step count, with the same `steps_computation_policy`; TaylorSeer becomes
`TaylorSeerCalibratorConfig(order)`; `enable_separate_cfg` is on iff the schedule uses CFG. Guidance: diffusers' `cond +
g·(cond − uncond)` is our standard `s` with `g = s − 1`."""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Any

import torch

from ..api import disable as dicache_disable
from ..engine.policies import step_mask
from ..errors import DicacheError
from ..models.krea2.pipeline import read_dicache_json, resolve_base_checkpoint
from ..models.loading import read_json
from ..settings.cache_config import CacheConfig
from .runners import CallRecorder, Sample, recorded_sample
from .spec import Schedule

INSTALL_HINT = (
    'cache-dit is not installed; install the benchmark extra: pip install "dicache[bench]" (cache-dit==1.5.3)'
)


NO_EQUIVALENT = (
    "taylorseer_damping",
    "cached_step_blocks",
    "forecaster",
    "cached_step_method",
)
"""dicache settings cache-dit has no counterpart of (a cell that changes one is not run on cache-dit)."""


class CacheDitMissing(DicacheError, ImportError):
    """cache-dit (the optional benchmark dependency) is not importable."""


def import_cache_dit() -> Any:
    """Import cache-dit quietly (its log level set to warning unless the user chose one), or raise `CacheDitMissing`."""
    os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")
    try:
        import cache_dit
    except ImportError as exc:
        raise CacheDitMissing(f"{INSTALL_HINT} ({exc})") from None
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("cache_dit") and os.environ["CACHE_DIT_LOG_LEVEL"] == "warning":
            logging.getLogger(name).setLevel(logging.WARNING)
    return cache_dit


def cache_dit_available() -> bool:
    try:
        import_cache_dit()
    except CacheDitMissing:
        return False
    return True


def unsupported_reason(config: CacheConfig) -> str | None:
    """Why cache-dit has no equivalent of `config`, or None when it has one."""
    if config.policy != "dbcache":
        return f"policy={config.policy!r} has no cache-dit equivalent"
    if config.enable_taylorseer and config.taylorseer_distance != "step":
        return "TaylorSeer distance in sigmas has no cache-dit equivalent"
    if config.Fn_compute_blocks < 1:
        return "cache-dit needs Fn_compute_blocks >= 1 (no whole-step reuse)"
    defaults = CacheConfig.from_env({})
    for key in NO_EQUIVALENT:
        if hasattr(config, key) and getattr(config, key) != getattr(defaults, key):
            return f"{key}={getattr(config, key)!r} has no cache-dit equivalent"
    return None


def cache_dit_settings(config: CacheConfig, schedule: Schedule) -> tuple[dict[str, Any], int | None]:
    """`DBCacheConfig` keyword arguments and the TaylorSeer order (None: off) equivalent to `config` on `schedule`."""
    reason = unsupported_reason(config)
    if reason is not None:
        raise ValueError(reason)
    kwargs: dict[str, Any] = dict(
        num_inference_steps=schedule.steps,
        Fn_compute_blocks=config.Fn_compute_blocks,
        Bn_compute_blocks=config.Bn_compute_blocks,
        max_warmup_steps=config.max_warmup_steps,
        residual_diff_threshold=config.residual_diff_threshold,
        max_continuous_cached_steps=config.max_continuous_cached_steps,
        max_cached_steps=config.max_cached_steps,
        enable_separate_cfg=schedule.cfg,
    )
    mask = step_mask(config, schedule.steps)
    if mask is not None:
        kwargs.update(steps_computation_mask=list(mask), steps_computation_policy=config.scm_policy)
    return kwargs, (config.taylorseer_order if config.enable_taylorseer else None)


def enable_equivalent(pipe: Any, config: CacheConfig, schedule: Schedule) -> None:
    """`cache_dit.enable_cache(pipe, ...)` with the settings equivalent to `config` on `schedule`
    (`cache_dit_settings`; TaylorSeer as `TaylorSeerCalibratorConfig(order)`). `ValueError` when it has none."""
    cache_dit = import_cache_dit()
    kwargs, order = cache_dit_settings(config, schedule)
    calibrator = None if order is None else cache_dit.TaylorSeerCalibratorConfig(taylorseer_order=order)
    cache_dit.enable_cache(pipe, cache_config=cache_dit.DBCacheConfig(**kwargs), calibrator_config=calibrator)


def cached_steps(pipe: Any, cfg: bool) -> dict[str, list[int]]:
    """The step indices cache-dit cached in `pipe`'s last call, `{"cond": [...], "uncond": [...]}` (uncond only with
    `cfg`), from its first cache context (`cache_dit.summary`); {} when cache-dit is not enabled on `pipe`."""
    stats = [s for s in import_cache_dit().summary(pipe, logging=False) if s.cache_options]
    if not stats:
        return {}
    first = stats[0]
    out = {"cond": list(first.cached_steps or [])}
    if cfg:
        out["uncond"] = list(first.cfg_cached_steps or [])
    return out


class CacheDitRunner:
    """diffusers' `Krea2Pipeline`, plain (`cache=None`) or cached by cache-dit with the settings equivalent to `cache`.

    diffusers runs the text path (fusion + `txt_in`) on every transformer call: `text_per_call = True`.
    """

    pipeline = "diffusers"
    text_per_call = True

    def __init__(self, pipe: Any, family: Any = None) -> None:
        self.cache_dit = import_cache_dit()
        self.pipe = pipe
        self.pipe.set_progress_bar_config(disable=True)
        self._active: tuple[Any, ...] | None = None
        self._distilled = bool(pipe.config.get("is_distilled", False))
        self.family = family  # a FamilyRunner whose pipeline this is (`on_family`), or None (diffusers' Krea-2)

    @classmethod
    def on_family(cls, runner: Any) -> CacheDitRunner:
        """cache-dit (`cache_dit.enable_cache`) on the very pipeline a `FamilyRunner` runs, called the same way; the
        two never cache at once (each disables the other before a generation), and cache-dit's runs are measured
        against that runner's uncached references (`shares_references`)."""
        cached = cls(runner.pipe, family=runner)
        runner.exclusive = cached
        return cached

    @property
    def shares_references(self) -> bool:
        """True when this runner's uncached run is the native runner's (the same pipeline and call)."""
        return self.family is not None

    @classmethod
    def load(cls, model_dir: str, dtype: torch.dtype = torch.float32, device: str | None = None) -> CacheDitRunner:
        import_cache_dit()
        from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline, Krea2Transformer2DModel

        root = Path(model_dir)
        base = resolve_base_checkpoint(root, read_dicache_json(root))
        if base is None:
            pipe = Krea2Pipeline.from_pretrained(model_dir, dtype=dtype)
        else:  # a partial checkpoint (the Turbo student): its transformer and scheduler over the base's other parts
            pipe = Krea2Pipeline.from_pretrained(
                base,
                transformer=Krea2Transformer2DModel.from_pretrained(root, subfolder="transformer", dtype=dtype),
                scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(root, subfolder="scheduler"),
                is_distilled=bool(read_json(root, "model_index.json").get("is_distilled", False)),
                dtype=dtype,
            )
        return cls(pipe.to(device) if device else pipe)

    @property
    def num_blocks(self) -> int:
        return len(self.pipe.transformer.transformer_blocks)

    @property
    def version(self) -> str:
        return str(getattr(self.cache_dit, "__version__", "unknown"))

    def text_length(self, prompt: str) -> int:
        """diffusers' `max_sequence_length` for `prompt`: its tokens + the template suffix, rounded up to 32 (cap 512).

        diffusers pads text to this length and masks the padding, so the output does not depend on it (equal within
        float noise); fitting it keeps CPU runs from spending most of their time on 512 padded tokens.
        """
        pipe = self.pipe
        if pipe.tokenizer is None:
            return 512
        prefix = pipe.prompt_template_encode_prefix
        tokens = len(pipe.tokenizer(prefix + prompt).input_ids) - pipe.prompt_template_encode_start_idx
        needed = tokens + pipe.prompt_template_encode_num_suffix_tokens
        return min(512, max(32, -(-needed // 32) * 32))

    def _configure(self, cache: CacheConfig | None, schedule: Schedule) -> None:
        key = None if cache is None else (tuple(sorted(cache.model_dump().items(), key=str)), schedule)
        if key == self._active:
            return
        if self._active is not None:
            self.cache_dit.disable_cache(self.pipe)
            self._active = None
        if cache is not None:
            enable_equivalent(self.pipe, cache, schedule)
            self._active = key

    def close(self) -> None:
        self._configure(None, Schedule(1))

    def _generate_family(
        self, prompt: str, seed: int, schedule: Schedule, steps: int, height: int, width: int, cache: CacheConfig | None
    ) -> Sample:
        """`generate` on a family's pipeline: dicache off, cache-dit on, the family runner's own call."""
        dicache_disable(self.pipe)
        self._configure(cache, schedule)
        with CallRecorder(self.pipe.transformer) as rec:
            image, latents = self.family.call(prompt, seed, schedule, steps, height, width)
        num_blocks = self.family.num_blocks
        cached_steps = self._cached_steps(schedule.cfg) if cache is not None else {}
        cached = sum(len(v) for v in cached_steps.values())
        skipped = 0 if cache is None else num_blocks - cache.Fn_compute_blocks - cache.Bn_compute_blocks
        return recorded_sample(
            rec,
            schedule,
            image,
            latents,
            num_blocks,
            cached_calls=cached,
            blocks_run=rec.calls * num_blocks - cached * skipped,
            cached_steps=cached_steps,
            full_calls=self.family._full_calls(rec, schedule, steps),
        )

    def _cached_steps(self, cfg: bool) -> dict[str, list[int]]:
        return cached_steps(self.pipe, cfg)

    @contextlib.contextmanager
    def _schedule_variant(self, schedule: Schedule):
        """Pin mu = 1.15 like the native pipeline does for `variant="turbo"` or a distilled checkpoint."""
        distilled = self._distilled or schedule.variant == "turbo"
        self.pipe.register_to_config(is_distilled=distilled)
        try:
            yield
        finally:
            self.pipe.register_to_config(is_distilled=self._distilled)

    def generate(
        self, prompt: str, seed: int, schedule: Schedule, steps: int, height: int, width: int, cache: CacheConfig | None
    ) -> Sample:
        """One image, as `NativeRunner.generate`; the latents are read at the last step's callback (packed)."""
        if cache is not None and steps != schedule.steps:
            raise ValueError("cache-dit runs use the schedule's step count (its step mask is built for it)")
        if self.family is not None:
            return self._generate_family(prompt, seed, schedule, steps, height, width, cache)
        self._configure(cache, schedule)
        final: dict[str, torch.Tensor] = {}

        def keep_latents(pipe: Any, i: int, t: Any, kwargs: dict) -> dict:
            final["latents"] = kwargs["latents"]
            return {}

        with self._schedule_variant(schedule), CallRecorder(self.pipe.transformer) as rec:
            out = self.pipe(
                prompt,
                height=height,
                width=width,
                num_inference_steps=steps,
                guidance_scale=schedule.diffusers_guidance,
                generator=torch.Generator("cpu").manual_seed(int(seed)),
                max_sequence_length=self.text_length(prompt),
                output_type="pt",
                callback_on_step_end=keep_latents,
                callback_on_step_end_tensor_inputs=["latents"],
            )
        num_blocks = self.num_blocks
        cached_steps = self._cached_steps(schedule.cfg) if cache is not None else {}
        cached = sum(len(v) for v in cached_steps.values())
        skipped = 0 if cache is None else num_blocks - cache.Fn_compute_blocks - cache.Bn_compute_blocks
        return recorded_sample(
            rec,
            schedule,
            out.images[0],
            final["latents"][0],
            num_blocks,
            cached_calls=cached,
            blocks_run=rec.calls * num_blocks - cached * skipped,
            cached_steps=cached_steps,
        )
