"""Recovery after an API server outage (issue 13): a change written right after the
server comes back reaches the reflector within one backoff cap (8 s) and a round trip,
at 1,000 services, with the production backoff (ReflectorOptions' defaults).

The goal is stated for a 20 s outage. The test does not wait 20 s: once the backoff has
reached its cap (the 5th failure in a row, at most 0.5+1+2+4 = 7.5 s of delays into the
outage) every later delay has the same distribution, uniform in [4, 8] s, so any longer
outage ends in the same state. The worst moment for the server to come back is right
after a failed attempt, with a whole delay ahead; the test restarts the server at that
moment (polled), writes a change at once, and measures the time from the return to the
reflector delivering it. The agent-level test (to the kernel's rules) is tests/faults/.
"""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path

from proxy.kube.reflector import Reflector, ReflectorOptions
from proxy.kube.resources import SERVICES
from proxy.sim import SimServer
from tests.integration.watchkit import GatedApi, Recorder, connect, eventually, in_thread, run
from tests.sim.client import service

SERVICES_COUNT = 1_000
# One round trip to a local simulator, on a loaded machine: the watch request, the
# event. Generous on purpose; the measured figure is printed (run with -s).
ROUND_TRIP = 2.0


def test_a_change_after_an_outage_arrives_within_the_backoff_cap(tmp_path: Path) -> None:
    options = ReflectorOptions()  # the production backoff: 0.5 s, doubling, capped at 8 s
    cap = options.backoff_max
    with SimServer(bookmark_interval=1.0) as sim:
        sim.load([service(f"s{i}") for i in range(SERVICES_COUNT)])

        async def main() -> None:
            api = GatedApi(await connect(sim, tmp_path))
            rec = Recorder()
            reflector = Reflector(api, SERVICES, rec, options)
            task = asyncio.create_task(reflector.run())
            loop = asyncio.get_running_loop()
            try:
                await asyncio.wait_for(reflector.synced.wait(), 30)
                assert len(reflector.known) == SERVICES_COUNT
                await eventually(lambda: sim.open_watches() == 1, what="the watch open")

                await in_thread(sim.stop)
                down = loop.time()
                # The 5th failure in a row draws its delay at the cap: [cap/2, cap].
                await eventually(lambda: reflector.stats.errors >= 5, timeout=30,
                                 what="five failed attempts")
                delay = reflector.stats.retry_delay
                assert cap / 2 <= delay <= cap, reflector.stats
                await in_thread(sim.start)  # same port; history kept
                back = loop.time()
                mark = len(rec.events)
                sim.create(service("after"))
                await eventually(lambda: ("ADDED", "after") in rec.names(mark), timeout=30,
                                 what="the change written after the return")
                took = loop.time() - back
                print(f"\noutage {back - down:.1f}s, {reflector.stats.errors} attempts; "
                      f"delay drawn {delay:.2f}s; change delivered {took:.2f}s after return")
                assert took <= cap + ROUND_TRIP, (took, reflector.stats)
                # Each attempt in the outage waited at least half its ceiling: no more
                # requests than the backoff allows.
                attempts = [r.at for r in api.watches() if r.at >= down]
                gaps = [b - a for a, b in itertools.pairwise(attempts)]
                for n, gap in enumerate(gaps[:5]):
                    assert gap >= min(cap, options.backoff_initial * 2**n) / 2, gaps
                # A watch resumed where it was: no relist of the 1,000 services.
                assert reflector.stats.lists == 1, reflector.stats
                assert rec.violations == [] and not task.done()
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await api.close()

        run(main)
