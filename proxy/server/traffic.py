"""Each service port's traffic as the kernel counted it (dataplane/common/traffic.py),
shown: the dump's `traffic` field (and so explain's and the terminal view's) and the
`/metrics` series; `TrafficReading` holds the last reading the agent took.

Cardinality is the operator's: one series per service port always, one per endpoint
only for ports counted per endpoint (--traffic-per-endpoint, or the service's
sliceproxy.io/traffic-per-endpoint annotation). `TrafficReading.refresh` takes a new
reading from the data plane (on its thread); the rest is pure.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

from proxy.dataplane.base import Counted, PortTraffic
from proxy.model.types import ServicePortKey, format_endpoint

log = logging.getLogger(__name__)
PORT_LABELS = ["namespace", "service", "port", "family"]


@dataclass
class TrafficReading:
    """The last reading the agent took (`ports`), and when (monotonic seconds)."""

    ports: Mapping[ServicePortKey, PortTraffic] = field(default_factory=dict)
    taken: float | None = None

    def update(self, ports: Mapping[ServicePortKey, PortTraffic]) -> None:
        self.ports, self.taken = ports, time.monotonic()

    async def refresh(self, read: Callable[[], Awaitable[Mapping[ServicePortKey, PortTraffic]]],
                      timeout: float) -> None:
        """A new reading by `read` (the data plane's, on its thread); one that does not
        come within `timeout` (a long sync holds the thread) or fails (logged) leaves
        the last reading in place."""
        try:
            async with asyncio.timeout(timeout):
                self.update(await read())
        except TimeoutError:
            log.debug("traffic counters not read: the data plane is busy",
                      extra={"waited_seconds": timeout})
        except Exception as exc:
            log.warning("reading the traffic counters failed", extra={"error": str(exc)})


def _counted(c: Counted) -> dict[str, int]:
    out = {"connections": c.connections}
    if c.packets is not None:
        out["packets"] = c.packets
    if c.bytes is not None:
        out["bytes"] = c.bytes
    return out


def traffic_view(pt: PortTraffic | None) -> dict[str, Any] | None:
    """A port's traffic in the dump: totals, and by endpoint (`ip:port`, as the dump's
    endpoints are spelled) where counted per endpoint (else `endpoints` is null)."""
    if pt is None:
        return None
    endpoints = None if pt.endpoints is None else {
        format_endpoint(address, port): _counted(c)
        for (address, port), c in sorted(pt.endpoints.items(),
                                         key=lambda item: (item[0][0].version, item[0]))}
    return {**_counted(pt.total), "endpoints": endpoints}


_HELP = {
    "connections": "New connections (a UDP or SCTP flow is one) the node sent to the {}, "
                   "as the kernel counted them",
    "packets": "Packets of the {}'s connections, both ways (IPVS mode)",
    "bytes": "Bytes of the {}'s connections, both ways (IPVS mode)",
}


class TrafficCollector(Collector):
    """sliceproxy_service_{connections,packets,bytes}_total by service port and
    sliceproxy_endpoint_*_total by endpoint, from the last reading."""

    def __init__(self, reading: TrafficReading) -> None:
        self._reading = reading

    def collect(self) -> Iterator[Metric]:
        families = {(scope, what): CounterMetricFamily(
            f"sliceproxy_{scope}_{what}", _HELP[what].format(
                "service port" if scope == "service" else "endpoint"),
            labels=PORT_LABELS + (["endpoint"] if scope == "endpoint" else []))
            for scope in ("service", "endpoint") for what in _HELP}
        for key, pt in self._reading.ports.items():
            labels = [key.namespace, key.name, key.port, key.family.label]
            _add(families, "service", labels, pt.total)
            for (address, port), c in (pt.endpoints or {}).items():
                _add(families, "endpoint", [*labels, format_endpoint(address, port)], c)
        yield from families.values()


def _add(families: dict[tuple[str, str], CounterMetricFamily], scope: str,
         labels: list[str], c: Counted) -> None:
    families[scope, "connections"].add_metric(labels, c.connections)
    if c.packets is not None:
        families[scope, "packets"].add_metric(labels, c.packets)
    if c.bytes is not None:
        families[scope, "bytes"].add_metric(labels, c.bytes)
