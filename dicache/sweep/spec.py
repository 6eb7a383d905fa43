"""What a sweep runs: schedules, cache-setting cells, samples (prompt sets: `prompts`); read from CLI values or a
YAML/JSON grid file.

A *cell* is one set of cache settings, validated by `dicache.CacheConfig` against the built-in defaults (the
`SGLANG_CACHE_DIT_*` environment is ignored so that a sweep is reproducible). Grid keys are `CacheConfig` request
keys or their short names (`Fn, Bn, W, RDT, MC, TS, SCM, SCM_POLICY`); `taylorseer_order: 0` means TaylorSeer off.
A grid is a mapping of key -> list of values (their cartesian product) or a list of such mappings (their union).
"""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..settings.cache_config import CacheConfig
from .errors import SweepSpecError, as_int
from .files import read_data_file
from .prompts import FALLBACK_PROMPTS as FALLBACK_PROMPTS  # re-exported: the prompt sets live in `prompts`
from .prompts import make_samples as make_samples
from .prompts import read_prompts as read_prompts
from .settings import ALIASES, GRID_KEYS, RECOMMENDED_BUDGETS, cell_label, recommended

QUANTIZED_METHODS = {"fp8": "ours-fp8", "int8": "ours-int8", "fp8-emulated": "ours-fp8-emulated"}
"""`--quantization` values (besides none) and the method each adds."""
METHODS = ("ours", "cache-dit", *QUANTIZED_METHODS.values())
"""Cached methods a sweep can run (over the grid's cells; cache-dit over `cachedit_grid` when given). `ours-fp8` /
`ours-int8` / `ours-fp8-emulated` are ours on the model quantized to FP8 / INT8 / emulated FP8 (`--quantization
fp8|int8|fp8-emulated`), measured against the unquantized references; each also runs uncached (`policy never`),
which isolates what the quantization alone costs."""
UNCACHED_CELL_OVERRIDES = {"policy": "never"}
SOLVER_BASELINES = ("euler", "heun", "curved")
"""Same-compute baselines without a cache (`dicache.sweep.solvers`): fewer-steps Euler, fewer-steps Heun, `curved`."""
BASELINES = (*SOLVER_BASELINES, "cachedit")
"""Names a sweep spec's `baselines` list takes; `cachedit` (or `cache-dit`) = the cache-dit method."""
DEFAULT_REFERENCE_STEPS = 200
"""Steps of the high-accuracy reference (uncached Euler, same prompt, seed and guidance) for `psnr_ref`."""
DEFAULT_COMPUTE_TARGETS = RECOMMENDED_BUDGETS
"""Compute fractions at which the baselines run (and the report's bins are centred)."""

FILE_KEYS = (
    "model",
    "prompts",
    "seeds",
    "num_prompts",
    "schedules",
    "height",
    "width",
    "methods",
    "targets",
    "grid",
    "baselines",
    "reference_steps",
    "compute_targets",
    "cachedit_grid",
    "quantization",
    "fit_prompts",
    "fit_seeds",
)
VARIANTS = ("turbo", "raw")


