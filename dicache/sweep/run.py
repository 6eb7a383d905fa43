"""Run a sweep: references, cached cells (ours, cache-dit), the same-compute baselines; resumable.

For every schedule: the uncached reference of each (prompt, seed) on each pipeline (cached under `refs/`), the
high-accuracy reference (uncached Euler with `reference_steps` steps at the schedule's guidance; cached under `refs/`
once per prompt, seed, guidance and variant, so 28 and 50 steps share it), then every cell of every method, each
measured against the reference of its own pipeline (`psnr`, `ssim`, `rel_l2`) and against the high-accuracy one
(`psnr_ref`, `rel_l2_ref`: independent of the sampler under test). Baselines (native pipeline, no cache): fewer-steps
Euler at `round(steps × compute fraction)` of each cell, and Euler, Heun and the `curved` schedule at each of
`compute_targets` (`solvers.counts_for`: the counts just below and just above the target). Every finished record is
appended to `results.jsonl` at once; a rerun with the same model, schedule, settings, samples, size and
`reference_steps` skips it. Record keys come from `keys`, records are built by `records`, `launch` loads the models.
"""

from __future__ import annotations

import datetime
import os
import platform
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..engine.cached_step import load_weights
from ..engine.policies import step_mask
from ..errors import ConfigError
from ..models.store_layout import installed_version
from . import solvers
from .cachedit import unsupported_reason
from .compare import compare
from .fitting import BatchRun, Trajectory, fit_predictor, fit_samples
from .keys import RESULTS_VERSION, SweepKeys
from .plots import save_image_grid
from .progress import progress_bar
from .records import flops_ratio_of, measured_record, reference_record, sample_from_ref
from .runners import Sample
from .spec import QUANTIZED_METHODS, Cell, Schedule, SweepSpec, SweepSpecError, fitted_here
from .store import ResultStore

GRIDS_DIR = "grids"


