"""diffusers pipelines of the registered families as models of the commands (`--model` of `generate`, `calibrate`,
`sweep`): which pipeline a folder or hub id holds, loading it, and how to call it with a prompt, a seed, a step
count and a guidance scale.

A checkpoint's `model_index.json` names its pipeline class (`_class_name`): `Krea2Pipeline` is ours (the native
pipeline, `models/krea2`); any other class is loaded by diffusers' `DiffusionPipeline.from_pretrained` and must hold
a transformer of a registered family (`blocks/families.py`). A hub id resolves through the local hub cache
(`loading.resolve_component_dir`; offline and not cached: a `CheckpointError` saying how to fetch it). An optional
`dicache.json` beside it gives what diffusers' defaults do not: `default_size` ([height, width] px), `sampling`
(`steps`, `guidance`: the schedule the model is meant for) and `call` (extra keyword arguments of every call, e.g.
`max_sequence_length`, a length a model was trained at).

Guidance (`call_kwargs`): the standard CFG scale `s` (`uncond + s·(cond − uncond)`, 1 = off) goes where the family
takes it: `true_cfg_scale` with an empty negative prompt when the pipeline has one (Flux.1, Qwen-Image: their
`guidance_scale` is then the guidance embedding's value, `embedded_guidance`), else `guidance_scale` (diffusers'
classic CFG, the same convention: SD3, PixArt, Wan, …). Seeds go through the call's `generator` (a CPU generator,
as diffusers' own tests draw noise). Settings a family cannot take are refused before any run (`guidance_refusal`,
`step_mask_refusal`, `fitted_refusal`), naming the setting and the family.
"""

from __future__ import annotations

import copy
import inspect
import os
import pathlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..blocks.families import BATCHED, find_family
from ..errors import ConfigError, UnsupportedModelError
from .krea2.checkpoints import EMBEDDED_CHECKPOINT, read_dicache_json
from .loading import CheckpointError, hidden_packages, read_json, resolve_component_dir

NATIVE_PIPELINES = ("Krea2Pipeline",)
"""Pipeline classes the native Krea-2 pipeline loads (our `Krea2Pipeline`); any other goes through diffusers."""


def model_folder(model: str | os.PathLike | None) -> pathlib.Path:
    """The local folder of `--model` (None: the embedded checkpoint; a hub id: its snapshot in the hub cache)."""
    if model is None:
        return EMBEDDED_CHECKPOINT
    return resolve_component_dir(model, None)


def pipeline_class(model: str | os.PathLike | None) -> str:
    """The `_class_name` of the checkpoint's `model_index.json`."""
    folder = model_folder(model)
    name = read_json(folder, "model_index.json").get("_class_name")
    if not isinstance(name, str):
        raise CheckpointError(f"{folder / 'model_index.json'} names no pipeline class (`_class_name`)")
    return name


def is_family_model(model: str | os.PathLike | None) -> bool:
    """True when `--model` is a diffusers pipeline of another class than our Krea-2 (a registered family's)."""
    return model is not None and pipeline_class(model) not in NATIVE_PIPELINES


@dataclass
class FamilyModel:
    """A loaded diffusers pipeline of a registered family and what its `dicache.json` adds.

    `family`: the registry's name (e.g. "Flux.1"); `source`: the folder or hub id it came from (None: built in
    Python); `extras`: the parsed `dicache.json` (`{}` without one)."""

    pipe: Any
    family: str
    source: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{type(self.pipe).__name__} ({self.family})"

    @property
    def sampling(self) -> dict[str, Any]:
        """`{"steps", "guidance"}` of dicache.json's `sampling`, else the pipeline's default steps and no CFG."""
        given = self.extras.get("sampling") or {}
        steps = given.get("steps") or default_steps(self.pipe)
        return {"steps": int(steps), "guidance": float(given.get("guidance", 1.0))}

    @property
    def call(self) -> dict[str, Any]:
        """Extra keyword arguments of every call (dicache.json's `call`)."""
        return dict(self.extras.get("call") or {})

    @property
    def default_size(self) -> tuple[int, int]:
        """(height, width) px: dicache.json's `default_size`, else the pipeline's own default."""
        size = self.extras.get("default_size")
        if isinstance(size, list | tuple) and len(size) == 2:
            return int(size[0]), int(size[1])
        return pipeline_default_size(self.pipe)


def checkpoint_schedule(model: str | os.PathLike) -> tuple[int, float]:
    """(steps, CFG scale) a family checkpoint is meant for, without loading it: dicache.json's `sampling`, else
    its pipeline class's default step count and no CFG."""
    folder = model_folder(model)
    given = read_dicache_json(folder).get("sampling") or {}
    steps = given.get("steps")
    if steps is None:
        # diffusers is optional (the `diffusers` extra): only a family checkpoint needs it
        import diffusers

        steps = default_steps(getattr(diffusers, pipeline_class(model)))
    return int(steps), float(given.get("guidance", 1.0))


