"""The agent's two HTTP servers (aiohttp).

- health (default 0.0.0.0:10256): `/healthz` and `/livez`, kube-proxy's meaning and
  JSON body (see proxy/server/health.py), for probes and cloud load balancers;
- metrics (default 127.0.0.1:10249): `/metrics` (Prometheus text) and `/debug/dump`
  (JSON; `?service=ns/name` narrows it). The dump shows the whole cluster, so by
  default (`--debug-dump=local`) it answers only clients connecting from a loopback
  address, wherever the server listens; `true` serves it to every client, `false`
  turns it off; /metrics is served to all (docs/security.md).

Where they listen is kube-proxy's: an unspecified address (0.0.0.0 or ::) means both
families, as Go's listener makes it (one AF_INET6 socket with IPV6_V6ONLY off), or IPv4
alone where the node has no IPv6; a specific address means exactly that address.
"""

from __future__ import annotations

import json
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import Counter

from proxy.server.health import ForeignProxy, HealthStatus, ProxyHealth, go_time
from proxy.server.metrics import CONTENT_TYPE, AgentMetrics

log = logging.getLogger(__name__)

# Exactly upstream's headers (no charset parameter).
JSON_HEADERS = {"Content-Type": "application/json", "X-Content-Type-Options": "nosniff"}


class DumpSource(Protocol):
    async def debug_dump(self, service: str | None) -> dict[str, Any]: ...


def health_app(health: ProxyHealth, metrics: AgentMetrics) -> web.Application:
    async def healthz(_: web.Request) -> web.Response:
        st = health.status()
        eligible = "true" if st.node_eligible else "false"
        more = f', "nodeEligible": {eligible}' + _foreign(health.foreign_proxies)
        return _health_answer(st, st.ready, metrics.healthz, more)

    async def livez(_: web.Request) -> web.Response:
        st = health.status()
        return _health_answer(st, st.healthy, metrics.livez)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    return app


def _foreign(proxies: tuple[ForeignProxy, ...]) -> str:
    """`foreignProxies` for /healthz's body, only while one is seen (so a node in its
    usual state answers exactly upstream's body); never changes the code (health.py)."""
    if not proxies:
        return ""
    shown = [{"name": p.name, "since": go_time(p.since), "lastWrite": go_time(p.last_write),
              "objects": list(p.objects)} for p in proxies]
    return f', "foreignProxies": {json.dumps(shown)}'


def _health_answer(st: HealthStatus, ok: bool, answers: Counter, more: str = "",
                   ) -> web.Response:
    """Upstream's body for /healthz and /livez (`more`: fields after currentTime), 200
    when `ok`, else 503; counted in `answers` by code."""
    code = 200 if ok else 503
    answers.labels(str(code)).inc()
    # Upstream reports lastUpdated = currentTime while healthy (older clients read it
    # as "the last time the sync loop ran").
    last = st.current_time if ok else st.last_updated
    text = (f'{{"lastUpdated": {json.dumps(go_time(last))},'
            f'"currentTime": {json.dumps(go_time(st.current_time))}{more}}}')
    return web.Response(body=text.encode(), status=code, headers=JSON_HEADERS)


DUMP_DISABLED = "the debug dump is disabled (--debug-dump=false)"
DUMP_LOCAL_ONLY = (
    "the debug dump answers only clients on this node's loopback addresses "
    "(--debug-dump=local, the default): ask from the node (python -m proxy dump, or "
    "kubectl port-forward to the agent's pod), or set --debug-dump=true to serve it to "
    "every client that reaches --metrics-bind-address")


