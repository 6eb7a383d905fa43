"""How a call splits its block stack: the first Fn blocks, the middle, the last Bn blocks, and within the middle the
blocks a cached step still computes (`cached_step_blocks`). Pure arithmetic on indices."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Segment:
    """Blocks `[start, stop)` of the middle; `cached` runs add a stored residual on cached steps, the others run."""

    start: int
    stop: int
    cached: bool

    @property
    def size(self) -> int:
        return self.stop - self.start


def middle_segments(
    num_blocks: int,
    fn: int,
    bn: int,
    computed: list[int] | tuple[int, ...] | None,
    boundaries: tuple[int, ...] = (),
) -> list[Segment]:
    """The middle `[fn, num_blocks - bn)` as maximal runs, in order, of blocks a cached step skips (`cached=True`) and
    of blocks it still computes (`computed`, indices in the middle), also cut where a block list begins
    (`boundaries`, stack indices). With no `computed` blocks and one list: one cached segment, the classic DBCache
    middle. Raises `ValueError` for an index outside the middle."""
    stop = num_blocks - bn
    if not 0 <= fn < stop <= num_blocks:
        raise ValueError(f"no middle blocks: Fn={fn}, Bn={bn}, num_blocks={num_blocks}")
    keep = set(computed or ())
    outside = sorted(b for b in keep if not fn <= b < stop)
    if outside:
        raise ValueError(f"blocks {outside} are outside the middle [{fn}, {stop})")
    segments: list[Segment] = []
    for b in range(fn, stop):
        cached = b not in keep
        if segments and segments[-1].cached == cached and b not in boundaries:
            segments[-1] = Segment(segments[-1].start, b + 1, cached)
        else:
            segments.append(Segment(b, b + 1, cached))
    return segments
