"""Result records of a sweep: a list of generated samples measured against their references becomes one JSON-ready
record (pure functions of the samples; the sweep loop in `run` decides what to generate and stores what this builds).

Measures: `psnr`, `ssim`, `ms_ssim`, `rel_l2` against the uncached run of the same pipeline; `psnr_ref`, `rel_l2_ref`
against the high-accuracy reference (`hirefs`, when the sweep has one); compute fraction and FLOPs ratio per sample;
means (and the minimum PSNR) over the samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .flops import flops_ratio, krea2_call_flops
from .metrics import ms_ssim, psnr, relative_l2, ssim
from .runners import Sample, branches
from .spec import Cell, Schedule


def mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def rounded(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(float(value), digits)


def runner_config(runner: Any) -> Any:
    """The transformer config of a runner's pipeline (for the FLOPs estimate)."""
    pipe = getattr(runner, "pipe", None)
    return pipe.transformer.config if pipe is not None else runner.transformer_config


def flops_ratio_of(runner: Any, schedule: Schedule, s: Sample) -> float | None:
    """Estimated transformer FLOPs of sample `s` over those of the uncached run of `schedule` (None for a model
    without a FLOPs estimate: a family's diffusers pipeline)."""
    if getattr(runner, "model", None) is not None or getattr(runner, "family", None) is not None:
        return None
    call = krea2_call_flops(runner_config(runner), s.image_tokens, s.text_tokens)
    full_calls = s.full_calls if s.full_calls is not None else s.calls
    if runner.text_per_call:
        return flops_ratio(call, s.calls, s.blocks_run, s.calls, full_calls, full_calls)
    return flops_ratio(call, s.calls, s.blocks_run, branches(schedule), full_calls, branches(schedule))


def sample_from_ref(ref: dict[str, Any], num_blocks: int, schedule: Schedule) -> Sample:
    """A stored uncached reference as a `Sample` (a baseline run that equals the uncached run)."""
    return Sample(
        image=ref["image"],
        latents=ref["latents"],
        denoise_s=ref["denoise_s"],
        total_s=ref["total_s"],
        calls=ref["calls"],
        cached_calls=0,
        blocks_run=ref["calls"] * num_blocks,
        num_blocks=num_blocks,
        image_tokens=ref["image_tokens"],
        text_tokens=ref["text_tokens"],
        full_calls=ref["calls"],  # the uncached run of the schedule (a batched CFG call counts once)
    )


def against_hirefs(samples: Sequence[Any], hirefs: Sequence[dict[str, Any]] | None) -> dict[str, list[float]] | None:
    """PSNR (images) and relative L2 (latents) of each sample (a `Sample` or a stored reference dict) against the
    high-accuracy reference of the same (prompt, seed); None without one."""
    if not hirefs:
        return None
    images = torch.stack([s["image"] if isinstance(s, dict) else s.image for s in samples])
    latents = torch.stack([s["latents"] if isinstance(s, dict) else s.latents for s in samples])
    return {
        "psnr_ref": psnr(images, torch.stack([h["image"] for h in hirefs])),
        "rel_l2_ref": relative_l2(latents, torch.stack([h["latents"] for h in hirefs])),
    }


