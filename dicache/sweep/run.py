"""Run a sweep: references, cached cells (ours, cache-dit), the same-compute baselines; resumable.

For every schedule: the uncached reference of each (prompt, seed) on each pipeline (cached under `refs/`), the
high-accuracy reference (uncached Euler with `reference_steps` steps at the schedule's guidance; cached under `refs/`
once per prompt, seed, guidance and variant, so 28 and 50 steps share it), then every cell of every method, each
measured against the reference of its own pipeline (`psnr`, `ssim`, `rel_l2`) and against the high-accuracy one
(`psnr_ref`, `rel_l2_ref`: independent of the sampler under test). Baselines (native pipeline, no cache): fewer-steps
Euler at `round(steps × compute fraction)` of each cell, and Euler, Heun and the `curved` schedule at each of
`compute_targets` (`solvers.counts_for`: the counts just below and just above the target). Every finished record is
appended to `results.jsonl` at once; a rerun with the same model, schedule, settings, samples, size and
`reference_steps` skips it.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from . import solvers
from .cachedit import unsupported_reason
from .compare import compare
from .flops import flops_ratio, krea2_call_flops
from .metrics import ms_ssim, psnr, relative_l2, ssim
from .runners import Sample, branches
from .spec import QUANTIZED_METHODS, Cell, Schedule, SweepSpec, SweepSpecError, stable_hash
from .store import ResultStore, model_fingerprint

RESULTS_VERSION = 1
GRIDS_DIR = "grids"


def _mean(values: list[float]) -> float:
    return float(sum(values) / len(values)) if values else float("nan")


def _round(value: float | None, digits: int = 6) -> float | None:
    return None if value is None else round(float(value), digits)


class Sweep:
    """One sweep over `spec` with the given runners, writing to `out_dir`.

    Args:
        native: a `NativeRunner` (ours, the references and the fewer-steps baseline).
        cache_dit: a `CacheDitRunner` for the side-by-side comparison, or None.
        model_id: what identifies the model in record keys (a local folder's fingerprint).
        progress: show a tqdm bar over all generations of the sweep.
        log: where one-line notes go (skipped cells, warm-up).
    """

    def __init__(
        self,
        spec: SweepSpec,
        out_dir: str | os.PathLike,
        native: Any,
        cache_dit: Any | None = None,
        model_id: str | None = None,
        model_name: str | None = None,
        progress: bool = True,
        log: Callable[[str], None] = print,
        quantized: dict[str, Any] | None = None,
    ) -> None:
        if "cache-dit" in spec.methods and cache_dit is None:
            raise SweepSpecError("method 'cache-dit' needs a cache-dit runner (diffusers' Krea2Pipeline + cache-dit)")
        self.quantized = dict(quantized or {})  # method (e.g. "ours-fp8") -> a NativeRunner on the quantized model
        missing = [m for m in spec.methods if m in QUANTIZED_METHODS.values() and m not in self.quantized]
        if missing:
            raise SweepSpecError(f"method(s) {missing} need a runner on the quantized model")
        self.spec = spec
        self.store = ResultStore(out_dir)
        self.root = self.store.root
        self.native = native
        self.cache_dit = cache_dit if "cache-dit" in spec.methods else None
        self.model_id = model_id or "unknown"
        self.model_name = model_name or self.model_id
        self.height = spec.height or native.default_size[0]
        self.width = spec.width or native.default_size[1]
        self.progress = progress
        self.log = log
        self.notes: list[str] = []
        self._order: list[str] = []
        self._bar: Any = None
        self._warm: set[str] = set()
        self._hirefs: list[dict[str, Any]] | None = None
        for cell in dict.fromkeys(c for m in spec.methods for c in spec.method_cells(m)):
            try:
                cell.config.check_block_split(native.num_blocks)
            except Exception as exc:
                raise SweepSpecError(f"grid cell {cell.label!r}: {exc}") from None

    # ------------------------------------------------------------------ keys
    def _key(self, **parts: Any) -> str:
        base = {"model": self.model_id, "size": [self.height, self.width], "v": RESULTS_VERSION}
        return stable_hash({**base, **parts})

    def _measured_key(self, **parts: Any) -> str:
        """A record measured against the references: its key also names the high-accuracy reference's steps (left
        out when there is none, so that stores written before that reference existed still resume)."""
        if self.spec.reference_steps:
            parts["reference_steps"] = self.spec.reference_steps
        return self._key(**parts)

    def _samples_id(self) -> str:
        return stable_hash([list(s) for s in self.spec.samples])

    def ref_key(self, pipeline: str, schedule: Schedule, prompt: str, seed: int) -> str:
        return self._key(kind="ref", pipeline=pipeline, schedule=schedule.to_dict(), prompt=prompt, seed=seed)

    def hiref_key(self, schedule: Schedule, prompt: str, seed: int) -> str:
        """The high-accuracy reference of one sample: independent of the schedule's step count."""
        guidance = {"guidance_scale": schedule.guidance_scale, "variant": schedule.variant}
        steps = self.spec.reference_steps
        return self._key(kind="hiref", steps=steps, guidance=guidance, prompt=prompt, seed=seed)

    def reference_key(self, pipeline: str, schedule: Schedule) -> str:
        return self._measured_key(
            kind="reference", pipeline=pipeline, schedule=schedule.to_dict(), samples=self._samples_id()
        )

    def cell_key(self, method: str, schedule: Schedule, cell: Cell) -> str:
        return self._measured_key(
            kind="cell", method=method, schedule=schedule.to_dict(), config=cell.canonical(), samples=self._samples_id()
        )

    def baseline_key(self, schedule: Schedule, steps: int) -> str:
        return self._measured_key(kind="baseline", schedule=schedule.to_dict(), steps=steps, samples=self._samples_id())

    def solver_key(self, kind: str, schedule: Schedule, count: int) -> str:
        return self._measured_key(
            kind="solver", solver=kind, schedule=schedule.to_dict(), count=count, samples=self._samples_id()
        )

    # ------------------------------------------------------------------ planning
    def planned_generations(self) -> int:
        """Generations still to run (fewer-steps Euler excluded: it depends on the cells' compute fractions)."""
        n = len(self.spec.samples)
        total = 0
        hirefs = set()
        for schedule in self.spec.schedules:
            for pipeline in self._pipelines():
                if self.reference_key(pipeline, schedule) not in self.store:
                    total += sum(
                        self.store.load_ref(self.ref_key(pipeline, schedule, p, s)) is None
                        for p, s in self.spec.samples
                    )
            if self.spec.reference_steps:
                hirefs |= {self.hiref_key(schedule, p, s) for p, s in self.spec.samples}
            for method, cell in self._cells():
                if self._supported(method, cell) and self.cell_key(method, schedule, cell) not in self.store:
                    total += n
            for kind, count in self._solver_runs(schedule):
                if self.solver_key(kind, schedule, count) not in self.store and not self._is_reference(
                    kind, schedule, count
                ):
                    total += n
        return total + sum(not self.store.ref_path(key).is_file() for key in hirefs)

    def _solver_runs(self, schedule: Schedule) -> list[tuple[str, int]]:
        """(kind, count) of the Heun and curved baselines at the compute targets (Euler runs via `_baseline`)."""
        runs = []
        for kind in self.spec.baselines:
            if kind == "euler":
                continue
            for target in self.spec.compute_targets:
                runs += [(kind, c) for c in solvers.counts_for(kind, schedule.steps, target)]
        return list(dict.fromkeys(runs))

    def _euler_targets(self, schedule: Schedule) -> list[int]:
        if "euler" not in self.spec.baselines:
            return []
        counts = [c for t in self.spec.compute_targets for c in solvers.counts_for("euler", schedule.steps, t)]
        return list(dict.fromkeys(counts))

    @staticmethod
    def _is_reference(kind: str, schedule: Schedule, count: int) -> bool:
        """A curved run computing every step is the uncached run itself."""
        return kind == "curved" and solvers.evaluations(kind, schedule.steps, count) >= schedule.steps

    def _pipelines(self) -> list[str]:
        return ["native"] + (["diffusers"] if self.cache_dit is not None else [])

    def _cells(self) -> list[tuple[str, Cell]]:
        return [(m, c) for m in self.spec.methods for c in self.spec.method_cells(m)]

    def _supported(self, method: str, cell: Cell) -> bool:
        return method != "cache-dit" or unsupported_reason(cell.config) is None

    def _runner(self, pipeline: str) -> Any:
        if pipeline in self.quantized:
            return self.quantized[pipeline]
        return self.native if pipeline == "native" else self.cache_dit

    @staticmethod
    def _pipeline_of(method: str) -> str:
        """The pipeline a method runs on: diffusers for cache-dit, the quantized model for `ours-<q>`, else native."""
        if method == "cache-dit":
            return "diffusers"
        return method if method in QUANTIZED_METHODS.values() else "native"

    @staticmethod
    def _reference_pipeline(pipeline: str) -> str:
        """Whose uncached samples a pipeline is measured against: a quantized model against the unquantized one."""
        return "native" if pipeline in QUANTIZED_METHODS.values() else pipeline

    # ------------------------------------------------------------------ running
    def run(self) -> dict[str, Any]:
        """Run (or resume) the whole sweep; returns the results (also written to `results.json`)."""
        from tqdm.auto import tqdm

        self._bar = tqdm(total=self.planned_generations(), unit="img", desc="sweep", disable=not self.progress)
        try:
            for note in self.spec.extra.get("notes", []):  # said already by whoever built the spec: kept for the report
                if note not in self.notes:
                    self.notes.append(note)
            for method, cell in self._cells():
                if not self._supported(method, cell):
                    self._note(f"{method}: {cell.label} skipped ({unsupported_reason(cell.config)})")
            for schedule in self.spec.schedules:
                self._run_schedule(schedule)
                self.store.write_json(self.results())
        finally:
            self._bar.close()
            if self.cache_dit is not None and hasattr(self.cache_dit, "close"):
                self.cache_dit.close()
        return self.results()

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            self.log(text)

    def _advance(self, label: str) -> None:
        self._bar.set_postfix_str(label[:40], refresh=False)
        self._bar.update(1)

    def _warmup(self, pipeline: str) -> None:
        """One untimed uncached generation per pipeline at the first schedule, so that one-time costs (kernel
        selection, allocator growth, a GPU's clocks ramping up) do not land in the first timings (the references)."""
        if pipeline in self._warm:
            return
        prompt, seed = self.spec.samples[0]
        schedule = self.spec.schedules[0]
        self._runner(pipeline).generate(prompt, seed, schedule, schedule.steps, self.height, self.width, None)
        self._warm.add(pipeline)

    def _generate(self, pipeline: str, schedule: Schedule, steps: int, cache: Any, label: str) -> list[Sample]:
        self._warmup(pipeline)
        runner = self._runner(pipeline)
        out = []
        for prompt, seed in self.spec.samples:
            out.append(runner.generate(prompt, seed, schedule, steps, self.height, self.width, cache))
            self._advance(label)
        return out

    def references(self, pipeline: str, schedule: Schedule) -> list[dict[str, Any]]:
        """The uncached sample of each (prompt, seed): loaded from `refs/` or generated and saved there."""
        runner = self._runner(pipeline)
        refs = []
        for prompt, seed in self.spec.samples:
            key = self.ref_key(pipeline, schedule, prompt, seed)
            ref = self.store.load_ref(key)
            if ref is None:
                self._warmup(pipeline)
                s = runner.generate(prompt, seed, schedule, schedule.steps, self.height, self.width, None)
                ref = {
                    "image": s.image,
                    "latents": s.latents,
                    "denoise_s": s.denoise_s,
                    "total_s": s.total_s,
                    "calls": s.calls,
                    "image_tokens": s.image_tokens,
                    "text_tokens": s.text_tokens,
                }
                self.store.save_ref(key, ref)
                self._advance(f"reference {pipeline}")
            refs.append(ref)
        self._order.append(self.reference_key(pipeline, schedule))
        return refs

    def high_references(self, schedule: Schedule) -> list[dict[str, Any]] | None:
        """The high-accuracy reference of each (prompt, seed): uncached Euler with `reference_steps` steps at the
        schedule's guidance and variant, loaded from `refs/` or generated and saved there (None when off)."""
        steps = self.spec.reference_steps
        if not steps:
            return None
        out = []
        for prompt, seed in self.spec.samples:
            key = self.hiref_key(schedule, prompt, seed)
            ref = self.store.load_ref(key)
            if ref is None:
                self._warmup("native")
                s = self.native.generate(prompt, seed, schedule, steps, self.height, self.width, None)
                ref = {"image": s.image, "latents": s.latents, "denoise_s": s.denoise_s, "steps": steps}
                self.store.save_ref(key, ref)
                self._advance(f"{steps}-step reference")
            out.append(ref)
        return out

    def _run_schedule(self, schedule: Schedule) -> None:
        refs = {pipeline: self.references(pipeline, schedule) for pipeline in self._pipelines()}
        self._hirefs = self.high_references(schedule)
        for pipeline in self._pipelines():
            key = self.reference_key(pipeline, schedule)
            if key not in self.store:
                self.store.add(self._reference_record(key, pipeline, schedule, refs[pipeline]))
        for method, cell in self._cells():
            if not self._supported(method, cell):
                continue
            key = self.cell_key(method, schedule, cell)
            record = self.store.get(key)
            if record is None:
                pipeline = self._pipeline_of(method)
                ref_samples = refs[self._reference_pipeline(pipeline)]
                samples = self._generate(pipeline, schedule, schedule.steps, cell.config, f"{method} {cell.label}")
                record = self._record(key, method, pipeline, schedule, samples, ref_samples, cell=cell)
                record["grid"] = self._save_grid(schedule, f"{method}-{key[:10]}", ref_samples, samples)
                record["baseline_steps"] = max(1, round(schedule.steps * record["compute_fraction"]))
                record["baseline_key"] = self.baseline_key(schedule, record["baseline_steps"])
                self.store.add(record)
            self._order.append(key)
            if "euler" in self.spec.baselines:
                self._baseline(schedule, record["baseline_steps"], refs["native"])
        for steps in self._euler_targets(schedule):
            self._baseline(schedule, steps, refs["native"])
        for kind, count in self._solver_runs(schedule):
            self._solver_baseline(schedule, kind, count, refs["native"])

    def _baseline(self, schedule: Schedule, steps: int, refs: list[dict[str, Any]]) -> dict[str, Any]:
        """Fewer-steps Euler at `steps` steps (the native pipeline's own sampler, no cache)."""
        key = self.baseline_key(schedule, steps)
        record = self.store.get(key)
        if record is None:
            if steps >= schedule.steps:
                samples = [_sample_from_ref(r, self.native.num_blocks, schedule) for r in refs]
            else:
                self._bar.total += len(self.spec.samples)
                samples = self._generate("native", schedule, steps, None, f"fewer steps {steps}")
            record = self._record(key, "fewer-steps", "native", schedule, samples, refs, steps=steps)
            record["setting"] = solvers.setting_label("euler", schedule.steps, steps)
            record["evaluations"] = steps
            record["grid"] = self._save_grid(schedule, f"fewer-steps-{steps}", refs, samples)
            self.store.add(record)
        if key not in self._order:
            self._order.append(key)
        return record

    def _solver_baseline(self, schedule: Schedule, kind: str, count: int, refs: list[dict]) -> dict[str, Any]:
        """A Heun or curved baseline (`solvers`) with solver count `count`, no cache."""
        key = self.solver_key(kind, schedule, count)
        record = self.store.get(key)
        if record is None:
            label = solvers.setting_label(kind, schedule.steps, count)
            if self._is_reference(kind, schedule, count):
                samples = [_sample_from_ref(r, self.native.num_blocks, schedule) for r in refs]
            else:
                samples = []
                for prompt, seed in self.spec.samples:
                    samples.append(
                        self.native.generate_baseline(prompt, seed, schedule, kind, count, self.height, self.width)
                    )
                    self._advance(label)
            steps = count if kind == "heun" else schedule.steps
            record = self._record(key, kind, "native", schedule, samples, refs, steps=steps)
            record["setting"] = label
            record["solver_count"] = count
            record["evaluations"] = solvers.evaluations(kind, schedule.steps, count)
            if kind == "curved":
                record["computed_steps"] = solvers.curved_steps(schedule.steps, count)
            record["grid"] = self._save_grid(schedule, f"{kind}-{count}", refs, samples)
            self.store.add(record)
        if key not in self._order:
            self._order.append(key)
        return record

    # ------------------------------------------------------------------ records
    def _flops_ratio(self, pipeline: str, schedule: Schedule, s: Sample) -> float:
        runner = self._runner(pipeline)
        call = krea2_call_flops(runner_config(runner), s.image_tokens, s.text_tokens)
        full_calls = s.full_calls if s.full_calls is not None else s.calls
        if runner.text_per_call:
            return flops_ratio(call, s.calls, s.blocks_run, s.calls, full_calls, full_calls)
        return flops_ratio(call, s.calls, s.blocks_run, branches(schedule), full_calls, branches(schedule))

    def _against_hirefs(self, samples: list[Any]) -> dict[str, list[float]] | None:
        """PSNR (images) and relative L2 (latents) of each sample against the high-accuracy reference."""
        hirefs = self._hirefs
        if not hirefs:
            return None
        images = torch.stack([s["image"] if isinstance(s, dict) else s.image for s in samples])
        latents = torch.stack([s["latents"] if isinstance(s, dict) else s.latents for s in samples])
        return {
            "psnr_ref": psnr(images, torch.stack([h["image"] for h in hirefs])),
            "rel_l2_ref": relative_l2(latents, torch.stack([h["latents"] for h in hirefs])),
        }

    def _record(
        self,
        key: str,
        method: str,
        pipeline: str,
        schedule: Schedule,
        samples: list[Sample],
        refs: list[dict[str, Any]],
        cell: Cell | None = None,
        steps: int | None = None,
    ) -> dict[str, Any]:
        images = torch.stack([s.image for s in samples])
        ref_images = torch.stack([r["image"] for r in refs])
        latents = torch.stack([s.latents for s in samples])
        ref_latents = torch.stack([r["latents"] for r in refs])
        p, q, l2 = psnr(images, ref_images), ssim(images, ref_images), relative_l2(latents, ref_latents)
        ms = ms_ssim(images, ref_images)
        hi = self._against_hirefs(samples)
        per = []
        for i, ((prompt, seed), s) in enumerate(zip(self.spec.samples, samples)):
            per.append(
                {
                    "prompt": prompt,
                    "seed": seed,
                    "psnr": _round(p[i], 4),
                    "ssim": _round(q[i]),
                    "ms_ssim": None if ms is None else _round(ms[i]),
                    "rel_l2": _round(l2[i]),
                    "psnr_ref": None if hi is None else _round(hi["psnr_ref"][i], 4),
                    "rel_l2_ref": None if hi is None else _round(hi["rel_l2_ref"][i]),
                    "compute_fraction": _round(s.compute_fraction),
                    "flops_ratio": _round(self._flops_ratio(pipeline, schedule, s)),
                    "calls": s.calls,
                    "cached_calls": s.cached_calls,
                    "cached_steps": s.cached_steps,
                    "denoise_s": _round(s.denoise_s, 4),
                    "e2e_s": _round(s.total_s, 4),
                }
            )
        ref_record = self.store.get(self.reference_key(self._reference_pipeline(pipeline), schedule)) or {}
        denoise, e2e = _mean([s.denoise_s for s in samples]), _mean([s.total_s for s in samples])
        record = {
            "key": key,
            "method": method,
            "pipeline": pipeline,
            "schedule": schedule.to_dict(),
            "schedule_name": schedule.name,
            "schedule_slug": schedule.slug,
            "steps": steps or schedule.steps,
            "setting": cell.label if cell is not None else f"{steps or schedule.steps} of {schedule.steps} steps",
            "settings": cell.overrides if cell is not None else None,
            "compute_fraction": _round(_mean([x["compute_fraction"] for x in per])),
            "flops_ratio": _round(_mean([x["flops_ratio"] for x in per])),
            "psnr": _round(_mean(p), 4),
            "psnr_min": _round(min(p), 4),
            "ssim": _round(_mean(q)),
            "ms_ssim": None if ms is None else _round(_mean(ms)),
            "rel_l2": _round(_mean(l2)),
            "psnr_ref": None if hi is None else _round(_mean(hi["psnr_ref"]), 4),
            "psnr_ref_min": None if hi is None else _round(min(hi["psnr_ref"]), 4),
            "rel_l2_ref": None if hi is None else _round(_mean(hi["rel_l2_ref"])),
            "denoise_s": _round(denoise, 4),
            "e2e_s": _round(e2e, 4),
            "speedup_denoise": _round(ref_record.get("denoise_s", 0) / denoise if denoise > 0 else None, 3),
            "speedup_e2e": _round(ref_record.get("e2e_s", 0) / e2e if e2e > 0 else None, 3),
            "samples": per,
        }
        return record

    def _reference_record(self, key: str, pipeline: str, schedule: Schedule, refs: list[dict]) -> dict[str, Any]:
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
            "denoise_s": _round(_mean([r["denoise_s"] for r in refs]), 4),
            "e2e_s": _round(_mean([r["total_s"] for r in refs]), 4),
            "image_tokens": int(refs[0]["image_tokens"]),
            "text_tokens": int(refs[0]["text_tokens"]),
        }
        hi = self._against_hirefs(refs)
        if hi is not None:  # how far the uncached n-step run itself is from the high-accuracy reference
            record["psnr_ref"] = _round(_mean(hi["psnr_ref"]), 4)
            record["psnr_ref_min"] = _round(min(hi["psnr_ref"]), 4)
            record["rel_l2_ref"] = _round(_mean(hi["rel_l2_ref"]))
        if pipeline != "native":  # how close the two pipelines' uncached outputs are (same checkpoint, seed)
            native = [self.store.load_ref(self.ref_key("native", schedule, p, s)) for p, s in self.spec.samples]
            if all(n is not None for n in native):
                a, b = torch.stack([r["image"] for r in refs]), torch.stack([n["image"] for n in native])
                record["psnr_vs_native"] = _round(_mean(psnr(a, b)), 4)
        return record

    def _save_grid(self, schedule: Schedule, name: str, refs: list[dict], samples: list[Sample]) -> str:
        from .plots import save_image_grid

        rel = Path(GRIDS_DIR) / schedule.slug / f"{name}.png"
        save_image_grid([r["image"] for r in refs], [s.image for s in samples], self.root / rel)
        return rel.as_posix()

    # ------------------------------------------------------------------ results
    def results(self) -> dict[str, Any]:
        """Everything this sweep produced so far, in plan order: meta + records, and `comparison` (dicache vs the four
        baselines per schedule, measure and compute bin: `compare.compare`)."""
        seen, records = set(), []
        for key in self._order:
            if key not in seen and key in self.store:
                seen.add(key)
                records.append(self.store.get(key))
        results = {"version": RESULTS_VERSION, "meta": self.meta(), "records": records}
        results["comparison"] = compare(results)
        return results

    def meta(self) -> dict[str, Any]:
        try:
            import diffusers
        except ImportError:  # optional: only cache-dit runs need it
            diffusers = None

        return {
            "model": self.model_name,
            "model_id": self.model_id,
            "height": self.height,
            "width": self.width,
            "num_blocks": self.native.num_blocks,
            "is_distilled": bool(getattr(getattr(self.native, "pipe", None), "is_distilled", False)),
            "samples": [list(s) for s in self.spec.samples],
            "schedules": [s.to_dict() | {"name": s.name, "slug": s.slug} for s in self.spec.schedules],
            "methods": list(self.spec.methods),
            "baselines": list(self.spec.baselines),
            "reference_steps": self.spec.reference_steps,
            "compute_targets": list(self.spec.compute_targets),
            "cells": [{"setting": c.label, "settings": c.overrides} for c in self.spec.cells],
            "cachedit_cells": None
            if self.spec.cachedit_cells is None
            else [{"setting": c.label, "settings": c.overrides} for c in self.spec.cachedit_cells],
            "targets": list(self.spec.targets),
            "notes": list(self.notes),
            "versions": {
                "dicache": __version__,
                "torch": torch.__version__,
                "diffusers": getattr(diffusers, "__version__", None),
                "cache_dit": getattr(self.cache_dit, "version", None) if self.cache_dit is not None else None,
            },
            "machine": machine_description(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        }


def runner_config(runner: Any) -> Any:
    pipe = getattr(runner, "pipe", None)
    return pipe.transformer.config if pipe is not None else runner.transformer_config


def machine_description() -> str:
    """e.g. `Linux x86_64, 2 CPU threads (torch: 2), CPU` or `..., NVIDIA H200`."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU threads "
        f"(torch: {torch.get_num_threads()}), {device}"
    )


def _sample_from_ref(ref: dict[str, Any], num_blocks: int, schedule: Schedule) -> Sample:
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
        full_calls=schedule.steps * branches(schedule),
    )


def model_identity(model: str | os.PathLike | None) -> tuple[str, str]:
    """(display name, fingerprint) of a model argument; None is the embedded checkpoint."""
    from ..models.krea2.pipeline import EMBEDDED_CHECKPOINT, EMBEDDED_TURBO_CHECKPOINT

    path = Path(model) if model is not None else EMBEDDED_CHECKPOINT
    name = "embedded krea2-tiny" if model is None else str(model)
    if path.is_dir() and path.resolve() == EMBEDDED_TURBO_CHECKPOINT:
        name = "embedded krea2-tiny-turbo"
    return name, model_fingerprint(path) if path.is_dir() else str(model)


def run_sweep(
    spec: SweepSpec,
    out_dir: str | os.PathLike,
    *,
    progress: bool = True,
    log: Callable[[str], None] = print,
    dtype: torch.dtype = torch.float32,
    device: str | None = None,
) -> dict[str, Any]:
    """Load the model(s) named by `spec` (both pipelines in `dtype` on `device`), run (or resume) the sweep into
    `out_dir`, write `results.json`, `report.md` and the plots; returns the results. cache-dit is loaded only when
    `spec.methods` has it.

    Nothing needs a network when the model is a local folder (the embedded checkpoint by default). float32 on CUDA
    is true float32 (TF32 off for matmuls and cuDNN convolutions while the sweep runs), as on a CPU."""
    from ..models.krea2.pipeline import EMBEDDED_CHECKPOINT
    from .cachedit import CacheDitRunner
    from .report import write_report
    from .runners import NativeRunner

    name, model_id = model_identity(spec.model)
    # results depend on the numerics too: a sweep resumed in another dtype or on another device type starts afresh
    model_id = f"{model_id}|{str(dtype).removeprefix('torch.')}|{torch.device(device or 'cpu').type}"
    with _full_float32():
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
        if "cache-dit" in spec.methods:
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
