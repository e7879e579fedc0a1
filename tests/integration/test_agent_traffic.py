"""The agent's traffic readings (server/traffic.py): the data plane's thread only hands
a reading what to read; the reading itself runs on a thread of its own, so a change
that comes during a slow one (a kernel dump of 100,000 counters) is applied at once."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from proxy.sim import SimServer
from tests.integration.agent_harness import FakeDataPlane, running_agent, wait_until
from tests.integration.test_agent_watch import endpoints, sim, web_slice

__all__ = ["sim"]  # the fixture


def test_a_change_during_a_slow_reading_is_applied_without_waiting_for_it(
        sim: SimServer, tmp_path: Path) -> None:
    fake = FakeDataPlane(reading_gate=threading.Event())
    with running_agent(sim, tmp_path, dataplane=fake) as agent:
        wait_until(lambda: endpoints(agent) == {"198.18.1.10:8080"}, what="the first sync")
        dump = asyncio.run_coroutine_threadsafe(agent.agent.debug_dump(None), agent.loop)
        wait_until(lambda: fake.reading_threads, what="a reading to begin")

        sim.apply(web_slice("198.18.1.11"))
        wait_until(lambda: endpoints(agent) == {"198.18.1.11:8080"},
                   what="the change applied while the reading goes on")
        assert not dump.done()

        assert fake.reading_gate is not None
        fake.reading_gate.set()
        shown = dump.result(10)
        assert shown["services"], "the dump came back once the reading ended"
        # The reading ran off the data plane's thread (where syncs run).
        assert fake.reading_threads.isdisjoint(fake.threads)