def metrics_app(metrics: AgentMetrics, source: DumpSource | None, *,
                loopback_only: bool = True,
                refresh: Callable[[], Awaitable[None]] | None = None) -> web.Application:
    """`source` None: /debug/dump answers 404 and says why (--debug-dump=false);
    `loopback_only`: it answers 403 to a client that is not on a loopback address;
    `refresh`: what a scrape awaits first (the kernel's traffic counters read)."""
    async def serve_metrics(request: web.Request) -> web.StreamResponse:
        if refresh is not None:
            await refresh()
        parts = metrics.render_parts()
        response = web.StreamResponse(headers={"Content-Type": CONTENT_TYPE})
        response.content_length = sum(map(len, parts))
        try:
            await response.prepare(request)
            for part in parts:  # each write waits while the client is behind (~200 KB)
                await response.write(part)
            await response.write_eof()
        except ConnectionResetError:
            # A scraper that gave up (its scrape_timeout passed while a reading was
            # awaited): not the agent's error, and aiohttp logged each with a traceback.
            log.debug("the scraper went away before its answer was written",
                      extra={"client": peer_address(request)})
        return response

    async def dump(request: web.Request) -> web.Response:
        if source is None:
            return web.json_response({"error": DUMP_DISABLED}, status=404)
        if loopback_only:
            client = peer_address(request)
            if client is None or not is_loopback(client):
                return web.json_response({"error": DUMP_LOCAL_ONLY, "client": client},
                                         status=403)
        service = request.query.get("service") or None
        if service is not None and service.count("/") != 1:
            return web.json_response(
                {"error": f"service must be NAMESPACE/NAME, got {service!r}"}, status=400)
        doc = await source.debug_dump(service)
        return web.Response(text=json.dumps(doc, indent=1) + "\n",
                            content_type="application/json")

    app = web.Application()
    app.router.add_get("/metrics", serve_metrics)
    app.router.add_get("/debug/dump", dump)
    return app


def peer_address(request: web.Request) -> str | None:
    """The connecting client's address, from the socket (never from headers)."""
    peer = request.transport.get_extra_info("peername") if request.transport else None
    return str(peer[0]) if isinstance(peer, tuple) and peer else None


def is_loopback(address: str) -> bool:
    """127.0.0.0/8 or ::1, also as a dual-stack socket shows IPv4 (::ffff:127.0.0.1)."""
    try:
        ip = ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped.is_loopback
    return ip.is_loopback


# --- where a server listens -------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Listening:
    """What a server really listens on, for the log and the caller."""
    address: str  # host:port as bound ("[::]:10256")
    families: str  # "IPv4 and IPv6", "IPv4" or "IPv6"
    ipv6_missing: str | None = None  # why an unspecified address got IPv4 alone

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])


def ipv6_missing() -> str | None:
    """Why this network namespace cannot serve IPv6, or None if it can. Go's own probe:
    an AF_INET6 socket bound to ::1, which fails without IPv6 in the kernel
    (EAFNOSUPPORT) or with it disabled here (disable_ipv6: ::1 is gone, EADDRNOTAVAIL)."""
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            probe.bind(("::1", 0))
    except OSError as exc:
        return exc.strerror or str(exc)
    return None


def _bound(family: socket.AddressFamily, host: str, port: int, v6only: bool) -> socket.socket:
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, int(v6only))
        sock.bind((host, port))
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def listen_socket(host: str, port: int) -> tuple[socket.socket, Listening]:
    """A bound socket for host:port as kube-proxy's Go listener takes it: 0.0.0.0 or ::
    is every address of both families (one socket: IPv4 clients appear as
    ::ffff:a.b.c.d) where this namespace has IPv6, else of IPv4 alone; any other address
    is that address only. Raises OSError (address in use, not a local address)."""
    ip = ip_address(host)
    if ip.is_unspecified:
        missing = ipv6_missing()
        if missing is None:
            sock = _bound(socket.AF_INET6, "::", port, v6only=False)
            return sock, Listening(_shown(sock), "IPv4 and IPv6")
        sock = _bound(socket.AF_INET, "0.0.0.0", port, v6only=False)
        return sock, Listening(_shown(sock), "IPv4", missing)
    if isinstance(ip, IPv4Address):
        sock = _bound(socket.AF_INET, host, port, v6only=False)
        return sock, Listening(_shown(sock), "IPv4")
    sock = _bound(socket.AF_INET6, host, port, v6only=True)
    return sock, Listening(_shown(sock), "IPv6")


def _shown(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"[{host}]:{port}" if sock.family == socket.AF_INET6 else f"{host}:{port}"


async def serve(app: web.Application, host: str, port: int,
                ) -> tuple[web.AppRunner, Listening]:
    """Start `app` on host:port (listen_socket); the caller cleans the runner up."""
    sock, listening = listen_socket(host, port)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    try:
        await runner.setup()
        await web.SockSite(runner, sock).start()
    except BaseException:
        await runner.cleanup()
        sock.close()
        raise
    return runner, listening
