"""A timing model of layerwise offload: the copy stream and the compute stream as two queues linked by events.

A trace is what the host issued, in order: copies (block into slot, bytes), block runs, host synchronisations (the
dynamic cache decision reads a number back) and call boundaries. `model_time` replays it with a copy bandwidth and a
per-block compute time: a copy starts when the copy stream is free, the host has issued it, and the slot's previous
block has finished; a block starts when the compute stream is free and its copy has landed. The benchmark uses it to
model a slower link (PCIe 4, ≈ 25 GB/s) from a trace measured on a fast one. `replay` produces the trace a
`SlotSchedule` gives for a list of calls whose plans are all known ahead (static masks), for tests and planning.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .schedule import SlotSchedule


@dataclass(frozen=True)
class TraceEvent:
    """kind: 'copy' (block into slot, nbytes), 'run' (block; slot -1 when resident), 'sync' or 'call' (a call ends)."""

    kind: str
    block: int = -1
    slot: int = -1
    nbytes: int = 0


@dataclass(frozen=True)
class Timeline:
    seconds: float
    stall_seconds: float
    copied_bytes: int


def model_time(
    trace: Sequence[TraceEvent], block_seconds: float, bandwidth: float, call_seconds: float = 0.0
) -> Timeline:
    """Seconds the traced work takes with copies at `bandwidth` bytes/s and `block_seconds` per block run
    (`call_seconds` of other work per call); `stall_seconds`: compute waiting for copies."""
    copy_free = compute_free = host = stall = 0.0
    ready: dict[int, float] = {}
    done: dict[int, float] = {}
    copied = 0
    for event in trace:
        if event.kind == "copy":
            start = max(copy_free, host, done.get(event.slot, 0.0))
            copy_free = start + event.nbytes / bandwidth
            ready[event.slot] = copy_free
            copied += event.nbytes
        elif event.kind == "run":
            start = compute_free
            if event.slot >= 0:
                start = max(start, ready.get(event.slot, 0.0))
            stall += start - compute_free
            compute_free = start + block_seconds
            if event.slot >= 0:
                done[event.slot] = compute_free
        elif event.kind == "sync":
            host = max(host, compute_free)
        elif event.kind == "call":
            compute_free += call_seconds
        else:
            raise ValueError(f"unknown trace event kind {event.kind!r}")
    return Timeline(seconds=compute_free, stall_seconds=stall, copied_bytes=copied)


def replay(
    calls: Sequence[Sequence[int]],
    streamed: Sequence[int],
    num_slots: int,
    block_bytes: Callable[[int], int],
    lookahead: int | None = None,
) -> list[TraceEvent]:
    """The trace of running `calls` (each a list of block indices) when every call's plan and the following calls'
    blocks (up to `lookahead` blocks, default one stack's worth) are known before it starts."""
    schedule = SlotSchedule(streamed, num_slots)
    trace: list[TraceEvent] = []
    horizon = lookahead if lookahead is not None else max((len(c) for c in calls), default=0)

    def issue(copies) -> None:
        trace.extend(TraceEvent("copy", c.block, c.slot, block_bytes(c.block)) for c in copies)

    for k, blocks in enumerate(calls):
        upcoming = [b for later in calls[k + 1 :] for b in later][:horizon]
        schedule.begin_call()
        issue(schedule.plan(blocks, upcoming))
        for block in blocks:
            issue(schedule.before_block(block))
            trace.append(TraceEvent("run", block, schedule.slot_of.get(block, -1)))
            issue(schedule.after_block(block))
        issue(schedule.end_call())
        trace.append(TraceEvent("call"))
    return trace
