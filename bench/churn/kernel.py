"""The kernel side: when each write's new address reached the agent's rules, and the
agent's CPU and RSS over time."""

from __future__ import annotations

import re
import threading
import time
from ipaddress import IPv6Network
from typing import Any

from bench.common import POD_CIDR_V6, cpu_times, size_mib
from proxy.dataplane.common.netlink import MulticastListener, replies
from proxy.dataplane.common.netlink_constants import (
    NETLINK_NETFILTER,
    NFNL_SUBSYS_NFTABLES,
    NFNLGRP_NFTABLES,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSETELEM,
)
from proxy.netns_lab.netns import entered

ADDING = {NFNL_SUBSYS_NFTABLES << 8 | m for m in (NFT_MSG_NEWRULE, NFT_MSG_NEWSETELEM)}


def _v6_pattern(cidr: str) -> bytes:
    """Any 16-byte address of `cidr` (its prefix whole bytes, then any)."""
    net = IPv6Network(cidr)
    fixed = net.prefixlen // 8
    return re.escape(net.network_address.packed[:fixed]) + b"[\\x00-\\xff]{%d}" % (16 - fixed)


# A pool address, wherever it sits (overlapping: a hairpin element holds two side by
# side): IPv4 of the benchmarking range 198.18.0.0/15, or IPv6 of the pods' /64. Both sit
# contiguous in a DNAT's immediate and in map and set elements; the /64's bare 8-byte
# prefix (the masquerade rule's) matches as a pool address no write awaits.
POOL_ADDRESS = re.compile(rb"(?=(\xc6[\x12\x13][\x00-\xff]{2}|" + _v6_pattern(POD_CIDR_V6)
                          + rb"))")


class AddressWatch(MulticastListener):
    """nf_tables' announcements in the node's namespace: the first time a rule or set
    element carrying each awaited address was added (a rule's DNAT, a map's element).
    The kernel sends them from the committing transaction, so the time one is read here
    is the commit's, plus this thread's wake-up. Deletions are not looked at: they
    carry the deleted rule, whose addresses are old ones."""

    def __init__(self, ns: str) -> None:
        self.wanted: dict[bytes, int] = {}  # packed address -> the write awaiting it
        self.seen: dict[int, float] = {}  # write -> when its address was added
        self.lost = 0
        self.messages = 0
        with entered(ns):  # the socket listens in the namespace it is made in
            super().__init__(NETLINK_NETFILTER, membership=NFNLGRP_NFTABLES,
                             buffer=64 << 20, name="churn-watch",
                             stopped="the churn bench's nf_tables listener stopped")

    def expect(self, packed: bytes, write: int) -> None:
        """Before the write is sent: its new address marks it."""
        self.wanted[packed] = write

    def _lost(self) -> None:
        self.lost += 1  # writes whose announcement was dropped are reported never seen

    def _feed(self, datagram: bytes) -> None:
        now = time.monotonic()
        for message in replies(datagram):
            if message.kind in ADDING:
                self.messages += 1
                for m in POOL_ADDRESS.finditer(message.payload):
                    write = self.wanted.pop(m.group(1), None)
                    if write is not None:
                        self.seen.setdefault(write, now)


class Sampler:
    """The agent's CPU seconds (its own and its reaped children's) and RSS every
    PERIOD, in a thread: CPU over any 1 s window, peak RSS within a phase."""

    PERIOD = 0.1

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float, float]] = []  # time, CPU s, RSS MiB
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self) -> None:
        while True:
            try:
                own, children = cpu_times(self.pid)
            except OSError:
                return
            self.samples.append((time.monotonic(), own + children,
                                 size_mib(self.pid, "VmRSS") or 0.0))
            if self._stop.wait(self.PERIOD):  # the sampling period, not synchronisation
                return

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)

    def window(self, start: float, end: float) -> dict[str, Any]:
        """CPU % of one core over [start, end]; its highest over any 1 s window that
        overlaps it (a phase shorter than 1 s too); the peak sampled RSS in it; and CPU
        % in consecutive 1-s windows from `start` (seconds since start, %)."""
        inside = [s for s in self.samples if start - self.PERIOD <= s[0] <= end + self.PERIOD]
        around = [s for s in self.samples if start - 1.0 - self.PERIOD <= s[0]
                  <= end + 1.0 + self.PERIOD]
        out: dict[str, Any] = {"cpu_percent": None, "cpu_s": None,
                               "cpu_max_1s_percent": None, "peak_rss_mib": None,
                               "cpu_1s": []}
        if len(inside) >= 2:
            (t0, c0, _), (t1, c1, _) = inside[0], inside[-1]
            out |= {"cpu_percent": round(100 * (c1 - c0) / max(t1 - t0, 1e-9), 1),
                    "cpu_s": round(c1 - c0, 2),
                    "peak_rss_mib": round(max(r for _, _, r in inside), 1)}
        peak: float | None = None
        j = 0
        for i, (ti, ci, _) in enumerate(around):
            j = max(j, i + 1)
            while j < len(around) and around[j][0] - ti < 1.0:
                j += 1
            if j == len(around):
                break
            tj, cj, _ = around[j]
            pct = 100 * (cj - ci) / (tj - ti)
            peak = pct if peak is None else max(peak, pct)
            series = out["cpu_1s"]
            if ti >= start - self.PERIOD / 2 and (
                    not series or ti - start >= series[-1][0] + 1.0 - self.PERIOD / 2):
                series.append((round(ti - start, 2), round(pct, 1)))
        out["cpu_max_1s_percent"] = None if peak is None else round(peak, 1)
        return out
