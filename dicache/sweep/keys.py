"""Record keys of a sweep: what identifies a reference, a cell, a baseline run in the resumable store.

A key hashes the model, the image size, `RESULTS_VERSION` and what the record measured (schedule, setting, samples,
the high-accuracy reference's steps), so that a rerun finds exactly the records it would produce again.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from .spec import Cell, Schedule, fitted_here, stable_hash

RESULTS_VERSION = 1


class SweepKeys:
    """Key methods of `Sweep` (a mixin): needs `spec`, `model_id`, `height` and `width` on the instance."""

    spec: Any
    model_id: str
    height: int
    width: int

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
        parts: dict[str, Any] = {}
        if fitted_here(cell.config):
            parts["fit"] = {"prompts": [list(p) for p in self.spec.fit_prompts or []], "seeds": self.spec.fit_seeds}
        elif cell.config.cached_step_method == "fitted":  # a file: its content, so a refit is measured again
            parts["predictor"] = file_digest(cell.config.fitted_predictor)
        return self._measured_key(
            kind="cell",
            method=method,
            schedule=schedule.to_dict(),
            config=cell.canonical(),
            samples=self._samples_id(),
            **parts,
        )

    def predictor_key(self, method: str, schedule: Schedule, cell: Cell, steered_to: str | None = None) -> str:
        """The fitted predictor a sweep fits for a cell (its file `predictors/<key>.safetensors`); `steered_to`: the
        pipeline whose uncached run the fit steers to when it is not the method's own."""
        fit = {"prompts": [list(p) for p in self.spec.fit_prompts or []], "seeds": self.spec.fit_seeds}
        if steered_to is not None:
            fit["steered_to"] = steered_to
        return self._key(kind="predictor", method=method, schedule=schedule.to_dict(), config=cell.canonical(), fit=fit)

    def baseline_key(self, schedule: Schedule, steps: int) -> str:
        return self._measured_key(kind="baseline", schedule=schedule.to_dict(), steps=steps, samples=self._samples_id())

    def solver_key(self, kind: str, schedule: Schedule, count: int) -> str:
        return self._measured_key(
            kind="solver", solver=kind, schedule=schedule.to_dict(), count=count, samples=self._samples_id()
        )


def file_digest(path: str) -> str:
    """SHA-256 of a file's bytes (hex), or "missing" when it cannot be read."""
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return "missing"
