"""The IPVS benchmark's workload, and kernel tables in a form both clients can be compared
in (pure; bench/ipvs/run.py explains the benchmark).

N TCP virtual servers, each with M masqueraded real servers at weight 1, scheduler rr,
with exactly the addresses `bench.common.make_objects` gives its services and
endpoints (service i: SERVICE_BASE + i, port 80; its endpoints POD_BASE + i*M + j, port
8080). So the raw clients and the whole IPVS data plane, fed that model, must build the
very same table, and the benchmark checks that they do.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from typing import Any

from bench.common import POD_BASE, SERVICE_BASE
from proxy.dataplane.ipvs.diff import FWD_MASQ
from proxy.dataplane.ipvs.render import WEIGHT, RsKey, VirtualServer, VsKey, VsKind
from proxy.model.types import Protocol

SCHEDULER = "rr"
SERVICE_PORT = 80
TARGET_PORT = 8080
# The real server an update adds and removes again: outside both address ranges above.
SPARE = RsKey(IPv4Address("198.18.127.1"), TARGET_PORT)
# make_objects wraps service addresses at 32,768 and endpoint addresses at 65,536; past
# that, two services would share an address and the table would not be N x M.
MAX_SERVICES = 32_768
MAX_REAL_SERVERS = 65_536


@dataclass(frozen=True, slots=True)
class Workload:
    services: int
    endpoints: int  # real servers per virtual server

    def __post_init__(self) -> None:
        if not 1 <= self.services <= MAX_SERVICES:
            raise ValueError(f"services must be 1..{MAX_SERVICES}, not {self.services}")
        if self.endpoints < 1 or self.services * self.endpoints > MAX_REAL_SERVERS:
            raise ValueError(f"endpoints must be at least 1, and services x endpoints at "
                             f"most {MAX_REAL_SERVERS} (got {self.services} x {self.endpoints})")

    @property
    def objects(self) -> int:
        """Virtual plus real servers: one request each to program them one by one."""
        return self.services * (self.endpoints + 1)

    def virtual_servers(self) -> list[VirtualServer]:
        return [
            VirtualServer(
                key=VsKey(Protocol.TCP, SERVICE_BASE + i, SERVICE_PORT),
                kind=VsKind.CLUSTER_IP,
                scheduler=SCHEDULER,
                flags=0,
                timeout=0,
                real_servers=tuple(RsKey(POD_BASE + i * self.endpoints + j, TARGET_PORT)
                                   for j in range(self.endpoints)),
                endpoint_set="cluster",
            )
            for i in range(self.services)
        ]

    def addresses(self) -> list[IPv4Address]:
        """The service addresses, as the data plane puts them on its dummy interface."""
        return [SERVICE_BASE + i for i in range(self.services)]

    def update_target(self) -> tuple[VsKey, RsKey]:
        """The virtual server an update changes (one in the middle) and the real server
        it swaps with SPARE."""
        vs = self.virtual_servers()[self.services // 2]
        return vs.key, vs.real_servers[0]

    def expected(self) -> Table:
        return {str(vs.key): Service(SCHEDULER, 0, 0, {str(rs): Dest(FWD_MASQ, WEIGHT)
                                                      for rs in vs.real_servers})
                for vs in self.virtual_servers()}


@dataclass(frozen=True, slots=True)
class Dest:
    fwd_method: int
    weight: int


@dataclass(frozen=True, slots=True)
class Service:
    scheduler: str
    flags: int  # without the kernel's "hashed" bit
    timeout: int
    dests: dict[str, Dest] = field(default_factory=dict)  # "ip:port" -> Dest


Table = dict[str, Service]  # "TCP ip:port" -> Service


def digest(table: Table) -> str:
    """A short fingerprint of a table, to show in the results that tables were equal."""
    text = "\n".join(
        f"{key} {s.scheduler} {s.flags} {s.timeout} "
        + " ".join(f"{rs}/{d.fwd_method}/{d.weight}" for rs, d in sorted(s.dests.items()))
        for key, s in sorted(table.items()))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differences(got: Table, want: Table, limit: int = 3) -> list[str]:
    """The first few virtual servers on which two tables differ, for an error message."""
    out = []
    for key in sorted(set(got) | set(want)):
        if got.get(key) != want.get(key):
            out.append(f"{key}: got {got.get(key)}, want {want.get(key)}")
            if len(out) == limit:
                break
    return out


def summary(samples: list[float]) -> dict[str, Any]:
    """Median, min and max seconds of a list of timings, their number, and the timings in
    the order they were taken (to tell a one-off outlier from drift)."""
    return {"median_s": statistics.median(samples), "min_s": min(samples),
            "max_s": max(samples), "samples": len(samples),
            "all_s": [round(s, 6) for s in samples]}
