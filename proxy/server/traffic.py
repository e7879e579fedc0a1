"""Each service port's traffic as the kernel counted it (dataplane/common/traffic.py),
shown: the dump's `traffic` field (and so explain's and the terminal view's) and the
`/metrics` series; `TrafficReading` holds the last reading the agent took.

Cardinality is the operator's: one series per service port always, one per endpoint
only for ports counted per endpoint (--traffic-per-endpoint, or the service's
sliceproxy.io/traffic-per-endpoint annotation). `TrafficReading.refresh` takes a new
reading from the data plane; the rest is pure.

A reading costs what asking the kernel for each of our counters costs, in nftables mode
(dataplane/nftables/counters.py: by name, linear) 1.2-1.4 s at 100,000 services in
process, its rests not counted, a third of it the kernel's (a dump of them all, which
the kernel walks again for each message it fills, took 2.9-4.3 s).
In that mode the reading runs on a thread of its own (DataPlane.traffic_reader): the
data plane's thread only hands it the ports to read, and a change does not wait for
the reading, which instead waits for a change's sync at its pauses, and rests there as
long as it worked (dataplane/common/priority.py: half of a core at most). It still costs
CPU, so after a reading of READ_FREE or longer, the next is taken no sooner than
READ_SPACING times its length (~3% of a core: at 10,000 services every ~3.5 s, at
100,000 about once a minute), the scrapes between answering with the last
reading; shorter ones (a small node's) are taken at every scrape. One reading at
a time: a scrape during one waits for it, at most its timeout, and a reading that
outlasts that goes on and is kept when it ends.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from proxy.dataplane.base import Counted, Packed, PortTraffic, packed_ports, unpacked
from proxy.model.types import ServicePortKey, format_endpoint

log = logging.getLogger(__name__)
READ_SPACING = 15.0  # times a reading's length, half of it rests (READING_SHARE)
READ_FREE = 0.1  # seconds


Read = Callable[[], Awaitable[tuple[Mapping[ServicePortKey, PortTraffic], float]]]


@dataclass
class TrafficReading:
    """The last reading the agent took, by service port."""

    ports: Mapping[ServicePortKey, PortTraffic] = field(default_factory=dict)
    clock: Callable[[], float] = time.monotonic
    not_before: float = 0.0  # no new reading before then (READ_SPACING)
    _taking: asyncio.Future[None] | None = field(default=None, repr=False)
    _series: tuple[bytes, ...] | None = field(default=None, repr=False)  # series_text

    def update(self, ports: Mapping[ServicePortKey, PortTraffic],
               series: tuple[bytes, ...] | None = None) -> None:
        self.ports, self._series = ports, series

    def series(self) -> tuple[bytes, ...]:
        """`series_text` of the last reading, made once per reading (0.25 s at 100,000
        ports: on the event loop at every scrape, it held each change meanwhile)."""
        if self._series is None:
            self._series = series_text(self.ports)
        return self._series

    async def refresh(self, read: Read, timeout: float) -> None:
        """Wait up to `timeout` for a reading by `read` (the reading and the seconds it
        took): the one under way, else a new one unless the last was too recent for its
        cost (module docstring). One that takes longer goes on, and is kept when it
        ends: a scrape meanwhile serves the last reading and starts no other (at 100,000
        ports a reading outlasts a scrape's wait, and each scrape began one more). One
        that fails (logged) leaves the last reading in place."""
        if self._taking is None or self._taking.done():
            now = self.clock()
            if now < self.not_before:
                return
            self._taking = asyncio.ensure_future(self._take(read, now))
        try:
            await asyncio.wait_for(asyncio.shield(self._taking), timeout)
        except TimeoutError:
            log.debug("traffic counters: the reading goes on, the last one served",
                      extra={"waited_seconds": timeout})

    async def _take(self, read: Read, began: float) -> None:
        try:
            ports, seconds = await read()
        except Exception as exc:
            log.warning("reading the traffic counters failed", extra={"error": str(exc)})
            return
        # Its text made off the event loop too, while the last reading is still served.
        self.update(ports, await asyncio.to_thread(series_text, ports))
        self.not_before = began + READ_SPACING * seconds if seconds >= READ_FREE else began


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


PART_LINES = 2000  # ~200 KB of text, ~0.5 ms to join and encode
OFFER_EVERY = 200  # ports, ~0.5 ms of Python


def series_text(ports: Mapping[ServicePortKey, PortTraffic]) -> tuple[bytes, ...]:
    """sliceproxy_service_{connections,packets,bytes}_total by service port and
    sliceproxy_endpoint_*_total by endpoint, from a reading's `ports`, as Prometheus text
    in parts of at most PART_LINES lines (joined, the whole text). Written here rather
    than through prometheus_client's collectors: 10,000 ports took 70 ms there, a
    scrape's whole budget. Made off the event loop (0.25 s at 100,000 ports), it offers
    the interpreter's lock between parts: 10 MB joined and encoded at once held it for
    20-40 ms, and each change on the loop or the data plane's thread waited for it."""
    out: dict[tuple[str, str], list[str]] = {(scope, what): [] for scope in SCOPES
                                             for what in _HELP}
    connections = out["service", "connections"]
    for i, (key, total, endpoints) in enumerate(packed_ports(ports)):
        labels = (f'namespace="{_escape(key.namespace)}",service="{_escape(key.name)}",'
                  f'port="{_escape(key.port)}",family="{key.family.label}"')
        if isinstance(total, int):  # connections only: most ports, most modes
            connections.append(f"{labels}}} {total}")
        else:
            _samples(out, "service", labels, total)
        for (address, port), c in (endpoints or {}).items():
            _samples(out, "endpoint", f'{labels},endpoint="{format_endpoint(address, port)}"',
                     c)
        if i % OFFER_EVERY == OFFER_EVERY - 1:
            time.sleep(0)
    parts = []
    for (scope, what), samples in out.items():
        if not samples and what != "connections":  # packets and bytes: IPVS only
            continue
        name = f"sliceproxy_{scope}_{what}_total"
        head = f"# HELP {name} {_HELP[what].format(SCOPES[scope])}\n# TYPE {name} counter\n"
        for at in range(0, max(len(samples), 1), PART_LINES):
            lines = "".join(f"{name}{{{s}\n" for s in samples[at:at + PART_LINES])
            parts.append(((head if at == 0 else "") + lines).encode())
            time.sleep(0)  # offers the lock (see above)
    return tuple(parts)


SCOPES = {"service": "service port", "endpoint": "endpoint"}


def _samples(out: dict[tuple[str, str], list[str]], scope: str, labels: str,
             p: Packed) -> None:
    connections, packets, bytes_ = unpacked(p)
    out[scope, "connections"].append(f"{labels}}} {connections}")
    if packets is not None:
        out[scope, "packets"].append(f"{labels}}} {packets}")
    if bytes_ is not None:
        out[scope, "bytes"].append(f"{labels}}} {bytes_}")


def _escape(value: str) -> str:
    """A label value as Prometheus' text format quotes it."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
