"""The block plan: the seam between caching and memory (docs/architecture.md §9).

Before a call runs blocks, the runner tells every `BlockObserver` of the stack (e.g. the layerwise offloader) which
blocks it will run, in order (`BlockPlan`), and which blocks later calls will run as far as the policy already knows;
then it reports each block's start and end. Policies never see the observers, and observers never see the policies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class BlockPlan:
    """The blocks a transformer call runs, published before they run.

    blocks: this call's blocks known so far, in run order (indices into the stack).
    complete: True when `blocks` is the whole call; False when more follow once the cache has decided (after the
        Fn blocks), in which case a second plan with the whole call follows before they run.
    upcoming: the blocks later calls will run, in run order (their plans joined), as far as they are known now; with
        `complete=False` they come after this call's unknown remainder. May repeat indices (one entry per run).
    """

    blocks: tuple[int, ...]
    complete: bool
    upcoming: tuple[int, ...] = ()


@dataclass(frozen=True)
class CallInfo:
    """Which call of a request is starting: its step and branch when the cache engine knows them (else None)."""

    step: int | None = None
    branch: str | None = None


class BlockObserver(Protocol):
    """Told about every call of a block stack: `begin_call`, one or two `plan`s, `before_block`/`after_block` around
    each block, `end_call` (always, also after an error). Calls arrive in that order, from the thread running the
    call; they must not synchronise with the device."""

    def begin_call(self, info: CallInfo) -> None: ...

    def plan(self, plan: BlockPlan) -> None: ...

    def before_block(self, index: int) -> None: ...

    def after_block(self, index: int) -> None: ...

    def end_call(self) -> None: ...


def publish(observers: tuple, plan: BlockPlan) -> None:
    """Give `plan` to every observer, in order."""
    for observer in observers:
        observer.plan(plan)
