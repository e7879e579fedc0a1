"""The run's settings, the cluster's objects and the pod addresses the writes use."""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Network, ip_address
from typing import Any

from bench.common import PACINGS, POD_CIDR_V6, single_stack_v6

NODE = "node-a"
NAMESPACE = "default"
POD_PORT = 8080
POD_CIDR = "198.19.0.0/16"  # the agent's --cluster-cidr
# Issue 29's sync pacing: "old" is the fixed-rate runner set explicitly (upstream's 1 s),
# "new" passes no pacing flag, so it measures the agent's default, whatever it is.
PHASES = ("isolated", "random", "burst")
FIRST_SYNC = re.compile(r"first sync done")
Obj = dict[str, Any]


@dataclass(frozen=True)
class Settings:
    services: int = 10_000
    endpoints: int = 3  # per service, one slice each
    pacing: tuple[str, ...] = ("old", "new")
    phases: tuple[str, ...] = PHASES
    isolated: int = 30  # changes, one at a time
    spacing: float = 1.0  # seconds from one isolated change seen to the next
    rates: tuple[float, ...] = (10.0, 100.0, 1000.0)  # random churn, writes a second
    duration: float = 20.0  # seconds of random churn at each rate
    burst: int = 1000  # services created at once
    gap: float = 2.0  # quiet seconds between phases
    settle: float = 60.0  # a phase's last write -> every change seen, at most
    start_timeout: float = 600.0
    seed: int = 29
    ipv6: bool = False  # a single-stack IPv6 cluster instead of IPv4
    restart: bool = False  # the phases run against an agent restarted over its tables
    # The agent's --sync-period, in seconds (None: its default hour): a periodic resync
    # during the phases, the changes meanwhile measured as any.
    resync: float | None = None

    @property
    def family(self) -> str:
        return "IPv6" if self.ipv6 else "IPv4"

    def pool(self) -> AddressPool:
        return AddressPool6() if self.ipv6 else AddressPool()

    def check(self) -> None:
        if self.services < 1 or self.endpoints < 1:
            raise ValueError("--services and --endpoints must be positive")
        if not self.pacing or not set(self.pacing) <= set(PACINGS):
            raise ValueError(f"--pacing: one or more of {sorted(PACINGS)}")
        if not set(self.phases) <= set(PHASES):
            raise ValueError(f"--phases: some of {PHASES}")
        if self.resync is not None and self.resync <= 0:
            raise ValueError("--resync must be positive")
        if any(r <= 0 for r in self.rates) or self.duration <= 0:
            raise ValueError("--rates and --duration must be positive")
        wanted = (self.services + self.burst) * self.endpoints
        size = self.pool().SIZE  # IPv6's /64: never short
        if wanted > size // 2:  # half left free for the writes to cycle
            more = "" if self.ipv6 else " (--ipv6 for more)"
            raise ValueError(f"at most {size // 2:,} endpoints{more}")


class AddressPool:
    """Pod addresses, 198.19.0.0/16 then 198.18.4.0-198.18.127.255 (clear of the lab's
    198.18.0-1.x and the simulator's services, 198.18.128.0/17): 97,280. Each write takes
    a fresh one, and an address a write replaced goes to the back of the queue, so it
    is reused only tens of thousands of writes later: a write is known in the kernel by
    its new address, which no pending write shares."""

    SIZE = 65_536 + 124 * 256
    ADDRESS_TYPE = "IPv4"  # the slices'
    _SPILL = IPv4Address("198.18.4.0")

    def __init__(self) -> None:
        # Never-taken addresses in order, then the given-back ones: as a queue of
        # range(SIZE) would, without holding an IPv6 pool's millions up front.
        self._fresh = 0
        self._free: collections.deque[int] = collections.deque()

    @classmethod
    def address(cls, k: int) -> str:
        return str(IPv4Address("198.19.0.0") + k if k < 65_536 else cls._SPILL + k - 65_536)

    @classmethod
    def packed(cls, k: int) -> bytes:
        return ip_address(cls.address(k)).packed

    def take(self) -> int:
        if self._fresh < self.SIZE:
            self._fresh += 1
            return self._fresh - 1
        return self._free.popleft()

    def give_back(self, k: int) -> None:
        self._free.append(k)


class AddressPool6(AddressPool):
    """Pod addresses from fd00:19::1 on, in the agent's --cluster-cidr fd00:19::/64 (as
    bench/agent_start.py's): one /64 holds more than any run writes, so no address is
    ever reused."""

    _NET = IPv6Network(POD_CIDR_V6)
    SIZE = _NET.num_addresses - 1
    ADDRESS_TYPE = "IPv6"

    @classmethod
    def address(cls, k: int) -> str:
        return str(cls._NET.network_address + 1 + k)


def service(name: str, ipv6: bool = False) -> Obj:
    """A ClusterIP service of one TCP port; the simulator gives it its address (an IPv6
    one only, with `ipv6`)."""
    svc: Obj = {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP",
                                    "targetPort": POD_PORT}]}}
    return single_stack_v6(svc) if ipv6 else svc


def endpoint_slice(pool: AddressPool, name: str, addresses: list[int],
                   rv: str | None = None) -> Obj:
    """The service's one slice, as the EndpointSlice controller writes it: `addresses`
    are `pool`'s, of its family."""
    meta: Obj = {"name": f"{name}-x1", "namespace": NAMESPACE,
                 "labels": {"kubernetes.io/service-name": name,
                            "endpointslice.kubernetes.io/managed-by":
                                "endpointslice-controller.k8s.io"}}
    if rv is not None:
        meta["resourceVersion"] = rv
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "metadata": meta,
            "addressType": pool.ADDRESS_TYPE,
            "endpoints": [{"addresses": [pool.address(k)],
                           "conditions": {"ready": True, "serving": True,
                                          "terminating": False},
                           "nodeName": f"node-{k % 50}"} for k in addresses],
            "ports": [{"name": "http", "port": POD_PORT, "protocol": "TCP"}]}
