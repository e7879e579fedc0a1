"""Noticing that someone else changed the tables our rules live in, between syncs.

A host firewall reload (`iptables -t nat -F`, `nft flush ruleset`, an
`iptables-restore` without `--noflush`) or a careless admin removes our rules; upstream
kube-proxy notices at its next canary check, once per sync period. Our full resync is an
hour apart, so the iptables data plane watches instead, and asks for a check (read our
chains back, compare counts: `Ruleset.differences`) only when something changed:

- on nf_tables, `NftablesListener` joins the multicast group on which the kernel
  announces every committed transaction and reports those that touched the nat or
  filter table and were not committed by us: no polling, nothing read back unless
  someone else wrote;
- on legacy x_tables there is no such announcement; `LegacyCanary` asks the kernel for
  each table's entry count and blob size (one getsockopt, microseconds, however big the
  table) every `interval` seconds and reports when they moved since our last apply.

Both call `notify(reason)` from their own thread; the sync runner takes it from there.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import socket
import threading
from collections.abc import Callable, Collection, Iterable
from typing import Protocol

from proxy.dataplane.common import processes
from proxy.dataplane.common.netlink import MulticastListener
from proxy.dataplane.common.netlink_constants import NETLINK_NETFILTER, NFNLGRP_NFTABLES, NFPROTO
from proxy.dataplane.common.nft_events import TransactionReader
from proxy.model.types import Family

# Room for a burst of notifications: a full sync at 10,000 services announces ~300,000
# objects. Overflowing costs one check (the lost messages might have been someone else's).
LISTEN_BUFFER = 8 << 20

Notify = Callable[[str], None]
# What `notify` is told when announcements were dropped: no evidence of anyone else's
# change by itself (our own full sync can overflow the buffer).
LOST = "nf_tables announcements were lost (receive buffer full)"


class NftablesListener(MulticastListener):
    """A thread reading nf_tables change announcements; `notify` for every foreign
    transaction that touched one of `tables` ((NFPROTO family, table name))."""

    def __init__(self, tables: Collection[tuple[int, str]], ours: Callable[[int], bool],
                 notify: Notify) -> None:
        self.tables = frozenset(tables)
        self._ours, self._notify = ours, notify
        self._reader = TransactionReader()
        super().__init__(NETLINK_NETFILTER, membership=NFNLGRP_NFTABLES,
                         buffer=LISTEN_BUFFER, name="nftables-listener",
                         stopped="nf_tables listener stopped; foreign changes to our "
                                 "rules are repaired at the next full sync only")

    def _lost(self) -> None:
        self._reader.reset()
        self._notify(LOST)

    def _feed(self, datagram: bytes) -> None:
        for tx in self._reader.feed(datagram):
            if not tx.tables & self.tables:
                continue
            if self._ours(tx.port_id) or (tx.pid is not None and self._ours(tx.pid)):
                continue
            self._notify(f"nf_tables transaction: {tx.describe()}")


# struct ipt_getinfo / ip6t_getinfo: the same layout for both families.
class _GetInfo(ctypes.Structure):
    _fields_ = [("name", ctypes.c_char * 32), ("valid_hooks", ctypes.c_uint),
                ("hook_entry", ctypes.c_uint * 5), ("underflow", ctypes.c_uint * 5),
                ("num_entries", ctypes.c_uint), ("size", ctypes.c_uint)]


SO_GET_INFO = 64  # IPT_SO_GET_INFO and IP6T_SO_GET_INFO
_LEVEL = {Family.V4: (socket.AF_INET, socket.IPPROTO_IP),
          Family.V6: (socket.AF_INET6, socket.IPPROTO_IPV6)}
_libc = ctypes.CDLL(None, use_errno=True)


class Summaries(Protocol):
    def read(self, table: str) -> tuple[int, int]: ...

    def close(self) -> None: ...


class TableInfo:
    """x_tables' summary of one legacy table: (entries, blob bytes). Any rule or chain
    added, removed or flushed changes it."""

    def __init__(self, family: Family) -> None:
        af, self._level = _LEVEL[family]
        self._sock = socket.socket(af, socket.SOCK_RAW, socket.IPPROTO_RAW)

    def read(self, table: str) -> tuple[int, int]:
        info = _GetInfo(name=table.encode())
        size = ctypes.c_uint(ctypes.sizeof(info))
        if _libc.getsockopt(self._sock.fileno(), self._level, SO_GET_INFO,
                            ctypes.byref(info), ctypes.byref(size)) != 0:
            code = ctypes.get_errno()
            raise OSError(code, f"{table} table summary: {errno.errorcode.get(code, code)}")
        return int(info.num_entries), int(info.size)

    def close(self) -> None:
        self._sock.close()


class LegacyCanary:
    """A thread comparing each legacy table's summary with the one taken after our last
    apply (`rebaseline`); `notify` when it moved. `busy` is held by the data plane while
    it applies, so our own restores are never reported."""

    def __init__(self, tables: Iterable[tuple[Family, str]], notify: Notify,
                 busy: threading.Lock, interval: float = 2.0,
                 info: Callable[[Family], Summaries] | None = None) -> None:
        self.tables = tuple(tables)
        self.interval = interval
        self._notify, self._busy = notify, busy
        self._info = {family: (info or TableInfo)(family) for family, _ in self.tables}
        self._baseline: dict[tuple[Family, str], tuple[int, int] | None] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="legacy-canary", daemon=True)

    def _read(self, family: Family, table: str) -> tuple[int, int] | None:
        try:
            return self._info[family].read(table)
        except OSError:
            return None  # no such table yet: a later apply makes it

    def rebaseline(self) -> None:
        """Our apply is done (caller holds `busy`): what the tables hold now is ours."""
        for family, table in self.tables:
            self._baseline[(family, table)] = self._read(family, table)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        for info in self._info.values():
            info.close()

    def check(self) -> None:
        """One look at every table (what the thread does each interval)."""
        if not self._busy.acquire(blocking=False):
            return  # we are applying: our own change, not drift
        try:
            for key in self.tables:
                now, then = self._read(*key), self._baseline.get(key)
                if now == then or key not in self._baseline:
                    continue
                self._baseline[key] = now
                family, table = key
                self._notify(f"legacy {family.label} {table} table changed: "
                             f"{_entries(then)} entries before, {_entries(now)} now")
        finally:
            self._busy.release()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.check()


def _entries(summary: tuple[int, int] | None) -> str:
    return "no table" if summary is None else str(summary[0])


# Seconds between looks at the legacy tables' summaries: a foreign flush is noticed
# within this, at the cost of one getsockopt per table.
CANARY_INTERVAL = 2.0
XTABLES = ("nat", "filter")


def watch_xtables(families: Iterable[Family], nft: bool, notify: Notify,
                  busy: threading.Lock) -> NftablesListener | LegacyCanary:
    """Start watching the nat and filter tables of `families`, where the iptables and
    IPVS modes keep their rules: nf_tables announcements on the nf_tables back end
    (`nft`), else the legacy canary, baselined now (under `busy`, which the data plane
    holds while it writes)."""
    families = tuple(families)
    watch: NftablesListener | LegacyCanary
    if nft:
        watch = NftablesListener({(NFPROTO[f], t) for f in families for t in XTABLES},
                                 processes.started_here, notify)
    else:
        watch = LegacyCanary([(f, t) for f in families for t in XTABLES], notify, busy,
                             CANARY_INTERVAL)
        with busy:
            watch.rebaseline()
    watch.start()
    return watch


def how_xtables_are_watched(nft: bool) -> str:
    """For the log line saying how drift is noticed."""
    return ("nf_tables announcements" if nft
            else f"legacy table summaries every {CANARY_INTERVAL:g}s")


def deaf_while(watch: NftablesListener | LegacyCanary | None,
               full: bool) -> contextlib.AbstractContextManager[object]:
    """Our nf_tables listener deaf while a full sync writes: the kernel then announces
    nothing of it to us (netlink.MulticastListener.deaf)."""
    if full and isinstance(watch, NftablesListener):
        return watch.deaf()
    return contextlib.nullcontext()
