"""The process's collector held off while a sync, a housekeeping part or a conntrack
dump builds what stays, and back on when the last hold ends: holds nest, come from
several threads, and never turn on a collector someone else turned off."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from proxy.agent.startup_gc import StartupPause
from proxy.dataplane.common import collector

pytestmark = pytest.mark.usefixtures("collector_restored")


def test_held_off_for_the_block_and_back_on_after() -> None:
    with collector.held():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_back_on_after_a_block_that_raised() -> None:
    with pytest.raises(ValueError), collector.held():
        raise ValueError("a refused sync")
    assert gc.isenabled()


def test_holds_from_two_threads_overlapping_end_with_the_last() -> None:
    # The traffic reader's dump ending while a sync still builds must not turn the
    # collector back on under the sync.
    dump_holds, dump_may_end, dump_ended = threading.Event(), threading.Event(), []

    def dump() -> None:
        with collector.held():
            dump_holds.set()
            dump_may_end.wait(5)
        dump_ended.append(gc.isenabled())

    with collector.held():
        reader = threading.Thread(target=dump)
        reader.start()
        assert dump_holds.wait(5)
        dump_may_end.set()
        reader.join(5)
        assert dump_ended == [False]  # the sync's hold keeps it off
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_collector_someone_else_turned_off_stays_off() -> None:
    gc.disable()
    with collector.held():
        pass
    assert not gc.isenabled()


def test_released_more_often_than_held_is_an_error() -> None:
    with pytest.raises(RuntimeError):
        collector.release()
    assert gc.isenabled()


def test_the_start_s_pause_ending_during_a_sync_leaves_the_sync_s_hold() -> None:
    pause = StartupPause()
    pause.begin()
    with collector.held():
        pause.end("first sync done")
        assert not gc.isenabled()  # the sync still holds it
    assert gc.isenabled()


def test_work_that_left_much_is_collected_once_and_what_stays_frozen() -> None:
    gc.collect()
    with collector.held():
        kept = [[i] for i in range(collector.SETTLE_AFTER)]  # a sync's new state
        died = _Cycle()  # a cycle that died meanwhile (a traceback and its frames)
        gone = weakref.ref(died)
        del died
    assert gc.isenabled()
    assert gc.get_freeze_count() >= len(kept)  # never rescanned by later collections
    assert gone() is None  # the cycle was freed, not frozen for good


class _Cycle:
    def __init__(self) -> None:
        self.me = self


def test_a_small_job_leaves_the_collector_to_its_own_pace() -> None:
    gc.collect()
    with collector.held():
        kept = [[i] for i in range(1000)]  # a change's sync
    assert gc.isenabled() and gc.get_freeze_count() == 0 and kept
