"""Per-request cache state: one `RequestState` per pipeline call, one `BranchState` per CFG branch.

A `RequestState` is created when a request starts and dropped when it ends; nothing in it is shared between
requests. `StepTracker` derives (step, branch) from timestep values for callers that do not declare them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..settings.cache_config import CacheConfig
from .cached_step import ComputedCalls, FittedWeights, load_weights
from .calibrators import Calibrator, make_calibrator
from .policies import CachePolicy, Segment, make_policy, middle_segments
from .stats import BranchStats, RequestStats

BRANCH_NAMES = ("cond", "uncond")
"""Names for the k-th call at one timestep when the caller does not name branches (diffusers order: cond first)."""


def branch_name(index: int) -> str:
    return BRANCH_NAMES[index] if index < len(BRANCH_NAMES) else f"branch{index}"


@dataclass
class BranchState:
    """Everything one CFG branch keeps between its calls within one request.

    `reference`: the Fn residual of the last computed step (one tensor per diff stream), what diffs are measured
    against. `calibrators`: one per (cached middle segment, stream), made by `new_calibrator` when a computed step
    first stores that residual. `none_outputs`: the (segment, stream) pairs whose blocks returned `None` for the
    stream on the last computed step (a cached step returns `None` there too).
    """

    name: str
    stats: BranchStats
    new_calibrator: Callable[[], Calibrator]
    calibrators: dict[tuple[int, str], Calibrator] = field(default_factory=dict)
    none_outputs: set[tuple[int, str]] = field(default_factory=set)
    reference: tuple[torch.Tensor, ...] | None = None
    cached_total: int = 0
    continuous_cached: int = 0
    accumulated: float = 0.0
    """The policy's accumulator (`Decision.accumulated`; TeaCache, EasyCache), 0 after a computed call."""
    previous_input: tuple[torch.Tensor, ...] | None = None
    """EasyCache: the stack's input streams at the previous call, computed or cached."""
    computed_io: tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]] | None = None
    """EasyCache: (input, middle output) streams of the last computed call."""
    rate: float | None = None
    """EasyCache: the transformation rate measured on the last two computed calls."""
    computed_calls: ComputedCalls | None = None
    """`cached_step_method=fitted`: the inputs and outputs of the last computed calls (the predictor's features)."""
    kv: dict[int, tuple] = field(default_factory=dict)
    """`cached_step_method=tokens`: per stack block, the attention keys/values of the last computed call."""
    token_input: torch.Tensor | None = None
    """`cached_step_method=tokens`: the `h` stream entering the skipped blocks at the last computed call."""

    @property
    def has_residual(self) -> bool:
        """A computed step has stored what a cached call needs: the middle residuals (every calibrator can
        estimate), or, for the fitted predictor, a computed call's input and output."""
        if self.computed_calls is not None:
            return self.computed_calls.ready
        return bool(self.calibrators) and all(c.ready for c in self.calibrators.values())

    def calibrator(self, segment: int, stream: str) -> Calibrator:
        """The calibrator of `stream` in middle segment `segment` (made on first use)."""
        key = (segment, stream)
        found = self.calibrators.get(key)
        if found is None:
            found = self.calibrators[key] = self.new_calibrator()
        return found

    def stored_tensors(self) -> int:
        """Residual-sized tensors held: Fn residual(s) plus the calibrators' terms."""
        held = len(self.reference) if self.reference is not None else 0
        held += len(self.previous_input) if self.previous_input is not None else 0
        held += sum(map(len, self.computed_io)) if self.computed_io is not None else 0
        held += 2 * len(self.computed_calls.calls) if self.computed_calls is not None else 0
        held += self.token_input is not None
        return held + sum(c.stored_tensors for c in self.calibrators.values())


class StepTracker:
    """Maps the timestep of successive calls to (step, call index within the step).

    A new, lower value is the next step; the k-th call at one value is branch k; a higher value than the last one
    means a new request started (reported as `restarted`).
    """

    def __init__(self) -> None:
        self.last: float | None = None
        self.step = -1
        self.call = -1

    def observe(self, value: float) -> tuple[int, int, bool]:
        restarted = self.last is not None and value > self.last
        if self.last is None or restarted:
            self.step, self.call = 0, 0
        elif value == self.last:
            self.call += 1
        else:
            self.step, self.call = self.step + 1, 0
        self.last = value
        return self.step, self.call, restarted


