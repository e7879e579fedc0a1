"""Noticing quickly that someone removed our virtual servers: IPVS announces nothing.

`ipvsadm -C`, `kube-proxy --cleanup` (which flushes the whole IPVS table) and a kube-proxy
started beside us (which deletes every virtual server it does not serve) leave the node's
service addresses local but unserved: every connection to them is refused until the
next full sync. The IPVS table has no multicast group and no generation counter, so the
only way to see such a change is to ask.

`TableSampler` asks, from a thread of its own with a socket of its own: every `interval`
it GETs `per_tick` of our virtual servers by key (one batched exchange, nothing decoded),
moving on through the list each tick. A flush, which removes them all, is seen at the
next tick, whatever the table's size; a single `ipvsadm -D` within len/per_tick ticks
(10,000 virtual servers, 8 per 0.5 s: about 10 minutes, against the hour of the full
resync). A missing key only calls `notify`: the data plane's `check_drift` then compares
every key with one dump, and a real difference costs a full sync. Reading the whole
table each tick would bound a single deletion too, at about 10,000 times the netlink
messages (docs/dataplanes.md has both costs, measured).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

from proxy.dataplane.ipvs.kernel import IpvsTable
from proxy.dataplane.ipvs.render import VsKey

log = logging.getLogger(__name__)

INTERVAL = 0.5  # seconds between looks: a flush is noticed within this
PER_TICK = 8  # virtual servers asked for at each look


class TableSampler:
    """A thread GETting a rotating sample of our virtual servers; `notify(reason)` when
    one is missing. `publish` (from the data-plane thread, after each sync) gives it the
    keys the kernel holds for us; it asks nothing until the first publish."""

    def __init__(self, notify: Callable[[str], None], *, interval: float = INTERVAL,
                 per_tick: int = PER_TICK,
                 table: Callable[[], IpvsTable] = IpvsTable) -> None:
        self._notify = notify
        self.interval, self.per_tick = interval, per_tick
        self._make_table = table
        self._keys: tuple[VsKey, ...] = ()
        self._cursor = 0
        self._found: list[VsKey] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.looks = 0  # GETs sent, for tests and the cost figures

    def publish(self, keys: Sequence[VsKey]) -> None:
        self._keys = tuple(keys)  # one reference swap: the thread reads whole tuples

    def start(self) -> None:
        """Start the thread; it lives in the network namespace of the caller's thread."""
        self._thread = threading.Thread(target=self._run, name="ipvs-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def sample(self) -> list[VsKey]:
        """The keys to ask for now, moving the cursor on."""
        keys = self._keys
        if not keys:
            return []
        count = min(self.per_tick, len(keys))
        start = self._cursor % len(keys)
        self._cursor = start + count
        return [keys[(start + i) % len(keys)] for i in range(count)]

    def look(self, table: IpvsTable) -> list[VsKey]:
        """One look: the sampled keys the kernel lacks (notified)."""
        keys = self.sample()
        missing = table.missing(keys)
        self.looks += len(keys)
        if missing and set(missing) & set(self._keys):  # not just deleted by a sync
            self._found = missing
            self._notify(f"{len(missing)} of {len(keys)} virtual servers sampled are "
                         f"missing from the IPVS table, first {missing[0]}")
        return missing

    def take_found(self) -> list[VsKey]:
        """The keys the last look found missing, once (for `check_drift`, which need
        then only ask for those again)."""
        found, self._found = self._found, []
        return found

    def _run(self) -> None:
        try:
            table = self._make_table()
        except Exception as exc:
            log.warning("cannot sample the IPVS table; a foreign removal of our virtual "
                        "servers is repaired at the next full sync only",
                        extra={"error": str(exc)})
            return
        try:
            while not self._stop.wait(self.interval):
                try:
                    self.look(table)
                except Exception as exc:  # keep sampling: one failed exchange is not news
                    log.debug("sampling the IPVS table failed", extra={"error": str(exc)})
        finally:
            table.close()
