"""Per-step masks for few-step schedules: which steps of `n` to compute, searched on the calibration's samples.

A mask is a tuple of `n` 0/1 flags (1: computed), step 0 always computed (a cached step needs a computed one before
it). It becomes a candidate through `mask_overrides`: the static explicit mask (`scm_compute_bins` /
`scm_cache_bins`), no always-computed blocks (Fn 0, W 0: a cached step runs no block) and `MASK_FORECAST`, the
forecaster the masks are searched with.

`beam_search` walks down from the all-computed mask one step at a time: each round drops one more computed step from
every mask in the beam, scores the new masks (`score`: higher is better, the calibration's criterion PSNR; None for
a mask that could not run) and keeps the `beam` best. It stops after the round with `min_computed` computed steps,
or after a round where no mask meets `target` (dropping a step loses fidelity, so deeper rounds would not either).
Every scored mask is returned with its score, in the order scored. Cost: at most `beam · (n − 1)` scores a round.
Pure: the scoring (generating the samples) is the caller's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from typing import Any

Mask = tuple[int, ...]

MAX_MASK_STEPS = 12
"""Schedules up to this many steps get the mask search (longer ones: the built-in candidates' presets)."""
BEAM = 3
"""Masks kept per round."""
MASK_FORECAST: dict[str, Any] = {
    "enable_taylorseer": True,
    "taylorseer_order": 1,
    "taylorseer_distance": "sigma",
    "taylorseer_damping": 0.5,
    "forecaster": "input_corrected",
}
"""How a searched mask forecasts its cached steps (the best forecaster measured on the Turbo student)."""


def mask_bins(mask: Sequence[int]) -> tuple[list[int], list[int]]:
    """`(scm_compute_bins, scm_cache_bins)` of a mask: its runs of computed and of cached steps, alternating from
    the first (computed) step; ValueError when step 0 is not computed or a flag is not 0/1."""
    if not mask or mask[0] != 1 or any(f not in (0, 1) for f in mask):
        raise ValueError(f"a step mask is 0/1 flags starting with a computed step (1), got {list(mask)}")
    runs: list[int] = []
    previous = None
    for flag in mask:
        if flag == previous:
            runs[-1] += 1
        else:
            runs.append(1)
        previous = flag
    return runs[0::2], runs[1::2]


def mask_overrides(mask: Sequence[int]) -> dict[str, Any]:
    """The calibration candidate computing exactly the steps `mask` flags."""
    compute, cache = mask_bins(mask)
    return {
        "scm_compute_bins": compute,
        "scm_cache_bins": cache,
        "scm_policy": "static",
        "max_warmup_steps": 0,
        "Fn_compute_blocks": 0,
        **MASK_FORECAST,
    }


def computed_steps(mask: Sequence[int]) -> list[int]:
    """The indices a mask computes."""
    return [i for i, flag in enumerate(mask) if flag]


def masks_of(num_steps: int, count: int) -> list[Mask]:
    """Every mask of `num_steps` steps computing `count` of them, step 0 among them."""
    return [
        tuple(1 if i == 0 or i in rest else 0 for i in range(num_steps))
        for rest in itertools.combinations(range(1, num_steps), count - 1)
    ]


def fewer(mask: Mask) -> list[Mask]:
    """The masks with one computed step (never step 0) of `mask` turned into a cached one."""
    return [mask[:i] + (0,) + mask[i + 1 :] for i in range(1, len(mask)) if mask[i]]


def beam_search(
    num_steps: int,
    score: Callable[[Mask], float | None],
    *,
    target: float,
    beam: int = BEAM,
    min_computed: int = 2,
) -> list[tuple[Mask, float | None]]:
    """Every mask scored on the way down from `num_steps` computed steps (see the module docstring)."""
    if num_steps < 2 or beam < 1:
        return []
    scored: list[tuple[Mask, float | None]] = []
    frontier: list[Mask] = [(1,) * num_steps]
    computed = num_steps
    while computed > max(min_computed, 1) and frontier:
        computed -= 1
        seen: dict[Mask, float | None] = {}
        for mask in frontier:
            for child in fewer(mask):
                if child not in seen:
                    seen[child] = score(child)
                    scored.append((child, seen[child]))
        ranked = sorted((m for m, s in seen.items() if s is not None), key=lambda m: (-seen[m], m))
        frontier = ranked[:beam]
        if not any(seen[m] >= target for m in frontier):
            break
    return scored


MOVES = (-1, 1, -2, 2)
"""How far `hill_climb` moves a computed step, in the order tried."""


def moved(mask: Mask, moves: Sequence[int] = MOVES) -> list[Mask]:
    """The masks with one computed step of `mask` (never step 0) moved by one of `moves` onto a cached step of the
    schedule, computed steps in order and each move in `moves`' order."""
    found: list[Mask] = []
    for i in computed_steps(mask)[1:]:
        for move in moves:
            j = i + move
            if 0 < j < len(mask) and not mask[j]:
                child = list(mask)
                child[i], child[j] = 0, 1
                found.append(tuple(child))
    return found


def hill_climb(
    start: Mask,
    score: Callable[[Mask], float | None],
    *,
    budget: int,
    known: Mapping[Mask, float | None] | None = None,
    min_gain: float = 0.05,
    moves: Sequence[int] = MOVES,
) -> list[tuple[Mask, float | None]]:
    """The masks scored while climbing from `start`, in the order scored, at most `budget` of them (see the module
    docstring). `known`: scores already measured (`start`'s among them, else it is scored first), used without
    scoring again."""
    scored: dict[Mask, float | None] = dict(known or {})
    order: list[tuple[Mask, float | None]] = []

    def measure(mask: Mask) -> float | None:
        if mask not in scored:
            scored[mask] = score(mask)
            order.append((mask, scored[mask]))
        return scored[mask]

    if start not in scored and budget < 1:
        return order
    current, best = start, measure(start)
    climbing, resume = best is not None, 0
    while climbing:
        climbing = False
        children = moved(current, moves)
        resume %= max(len(children), 1)
        for index, child in enumerate(children[resume:] + children[:resume]):
            if child not in scored and len(order) >= budget:
                return order
            value = measure(child)
            if value is not None and value > best + min_gain:
                current, best, climbing, resume = child, value, True, resume + index + 1
                break
    return order


def max_scored(num_steps: int, beam: int = BEAM, min_computed: int = 2) -> int:
    """The most masks `beam_search` can score (a progress bar's total before the search): `num_steps − 1` in the
    first round, then at most `beam` masks each dropping one of their `computed − 1` droppable steps."""
    if num_steps < 2 or beam < 1:
        return 0
    total, computed, width = 0, num_steps, 1
    while computed > max(min_computed, 1):
        total += width * (computed - 1)
        computed -= 1
        width = beam
    return total