class Sweep(SweepKeys):
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
        self._trajectories: dict[tuple[str, Schedule], Trajectory] = {}
        self._euler_runs = 0
        for schedule in spec.schedules:  # settings the model cannot take are refused before any run
            if hasattr(native, "check_schedule"):
                try:
                    native.check_schedule(schedule)
                except ConfigError as exc:
                    raise SweepSpecError(f"schedule {schedule.name!r}: {exc}") from None
        refusal = getattr(native, "mask_refusal", None)
        fitted_refusal = getattr(native, "fitted_refusal", None)
        for cell in dict.fromkeys(c for m in spec.methods for c in spec.method_cells(m)):
            try:
                cell.config.check_block_split(native.num_blocks)
            except Exception as exc:
                raise SweepSpecError(f"grid cell {cell.label!r}: {exc}") from None
            for schedule in spec.schedules if refusal is not None else ():
                if step_mask(cell.config, schedule.steps) is not None and refusal(schedule.steps):
                    raise SweepSpecError(f"grid cell {cell.label!r}: {refusal(schedule.steps)}")
            if cell.config.cached_step_method == "fitted":
                for schedule in spec.schedules if fitted_refusal is not None else ():
                    if fitted_refusal(schedule):
                        raise SweepSpecError(f"grid cell {cell.label!r}: {fitted_refusal(schedule)}")
                self._check_predictor_file(cell)

    def _check_predictor_file(self, cell: Cell) -> None:
        """A cell naming a predictor file: the file loads, and none of the prompts it was fitted on is judged."""
        if cell.config.fitted_predictor is None:
            return
        try:
            fitted_on = load_weights(cell.config.fitted_predictor).fitted_on
        except ConfigError as exc:
            raise SweepSpecError(f"grid cell {cell.label!r}: {exc}") from None
        judged = {p for p, _ in self.spec.samples} & {s.get("prompt") for s in fitted_on if isinstance(s, dict)}
        if judged:
            raise SweepSpecError(
                f"grid cell {cell.label!r}: its fitted_predictor was fitted on {sorted(judged)[:3]}, which this sweep "
                "judges; a fitted predictor is judged on prompts it was not fitted on"
            )

    # ------------------------------------------------------------------ planning
    def planned_generations(self) -> int:
        """Generations still to run, known before the first one: the per-cell fewer-steps Euler runs count at their
        most (a cell's step count depends on its measured compute: `_euler_plan`); the bar's total is lowered by the
        ones a schedule did not need once it is done, so it never grows."""
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
            total += n * self._euler_plan(schedule)
        return total + sum(not self.store.ref_path(key).is_file() for key in hirefs)

    def _euler_plan(self, schedule: Schedule) -> int:
        """The most fewer-steps Euler runs `schedule` can still need (each one image per sample): the compute
        targets' step counts and those of finished cells that are not stored yet, plus one per unfinished cell, up to
        the step counts left (1 … steps − 1, not stored)."""
        if "euler" not in self.spec.baselines:
            return 0
        open_counts = {s for s in range(1, schedule.steps) if self.baseline_key(schedule, s) not in self.store}
        needed = set(self._euler_targets(schedule)) & open_counts
        unknown = 0
        for method, cell in self._cells():
            if not self._supported(method, cell):
                continue
            record = self.store.get(self.cell_key(method, schedule, cell))
            if record is None:
                unknown += 1
            elif record["baseline_steps"] in open_counts:
                needed.add(record["baseline_steps"])
        return len(needed) + min(unknown, len(open_counts - needed))

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
        """The pipelines with their own uncached references (cache-dit on a family's pipeline shares native's)."""
        own = self.cache_dit is not None and not getattr(self.cache_dit, "shares_references", False)
        return ["native"] + (["diffusers"] if own else [])

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

    def _reference_pipeline(self, pipeline: str) -> str:
        """Whose uncached samples a pipeline is measured against: a quantized model against the unquantized one,
        cache-dit on a family's pipeline against that pipeline's (native) references."""
        if pipeline in QUANTIZED_METHODS.values() or pipeline not in self._pipelines():
            return "native"
        return pipeline

    # ------------------------------------------------------------------ running
    def run(self) -> dict[str, Any]:
        """Run (or resume) the whole sweep; returns the results (also written to `results.json`)."""
        bar = progress_bar(total=self.planned_generations(), unit="img", desc="sweep", disable=not self.progress)
        with bar as self._bar:
            return self._run_all()

    def _run_all(self) -> dict[str, Any]:
        try:
            for note in self.spec.extra.get("notes", []):  # said already by whoever built the spec: kept for the report
                if note not in self.notes:
                    self.notes.append(note)
            for method, cell in self._cells():
                if not self._supported(method, cell):
                    self._note(f"{method}: {cell.label} skipped ({unsupported_reason(cell.config)})")
            for schedule in self.spec.schedules:
                planned, self._euler_runs = self._euler_plan(schedule), 0
                self._run_schedule(schedule)
                self._bar.total -= (planned - self._euler_runs) * len(self.spec.samples)  # unused upper bound
                self._bar.refresh()
                self.store.write_json(self.results())
        finally:
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
                config = self._cell_config(method, pipeline, schedule, cell)
                samples = self._generate(pipeline, schedule, schedule.steps, config, f"{method} {cell.label}")
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

    def _cell_config(self, method: str, pipeline: str, schedule: Schedule, cell: Cell) -> Any:
        """The cell's settings as run: a fitted-predictor cell that names no file gets the predictor fitted on the
        spec's `fit_prompts` (each with `fit_seeds` other seeds) on its own pipeline, kept in `predictors/`. The fit
        steers to the uncached run of the pipeline the cell is measured against: a quantized model's (`ours-fp8`) to
        the unquantized model's, as `dicache calibrate --quantization` fits the model it will serve."""
        config = cell.config
        if not fitted_here(config):
            return config
        reference = "native" if pipeline in QUANTIZED_METHODS.values() else pipeline
        key = self.predictor_key(method, schedule, cell, steered_to=None if reference == pipeline else reference)
        path = self.root / "predictors" / f"{key}.safetensors"
        if not path.is_file():
            self.log(f"fitting the predictor of {cell.label} on {len(self.spec.fit_prompts)} training prompt(s)")
            run = BatchRun(self._runner(pipeline), schedule, self.height, self.width)
            samples = fit_samples(self.spec.fit_prompts, self.spec.fit_seeds)
            steered = (reference, schedule)
            if steered not in self._trajectories:  # the fit samples' uncached run, shared by the schedule's cells
                steer = BatchRun(self._runner(reference), schedule, self.height, self.width)
                self._trajectories[steered] = Trajectory.record(steer, samples)
            fit_predictor(run, samples, cell.overrides, self._trajectories[steered]).save(path)
        return config.merged({"fitted_predictor": str(path)})

    def _baseline(self, schedule: Schedule, steps: int, refs: list[dict[str, Any]]) -> dict[str, Any]:
        """Fewer-steps Euler at `steps` steps (the native pipeline's own sampler, no cache)."""
        key = self.baseline_key(schedule, steps)

        def build() -> dict[str, Any]:
            if steps >= schedule.steps:
                samples = [sample_from_ref(r, self.native.num_blocks, schedule) for r in refs]
            else:
                self._euler_runs += 1
                samples = self._generate("native", schedule, steps, None, f"fewer steps {steps}")
            record = self._record(key, "fewer-steps", "native", schedule, samples, refs, steps=steps)
            record["setting"] = solvers.setting_label("euler", schedule.steps, steps)
            record["evaluations"] = steps
            record["grid"] = self._save_grid(schedule, f"fewer-steps-{steps}", refs, samples)
            return record

        return self._stored(key, build)

    def _solver_baseline(self, schedule: Schedule, kind: str, count: int, refs: list[dict]) -> dict[str, Any]:
        """A Heun or curved baseline (`solvers`) with solver count `count`, no cache."""
        key = self.solver_key(kind, schedule, count)

        def build() -> dict[str, Any]:
            label = solvers.setting_label(kind, schedule.steps, count)
            if self._is_reference(kind, schedule, count):
                samples = [sample_from_ref(r, self.native.num_blocks, schedule) for r in refs]
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
            return record

        return self._stored(key, build)

    def _stored(self, key: str, build: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The stored record of `key`, else `build()`'s (stored now); either way listed once in the results' order."""
        record = self.store.get(key)
        if record is None:
            record = build()
            self.store.add(record)
        if key not in self._order:
            self._order.append(key)
        return record

    # ------------------------------------------------------------------ records
    def _flops_ratio(self, pipeline: str, schedule: Schedule, s: Sample) -> float:
        return flops_ratio_of(self._runner(pipeline), schedule, s)

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
        ref_record = self.store.get(self.reference_key(self._reference_pipeline(pipeline), schedule)) or {}
        flops = [self._flops_ratio(pipeline, schedule, s) for s in samples]
        return measured_record(
            key,
            method,
            pipeline,
            schedule,
            samples,
            refs,
            self.spec.samples,
            self._hirefs,
            flops,
            ref_record,
            cell,
            steps,
        )

    def _reference_record(self, key: str, pipeline: str, schedule: Schedule, refs: list[dict]) -> dict[str, Any]:
        native = None
        if pipeline != "native":
            native = [self.store.load_ref(self.ref_key("native", schedule, p, s)) for p, s in self.spec.samples]
        return reference_record(key, pipeline, schedule, refs, self._hirefs, native)

    def _save_grid(self, schedule: Schedule, name: str, refs: list[dict], samples: list[Sample]) -> str:
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
        return {
            "model": self.model_name,
            "model_id": self.model_id,
            "height": self.height,
            "width": self.width,
            "num_blocks": self.native.num_blocks,
            "is_distilled": bool(getattr(getattr(self.native, "pipe", None), "is_distilled", False)),
            "family": None if getattr(self.native, "model", None) is None else self.native.model.name,
            "measured_on": getattr(self.native, "measured_on", None) or "image",
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
                "diffusers": installed_version("diffusers"),
                "cache_dit": getattr(self.cache_dit, "version", None) if self.cache_dit is not None else None,
            },
            "machine": machine_description(),
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        }


def machine_description() -> str:
    """e.g. `Linux x86_64, 2 CPU threads (torch: 2), CPU` or `..., NVIDIA H200`."""
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return (
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPU threads "
        f"(torch: {torch.get_num_threads()}), {device}"
    )