def measured_record(
    key: str,
    method: str,
    pipeline: str,
    schedule: Schedule,
    samples: Sequence[Sample],
    refs: Sequence[dict[str, Any]],
    sample_ids: Sequence[tuple[str, int]],
    hirefs: Sequence[dict[str, Any]] | None,
    flops: Sequence[float],
    ref_record: dict[str, Any],
    cell: Cell | None = None,
    steps: int | None = None,
) -> dict[str, Any]:
    """The record of one cell or baseline run: `samples[i]` is (prompt, seed) `sample_ids[i]`, measured against the
    uncached `refs[i]` (and `hirefs[i]`); `flops[i]` its FLOPs ratio; `ref_record` the uncached run's record (for the
    speedups; {} when unknown). A cell names its setting, a baseline its `steps`."""
    images = torch.stack([s.image for s in samples])
    ref_images = torch.stack([r["image"] for r in refs])
    latents = torch.stack([s.latents for s in samples])
    ref_latents = torch.stack([r["latents"] for r in refs])
    p, q, l2 = psnr(images, ref_images), ssim(images, ref_images), relative_l2(latents, ref_latents)
    ms = ms_ssim(images, ref_images)
    hi = against_hirefs(samples, hirefs)
    per = []
    for i, ((prompt, seed), s) in enumerate(zip(sample_ids, samples)):
        per.append(
            {
                "prompt": prompt,
                "seed": seed,
                "psnr": rounded(p[i], 4),
                "ssim": rounded(q[i]),
                "ms_ssim": None if ms is None else rounded(ms[i]),
                "rel_l2": rounded(l2[i]),
                "psnr_ref": None if hi is None else rounded(hi["psnr_ref"][i], 4),
                "rel_l2_ref": None if hi is None else rounded(hi["rel_l2_ref"][i]),
                "compute_fraction": rounded(s.compute_fraction),
                "flops_ratio": rounded(flops[i]),
                "calls": s.calls,
                "cached_calls": s.cached_calls,
                "cached_steps": s.cached_steps,
                "denoise_s": rounded(s.denoise_s, 4),
                "e2e_s": rounded(s.total_s, 4),
            }
        )
    denoise, e2e = mean([s.denoise_s for s in samples]), mean([s.total_s for s in samples])
    return {
        "key": key,
        "method": method,
        "pipeline": pipeline,
        "schedule": schedule.to_dict(),
        "schedule_name": schedule.name,
        "schedule_slug": schedule.slug,
        "steps": steps or schedule.steps,
        "setting": cell.label if cell is not None else f"{steps or schedule.steps} of {schedule.steps} steps",
        "settings": cell.overrides if cell is not None else None,
        "compute_fraction": rounded(mean([x["compute_fraction"] for x in per])),
        "flops_ratio": None if None in flops else rounded(mean([x["flops_ratio"] for x in per])),
        "psnr": rounded(mean(p), 4),
        "psnr_min": rounded(min(p), 4),
        "ssim": rounded(mean(q)),
        "ms_ssim": None if ms is None else rounded(mean(ms)),
        "rel_l2": rounded(mean(l2)),
        "psnr_ref": None if hi is None else rounded(mean(hi["psnr_ref"]), 4),
        "psnr_ref_min": None if hi is None else rounded(min(hi["psnr_ref"]), 4),
        "rel_l2_ref": None if hi is None else rounded(mean(hi["rel_l2_ref"])),
        "denoise_s": rounded(denoise, 4),
        "e2e_s": rounded(e2e, 4),
        "speedup_denoise": rounded(ref_record.get("denoise_s", 0) / denoise if denoise > 0 else None, 3),
        "speedup_e2e": rounded(ref_record.get("e2e_s", 0) / e2e if e2e > 0 else None, 3),
        "samples": per,
    }


def reference_record(
    key: str,
    pipeline: str,
    schedule: Schedule,
    refs: Sequence[dict[str, Any]],
    hirefs: Sequence[dict[str, Any]] | None,
    native_refs: Sequence[dict[str, Any] | None] | None = None,
) -> dict[str, Any]:
    """The record of a pipeline's uncached run of `schedule`: its timings, how far it is from the high-accuracy
    reference, and (another pipeline than the native one, `native_refs` all stored) how close it is to the native
    pipeline's uncached images."""
    record = {
        "key": key,
        "method": "uncached",
        "pipeline": pipeline,
        "schedule": schedule.to_dict(),
        "schedule_name": schedule.name,
        "schedule_slug": schedule.slug,
        "steps": schedule.steps,
        "setting": f"{schedule.steps} steps, no cache ({pipeline})",
        "compute_fraction": 1.0,
        "flops_ratio": 1.0,
        "denoise_s": rounded(mean([r["denoise_s"] for r in refs]), 4),
        "e2e_s": rounded(mean([r["total_s"] for r in refs]), 4),
        "image_tokens": int(refs[0]["image_tokens"]),
        "text_tokens": int(refs[0]["text_tokens"]),
    }
    hi = against_hirefs(refs, hirefs)
    if hi is not None:  # how far the uncached n-step run itself is from the high-accuracy reference
        record["psnr_ref"] = rounded(mean(hi["psnr_ref"]), 4)
        record["psnr_ref_min"] = rounded(min(hi["psnr_ref"]), 4)
        record["rel_l2_ref"] = rounded(mean(hi["rel_l2_ref"]))
    if native_refs is not None and all(n is not None for n in native_refs):  # same checkpoint, seed
        a, b = torch.stack([r["image"] for r in refs]), torch.stack([n["image"] for n in native_refs])
        record["psnr_vs_native"] = rounded(mean(psnr(a, b)), 4)
    return record
