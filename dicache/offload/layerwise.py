"""Layerwise offload of a transformer's block stack, driven by the block plan the hook layer publishes.

Resident blocks and everything outside the stack live on the device. Each streamed block has one packed copy of its
weights on the host (page-locked, allocated once) and is brought into one of a few device slots shortly before it
runs: `SlotSchedule` decides which copies to issue from each call's plan and the upcoming calls' blocks, so a cached
call's skipped blocks are never copied and the next step's first blocks load while this step finishes.

On CUDA, copies go on a side stream: each copy waits for an event marking the end of the slot's previous block, and
records an event that the compute stream waits on before the block runs; the host never waits. On CPU the copies are
plain copies, so the bookkeeping (and bitwise equality with the resident model) can be tested anywhere. The block
modules are not wrapped or hooked: the runner tells the offloader when a block starts, so compiled blocks keep their
graphs (their weights change address, not shape).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ..blocks import StackSpec, stack_spec
from ..engine.block_plan import BlockPlan, CallInfo
from ..engine.install import observe_blocks
from .packing import PackedWeights
from .schedule import Copy, SlotSchedule
from .timeline import TraceEvent


@dataclass
class CallTransfer:
    """One transformer call: the blocks it ran, the streamed ones among them whose weights were copied for it (since
    their previous run), those copies' bytes, and how many were copied late (not prefetched: a miss)."""

    step: int | None
    branch: str | None
    ran: list[int] = field(default_factory=list)
    copied: list[int] = field(default_factory=list)
    bytes: int = 0
    misses: int = 0


@dataclass(frozen=True)
class TransferTotals:
    """Counters since the offloader was made (or `reset_counters`): all bytes copied host to device, copies issued,
    copies evicted before any block used them (`wasted_bytes`) and calls run."""

    bytes: int
    copies: int
    wasted_bytes: int
    calls: int