# ---------------------------------------------------------------------------------------------------- schedules
@dataclass(frozen=True)
class Schedule:
    """A sampling schedule: `steps`, CFG scale `guidance_scale` in the standard convention
    `uncond + s·(cond − uncond)` (s = 1: no CFG), an optional pipeline `variant` (turbo | raw, Krea-2's presets) and
    an optional `embedded_guidance` (the value of a guidance embedding, Flux.1-dev's `guidance_scale`)."""

    steps: int
    guidance_scale: float = 1.0
    variant: str | None = None
    embedded_guidance: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.steps, int) or self.steps < 1:
            raise SweepSpecError(f"schedule steps={self.steps!r} is invalid: must be an integer >= 1")
        if not self.guidance_scale >= 1.0:
            raise SweepSpecError(
                f"schedule guidance_scale={self.guidance_scale!r} is invalid: must be 1 (no CFG) or > 1 "
                "(standard convention uncond + s·(cond − uncond))"
            )
        if self.variant is not None and self.variant not in VARIANTS:
            raise SweepSpecError(f"schedule variant={self.variant!r} is invalid: must be one of {', '.join(VARIANTS)}")

    @property
    def cfg(self) -> bool:
        return self.guidance_scale > 1.0

    @property
    def diffusers_guidance(self) -> float:
        """The same CFG for diffusers' `Krea2Pipeline` (`cond + g·(cond − uncond)`, on iff g > 0): g = s − 1."""
        return self.guidance_scale - 1.0

    @property
    def name(self) -> str:
        cfg = f"CFG {self.guidance_scale:g}" if self.cfg else "no CFG"
        embedded = "" if self.embedded_guidance is None else f", guidance embedding {self.embedded_guidance:g}"
        return f"{self.steps} steps, {cfg}{embedded}" + (f", {self.variant}" if self.variant else "")

    @property
    def slug(self) -> str:
        return (
            f"n{self.steps}"
            + (f"-cfg{self.guidance_scale:g}" if self.cfg else "")
            + ("" if self.embedded_guidance is None else f"-g{self.embedded_guidance:g}")
            + (f"-{self.variant}" if self.variant else "")
        )

    def to_dict(self) -> dict[str, Any]:
        out = {"steps": self.steps, "guidance_scale": self.guidance_scale, "variant": self.variant}
        if self.embedded_guidance is not None:  # absent otherwise: older records' keys stay as they were
            out["embedded_guidance"] = self.embedded_guidance
        return out

    @classmethod
    def parse(cls, value: Any) -> Schedule:
        """`8`, `"28:4.5"`, `"8:1:turbo"`, `"28:1:g3.5"` (a guidance embedding of 3.5) or `{"steps": 28,
        "guidance_scale": 4.5, "variant": null, "embedded_guidance": null}`."""
        if isinstance(value, Schedule):
            return value
        keys = ("steps", "guidance_scale", "variant", "embedded_guidance")
        if isinstance(value, Mapping):
            unknown = set(value) - set(keys)
            if unknown:
                raise SweepSpecError(f"schedule keys {sorted(unknown)} are unknown; allowed: {', '.join(keys)}")
            embedded = value.get("embedded_guidance")
            return cls(
                as_int(value.get("steps"), "schedule steps"),
                float(value.get("guidance_scale", 1.0)),
                value.get("variant"),
                None if embedded is None else float(embedded),
            )
        parts = str(value).split(":")
        if not 1 <= len(parts) <= 4:
            raise SweepSpecError(
                f"schedule {value!r} is invalid: expected STEPS[:CFG_SCALE[:VARIANT][:gEMBEDDED]], e.g. 28:4.5"
            )
        steps = as_int(parts[0], f"schedule {value!r} steps")
        try:
            scale = float(parts[1]) if len(parts) > 1 else 1.0
        except ValueError:
            raise SweepSpecError(f"schedule {value!r}: CFG scale {parts[1]!r} is not a number") from None
        variant, embedded = None, None
        for part in parts[2:]:
            if part[:1] == "g" and part[1:2].isdigit():
                try:
                    embedded = float(part[1:])
                except ValueError:
                    raise SweepSpecError(f"schedule {value!r}: guidance embedding {part!r} is not g<number>") from None
            else:
                variant = part
        return cls(steps, scale, variant, embedded)


# ---------------------------------------------------------------------------------------------------- cells
@dataclass(frozen=True)
class Cell:
    """One cache setting: `settings` are `CacheConfig` request keys over the built-in defaults."""

    settings: tuple[tuple[str, Any], ...]

    @property
    def overrides(self) -> dict[str, Any]:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.settings}

    @property
    def config(self) -> CacheConfig:
        return CacheConfig.from_env({}, **self.overrides)

    @property
    def label(self) -> str:
        return cell_label(self.config)

    def canonical(self) -> dict[str, Any]:
        """Every setting of the resolved config (defaults filled in): what the cell's identity hashes."""
        data = self.config.model_dump()
        data.pop("enable_cache", None)
        return data


def fitted_here(config: CacheConfig) -> bool:
    """A setting whose predictor the sweep fits itself: `cached_step_method=fitted` naming no `fitted_predictor`."""
    return config.cached_step_method == "fitted" and config.fitted_predictor is None


