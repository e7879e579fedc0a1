"""The run's settings and the roll: what the API holds, tick by tick."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, summarize_address_range
from typing import Any

from bench.common import ENDPOINTS_PER_SLICE
from bench.huge_service import (
    NAMESPACE,
    NODES,
    SERVICE,
    ZONES,
    slice_object,
)

MODES = ("nftables", "iptables")
NODE = "node-a"
TICK = 0.1
POD_PORT, SERVICE_PORT = 8080, 80
POD_CIDR = "198.19.0.0/16"  # the agent's --cluster-cidr; pods spill over (POD_NETS)
# Pod p's address: 198.19.0.0 + p, then on from 198.18.4.0 up to 198.18.254.255, clear
# of the lab (198.18.0-1.x), the pods' link (198.18.2.x) and the service (198.18.255.1):
# 50,000 old and 50,000 new pods, all distinct.
POD_NETS = (IPv4Network(POD_CIDR), *summarize_address_range(
    IPv4Address("198.18.4.0"), IPv4Address("198.18.254.255")))
_SPILL, _SPILL_SIZE = IPv4Address("198.18.4.0"), 251 * 256
MAX_ENDPOINTS = (65_536 + _SPILL_SIZE) // 2  # old and new pods both
PODS_LINK_NODE, PODS_LINK_POD = "198.18.2.1", "198.18.2.2"
PODS_DEV = "eth0"  # the pods' end of the veth holds every pod address
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
NFT_TABLE = "sliceproxy"
NFT_MAX_SHARDS = 64
FIRST_SYNC = re.compile(r"first sync done")
SYNC_LINE = re.compile(r'msg="(?:full )?sync done".*?\bduration=([0-9.]+)s')
DNAT_NFT = re.compile(r"dnat (?:ip )?to ([0-9.]+):" + str(POD_PORT))
# A large port balances through a slot map (nftables/render.py): its endpoints are there.
DNAT_MAP_NFT = re.compile(r"dnat ip to numgen random mod \d+ map @(\S+)")
SLOT_NFT = re.compile(r"\d+ : ([0-9.]+) \. " + str(POD_PORT) + r"\b")
DNAT_IPT = re.compile(r"-> ([0-9.]+):" + str(POD_PORT) + r"\b")
Obj = dict[str, Any]
Conditions = tuple[bool, bool, bool]  # ready, serving, terminating
READY: Conditions = (True, True, False)
NOT_READY: Conditions = (False, False, False)
TERMINATING: Conditions = (False, True, True)


@dataclass(frozen=True)
class Settings:
    endpoints: int = 1000
    rate: float = 100.0  # endpoints replaced a second
    mode: str = "nftables"
    ready_delay: float = 0.5
    grace: float = 2.0  # terminating -> deleted
    teardown: float = 1.0  # deleted -> address removed
    traffic_rate: float = 200.0
    connect_timeout: float = 1.0
    before: float = 1.0  # traffic before the roll
    after: float = 3.0  # and after the last address is removed
    pacing: str = "new"  # PACINGS
    min_sync_period: str = ""  # an explicit --min-sync-period instead of `pacing`
    settle_timeout: float = 120.0  # last write -> kernel exact, at most
    start_timeout: float = 600.0


def pod_address(p: int) -> str:
    if p < 65_536:
        return str(IPv4Address("198.19.0.0") + p)
    if p < 65_536 + _SPILL_SIZE:
        return str(_SPILL + (p - 65_536))
    raise ValueError(f"at most {65_536 + _SPILL_SIZE} pods")


# Issue 29's sync pacing: "old" is the fixed-rate runner set explicitly (upstream's 1 s),
# "new" passes no pacing flag, so it measures the agent's default, whatever it is.


# --- the roll: what the API holds, tick by tick ----------------------------------------


@dataclass
class SliceState:
    name: str
    endpoints: dict[int, Conditions] = field(default_factory=dict)  # pod -> conditions
    rv: str | None = None  # None: not created yet


@dataclass(frozen=True)
class Write:
    """One slice write of a tick, what it does to the kernel's wanted set, and when."""

    tick: int
    op: str  # POST, PUT, DELETE
    slice: str
    adds: frozenset[int]  # pods this write made ready
    removes: frozenset[int]  # pods this write made terminating


