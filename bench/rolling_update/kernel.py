"""The kernel: the service's DNAT targets over time."""

from __future__ import annotations

import re
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from bench.huge_service import (
    SERVICE_IP,
)
from bench.rolling_update.workload import (
    DNAT_IPT,
    DNAT_MAP_NFT,
    DNAT_NFT,
    NFT_MAX_SHARDS,
    NFT_TABLE,
)
from proxy.dataplane.common.drift_watch import NftablesListener
from proxy.dataplane.common.netlink import NFGEN, MulticastListener, attributes, replies
from proxy.dataplane.common.netlink_constants import (
    NETLINK_NETFILTER,
    NFNL_SUBSYS_NFTABLES,
    NFNLGRP_NFTABLES,
    NFPROTO_IPV4,
    NFT_MSG_DELSET,
    NFT_MSG_DELSETELEM,
    NFT_MSG_DELTABLE,
    NFT_MSG_NEWGEN,
    NFT_MSG_NEWSETELEM,
    NFTA_DATA_VALUE,
    NFTA_SET_ELEM_DATA,
    NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_TABLE,
    NFTA_SET_NAME,
    NFTA_SET_TABLE,
    NFTA_TABLE_NAME,
)
from proxy.dataplane.nftables.render import SLOTS
from proxy.dataplane.nftables.slot_tail import TAIL_PREFIX
from proxy.netns_lab.netns import entered

# --- the kernel: the service's DNAT targets over time ----------------------------------

SLOT_KEYED_NFT = re.compile(r"(\d+) : ([0-9.]+) \. \d+\b")


def _value(data: bytes, start: int, end: int) -> bytes | None:
    """The NFTA_DATA_VALUE inside a key or data attribute."""
    for kind, a, b in attributes(data, start, end):
        if kind == NFTA_DATA_VALUE:
            return data[a:b]
    return None


class KernelView:
    """The service's endpoints as the agent's rules in the node's namespace hold them."""

    def __init__(self, ns: str, mode: str) -> None:
        self.ns, self.mode = ns, mode
        self.backend = "nftables" if mode == "nftables" else ""
        self.chain: list[str] = []  # the command listing the service's chain

    def _run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True,
                              text=True, check=False, timeout=120)

    def locate(self) -> bool:
        """Find the service's chain (once the agent's first sync is in)."""
        if self.mode == "nftables":
            text = self._run(["nft", "list", "ruleset"]).stdout
            table = chain = ""
            for line in text.splitlines():
                words = line.split()
                if words[:1] == ["table"] and len(words) >= 3:
                    table = f"{words[1]} {words[2]}"
                elif words[:1] == ["chain"] and len(words) >= 2:
                    chain = words[1]
                elif (DNAT_NFT.search(line) or DNAT_MAP_NFT.search(line)) and table and chain \
                        and not chain.startswith(TAIL_PREFIX):  # the policy chain, not its tail
                    self.chain = ["nft", "list", "chain", *table.split(), chain]
                    return True
            return False
        for backend in ("nft", "legacy"):
            text = self._run([f"iptables-{backend}-save", "-t", "nat"]).stdout
            for line in text.splitlines():
                if line.startswith("-A SPX-SERVICES") and f"-d {SERVICE_IP}/32" in line:
                    target = line.split(" -j ")[-1].split()[0]
                    self.backend = backend
                    self.chain = [f"iptables-{backend}", "-w", "-t", "nat", "-S", target]
                    return True
        return False

    def read(self) -> frozenset[str] | None:
        """The addresses the service's chain DNATs to (None if it cannot be read)."""
        if not self.chain and not self.locate():
            return None
        res = self._run(self.chain)
        if res.returncode != 0:
            return None
        if self.mode != "nftables":
            return frozenset(DNAT_IPT.findall(res.stdout))
        if DNAT_MAP_NFT.search(res.stdout) is None:
            return frozenset(DNAT_NFT.findall(res.stdout))
        slots = self.slots()
        return None if slots is None else frozenset(slots.values())

    def slot_map(self) -> tuple[str, tuple[str, ...]] | None:
        """(table, maps) when the service balances through a slot map (nftables mode, a
        port of 128 endpoints or more): the main map, and its tail from 1,024 endpoints
        on (nftables/slot_tail.py, whether it holds anything now or not); else None."""
        if self.mode != "nftables" or (not self.chain and not self.locate()):
            return None
        res = self._run(self.chain)
        found = DNAT_MAP_NFT.search(res.stdout) if res.returncode == 0 else None
        if not found:
            return None
        return self.chain[4], (found[1], TAIL_PREFIX + found[1].removeprefix(SLOTS))

    def slots(self) -> dict[tuple[str, bytes], str] | None:
        """The slot maps' elements: (map, slot as the kernel holds it) -> address."""
        where = self.slot_map()
        if where is None:
            return None
        out: dict[tuple[str, bytes], str] = {}
        for name in where[1]:
            res = self._run(["nft", "list", "map", *self.chain[3:5], name])
            if res.returncode != 0:
                if name == where[1][0]:
                    return None
                continue  # no tail (yet)
            # numgen's slot is a 32-bit register in host order, as nft prints it.
            out.update(((name, struct.pack("=I", int(k))), a)
                       for k, a in SLOT_KEYED_NFT.findall(res.stdout))
        return out

    def commit_tables(self) -> set[tuple[int, str]]:
        if self.mode == "nftables":
            return {(NFPROTO_IPV4, t) for t in
                    [NFT_TABLE, *(f"{NFT_TABLE}-{i}" for i in range(NFT_MAX_SHARDS))]}
        return {(NFPROTO_IPV4, "nat")} if self.backend == "nft" else set()


