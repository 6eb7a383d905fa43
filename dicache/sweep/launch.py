"""Load the model(s) a sweep spec names and run the sweep: `run_sweep`, what `dicache sweep` calls."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from ..models.families import is_family_model
from ..models.krea2.pipeline import EMBEDDED_CHECKPOINT, EMBEDDED_TURBO_CHECKPOINT, Krea2Pipeline
from .cachedit import CacheDitRunner
from .report import write_report
from .run import Sweep
from .runners import FamilyRunner, NativeRunner, runner_for
from .spec import QUANTIZED_METHODS, SweepSpec, SweepSpecError
from .store import model_fingerprint


def model_identity(model: str | os.PathLike | None) -> tuple[str, str]:
    """(display name, fingerprint) of a model argument; None is the embedded checkpoint."""
    path = Path(model) if model is not None else EMBEDDED_CHECKPOINT
    name = "embedded krea2-tiny" if model is None else str(model)
    if path.is_dir() and path.resolve() == EMBEDDED_TURBO_CHECKPOINT:
        name = "embedded krea2-tiny-turbo"
    return name, model_fingerprint(path) if path.is_dir() else str(model)


FAMILY_BASELINES = ("euler",)
"""The uncached baselines a family's pipeline runs: fewer steps (the same pipeline's call with fewer steps)."""


def check_family_spec(spec: SweepSpec, name: str) -> None:
    """Refuse, before loading anything, what a family's pipeline cannot run (naming the setting and the model)."""
    refused = [b for b in spec.baselines if b not in FAMILY_BASELINES]
    if refused:
        raise SweepSpecError(
            f"baselines {', '.join(refused)} are refused for {name}: they need Krea-2's pipeline pieces; a family "
            f"runs {', '.join(FAMILY_BASELINES)} (fewer steps) and cachedit"
        )
    quantized = [m for m in spec.methods if m in QUANTIZED_METHODS.values()]
    if quantized:
        raise SweepSpecError(f"methods {', '.join(quantized)} (--quantization) are refused for {name}: Krea-2 only")


def run_sweep(
    spec: SweepSpec,
    out_dir: str | os.PathLike,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    dtype: torch.dtype = torch.float32,
    device: str | None = None,
    pipe: Any = None,
    call: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Load the model(s) named by `spec` (both pipelines in `dtype` on `device`), run (or resume) the sweep into
    `out_dir`, write `results.json`, `report.md` and the plots; returns the results. cache-dit is loaded only when
    `spec.methods` has it. `pipe`: a pipeline built in Python (our Krea-2 or a registered family's) instead of
    `spec.model`; its resumed records are keyed by its class; `call`: extra keyword arguments of its every call.

    A family's diffusers pipeline (`dicache.models.families`) runs through its own `__call__`; cache-dit caches the
    same pipeline (`cache_dit.enable_cache`). Nothing needs a network when the model is a local folder (the embedded
    checkpoint by default). float32 on CUDA is true float32 (TF32 off for matmuls and cuDNN convolutions while the
    sweep runs), as on a CPU."""
    family = pipe is not None and not isinstance(pipe, Krea2Pipeline) or pipe is None and is_family_model(spec.model)
    if pipe is not None:
        name, model_id = type(pipe).__name__, f"python:{type(pipe).__name__}"
    else:
        name, model_id = model_identity(spec.model)
    if family:
        check_family_spec(spec, name)
    # results depend on the numerics too: a sweep resumed in another dtype or on another device type starts afresh
    model_id = f"{model_id}|{str(dtype).removeprefix('torch.')}|{torch.device(device or 'cpu').type}"
    with _full_float32():
        if pipe is not None:
            native = runner_for(pipe, call)
        elif family:
            native = FamilyRunner.load(spec.model, dtype=dtype, device=device)
        else:
            native = NativeRunner.load(spec.model, dtype=dtype, device=device)
        quantized = {}
        for quantization, method in QUANTIZED_METHODS.items():
            if method in spec.methods:
                if dtype != torch.bfloat16:
                    raise SweepSpecError(
                        f"method {method!r} (--quantization {quantization}) is measured against bf16: pass --dtype "
                        f"bfloat16 (got {str(dtype).removeprefix('torch.')})"
                    )
                quantized[method] = NativeRunner.load(spec.model, dtype=dtype, device=device, quantization=quantization)
        cache_dit = None
        if "cache-dit" in spec.methods and family:
            cache_dit = CacheDitRunner.on_family(native)
        elif "cache-dit" in spec.methods:
            model_dir = Path(spec.model) if spec.model is not None else EMBEDDED_CHECKPOINT
            if not model_dir.is_dir():
                raise SweepSpecError(
                    f"cache-dit runs diffusers' Krea2Pipeline from a local folder; {model_dir} is not one"
                )
            cache_dit = CacheDitRunner.load(str(model_dir), dtype=dtype, device=device)
        sweep = Sweep(
            spec,
            out_dir,
            native,
            cache_dit,
            model_id=model_id,
            model_name=name,
            progress=progress,
            log=log,
            quantized=quantized,
        )
        results = sweep.run()
    write_report(results, out_dir)
    return results


@contextlib.contextmanager
def _full_float32():
    """TF32 off for CUDA matmuls and cuDNN convolutions inside; the previous flags restored after."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