def make_cell(values: Mapping[str, Any]) -> Cell:
    """Validate one setting (aliases resolved, `taylorseer_order: 0` = off) into a `Cell`."""
    overrides: dict[str, Any] = {}
    for raw_key, value in values.items():
        key = ALIASES.get(raw_key, raw_key)
        if key not in GRID_KEYS:
            allowed = ", ".join(GRID_KEYS) + "; short names: " + ", ".join(f"{a}={k}" for a, k in ALIASES.items())
            raise SweepSpecError(f"unknown grid key {raw_key!r}; allowed: {allowed}")
        overrides[key] = value
    order = overrides.get("taylorseer_order")
    if order is not None and not isinstance(order, bool) and str(order).strip() in ("0", "0.0"):
        overrides.pop("taylorseer_order")
        if overrides.get("enable_taylorseer") in (True, "true", "1", 1):
            raise SweepSpecError("taylorseer_order=0 (TaylorSeer off) contradicts enable_taylorseer=true in one cell")
        overrides["enable_taylorseer"] = False
    elif order is not None:
        overrides.setdefault("enable_taylorseer", True)
    try:
        config = CacheConfig.from_env({}, **overrides)
    except ConfigError as exc:
        raise SweepSpecError(f"grid cell {dict(values)}: {exc}") from None
    normalized = {k: getattr(config, k) for k in overrides}
    return Cell(tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in normalized.items())))


def expand_grid(grid: Mapping[str, Sequence[Any]] | Sequence[Mapping[str, Sequence[Any]]] | None) -> list[Cell]:
    """Cells of a grid: the cartesian product of each mapping's value lists, unioned over a list of mappings;
    duplicates (the same resolved settings) are dropped, first occurrence kept."""
    if grid is None:
        return []
    groups = [grid] if isinstance(grid, Mapping) else list(grid)
    cells: list[Cell] = []
    for group in groups:
        if not isinstance(group, Mapping):
            raise SweepSpecError(
                f"a grid must be a mapping of key -> list of values (or a list of them), got {group!r}"
            )
        keys = list(group)
        lists = []
        for key in keys:
            values = group[key]
            if isinstance(values, str | bytes) or not isinstance(values, Iterable):
                values = [values]
            values = list(values)
            if not values:
                raise SweepSpecError(f"grid key {key!r} has an empty list of values")
            lists.append(values)
        for combo in itertools.product(*lists):
            cells.append(make_cell(dict(zip(keys, combo))))
    return dedupe_cells(cells)


def dedupe_cells(cells: Iterable[Cell]) -> list[Cell]:
    seen, out = set(), []
    for cell in cells:
        key = stable_hash(cell.canonical())
        if key not in seen:
            seen.add(key)
            out.append(cell)
    return out