class KernelWatch:
    """A thread reading the service's endpoints after each nf_tables transaction on the
    agent's tables (or every POLL seconds without announcements): (time, endpoints)
    whenever they changed, dated by the announcement before the read (or the read)."""

    POLL = 0.1

    def __init__(self, view: KernelView) -> None:
        self.view = view
        self.timeline: list[tuple[float, frozenset[str]]] = []
        self.reads = 0
        self.read_seconds = 0.0
        self._heard = threading.Event()
        self._last_commit = 0.0
        self._commits = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._listener: NftablesListener | None = None
        self._thread = threading.Thread(target=self._run, name="kernel-watch", daemon=True)

    def _notify(self, _reason: str) -> None:
        self._last_commit = time.monotonic()
        self._commits += 1
        self._heard.set()

    def start(self) -> None:
        self._notify("the first read")
        tables = self.view.commit_tables()
        if tables:
            with entered(self.view.ns):
                self._listener = NftablesListener(tables, lambda _pid: False, self._notify)
            self._listener.start()
        self._thread.start()

    def _run(self) -> None:
        last: frozenset[str] | None = None
        while not self._stop.is_set():
            if self._listener is not None:
                if not self._heard.wait(1.0):
                    continue
                self._heard.clear()
                dated = self._last_commit
            start = time.monotonic()
            eps = self.view.read()
            end = time.monotonic()
            self.reads += 1
            self.read_seconds += end - start
            if self._listener is None:
                dated = end
            if eps is not None and eps != last:
                with self._lock:
                    self.timeline.append((dated, eps))
                last = eps
            if self._listener is None:
                self._stop.wait(max(0.0, start + self.POLL - time.monotonic()))

    def latest(self) -> frozenset[str] | None:
        with self._lock:
            return self.timeline[-1][1] if self.timeline else None

    def wait_for(self, want: Callable[[frozenset[str]], bool], deadline: float,
                 alive: Callable[[], None]) -> float | None:
        """Poll our own record until the endpoints satisfy `want`: the time they did."""
        while time.monotonic() < deadline:
            alive()
            with self._lock:
                if self.timeline and want(self.timeline[-1][1]):
                    return self.timeline[-1][0]
            self._stop.wait(0.05)
        return None

    @property
    def commits(self) -> int:
        return self._commits

    def stop(self) -> None:
        self._stop.set()
        self._heard.set()
        self._thread.join(30)
        if self._listener is not None:
            self._listener.stop()


