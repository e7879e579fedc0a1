"""The cyclic garbage collector held off while the process builds what stays alive.

Python's collector runs whenever allocations outnumber frees by 700, and its oldest
generation is rescanned whenever what joined it since is a quarter of what it held.
Work that builds a large state which stays (a full sync's rendered ports and kept
state, a resync's parts, a conntrack dump's entries, the start's lists:
agent/startup_gc.py) makes it rescan that state again and again as it grows, and find
nothing to free. In process (bench/nftables/encode_bench.py's full sync over our
tables): at 10,000 services x 10, 2.1-3.6 s of CPU with the collector on, 1.6-2.1 s
held off and settled as below; at 100,000 x 10 (IPv6), 29-37 s on (one run: 37 full
collections, 17.6 s, the longest 0.95 s), 16-22 s held off and settled. Reference
counting frees everything else at once either way; only reference cycles wait for the
collector.

Holds nest and may come from several threads (the data plane's worker, the traffic
reader): the collector is off while any is held and comes back when the last ends,
unless it was off before the first (a caller that turned it off keeps it off). When
the work held off left much behind (`SETTLE_AFTER` objects not yet collected), the
last hold's end collects once, which frees whatever cycles died meanwhile and scans the
new state that one time, and freezes what is left (`gc.freeze()`, as the start does):
the state just built is not rescanned by every later full collection (one took 1.0 s
after a 100,000-service sync), and the frozen state before it, which the work replaced,
is still freed by reference counting.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator
from contextlib import contextmanager

# Objects the work held off left uncollected, past which its end collects and freezes.
# At 10,000 services x 10 (in process) a change's sync leaves ~15, left to the
# collector's own pace; a full sync 188,000, a resync's part ~19 a port.
SETTLE_AFTER = 10_000


class _Holds:
    """The process's holds on its collector (one instance: the collector is one)."""

    def __init__(self) -> None:
        # Reentrant: the collection at a hold's end may run a finalizer that holds.
        self._lock = threading.RLock()
        self._count = 0
        self._restore = False  # whether the collector was on when the first hold began

    def hold(self) -> None:
        with self._lock:
            if self._count == 0:
                self._restore = gc.isenabled()
                gc.disable()
            self._count += 1

    def release(self) -> None:
        with self._lock:
            if self._count == 0:
                raise RuntimeError("collector released more often than held")
            self._count -= 1
            if self._count == 0 and self._restore:
                # The youngest generation's objects, not gc.get_count(): that counts
                # allocations net of frees, ~0 for a resync that replaced as much as it
                # made. Listing them is a copy of pointers (~1 ms for 100,000).
                if len(gc.get_objects(0)) >= SETTLE_AFTER:
                    gc.collect()
                    gc.freeze()
                gc.enable()


_HOLDS = _Holds()


def hold() -> None:
    """Hold the collector off until the matching `release()`."""
    _HOLDS.hold()


def release() -> None:
    """End one hold; the last one turns the collector back on if it was on before."""
    _HOLDS.release()


@contextmanager
def held() -> Iterator[None]:
    """The collector held off for the block."""
    hold()
    try:
        yield
    finally:
        release()
