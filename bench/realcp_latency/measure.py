"""Measuring one change: the rule's moment in the kernel, nf_tables' commits, the initial sync."""

from __future__ import annotations

import math
import statistics
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from bench.realcp_latency.nat import (
    chain_rules,
    dispatch_count,
    nft_view,
    parse_nat,
    save_nat,
    shows,
)
from bench.realcp_latency.proxies import Side, cpu_seconds, memory_mib
from bench.realcp_latency.settings import (
    BACKENDS,
    DISPATCH,
    INITIAL_POLL,
    NFT_MAIN,
    NFT_MAX_SHARDS,
    NFTABLES,
    SERVICE_CHAIN,
)
from proxy.dataplane.common.drift_watch import NftablesListener
from proxy.dataplane.common.netlink_constants import NFPROTO
from proxy.model.types import Family
from proxy.netns_lab.netns import entered

# --- measuring ----------------------------------------------------------------------------


class Commits:
    """nf_tables' own announcements of the transactions committed on a node's tables, as
    they reach this process (monotonic times). A poll that shows a change is then dated
    by the commit that made it rather than by the poll (whose resolution is tens of ms):
    the change was committed between the last poll that did not show it and the end of
    the first that did, and a proxy's change is one transaction."""

    # How long a poll that showed a change waits for the listener thread to read the
    # announcement: the kernel queued it before the rule was visible, but a busy 2-core
    # machine can run the poll before the thread that dates it.
    GRACE = 1.0

    def __init__(self, ns: str, tables: Iterable[str], family: Family = Family.V4) -> None:
        self._times: list[float] = []
        self._heard_one = threading.Condition()
        with entered(ns):  # the socket listens in the namespace it is made in
            self._listener = NftablesListener({(NFPROTO[family], t) for t in tables},
                                              lambda _pid: False, self._heard)
        self._listener.start()

    def _heard(self, reason: str) -> None:
        now = time.monotonic()
        if reason.startswith("nf_tables transaction"):  # not "announcements were lost"
            with self._heard_one:
                self._times.append(now)
                self._heard_one.notify_all()

    def between(self, after: float, until: float) -> list[float]:
        """The commits in (after, until]; if none was read yet, the first read within
        GRACE, dated `until` (it was committed by then: the poll saw its rule)."""
        with self._heard_one:
            self._heard_one.wait_for(lambda: any(t > after for t in self._times),
                                     timeout=max(0.0, until + self.GRACE - time.monotonic()))
            heard = [t for t in self._times if after < t <= until]
            if heard or not any(t > until for t in self._times):
                return heard
            return [until]

    def stop(self) -> None:
        self._listener.stop()


def commit_tables(backend: str) -> tuple[str, ...]:
    """The nf_tables tables a side's changes are committed to (none for legacy)."""
    if backend == NFTABLES:
        return (NFT_MAIN, *(f"{NFT_MAIN}-{i}" for i in range(NFT_MAX_SHARDS)))
    return ("nat",) if backend == "nft" else ()


@dataclass
class Seen:
    seconds: float | None  # write acknowledged -> end of the first poll showing the change
    resolution: float | None  # minus the start of the last poll not showing it
    polls: int
    # write -> the first commit announced in that window (nf_tables only), and how many
    committed: float | None = None
    commits: int = 0


def watch_rule(ns: str, backend: str, svc_chain: str, sep_chain: str, present: bool,
               sent: float, deadline: float, interval: float,
               commits: Commits | None = None) -> Seen:
    """Poll one proxy's service chain until its jump to `sep_chain` is `present`;
    times from `sent` (monotonic), when the write left."""
    polls = 0
    not_yet = sent
    with entered(ns):
        while True:
            start = time.monotonic()
            rules = chain_rules(backend, svc_chain)
            end = time.monotonic()
            polls += 1
            if rules is not None:
                if shows(backend, rules, sep_chain) == present:
                    heard = commits.between(not_yet, end) if commits is not None else []
                    return Seen(end - sent, end - not_yet, polls,
                                heard[0] - sent if heard else None, len(heard))
                not_yet = start
            if end > deadline:
                return Seen(None, None, polls)
            # The polling interval (the measurement's resolution), not synchronisation.
            time.sleep(max(0.0, start + interval - time.monotonic()))


def wait_initial(side: Side, namespace: str, want: set[tuple[str, str]], services: int,
                 deadline: float, family: Family = Family.V4) -> dict[str, Any]:
    """Until every (service port, endpoint) of the namespace is DNATed in the side's nat
    table (the nftables mode's: in `family`): how long since the process started, its
    CPU time and memory by then. A poll that began before the deadline reads to its end,
    however long the tables take to read."""
    polls = 0
    with entered(side.lab.node_ns):
        while True:
            side.proxy.check_alive()
            start = time.monotonic()
            polls += 1
            for backend in BACKENDS if side.base in DISPATCH else (NFTABLES,):
                seen: float | None = None
                if backend == NFTABLES:
                    found = nft_view(namespace, {port for port, _ in want}, family)
                    if found is None:
                        continue
                    view, seen = found
                # The dispatch chain first (cheap); the whole table once it is complete.
                elif dispatch_count(backend, DISPATCH[side.base], namespace) < services:
                    continue
                else:
                    view = parse_nat(save_nat(backend), namespace, DISPATCH[side.base],
                                     SERVICE_CHAIN[side.base])
                if want <= set(view.endpoints):
                    seen = seen or time.monotonic()
                    side.backend, side.view = backend, view
                    return {"seconds_to_rules": round(seen - side.proxy.started, 3),
                            "resolution_s": round(seen - start + INITIAL_POLL, 3),
                            "cpu_s": cpu_seconds(side.pid), "memory_mib": memory_mib(side.pid),
                            "nat_rules": view.rules, "backend": backend, "polls": polls}
            if start > deadline:
                raise TimeoutError(f"{side.name} did not program the {len(want)} endpoints "
                                   f"in time; log:\n{side.proxy.log_tail()}")
            time.sleep(max(0.0, start + INITIAL_POLL - time.monotonic()))


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """median, p90 (nearest rank), min, max of the values seen; misses counted."""
    xs = sorted(v for v in values if v is not None)
    out: dict[str, Any] = {"n": len(xs), "missed": sum(1 for v in values if v is None)}
    if xs:
        out.update(median=round(statistics.median(xs), 4),
                   p90=round(xs[max(0, math.ceil(0.9 * len(xs)) - 1)], 4),
                   min=round(xs[0], 4), max=round(xs[-1], 4))
    return out
