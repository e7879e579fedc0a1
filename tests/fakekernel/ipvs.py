"""The IPVS plane's kernel handles, in memory: the IPVS table, the links (our dummy
interface and the node's addresses) and ipsets, for unit tests of the plane itself
(the real kernel's answers are the kernel tier's: docs/kernel-tests.md).

`on_fakes` gives an IpvsDataPlane these handles instead of netlink sockets and the
ipset binary. Every operation succeeds; what the plane asked is recorded (`FakeIpvs.ops`
as diff.Op prints them, `FakeIpsets.lines`). The table's statistics are what a test puts
in `FakeIpvs.counted` (virtual servers) and `FakeIpvs.dest_counted` (real servers).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from ipaddress import ip_address
from typing import Any, cast

from proxy.dataplane.base import Counted, DataplaneOptions
from proxy.dataplane.common.kube_proxy_objects import IPVS_INTERFACE as KUBE_IPVS_INTERFACE
from proxy.dataplane.ipvs.apply import IpvsDataPlane, KernelHandles
from proxy.dataplane.ipvs.diff import KernelDest, KernelService, Op
from proxy.dataplane.ipvs.netlink import RawVsKey, raw_key
from proxy.dataplane.ipvs.render import RsKey, VsKey
from proxy.model.types import IPAddress

DUMMY_INDEX = 99  # our dummy interface's index
NODE_ADDRESS = ip_address("198.18.0.1")  # on interface 1


class FakeIpvs:
    """The IPVS table: `held` is what it holds (a test may set it, e.g. to what the plane
    believes); operations are recorded, and applied only with `applies` (as the kernel
    does: a real server added goes to the head of its list). Every real server keeps
    one connection, so a draining one stays draining."""

    def __init__(self, held: Mapping[VsKey, KernelService] | None = None,
                 applies: bool = False) -> None:
        self.applies = applies
        self.calls = self.writes = 0
        self.ops: list[str] = []
        self.held: Mapping[VsKey, KernelService] = dict(held or {})
        self.asked: list[list[VsKey]] = []  # by `missing` (the table sampler)
        self.counted: dict[VsKey, Counted] = {}
        self.dest_counted: dict[VsKey, dict[RsKey, Counted]] = {}
        self.dumps: list[VsKey | None] = []  # statistics dumps: None for the services'

    @classmethod
    def holding(cls, keys: Iterable[VsKey]) -> FakeIpvs:
        """A table holding `keys`, round robin, no real servers."""
        return cls({k: KernelService(k, "rr", 0, 0) for k in keys})

    def apply_many(self, ops: Sequence[Op]) -> list[int]:
        self.calls += 1
        self.writes += len(ops)
        self.ops += [str(op) for op in ops]
        if self.applies:
            for op in ops:
                self._apply(op)
        return [0] * len(ops)

    def _apply(self, op: Op) -> None:
        held = dict(self.held)
        if op.service is not None:  # add or edit: the real servers stay
            s = op.service
            dests = held[op.vs].dests if op.vs in held else {}
            held[op.vs] = KernelService(op.vs, s.scheduler, s.flags, s.timeout, dests)
        elif op.rs is None:
            held.pop(op.vs, None)
        else:
            old = held[op.vs]
            dests = dict(old.dests)
            if op.kind.value == "del-dest":
                dests.pop(op.rs)
            elif op.kind.value == "add-dest":
                assert op.rs not in dests, f"{op}: EEXIST"
                dests = {op.rs: KernelDest(op.weight), **dests}
            else:
                dests[op.rs] = KernelDest(op.weight)
            held[op.vs] = KernelService(old.key, old.scheduler, old.flags, old.timeout, dests)
        self.held = held

    def services(self) -> dict[VsKey, KernelService]:
        return dict(self.held)

    def service_keys(self) -> dict[VsKey, KernelService]:
        return dict(self.held)

    def missing(self, keys: Sequence[VsKey]) -> list[VsKey]:
        self.asked.append(list(keys))
        return [k for k in keys if k not in self.held]

    def service_stats(self) -> dict[RawVsKey, Counted]:
        self.dumps.append(None)
        return {raw_key(k): c for k, c in self.counted.items()}

    def dest_stats(self, key: VsKey) -> dict[RsKey, Counted]:
        self.dumps.append(key)
        return dict(self.dest_counted.get(key, {}))

    def dests(self, key: VsKey) -> dict[RsKey, KernelDest]:
        held = self.held[key].dests
        return {rs: KernelDest(d.weight, active=1) for rs, d in held.items()}

    def close(self) -> None:
        pass


class FakeLinks:
    """The links: our dummy interface (DUMMY_INDEX, up) and `table`, every address on
    the node as (interface index, address); kube-proxy's kube-ipvs0 at `kube_ipvs0`
    (None: not there)."""

    calls = 0
    port_id = 0

    def __init__(self, table: Sequence[tuple[int, IPAddress]] = ((1, NODE_ADDRESS),),
                 kube_ipvs0: int | None = None) -> None:
        self.table = list(table)
        self.kube_ipvs0 = kube_ipvs0

    def ensure(self) -> int:
        return DUMMY_INDEX

    def index(self, name: str | None = None) -> int | None:
        return self.kube_ipvs0 if name == KUBE_IPVS_INTERFACE else None

    def address_table(self) -> list[tuple[int, IPAddress]]:
        return list(self.table)

    def change(self, index: int, add: Sequence[IPAddress],
               remove: Sequence[IPAddress]) -> list[int]:
        return [0] * (len(add) + len(remove))

    def close(self) -> None:
        pass


class FakeIpsets:
    """`ipset restore` lines as the plane sent them; no set holds anything."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def restore(self, text: str) -> None:
        self.lines += text.splitlines()

    def save(self, name: str) -> str:
        return ""

    def names(self) -> list[str]:
        return []


def on_fakes(options: DataplaneOptions, ipvs: FakeIpvs | None = None,
             links: FakeLinks | None = None, ipsets: FakeIpsets | None = None
             ) -> IpvsDataPlane:
    """An IPVS plane whose kernel handles are these fakes (no iptables runners: the
    iptables side is netfilter.py's, tested on its own), for this thread."""
    dp = IpvsDataPlane(options)
    handles = KernelHandles(cast(Any, ipvs or FakeIpvs()), cast(Any, links or FakeLinks()),
                            cast(Any, ipsets or FakeIpsets()), {}, threading.get_ident())
    dp._h = handles
    return dp
