"""Changes before traffic readings.

In nftables mode a traffic reading (nftables/counters.py) runs on a thread of its own
beside the syncs. Both need the interpreter's lock, which a thread waiting for it gets
when the holder blocks or at the switch interval (agent/main.py): a change hands the
lock around a dozen times on its way (the event loop, the data plane's thread, each
netlink reply), each time up to an interval behind the reading's Python. So the sync
loop marks a change's sync under way (`Priority.change`), and the reading, at each of
its pauses, waits for that sync to end (at most GIVE_WAY_MAX each time: a stream of
changes slows a reading down, it never stops it). In process at 100,000 ports, changes
one every 10 ms beside a reading: p99 3.8-3.9 ms, against 6.2-7.9 with the lock only
offered, and 4.8-5.2 with the rests below (`bench.nftables.reading_beside`).

Both also need the machine's cores: at 100,000 ports a reading whose kernel side was a
dump of every counter kept 1.7 of 2 cores busy for seconds (the agent's own CPU), and a
change's other parts (the API server's, the client's) waited for a core. So a reading
also rests at each pause as long as it worked since the last (READING_SHARE): the
kernel answers the next counters only when asked, so its work rests too. With
`/metrics` scraped at 100,000 x 10 the agent's busiest second fell to 121-125 % of a
core, and the p99 of 200 changes to 23-25 ms from 40-41 (`bench.churn`, the same hour).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from time import monotonic, sleep

from proxy.dataplane.base import GiveWay, offer_lock

GIVE_WAY_MAX = 0.02  # seconds a reading waits at one pause for a change to end
READING_SHARE = 0.5  # of its time a reading works; it rests the rest


class Priority:
    """Whether a change's sync is under way (the sync loop's: one at a time), for a
    reading on another thread to wait for it."""

    __slots__ = ("_idle",)

    def __init__(self) -> None:
        self._idle = threading.Event()
        self._idle.set()

    @property
    def under_way(self) -> bool:
        return not self._idle.is_set()

    @contextlib.contextmanager
    def change(self) -> Iterator[None]:
        self._idle.clear()
        try:
            yield
        finally:
            self._idle.set()

    def give_way(self) -> None:
        """Until the change under way is synced (GIVE_WAY_MAX at most); with none, the
        interpreter's lock offered."""
        if self._idle.is_set():
            offer_lock()
        else:
            self._idle.wait(GIVE_WAY_MAX)

    def reading_pauses(self) -> GiveWay:
        """The pauses of one new reading: each gives way (`give_way`), then rests for
        what the reading worked since its last pause times (1 - READING_SHARE) /
        READING_SHARE."""
        last = monotonic()

        def pause() -> None:
            nonlocal last
            worked = monotonic() - last
            self.give_way()
            sleep(worked * (1 - READING_SHARE) / READING_SHARE)
            last = monotonic()

        return pause
