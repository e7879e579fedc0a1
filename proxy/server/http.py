"""The agent's two HTTP servers (aiohttp).

- health (default 0.0.0.0:10256): `/healthz` and `/livez`, kube-proxy's meaning and
  JSON body (see proxy/server/health.py), for probes and cloud load balancers;
- metrics (default 127.0.0.1:10249): `/metrics` (Prometheus text) and `/debug/dump`
  (JSON; `?service=ns/name` narrows it). Local by default: the dump shows the cluster;
  `--debug-dump=false` turns the dump off and leaves /metrics (docs/security.md).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import Counter

from proxy.server.health import HealthStatus, ProxyHealth, go_time
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
        return _health_answer(st, st.ready, metrics.healthz, f', "nodeEligible": {eligible}')

    async def livez(_: web.Request) -> web.Response:
        st = health.status()
        return _health_answer(st, st.healthy, metrics.livez)

    app = web.Application()
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/livez", livez)
    return app


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


def metrics_app(metrics: AgentMetrics, source: DumpSource | None) -> web.Application:
    """`source` None: /debug/dump answers 404 and says why (--debug-dump=false)."""
    async def serve_metrics(_: web.Request) -> web.Response:
        return web.Response(body=metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def dump(request: web.Request) -> web.Response:
        if source is None:
            return web.json_response({"error": DUMP_DISABLED}, status=404)
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


async def serve(app: web.Application, host: str, port: int) -> web.AppRunner:
    """Start `app` on host:port; the caller cleans the runner up."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0)
    await runner.setup()
    site = web.TCPSite(runner, host, port, reuse_address=True)
    try:
        await site.start()
    except OSError:
        await runner.cleanup()
        raise
    return runner


