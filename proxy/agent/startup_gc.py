"""The cyclic garbage collector paused while the agent loads the cluster.

Loading a cluster is millions of allocations that all stay alive (decoded objects, the
model, the first render). Python's collector runs whenever allocations outnumber frees by
700, and its older generations rescan everything that survived so far, so the start cost
grows with the cluster and found nothing to free: at 10,000 services x 10 endpoints
(bench/agent_start.py) 2,562 collections took 1.8 s of a 6.2 s cold start, single gen-2
passes up to 0.35 s. (Reference counting still frees everything else at once; only
reference cycles wait for the collector, and loading makes few.)

So the process starts with the collector off and, once the first sync is done and the
work the data plane left for right after it (a restart's kept state, the input marks:
4.4 s at 100,000 services, during which one collection scanned for 171 ms), freezes
what it holds (`gc.freeze()`: the loaded cluster is never scanned again, which also keeps
later collections short) and turns it back on. If that does not come within
`PAUSE_LIMIT` (an API server away for minutes, a list failing again and again), the
collector comes back anyway, after one collection and without a freeze: what the
failures left (an exception's traceback holds its frames, and with them a failed list's
buffers: gigabytes within minutes) is garbage to free, not a cluster to keep.

The pause is one hold of the process's collector (dataplane/common/collector.py), which
the data plane's heavy work holds too: whichever ends last turns it back on.
"""

from __future__ import annotations

import gc
import logging
import time

from proxy.dataplane.common.collector import hold, release

log = logging.getLogger(__name__)

PAUSE_LIMIT = 300.0  # seconds


class StartupPause:
    """`begin()` at process start, `end()` once the start is over (or the limit)."""

    def __init__(self) -> None:
        self._since: float | None = None

    @property
    def active(self) -> bool:
        return self._since is not None

    def begin(self) -> None:
        if gc.isenabled():
            hold()
            self._since = time.monotonic()

    def end(self, reason: str, loaded: bool = True) -> None:
        """`loaded`: the cluster is loaded (frozen); else what is unreachable is freed."""
        if self._since is None:
            return
        paused, self._since = time.monotonic() - self._since, None
        freed = 0
        if loaded:
            gc.freeze()
        else:
            freed = gc.collect()
        release()  # on again, unless a sync's hold still keeps it off
        # Not gc.get_freeze_count(): it walks every frozen object, on the event loop
        # (87 ms for 4 million; a change arriving then waited for it).
        log.debug("garbage collector back on", extra={
            "reason": reason, "paused": f"{paused:.3f}s", "frozen": loaded, "freed": freed})