class LayerwiseOffloader:
    """Keeps `resident` blocks of `model`'s stack on `device` and streams the others through `num_slots` slots.

    Args:
        model: a transformer; moved in place: everything but the streamed blocks goes to `device`, the streamed
            blocks' weights to their host copies.
        resident: indices of the blocks kept on the device (stack indices, over all its block lists).
        num_slots: device buffers streamed blocks pass through (at least 1 when any block streams; 2 overlaps a copy
            with the running block).
        device: the compute device.
        pin_memory: page-lock the host copies (CUDA).
        spec: the model's stack, when not the one `stack_spec` finds.
    """

    def __init__(
        self,
        model: nn.Module,
        resident: Sequence[int],
        num_slots: int,
        device: torch.device | str,
        pin_memory: bool = True,
        spec: StackSpec | None = None,
    ) -> None:
        spec = spec or stack_spec(model)
        self.model, self.device = model, torch.device(device)
        blocks = spec.blocks
        self.resident = frozenset(int(i) for i in resident)
        self.streamed = tuple(i for i in range(len(blocks)) if i not in self.resident)
        self.cuda = self.device.type == "cuda"
        move_all_but(model, blocks, set(self.streamed), self.device)
        self.packed = {i: PackedWeights(blocks[i], pin=pin_memory and self.cuda) for i in self.streamed}
        slot_bytes = max((p.nbytes for p in self.packed.values()), default=0)
        count = num_slots if self.streamed else 0
        self.slots = [torch.empty(slot_bytes, dtype=torch.uint8, device=self.device) for _ in range(count)]
        self.schedule = SlotSchedule(self.streamed, count)
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.ready = [torch.cuda.Event() for _ in range(count)]
            self.done = [torch.cuda.Event() for _ in range(count)]
        self.done_recorded = [False] * count
        self.calls: deque[CallTransfer] = deque(maxlen=4096)
        self.trace: list[TraceEvent] | None = None  # set to a list to record what was issued (benchmark timing)
        self._lock = threading.Lock()
        self._call: CallTransfer | None = None
        self._incomplete = False
        self._fresh: dict[int, int] = {}  # block -> bytes copied and not used by a run yet
        self.reset_counters()
        self._stop = observe_blocks(spec, self)

    @property
    def slot_bytes(self) -> int:
        return self.slots[0].numel() if self.slots else 0

    def reset_counters(self) -> None:
        self._bytes = self._copies = self._wasted = self._num_calls = 0
        self.calls.clear()

    def totals(self) -> TransferTotals:
        return TransferTotals(self._bytes, self._copies, self._wasted, self._num_calls)

    # ------------------------------------------------------------------ block observer
    def begin_call(self, info: CallInfo) -> None:
        self._lock.acquire()  # one call at a time uses the slots
        self.schedule.begin_call()
        self._call = CallTransfer(info.step, info.branch)
        self._incomplete = False

    def plan(self, plan: BlockPlan) -> None:
        if self._incomplete and self.trace is not None:
            self.trace.append(TraceEvent("sync"))  # the rest of the call was decided on the host after its Fn blocks
        self._incomplete = not plan.complete
        self._issue(self.schedule.plan(plan.blocks, plan.upcoming))

    def before_block(self, index: int) -> None:
        call = self._call
        call.ran.append(index)
        if index in self.resident:
            if self.trace is not None:
                self.trace.append(TraceEvent("run", index))
            return
        if not self.schedule.loaded(index):
            call.misses += 1
        self._issue(self.schedule.before_block(index))
        slot = self.schedule.slot_of[index]
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.ready[slot])
        if index in self._fresh:
            call.copied.append(index)
            call.bytes += self._fresh.pop(index)
        if self.trace is not None:
            self.trace.append(TraceEvent("run", index, slot))

    def after_block(self, index: int) -> None:
        if index in self.resident:
            return
        self._mark_done(self.schedule.slot_of[index])
        self._issue(self.schedule.after_block(index))

    def end_call(self) -> None:
        try:
            running = self.schedule.running
            if running is not None and running in self.schedule.slot_of:  # a block failed: fence its slot anyway
                self._mark_done(self.schedule.slot_of[running])
            self._issue(self.schedule.end_call())
            self.calls.append(self._call)
            self._num_calls += 1
            if self.trace is not None:
                self.trace.append(TraceEvent("call"))
        finally:
            self._call = None
            self._lock.release()

    # ------------------------------------------------------------------ copies
    def _mark_done(self, slot: int) -> None:
        if self.cuda:
            self.done[slot].record(torch.cuda.current_stream(self.device))
        self.done_recorded[slot] = True

    def _issue(self, copies: list[Copy]) -> None:
        for copy in copies:
            packed = self.packed[copy.block]
            if copy.evicts is not None:
                evicted = self.packed[copy.evicts]
                evicted.point_to(evicted.host)
                self._wasted += self._fresh.pop(copy.evicts, 0)
            target = self.slots[copy.slot][: packed.nbytes]
            if self.cuda:
                with torch.cuda.stream(self.copy_stream):
                    if self.done_recorded[copy.slot]:
                        self.copy_stream.wait_event(self.done[copy.slot])
                    target.copy_(packed.host, non_blocking=True)
                    self.ready[copy.slot].record(self.copy_stream)
            else:
                target.copy_(packed.host)
            packed.point_to(self.slots[copy.slot])
            self._fresh[copy.block] = packed.nbytes
            self._bytes += packed.nbytes
            self._copies += 1
            if self.trace is not None:
                self.trace.append(TraceEvent("copy", copy.block, copy.slot, packed.nbytes))

    # ------------------------------------------------------------------ teardown
    def close(self) -> None:
        """Stop streaming: the streamed blocks' weights stay in (now pageable) host memory, the rest on the device."""
        self._stop()
        if self.cuda:
            torch.cuda.synchronize(self.device)
        for packed in self.packed.values():
            packed.point_to(packed.host)
            packed.release()
        self.slots = []


def move_all_but(model: nn.Module, blocks: Sequence[nn.Module], streamed: set[int], device: torch.device) -> None:
    """Move `model`'s parameters and buffers to `device`, except those of the blocks listed in `streamed`."""
    skip = {id(blocks[i]) for i in streamed}

    def move(module: nn.Module) -> None:
        if id(module) in skip:
            return
        module._apply(lambda t: t.to(device), recurse=False)  # as Module.to does (tensor subclasses included)
        for child in module.children():
            move(child)

    move(model)
