"""Each service port's traffic, as the kernel counts it (pure; each mode reads its own
counters and `DataPlane.traffic` returns `PortTraffic` by service port).

What is counted is what the proxy decides: new connections (a UDP or SCTP flow is one),
per service port always and per endpoint where asked (`per_endpoint`: the service's
sliceproxy.io/traffic-per-endpoint annotation, else the node's --traffic-per-endpoint).
The counters live in the kernel, not in the agent, so they count while no agent runs,
and each mode keeps them where a rule rewrite or a restart would otherwise reset them:

- nftables: named counter objects (`counter name`), which a rule references; rewriting
  a chain, a full sync or a restart leaves them as they are. One per service port, at
  the top of its policy chains, and one per endpoint beside its DNAT where counted per
  endpoint. They go when the service port (or the endpoint) does.
- iptables: nfacct objects (`-m nfacct`), the same idea for xtables rules.
- IPVS: the kernel's own statistics of each virtual server and real server (packets
  and bytes too); a virtual server per frontend, so a port's total is their sum. The
  kernel publishes them every 2 s (a reading lags by up to that), and keeps a deleted
  real server aside for a while: one added again within about two minutes of its last
  connection comes back with its old counts (ipvs/traffic.py).

Totals therefore start when the port (or endpoint) is first programmed and end when it
is removed; a Prometheus counter reset is a port or an endpoint that went and came back.

A reading is kept until the next one as numbers the cyclic collector does not track
(base.py's `TrafficByPort`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import TypeVar

from proxy.dataplane.base import NOTHING, Counted, PortTraffic
from proxy.model.types import IPAddress, Service

K = TypeVar("K")


def per_endpoint(service: Service, default: bool) -> bool:
    """The service's annotation, else the node's --traffic-per-endpoint."""
    return default if service.traffic_per_endpoint is None else service.traffic_per_endpoint


def port_traffic(total: Counted | None,
                 endpoints: Iterable[tuple[tuple[IPAddress, int], Counted]] | None
                 ) -> PortTraffic:
    """A port's reading from its counters: `total`, else the sum of its endpoints'
    (a mode that counts only per endpoint); endpoints counted twice (two frontends,
    two counters) are added up."""
    by_endpoint: dict[tuple[IPAddress, int], Counted] | None = None
    if endpoints is not None:
        by_endpoint = {}
        for ep, counted in endpoints:
            by_endpoint[ep] = by_endpoint[ep] + counted if ep in by_endpoint else counted
    if total is None:
        total = _sum((by_endpoint or {}).values()) or NOTHING
    return PortTraffic(total, by_endpoint)


def summed(readings: Mapping[K, Counted], names: Iterable[K]) -> Counted | None:
    """The sum of the counters `names` found in `readings` (by name, or any key); None
    when none of them is there (not programmed yet, or removed by someone else)."""
    return _sum(readings[n] for n in names if n in readings)


def _sum(counts: Iterable[Counted]) -> Counted | None:
    """Their sum (packets and bytes only where every one has them); None for none."""
    total: Counted | None = None
    for counted in counts:
        total = counted if total is None else total + counted
    return total
