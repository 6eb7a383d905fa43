"""`dicache.server.gc_pauses`: the collector's pauses counted per generation, start-up objects frozen."""

from __future__ import annotations

import gc

from dicache.server.gc_pauses import GCPauses, freeze_start_up_objects


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_pauses_are_counted_per_generation_and_uninstall_stops_counting():
    pauses = GCPauses().install()
    try:
        for _ in range(100):
            _Cycle()
        gc.collect(0)
        gc.collect(2)
        got = pauses.snapshot()
        assert got["collections"][0] >= 1 and got["collections"][2] >= 1
        assert got["pause_s"][2] > 0 and all(s >= 0 for s in got["pause_s"])
    finally:
        pauses.uninstall()
    gc.collect()
    assert pauses.snapshot()["collections"] == got["collections"]


def test_freezing_moves_live_objects_out_of_later_collections():
    kept = [_Cycle() for _ in range(1000)]
    try:
        frozen = freeze_start_up_objects()
        assert frozen >= 1000 and gc.get_freeze_count() == frozen
        pauses = GCPauses().install()
        try:
            garbage = [_Cycle() for _ in range(10)]
            del garbage
            assert gc.collect() >= 10  # what is allocated after the freeze is still collected
        finally:
            pauses.uninstall()
        assert all(k.me is k for k in kept)
    finally:
        gc.unfreeze()
