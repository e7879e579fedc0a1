"""Changes before traffic readings.

In nftables mode a traffic reading (nftables/counters.py) runs on a thread of its own
beside the syncs, and both need the interpreter's lock, which a thread waiting for it
gets when the holder blocks or at the switch interval (agent/main.py). A change hands
the lock around a dozen times on its way (the event loop, the data plane's thread, each
netlink reply), each time up to an interval behind the reading's Python: at 100,000
ports the changes that came during a reading took 6-26 ms, against 4-5 ms between
readings (`bench.churn` with /metrics scraped). So the sync loop marks a change's sync
under way (`Priority.change`), and the reading, at each point where it offers the lock,
waits for that sync to end instead (`give_way`), at most GIVE_WAY_MAX each time: a
stream of changes slows a reading down, it never stops it.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from proxy.dataplane.base import offer_lock

GIVE_WAY_MAX = 0.02  # seconds a reading waits at one point for a change to end


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
        """Called by a reading where it can pause: until the change under way is synced
        (GIVE_WAY_MAX at most), else `offer_lock`."""
        if self._idle.is_set():
            offer_lock()
        else:
            self._idle.wait(GIVE_WAY_MAX)