@dataclass
class RequestState:
    """Cache state of one request. Created per request, never shared.

    Args:
        config: the request's settings, already checked against the stack (`CacheSession.fit`); caching runs iff
            `config.enable_cache`.
        num_blocks: blocks in the hooked stack (over all its block lists).
        boundaries: stack indices where a block list other than the first begins (the middle is cut there).
        num_steps: denoising steps, when known (needed by step masks).
        sigmas: the scheduler's noise levels per step, when known.
    """

    config: CacheConfig
    num_blocks: int
    boundaries: tuple[int, ...] = ()
    num_steps: int | None = None
    sigmas: list[float] | None = None
    explicit: bool = False
    """Opened by `dicache.request` or a pipeline call (ends with its scope), not implicitly by a bare forward."""
    key_source: Callable[[], float] | None = None
    """Gives the current step's timestep key without reading the model's timestep tensor (no host sync)."""
    branches: dict[str, BranchState] = field(default_factory=dict)
    tracker: StepTracker = field(default_factory=StepTracker)

    _policy: CachePolicy | None = None
    _weights: FittedWeights | None = None

    def __post_init__(self) -> None:
        self.segments: list[Segment] = middle_segments(
            self.num_blocks,
            self.config.Fn_compute_blocks,
            self.config.Bn_compute_blocks,
            self.config.cached_step_blocks,
            self.boundaries,
        )
        """The middle's runs of skipped (`cached`) and still-computed blocks on a cached step."""
        self.segment_of: tuple[int | None, ...] = tuple(
            next((i for i, seg in enumerate(self.segments) if seg.start <= b < seg.stop), None)
            for b in range(self.num_blocks)
        )
        """For each stack block, the index of its middle segment (None for the Fn and Bn blocks)."""
        self.stats = self._new_stats()

    @property
    def enabled(self) -> bool:
        """Whether this request caches (else every call runs every block and records reason `disabled`)."""
        return self.config.enable_cache

    def _new_stats(self) -> RequestStats:
        return RequestStats(
            num_blocks=self.num_blocks,
            fn_blocks=self.config.Fn_compute_blocks,
            bn_blocks=self.config.Bn_compute_blocks,
            cached_step_blocks=len(self.config.cached_step_blocks or ()),
            num_steps=self.num_steps,
            enabled=self.enabled,
        )

    def restart(self) -> RequestStats:
        """Drop all branch state (a new generation began in the same scope); return the finished stats."""
        finished = self.stats
        self.branches = {}
        self.tracker = StepTracker()
        self._weights = None
        self.stats = self._new_stats()
        return finished

    def set_schedule(self, num_steps: int | None = None, sigmas: list[float] | None = None) -> None:
        """Record the step count / sigmas once the pipeline knows them (before the first transformer call)."""
        if num_steps is not None:
            self.num_steps = num_steps
            self.stats.num_steps = num_steps
        if sigmas is not None:
            self.sigmas = list(sigmas)
        self._policy = None
        self._weights = None

    @property
    def policy(self) -> CachePolicy:
        if self._policy is None:
            self._policy = make_policy(self.config, self.num_steps)
        return self._policy

    def branch(self, name: str) -> BranchState:
        state = self.branches.get(name)
        if state is None:
            config = self.config
            state = BranchState(
                name=name, stats=self.stats.branch(name), new_calibrator=lambda: make_calibrator(config)
            )
            if config.enable_cache and config.cached_step_method == "fitted":
                state.computed_calls = ComputedCalls()
            self.branches[name] = state
        return state

    @property
    def predicts_output(self) -> bool:
        """Cached calls of this request are answered by the fitted output predictor (no forward runs)."""
        return self.enabled and self.config.cached_step_method == "fitted"

    def fitted_weights(self) -> FittedWeights | None:
        """The predictor's weights from `fitted_predictor` (read once; checked against this request's step count
        and mask), or None when none is set (a fitter supplies them: `cached_step.FITTER`)."""
        if self._weights is None and self.config.fitted_predictor is not None:
            weights = load_weights(self.config.fitted_predictor)
            weights.check_schedule(self.num_steps, getattr(self.policy, "mask", None))
            self._weights = weights
        return self._weights

    def position(self, step: int, sigma: float | None) -> float:
        """Where a step sits for a forecaster: its index, or its sigma when `taylorseer_distance == 'sigma'` (with
        TaylorSeer or DMD on; the index otherwise)."""
        if self.config.taylorseer_distance == "step" or not (self.config.enable_taylorseer or self.config.enable_dmd):
            return float(step)
        if sigma is None and self.sigmas is not None and step < len(self.sigmas):
            sigma = self.sigmas[step]
        if sigma is None:
            raise ConfigError(
                "taylorseer_distance='sigma' needs the scheduler's sigmas, which this caller does not provide; "
                "use taylorseer_distance='step'"
            )
        return float(sigma)
