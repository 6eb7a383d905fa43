"""Which streamed block sits in which device slot, and which copies to issue when (pure bookkeeping, no tensors).

The offloader feeds it the block-plan events of each transformer call (`begin_call`, `plan`, `before_block`,
`after_block`, `end_call`) and issues the `Copy`s it returns, in order, on its copy stream. The rules:

- demand: the streamed blocks still to run, in run order: the rest of this call's plan, then the blocks the later
  calls will run as far as the plan says (so the next step's first streamed blocks load while this step finishes);
- copies follow the demand order and stop at the first block no slot can take, so the copy stream carries them in
  the order they are needed;
- a slot can take a block when its occupant is not running and is needed later than that block, or never
  (farthest next use first, empty slots before all); a block already in a slot is not copied again;
- a block that starts without being in a slot (its plan was not published or changed) is copied first (a miss).

Blocks outside the demand are never copied: a cached call's skipped blocks cost no transfer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

NEVER = float("inf")


@dataclass(frozen=True)
class Copy:
    """Copy `block`'s weights into `slot`; `evicts` is the block that slot held (now back on the host), if any."""

    block: int
    slot: int
    evicts: int | None = None


class SlotSchedule:
    """Slot occupancy and copy decisions for `streamed` blocks over `num_slots` device slots."""

    def __init__(self, streamed: Iterable[int], num_slots: int) -> None:
        self.streamed = frozenset(streamed)
        if self.streamed and num_slots < 1:
            raise ValueError("streaming blocks needs at least one slot")
        self.occupant: list[int | None] = [None] * num_slots
        self.slot_of: dict[int, int] = {}
        self.demand: list[int] = []
        self.running: int | None = None
        self._ran: set[int] = set()

    # ------------------------------------------------------------------ events
    def begin_call(self) -> None:
        self._ran = set()

    def plan(self, blocks: Sequence[int], upcoming: Sequence[int] = ()) -> list[Copy]:
        """A (new or completed) plan of the current call: replaces the demand; returns the copies to issue."""
        rest = [b for b in blocks if b not in self._ran]
        self.demand = [b for b in (*rest, *upcoming) if b in self.streamed]
        return self._fill()

    def before_block(self, block: int) -> list[Copy]:
        """`block` starts: returns the copies to issue first (`block` itself on a miss, then refills)."""
        if block in self.demand:
            self.demand.remove(block)  # normally the head
        copies: list[Copy] = []
        if block in self.streamed and block not in self.slot_of:
            slot = self._victim(-1)
            copies.append(self._place(block, slot))
        self.running = block
        return copies + self._fill()

    def after_block(self, block: int) -> list[Copy]:
        """`block` finished: its slot may be reused; returns the copies that can go now."""
        self.running = None
        self._ran.add(block)
        return self._fill()

    def end_call(self) -> list[Copy]:
        self.running = None
        return self._fill()

    # ------------------------------------------------------------------ rules
    def loaded(self, block: int) -> bool:
        return block in self.slot_of

    def _next_use(self, block: int) -> float:
        try:
            return self.demand.index(block)
        except ValueError:
            return NEVER

    def _victim(self, position: int) -> int | None:
        """The slot to put the demand entry at `position` in: empty first, else the occupant used farthest ahead
        (never counts as farthest), if that is later than `position`; None if every slot is needed sooner."""
        best, best_use = None, -1.0
        for slot, block in enumerate(self.occupant):
            if block is None:
                return slot
            if block == self.running:
                continue
            use = self._next_use(block)
            if use > position and use > best_use:
                best, best_use = slot, use
        return best

    def _place(self, block: int, slot: int) -> Copy:
        evicted = self.occupant[slot]
        if evicted is not None:
            del self.slot_of[evicted]
        self.occupant[slot] = block
        self.slot_of[block] = slot
        return Copy(block, slot, evicted)

    def _fill(self) -> list[Copy]:
        copies = []
        for position, block in enumerate(self.demand):
            if block in self.slot_of:
                continue
            slot = self._victim(position)
            if slot is None:
                break
            copies.append(self._place(block, slot))
        return copies