class Roll:
    """The pods of the roll and the slices holding them, as the controller keeps them.
    Old pod s (0 <= s < n) is replaced by new pod n + s."""

    def __init__(self, endpoints: int, rate: float, ready_delay: float, grace: float,
                 teardown: float) -> None:
        self.n = endpoints
        self.per_tick = max(1, round(rate * TICK))
        self.ready_ticks = max(1, round(ready_delay / TICK))
        self.grace_ticks = max(1, round(grace / TICK))
        self.teardown_ticks = max(0, round(teardown / TICK))
        self.desired: dict[int, Conditions] = dict.fromkeys(range(endpoints), READY)
        count = -(-endpoints // ENDPOINTS_PER_SLICE)
        self.slices = [SliceState(f"{SERVICE}-{i:05x}", dict.fromkeys(
            range(i * ENDPOINTS_PER_SLICE, min((i + 1) * ENDPOINTS_PER_SLICE, endpoints)),
            READY)) for i in range(count)]
        self._next_slice = count
        self.create_ticks = -(-endpoints // self.per_tick)

    @property
    def ticks(self) -> int:
        """Ticks until the last address is removed."""
        return (self.create_ticks - 1 + self.ready_ticks + 1 + self.grace_ticks
                + self.teardown_ticks + 1)

    def _slots(self, tick: int) -> range:
        if tick < 0 or tick >= self.create_ticks:
            return range(0)
        return range(tick * self.per_tick, min((tick + 1) * self.per_tick, self.n))

    def created(self, tick: int) -> list[int]:
        return [self.n + s for s in self._slots(tick)]

    def deleted(self, tick: int) -> list[int]:
        """Old pods deleted this tick (terminating `grace_ticks` ago)."""
        return list(self._slots(tick - self.ready_ticks - 1 - self.grace_ticks))

    def torn_down(self, tick: int) -> list[int]:
        """Old pods whose address goes this tick (deleted `teardown_ticks` ago)."""
        return list(self._slots(tick - self.ready_ticks - 1 - self.grace_ticks
                                - self.teardown_ticks))

    def step(self, tick: int) -> list[tuple[Write, Obj | None]]:
        """The API writes of tick `tick`: (what, the slice body; None for a DELETE)."""
        for p in self.created(tick):
            self.desired[p] = NOT_READY
        for s in self._slots(tick - self.ready_ticks):
            self.desired[self.n + s] = READY
        for s in self._slots(tick - self.ready_ticks - 1):
            self.desired[s] = TERMINATING
        for s in self._slots(tick - self.ready_ticks - 1 - self.grace_ticks):
            del self.desired[s]
        return self._reconcile(tick)

    def _reconcile(self, tick: int) -> list[tuple[Write, Obj | None]]:
        changed: dict[str, tuple[set[int], set[int]]] = {}
        placed: set[int] = set()
        for sl in self.slices:
            for p, cond in list(sl.endpoints.items()):
                want = self.desired.get(p)
                if want != cond:
                    adds, removes = changed.setdefault(sl.name, (set(), set()))
                    if want is None:
                        del sl.endpoints[p]
                    else:
                        sl.endpoints[p] = want
                        if want == READY:
                            adds.add(p)
                        elif want == TERMINATING:
                            removes.add(p)
            placed.update(sl.endpoints)
        new = [p for p in self.desired if p not in placed]
        for sl in self.slices:  # first the slices written anyway
            if sl.name in changed:
                new = self._fill(sl, new, changed)
        if new and len(new) <= ENDPOINTS_PER_SLICE:  # then the fullest that takes them all
            fits = [sl for sl in self.slices
                    if len(sl.endpoints) + len(new) <= ENDPOINTS_PER_SLICE]
            if fits:
                new = self._fill(max(fits, key=lambda s: len(s.endpoints)), new, changed)
        while new:
            sl = SliceState(f"{SERVICE}-{self._next_slice:05x}")
            self._next_slice += 1
            self.slices.append(sl)
            new = self._fill(sl, new, changed)
        out: list[tuple[Write, Obj | None]] = []
        for sl in list(self.slices):
            if sl.name not in changed:
                continue
            adds, removes = changed[sl.name]
            if not sl.endpoints:
                self.slices.remove(sl)
                if sl.rv is None:
                    continue
                out.append((Write(tick, "DELETE", sl.name, frozenset(), frozenset()), None))
                continue
            op = "POST" if sl.rv is None else "PUT"
            out.append((Write(tick, op, sl.name, frozenset(adds), frozenset(removes)),
                        self.body(sl)))
        return out

    def _fill(self, sl: SliceState, new: list[int],
              changed: dict[str, tuple[set[int], set[int]]]) -> list[int]:
        """Put as many of `new` into `sl` as it has room for; the rest."""
        room = ENDPOINTS_PER_SLICE - len(sl.endpoints)
        if room <= 0 or not new:
            return new
        adds, _ = changed.setdefault(sl.name, (set(), set()))
        for p in new[:room]:
            sl.endpoints[p] = self.desired[p]
            if self.desired[p] == READY:
                adds.add(p)
        return new[room:]

    @staticmethod
    def body(sl: SliceState) -> Obj:
        obj = slice_object(0, 0)  # huge_service's metadata, labels and owner; no endpoints
        obj["metadata"]["name"] = sl.name
        if sl.rv is None:
            obj["metadata"].pop("resourceVersion", None)
        else:
            obj["metadata"]["resourceVersion"] = sl.rv
        eps = []
        for p, (ready, serving, terminating) in sl.endpoints.items():
            eps.append({  # huge_service.endpoint_object's, with our wider addresses
                "addresses": [pod_address(p)],
                "conditions": {"ready": ready, "serving": serving,
                               "terminating": terminating},
                "nodeName": f"node-{p % NODES}", "zone": f"zone-{p % ZONES}",
                "targetRef": {"kind": "Pod", "namespace": NAMESPACE,
                              "name": f"{SERVICE}-{p:06d}",
                              "uid": f"00000000-0000-4000-8000-{p:012d}"}})
        obj["endpoints"] = eps
        return obj

    def api_state(self) -> dict[int, Conditions]:
        return {p: c for sl in self.slices for p, c in sl.endpoints.items()}