class SlotMapWatch(KernelWatch):
    """For a service balancing through a slot map (nftables mode): the elements of its
    map and its tail (nftables/slot_tail.py) read once, then kept from nf_tables' own
    announcements of each element added and deleted, and the endpoints recorded at the
    end of each transaction (its NEWGEN), dated when that is heard. Reading the map
    back after each commit instead takes ~90 ms at 10,000 endpoints and 2.7 s at 50,000
    (nft's listing), a core of the machine's two and a resolution worse than the lag
    measured."""

    def __init__(self, view: KernelView, table: str, slot_maps: Sequence[str]) -> None:
        super().__init__(view)
        self.table = table.encode() + b"\0"
        self.maps = {name.encode() + b"\0": name for name in slot_maps}
        self._slots: dict[tuple[str, bytes], str] = {}
        self._changed = False
        self._multicast: _Announcements | None = None

    def start(self) -> None:
        start = time.monotonic()
        slots = self.view.slots()
        if slots is None:
            raise RuntimeError("the service's slot map could not be read")
        self.reads, self.read_seconds = 1, time.monotonic() - start
        self._slots = slots
        self.timeline.append((time.monotonic(), frozenset(slots.values())))
        with entered(self.view.ns):  # the socket listens in the namespace it is made in
            self._multicast = _Announcements(self._feed)
        self._multicast.start()

    def _feed(self, datagram: bytes) -> None:
        now = time.monotonic()
        for message in replies(datagram):
            if message.kind >> 8 != NFNL_SUBSYS_NFTABLES:
                continue
            msg, body = message.kind & 0xFF, message.payload  # body: nfgenmsg, attributes
            if msg in (NFT_MSG_NEWSETELEM, NFT_MSG_DELSETELEM):
                self._elements(body, NFGEN.size, len(body), msg == NFT_MSG_NEWSETELEM)
            elif msg in (NFT_MSG_DELTABLE, NFT_MSG_DELSET):
                self._gone(body, NFGEN.size, len(body), msg)
            elif msg == NFT_MSG_NEWGEN:
                self._commits += 1
                if self._changed:
                    with self._lock:
                        self.timeline.append((now, frozenset(self._slots.values())))
                    self._changed = False

    def _gone(self, data: bytes, start: int, end: int, msg: int) -> None:
        """The map (or its table) deleted: its elements went with it (a full sync that
        rebuilds the table adds them all again)."""
        found = {kind: data[a:b] for kind, a, b in attributes(data, start, end)}
        if msg == NFT_MSG_DELTABLE:
            ours = found.get(NFTA_TABLE_NAME) == self.table
        else:
            ours = (found.get(NFTA_SET_TABLE) == self.table
                    and found.get(NFTA_SET_NAME, b"") in self.maps)
        if ours:
            gone = self.maps.get(found.get(NFTA_SET_NAME, b""))
            self._slots = {k: v for k, v in self._slots.items()
                           if gone is not None and k[0] != gone}
            self._changed = True

    def _elements(self, data: bytes, start: int, end: int, added: bool) -> None:
        table = name = b""
        elements = (0, 0)
        for kind, a, b in attributes(data, start, end):
            if kind == NFTA_SET_ELEM_LIST_TABLE:
                table = data[a:b]
            elif kind == NFTA_SET_ELEM_LIST_SET:
                name = data[a:b]
            elif kind == NFTA_SET_ELEM_LIST_ELEMENTS:
                elements = (a, b)
        map_name = self.maps.get(name)
        if table != self.table or map_name is None:
            return
        for _, a, b in attributes(data, *elements):  # each NFTA_LIST_ELEM
            key = value = None
            for kind, c, d in attributes(data, a, b):
                if kind == NFTA_SET_ELEM_KEY:
                    key = _value(data, c, d)
                elif kind == NFTA_SET_ELEM_DATA:
                    value = _value(data, c, d)
            if key is None:
                continue
            if added and value is not None and len(value) >= 4:
                self._slots[map_name, key] = ".".join(str(x) for x in value[:4])
            elif not added:
                self._slots.pop((map_name, key), None)
            self._changed = True

    @property
    def lost(self) -> int:
        """Times the kernel dropped announcements (a full receive buffer)."""
        return self._multicast.lost if self._multicast is not None else 0

    def stop(self) -> None:
        if self._multicast is not None:
            self._multicast.stop()


class _Announcements(MulticastListener):
    """Every nf_tables announcement of this namespace, raw, to `feed`."""

    def __init__(self, feed: Callable[[bytes], None]) -> None:
        self._on = feed
        self.lost = 0
        super().__init__(NETLINK_NETFILTER, membership=NFNLGRP_NFTABLES, buffer=64 << 20,
                         name="slot-map-watch", stopped="the bench's slot map watch stopped")

    def _lost(self) -> None:
        self.lost += 1  # reported: the slot map may be wrong from then on

    def _feed(self, datagram: bytes) -> None:
        self._on(datagram)