def stable_hash(obj: Any, length: int = 16) -> str:
    """SHA-256 of the canonical JSON of `obj` (sorted keys), truncated to `length` hex digits."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:length]


# ---------------------------------------------------------------------------------------------------- presets
# Step-mask cells set W = 0: the mask alone then decides, in ours and in cache-dit (which lets a mask override W).
QUICK_GRID: list[dict[str, list[Any]]] = [
    {"RDT": [0.08, 0.24], "TS": [0, 1]},
    {"SCM": ["medium"], "SCM_POLICY": ["static"], "W": [0], "TS": [0, 1]},
    # the recommended family at every compute budget the report bins
    *({key: [value] for key, value in recommended(f).items()} for f in RECOMMENDED_BUDGETS),
]
DEFAULT_GRID: list[dict[str, list[Any]]] = [
    {"Fn": [1], "RDT": [0.08, 0.12, 0.24], "MC": [3, -1], "TS": [0, 1]},
    {"Fn": [4], "RDT": [0.12], "MC": [4], "TS": [0, 1]},
    {"W": [8], "RDT": [0.08], "MC": [-1], "TS": [0, 1]},
    {"SCM": ["slow", "medium", "fast", "ultra"], "SCM_POLICY": ["static"], "W": [0], "TS": [0, 1]},
]
CACHEDIT_GRID: list[dict[str, list[Any]]] = [
    {"Fn": [1], "RDT": [0.08, 0.12, 0.16, 0.24, 0.32], "MC": [-1], "TS": [0, 1]},
    {"SCM": ["slow", "medium", "fast", "ultra"], "SCM_POLICY": ["static"], "W": [0], "TS": [0, 1]},
]
"""cache-dit's own settings for an answer table (`cachedit_grid` of a grid file `dicache calibrate --grid-out`
writes): its dynamic DBCache (Fn 1) at five thresholds and its step-mask presets, TaylorSeer off and on."""
QUICK_SCHEDULES = ("8", "28:4.5")
DEFAULT_SCHEDULES = ("8", "28:4.5", "50:4.5")
TURBO_SCHEDULES = ("8",)
"""Default schedules of a sweep of the distilled Turbo checkpoint (`dicache sweep --variant turbo`)."""
DEFAULT_TARGETS = (30.0, 35.0, 40.0)


@dataclass
class SweepSpec:
    """Everything a sweep needs besides the model objects. `samples` are (prompt, seed) pairs; `model=None` is the
    embedded checkpoint; `height`/`width` None: the pipeline's default size.

    `baselines`: the uncached same-compute baselines (`SOLVER_BASELINES`), run at each of `compute_targets` (the
    Euler one also at each cell's compute); `reference_steps`: steps of the high-accuracy reference for the
    sampler-independent measure (`psnr_ref`), None = off; `cachedit_cells`: the settings cache-dit runs (None: the
    same `cells` as ours).
    """

    samples: list[tuple[str, int]]
    schedules: list[Schedule]
    cells: list[Cell]
    methods: tuple[str, ...] = METHODS
    model: str | None = None
    height: int | None = None
    width: int | None = None
    targets: tuple[float, ...] = DEFAULT_TARGETS
    extra: dict[str, Any] = field(default_factory=dict)
    baselines: tuple[str, ...] = SOLVER_BASELINES
    reference_steps: int | None = DEFAULT_REFERENCE_STEPS
    compute_targets: tuple[float, ...] = DEFAULT_COMPUTE_TARGETS
    cachedit_cells: list[Cell] | None = None
    fit_prompts: list[tuple[str, int]] | None = None
    """Training prompts (prompt, seed) the fitted predictor of a `cached_step_method=fitted` cell that names no file is
    fitted on, each with the seeds `seed + 1 … seed + fit_seeds`; none may be one of `samples`' prompts."""
    fit_seeds: int = 8

    def __post_init__(self) -> None:
        if not self.samples:
            raise SweepSpecError("a sweep needs at least one prompt and seed")
        if not self.cells:
            raise SweepSpecError("a sweep needs at least one grid cell")
        if not self.schedules:
            raise SweepSpecError("a sweep needs at least one schedule (e.g. 8 or 28:4.5)")
        bad = [m for m in self.methods if m not in METHODS]
        if bad:
            raise SweepSpecError(f"methods {bad} are unknown; allowed: {', '.join(METHODS)}")
        bad = [b for b in self.baselines if b not in SOLVER_BASELINES]
        if bad:
            raise SweepSpecError(f"baselines {bad} are unknown; allowed: {', '.join(BASELINES)}")
        for name in ("height", "width"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 16):
                raise SweepSpecError(f"{name}={value!r} is invalid: must be an integer >= 16 (pixels)")
        steps = self.reference_steps
        if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
            raise SweepSpecError(f"reference_steps={steps!r} is invalid: must be an integer >= 1 (or 0/null: off)")
        for value in self.compute_targets:
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= 1:
                raise SweepSpecError(f"compute_targets value {value!r} is invalid: must be a number in (0, 1]")
        if self.cachedit_cells is not None and not self.cachedit_cells:
            raise SweepSpecError("cachedit_grid has no cells; leave it out to run cache-dit on the grid's cells")
        self._check_fit_prompts()

    def _check_fit_prompts(self) -> None:
        """A cell fitted by the sweep needs training prompts apart from the judged ones."""
        fitted = [
            c for c in self.cells if c.config.cached_step_method == "fitted" and c.config.fitted_predictor is None
        ]
        if not fitted:
            return
        if not self.fit_prompts:
            raise SweepSpecError(
                f"grid cell {fitted[0].label!r} has cached_step_method=fitted and no fitted_predictor: give the "
                "training prompts its predictor is fitted on (fit_prompts: a prompt file), or a fitted_predictor file"
            )
        if isinstance(self.fit_seeds, bool) or not isinstance(self.fit_seeds, int) or self.fit_seeds < 1:
            raise SweepSpecError(f"fit_seeds={self.fit_seeds!r} is invalid: must be an integer >= 1")
        judged = {p for p, _ in self.samples} & {p for p, _ in self.fit_prompts}
        if judged:
            raise SweepSpecError(
                f"fit_prompts and the sweep's prompts share {sorted(judged)[:3]}: a fitted predictor is judged on "
                "prompts it was not fitted on"
            )

    def method_cells(self, method: str) -> list[Cell]:
        """The cells `method` runs: cache-dit's own when `cachedit_cells` is given, else the grid's."""
        if method == "cache-dit" and self.cachedit_cells is not None:
            return self.cachedit_cells
        if method in QUANTIZED_METHODS.values():
            return dedupe_cells([make_cell(UNCACHED_CELL_OVERRIDES), *self.cells])
        return self.cells


def parse_baselines(values: Any) -> tuple[tuple[str, ...], bool]:
    """A `baselines` list (`euler, heun, curved, cachedit`; `cache-dit` also accepted) as (solver baselines in
    `SOLVER_BASELINES` order, whether cache-dit is asked for)."""
    items = [values] if isinstance(values, str) else list(values or [])
    names = []
    for item in items:
        name = str(item).strip().lower()
        name = "cachedit" if name == "cache-dit" else name
        if name not in BASELINES:
            raise SweepSpecError(f"baseline {item!r} is unknown; allowed: {', '.join(BASELINES)}")
        names.append(name)
    return tuple(b for b in SOLVER_BASELINES if b in names), "cachedit" in names


def parse_reference_steps(value: Any) -> int | None:
    """`reference_steps`: an integer >= 1, or 0 / None / "off" for no high-accuracy reference."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("off", "none", "null", "")):
        return None
    steps = as_int(value, "reference_steps")
    if steps < 0:
        raise SweepSpecError(f"reference_steps={value!r} is invalid: must be an integer >= 1 (or 0/null: off)")
    return steps or None


def read_grid_file(path: str | Path) -> dict[str, Any]:
    """A YAML (.yaml/.yml) or JSON grid file as a mapping; top-level keys are checked against `FILE_KEYS`. A
    relative `fitted_predictor` of its `grid` is relative to the file's folder (as in a profile: `dicache calibrate
    --grid-out` writes it so)."""
    data = read_data_file(path, "grid file", SweepSpecError)
    if not isinstance(data, Mapping):
        raise SweepSpecError(f"grid file {str(path)!r} must hold a mapping with keys among {', '.join(FILE_KEYS)}")
    unknown = sorted(set(data) - set(FILE_KEYS))
    if unknown:
        raise SweepSpecError(f"grid file {str(path)!r}: unknown key(s) {unknown}; allowed: {', '.join(FILE_KEYS)}")
    data = dict(data)
    if "grid" in data:
        data["grid"] = _grid_paths_from(data["grid"], Path(path).parent)
    return data


def _grid_paths_from(grid: Any, folder: Path) -> Any:
    """`grid` with each relative `fitted_predictor` value (or list of them) made relative to `folder`."""
    names = {short for short, key in ALIASES.items() if key == "fitted_predictor"} | {"fitted_predictor"}

    def resolve(value: Any) -> Any:
        empty = not isinstance(value, str) or value.strip().lower() in ("", "none", "unset")
        return value if empty or Path(value).is_absolute() else str(folder / value)

    def group_of(group: Any) -> Any:
        if not isinstance(group, Mapping):
            return group
        group = dict(group)
        for key in names & set(group):
            values = group[key]
            group[key] = [resolve(v) for v in values] if isinstance(values, list) else resolve(values)
        return group

    if isinstance(grid, Mapping):
        return group_of(grid)
    return [group_of(g) for g in grid] if isinstance(grid, list) else grid