def family_of(pipe: Any) -> str:
    """The registered family of `pipe`'s transformer; `UnsupportedModelError` for a pipeline without a registered
    one (the commands take registered families; `dicache.enable(pipe, form=...)` covers others from Python)."""
    transformer = getattr(pipe, "transformer", None)
    family = find_family(transformer) if transformer is not None else None
    if family is None:
        raise UnsupportedModelError(
            f"{type(pipe).__name__}: its transformer ({type(transformer).__name__}) is not a registered family "
            "(dicache.adapters.FAMILIES); the commands take registered families only, while "
            "dicache.enable(pipe, form=...) caches other models from Python"
        )
    return family.name


def load_family_model(
    model: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device | None = None
) -> FamilyModel:
    """Load `--model` with diffusers' `DiffusionPipeline.from_pretrained` (the class `model_index.json` names), in
    `dtype` (default float32) on `device` (default CPU); check its family; progress bars off."""
    folder = model_folder(model)
    with hidden_packages("torchao"):  # diffusers and transformers import it when installed; no family path uses it
        # diffusers is optional (the `diffusers` extra): only a family checkpoint needs it
        try:
            from diffusers import DiffusionPipeline
        except ImportError as exc:
            raise CheckpointError(
                f"{model}: a {pipeline_class(model)} checkpoint needs diffusers (pip install diffusers): {exc}"
            ) from None
        pipe = DiffusionPipeline.from_pretrained(folder, dtype=dtype or torch.float32)
    if device is not None:
        pipe = pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return FamilyModel(pipe, family_of(pipe), str(model), read_dicache_json(folder))


def wrap_pipeline(pipe: Any, call: Mapping[str, Any] | None = None) -> FamilyModel:
    """A pipeline a user built in Python, as a `FamilyModel`; `call`: extra keyword arguments of every call (as a
    checkpoint's dicache.json `call`)."""
    return FamilyModel(pipe, family_of(pipe), extras={"call": dict(call)} if call else {})


def call_parameters(pipe: Any) -> Mapping[str, inspect.Parameter]:
    """The parameters of a pipeline's (or pipeline class's) `__call__`."""
    kind = pipe if isinstance(pipe, type) else type(pipe)
    return inspect.signature(kind.__call__).parameters


def default_steps(pipe: Any) -> int:
    """The pipeline's `num_inference_steps` default (28 for Flux.1, 50 for most)."""
    parameter = call_parameters(pipe).get("num_inference_steps")
    default = None if parameter is None else parameter.default
    return int(default) if isinstance(default, int) else 50


def pipeline_default_size(pipe: Any) -> tuple[int, int]:
    """(height, width) px the pipeline makes by default: `default_sample_size × vae_scale_factor` where it has both."""
    sample = getattr(pipe, "default_sample_size", None)
    scale = getattr(pipe, "vae_scale_factor", None)
    if isinstance(sample, int) and isinstance(scale, int):
        return sample * scale, sample * scale
    config = getattr(getattr(pipe, "transformer", None), "config", {})
    sample = config.get("sample_size", 64) if hasattr(config, "get") else 64
    return int(sample) * int(scale or 8), int(sample) * int(scale or 8)


def cfg_parameter(pipe: Any) -> str | None:
    """The call argument that takes the CFG scale: `true_cfg_scale`, else `guidance_scale`, else None (no CFG)."""
    parameters = call_parameters(pipe)
    for name in ("true_cfg_scale", "guidance_scale"):
        if name in parameters:
            return name
    return None


def guidance_embedding(pipe: Any) -> bool:
    """Whether the transformer has a guidance embedding (Flux.1-dev's `guidance_embeds`)."""
    config = getattr(getattr(pipe, "transformer", None), "config", {})
    return bool(config.get("guidance_embeds", False)) if hasattr(config, "get") else False


def guidance_refusal(model: FamilyModel, guidance: float, embedded_guidance: float | None) -> str | None:
    """Why the family cannot sample with CFG scale `guidance` / guidance embedding `embedded_guidance`, or None."""
    name = model.name
    parameter = cfg_parameter(model.pipe)
    if guidance > 1.0 and parameter is None:
        return f"guidance={guidance:g} (CFG) is refused for {name}: its pipeline takes no CFG scale; use 1"
    if embedded_guidance is not None and (parameter != "true_cfg_scale" or not guidance_embedding(model.pipe)):
        return (
            f"embedded_guidance={embedded_guidance:g} is refused for {name}: its transformer has no guidance "
            "embedding (Flux.1-dev's `guidance_embeds`); CFG goes through guidance"
        )
    return None


