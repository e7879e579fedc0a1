"""Health-check node ports for `externalTrafficPolicy: Local` services.

Upstream (`pkg/proxy/healthcheck/service_health.go`): each such service with a
`healthCheckNodePort` gets an HTTP server on that port of the node. It answers 200 when
the node has at least one local *ready* endpoint for the service and the proxy itself
is healthy, 503 otherwise, so an external load balancer sends traffic only to nodes that
can serve it locally. A node whose only local endpoints are terminating answers 503
(they still get the traffic that reaches them, but the load balancer drains the node).

Servers open and close as services come and go; they listen on every node address, or
only those inside `--nodeport-addresses` when it is set (`primary` standing for the
node's primary addresses: all servers are opened again when those change).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import socket
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

from aiohttp import web

from proxy.model.nodeport_addresses import nodeport_cidrs
from proxy.model.snapshot import DesiredState
from proxy.model.types import IPAddress, IPNetwork, ServicePortKey, TrafficPolicy
from proxy.server.http import JSON_HEADERS

log = logging.getLogger(__name__)

ServiceRef = tuple[str, str]


def body(ref: ServiceRef, count: int, proxy_healthy: bool) -> str:
    return json.dumps({"service": {"namespace": ref[0], "name": ref[1]},
                       "localEndpoints": count, "serviceProxyHealthy": proxy_healthy},
                      indent="\t")


@dataclass(slots=True)
class _Instance:
    port: int
    servers: list[asyncio.base_events.Server] = field(default_factory=list)
    endpoints: int = 0


async def node_addresses(cidrs: Iterable[IPNetwork]) -> list[str]:
    """Addresses of this network namespace inside `cidrs` (for --nodeport-addresses)."""
    proc = await asyncio.create_subprocess_exec(
        "ip", "-j", "addr", "show", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL)
    out, _ = await proc.communicate()
    nets = list(cidrs)
    found: list[str] = []
    for link in json.loads(out or b"[]"):
        for info in link.get("addr_info", []):
            try:
                addr = ipaddress.ip_address(info.get("local", ""))
            except ValueError:
                continue
            if any(addr.version == n.version and addr in n for n in nets):
                found.append(str(addr))
    return found


class HealthCheckPorts:
    def __init__(self, proxy_healthy: Callable[[], bool],
                 nodeport_addresses: tuple[IPNetwork, ...] = (),
                 nodeport_primary: bool = False) -> None:
        self._proxy_healthy = proxy_healthy
        self._given, self._primary = nodeport_addresses, nodeport_primary
        self._cidrs = nodeport_cidrs(nodeport_addresses, nodeport_primary, ())
        self._services: dict[ServiceRef, _Instance] = {}
        self._lock = asyncio.Lock()

    @property
    def open_ports(self) -> dict[ServiceRef, int]:
        return {ref: inst.port for ref, inst in self._services.items()}

    def _handler(self, ref: ServiceRef) -> Callable[[web.BaseRequest], object]:
        async def handle(request: web.BaseRequest) -> web.StreamResponse:
            inst = self._services.get(ref)
            count = inst.endpoints if inst is not None else 0
            healthy = self._proxy_healthy()
            status = 200 if count and healthy else 503
            return web.Response(body=body(ref, count, healthy).encode(), status=status,
                                headers=JSON_HEADERS)
        return handle

    async def _open(self, ref: ServiceRef, port: int) -> _Instance:
        inst = _Instance(port)
        loop = asyncio.get_running_loop()
        server = web.Server(self._handler(ref), access_log=None)  # type: ignore[arg-type]
        hosts: list[str | None] = [None]
        if self._cidrs:
            hosts = list(await node_addresses(self._cidrs))
        try:
            for host in hosts:
                inst.servers.append(await loop.create_server(
                    server, host, port, reuse_address=True, family=socket.AF_UNSPEC))
        except OSError:
            await self._close(inst)
            raise
        return inst

    @staticmethod
    async def _close(inst: _Instance) -> None:
        for srv in inst.servers:
            srv.close()
        for srv in inst.servers:
            await srv.wait_closed()
        inst.servers.clear()

    async def update(self, wanted: Mapping[ServiceRef, int],
                     counts: Mapping[ServiceRef, int],
                     primary_ips: tuple[IPAddress, ...] = ()) -> None:
        """Open and close servers to match `wanted`, on the addresses --nodeport-addresses
        selects (`primary_ips`: the node's primary addresses); set the local endpoint
        counts."""
        async with self._lock:
            cidrs = nodeport_cidrs(self._given, self._primary, primary_ips)
            moved, self._cidrs = cidrs != self._cidrs, cidrs
            for ref, inst in list(self._services.items()):
                if moved or wanted.get(ref) != inst.port:
                    log.info("closing health check node port",
                            extra={"service": f"{ref[0]}/{ref[1]}", "port": inst.port})
                    del self._services[ref]
                    await self._close(inst)
            for ref, port in wanted.items():
                if ref in self._services:
                    continue
                try:
                    self._services[ref] = await self._open(ref, port)
                except OSError as exc:
                    # As upstream: log and carry on; the next update tries again.
                    log.error("cannot open health check node port",
                              extra={"service": f"{ref[0]}/{ref[1]}", "port": port,
                                     "error": str(exc)})
                    continue
                log.info("opened health check node port",
                         extra={"service": f"{ref[0]}/{ref[1]}", "port": port})
            for ref, inst in self._services.items():
                inst.endpoints = counts.get(ref, 0)

    async def close(self) -> None:
        async with self._lock:
            for inst in self._services.values():
                await self._close(inst)
            self._services.clear()


class LocalEndpointTracker:
    """Which services need a health-check node port and how many local ready endpoints
    each has, kept up to date from the service ports each sync changed (recounting
    every endpoint of every service after every sync would cost ~50 ms at 10,000
    services)."""

    def __init__(self, node_name: str) -> None:
        self.node_name = node_name
        self._port: dict[ServicePortKey, tuple[int, frozenset[str]]] = {}
        self._by_ref: dict[ServiceRef, set[ServicePortKey]] = {}
        self._wanted: dict[ServiceRef, int] = {}
        self._counts: dict[ServiceRef, int] = {}

    def update(self, state: DesiredState, keys: Iterable[ServicePortKey]) -> bool:
        """Take the new state of `keys`; True if any port or count changed."""
        touched: set[ServiceRef] = set()
        local_policy, ports = TrafficPolicy.LOCAL, self._port
        for key in keys:
            rsp = state.get(key)
            svc = rsp.service if rsp is not None else None
            hc = svc.health_check_node_port if svc is not None and (
                svc.external_traffic_policy is local_policy) else 0
            if not hc:
                # Only ports with a health-check port are kept (a set per service here
                # was 0.5 KB a service at 100,000 services), and only they need the
                # count: walking every endpoint of every service took 1.1 s of the first
                # sync at 10,000 services x 10. A port without one that had none changes
                # nothing (most ports: 0.23 s of the event loop at 100,000 otherwise).
                if ports.pop(key, None) is not None:
                    ref = (key.namespace, key.name)
                    touched.add(ref)
                    if (group := self._by_ref.get(ref)) is not None:
                        group.discard(key)
                continue
            ref = (key.namespace, key.name)
            touched.add(ref)
            assert rsp is not None
            local = frozenset(str(s.endpoint) for s in rsp.endpoints
                              if s.ready and s.node_name == self.node_name)
            self._port[key] = (hc, local)
            self._by_ref.setdefault(ref, set()).add(key)
        changed = False
        for ref in touched:
            group = self._by_ref.get(ref) or set()
            hc = max((self._port[k][0] for k in group), default=0)
            count = len(set().union(*(self._port[k][1] for k in group))) if group else 0
            if not group:
                self._by_ref.pop(ref, None)
            before = (self._wanted.get(ref), self._counts.get(ref))
            if hc:
                self._wanted[ref], self._counts[ref] = hc, count
            else:
                self._wanted.pop(ref, None)
                self._counts.pop(ref, None)
            changed |= before != (self._wanted.get(ref), self._counts.get(ref))
        return changed

    def wanted(self) -> dict[ServiceRef, int]:
        return dict(self._wanted)

    def counts(self) -> dict[ServiceRef, int]:
        return dict(self._counts)
