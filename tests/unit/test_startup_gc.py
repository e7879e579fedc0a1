"""The collector is off while the agent loads the cluster and back on, with the loaded
heap frozen, after the first sync, or after PAUSE_LIMIT without one."""

from __future__ import annotations

import asyncio
import gc
from types import SimpleNamespace
from typing import Any

import pytest

from proxy.agent import main as agent_main
from proxy.agent.startup_gc import StartupPause

pytestmark = pytest.mark.usefixtures("collector_restored")


def test_paused_then_frozen_and_back_on() -> None:
    pause = StartupPause()
    pause.begin()
    assert not gc.isenabled() and pause.active
    loaded = [[i] for i in range(1000)]  # what loading a cluster leaves alive
    pause.end("first sync done")
    assert gc.isenabled() and not pause.active
    assert gc.get_freeze_count() >= len(loaded)  # never scanned again
    pause.end("again")  # a second end changes nothing
    assert gc.isenabled()


def test_ending_the_pause_does_not_walk_the_frozen_heap(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # It ends on the event loop: counting the frozen objects walked all of them (87 ms
    # for 4 million), and a change arriving then waited for it.
    def walk() -> int:
        raise AssertionError("walked the frozen heap")

    monkeypatch.setattr(gc, "get_freeze_count", walk)
    for loaded in (True, False):
        pause = StartupPause()
        pause.begin()
        pause.end("first sync done", loaded=loaded)
        assert gc.isenabled()


def test_a_collector_someone_else_turned_off_stays_off() -> None:
    gc.disable()
    pause = StartupPause()
    pause.begin()
    assert not pause.active
    pause.end("first sync done")
    assert not gc.isenabled() and gc.get_freeze_count() == 0


def test_at_the_limit_the_garbage_of_failures_is_freed_not_frozen() -> None:
    pause = StartupPause()
    pause.begin()
    garbage: list[object] = []
    garbage.append(garbage)  # a cycle: what a failed list's traceback leaves
    del garbage
    pause.end("limit", loaded=False)
    assert gc.isenabled() and not pause.active
    assert gc.get_freeze_count() == 0 and gc.collect() == 0  # collected, nothing frozen


@pytest.mark.parametrize("synced", [True, False], ids=["first-sync", "limit"])
def test_the_agent_turns_it_back_on(monkeypatch: pytest.MonkeyPatch, synced: bool) -> None:
    pause = StartupPause()
    monkeypatch.setattr(agent_main, "_GC", pause)
    monkeypatch.setattr(agent_main, "PAUSE_LIMIT", 0.2)

    async def scenario() -> None:
        agent: Any = SimpleNamespace(settled=asyncio.Event())
        pause.begin()
        task = asyncio.ensure_future(agent_main._collect_after_first_sync(agent))
        await asyncio.sleep(0)
        assert pause.active
        if synced:
            agent.settled.set()
        await asyncio.wait_for(task, 5)
        assert not pause.active and gc.isenabled()
        assert (gc.get_freeze_count() > 0) == synced  # no cluster to freeze at the limit

    asyncio.run(scenario())