def step_mask_refusal(model: FamilyModel, steps: int) -> str | None:
    """Why a per-step mask cannot apply to `model` at `steps` steps, or None: the scheduler must make exactly one
    model evaluation per step (`order` 1 and `steps` timesteps), else step indices do not name denoising steps."""
    scheduler = getattr(model.pipe, "scheduler", None)
    if scheduler is None:
        return None
    kind = type(scheduler).__name__
    if getattr(scheduler, "order", 1) != 1:
        return (
            f"a step mask is refused for {model.name}: its scheduler {kind} evaluates the model {scheduler.order} "
            "times per step, so it has no fixed step count to mask"
        )
    count = scheduled_steps(scheduler, steps)
    if count is not None and count != steps:
        return (
            f"a step mask is refused for {model.name}: its scheduler {kind} makes {count} timesteps for "
            f"num_inference_steps={steps}, so it has no fixed step count to mask"
        )
    return None


def scheduled_steps(scheduler: Any, steps: int) -> int | None:
    """How many timesteps a copy of `scheduler` makes for `steps` steps (None when it cannot be asked alone)."""
    probe = copy.deepcopy(scheduler)
    kwargs: dict[str, Any] = {}
    if "mu" in inspect.signature(probe.set_timesteps).parameters and probe.config.get("use_dynamic_shifting", False):
        kwargs["mu"] = 1.0
    try:
        probe.set_timesteps(steps, **kwargs)
    except (TypeError, ValueError):
        return None
    return len(probe.timesteps)


def call_kwargs(
    model: FamilyModel,
    *,
    steps: int,
    guidance: float,
    embedded_guidance: float | None,
    height: int,
    width: int,
    seed: int,
) -> dict[str, Any]:
    """The keyword arguments (besides the prompt) of one call at this schedule (see the module's guidance rule);
    `ConfigError` for guidance the family cannot take."""
    reason = guidance_refusal(model, guidance, embedded_guidance)
    if reason is not None:
        raise ConfigError(reason)
    kwargs: dict[str, Any] = {
        **model.call,
        "num_inference_steps": steps,
        "height": height,
        "width": width,
        "generator": torch.Generator("cpu").manual_seed(int(seed)),
    }
    parameter = cfg_parameter(model.pipe)
    if parameter == "true_cfg_scale":
        kwargs["true_cfg_scale"] = guidance
        if guidance > 1.0:
            kwargs.setdefault("negative_prompt", "")
        if embedded_guidance is not None:
            kwargs["guidance_scale"] = embedded_guidance
    elif parameter == "guidance_scale":
        kwargs["guidance_scale"] = guidance
    return kwargs


FITTED = "cached_step_method='fitted'"


def fitted_refusal(model: FamilyModel, steps: int, guidance: float = 1.0) -> str | None:
    """Why the fitted output predictor (`cached_step_method=fitted`) cannot be fitted for or run on `model` at `steps`
    steps and CFG scale `guidance`, or None. It needs a step mask (`step_mask_refusal`); a flow-matching Euler
    scheduler, deterministic (its step is `x + (σ(i+1) − σ(i))·v`, which the fit steers by); with CFG, the branches
    called apart (the fit reads each branch's calls); one transformer; and the pipeline's step-end callback (the fit
    reads the latents there)."""
    reason = step_mask_refusal(model, steps)
    if reason is not None:
        return reason.replace("a step mask is refused", f"{FITTED} (a step mask) is refused", 1)
    pipe, name = model.pipe, model.name
    scheduler = getattr(pipe, "scheduler", None)
    kind = type(scheduler).__name__
    euler = any(c.__name__ == "FlowMatchEulerDiscreteScheduler" for c in type(scheduler).__mro__)
    config = getattr(scheduler, "config", {})
    if not euler or (hasattr(config, "get") and config.get("stochastic_sampling", False)):
        return (
            f"{FITTED} is refused for {name}: its scheduler {kind} does not take the deterministic Euler step "
            "x + (σ(i+1) − σ(i))·v the predictor is fitted for (FlowMatchEulerDiscreteScheduler does)"
        )
    family = find_family(pipe.transformer)
    if family is not None and family.cfg == BATCHED and guidance > 1.0:
        return (
            f"{FITTED} is refused for {name} with CFG (guidance {guidance:g}): its pipeline calls the two branches "
            "as one batched call; the predictor is fitted per branch call"
        )
    others = [a for a in (family.transformers if family else ()) if a != "transformer" and getattr(pipe, a, None)]
    if others:
        return f"{FITTED} is refused for {name}: it holds more than one transformer ({', '.join(others)})"
    if "callback_on_step_end" not in call_parameters(pipe):
        return f"{FITTED} is refused for {name}: its pipeline takes no callback_on_step_end (the fit reads the latents)"
    return None
