"""/debug/dump: exactly explain's per-service-port shape, plus applied rules and syncs."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any
from unittest import mock

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer, make_mocked_request

from proxy.cmd.explain import explain
from proxy.kube.ingest import EndpointsSource, apply_object
from proxy.kube.manifests import load_paths
from proxy.model.tracker import ClusterModel
from proxy.model.types import ServicePortKey
from proxy.model.view import service_port_view
from proxy.server.dump import build_dump
from proxy.server.http import DUMP_DISABLED, DUMP_LOCAL_ONLY, metrics_app
from proxy.server.metrics import AgentMetrics

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example_model() -> tuple[ClusterModel, list[dict[str, Any]]]:
    objects = load_paths([EXAMPLES])
    model = ClusterModel("node-a")
    for obj in objects:
        apply_object(model, obj)
    model.resolve()
    return model, objects


def dump(model: ClusterModel, service: str | None = None, applied: Any = None,
         note: str | None = None) -> dict[str, Any]:
    return build_dump(config={"proxy-mode": "iptables"}, model=model, applied=applied,
                      applied_note=note, syncs=[{"trigger": "initial"}],
                      health={"ready": True}, watch={"synced": True}, service=service)


def test_services_are_explains_shape_plus_applied_rules_and_traffic() -> None:
    model, objects = example_model()
    rules = {key: [f"rule for {key}"] for key in model.state.ports}
    doc = dump(model, applied=rules)
    assert set(doc) == {"config", "node", "health", "watch", "services", "skipped",
                        "skipped_summary", "syncs"}
    offline = explain(objects, node_name="node-a", node_labels={},
                      source=EndpointsSource.ENDPOINT_SLICES)
    assert doc["node"] == offline["node"]
    stripped = [{k: v for k, v in s.items() if k not in ("applied_rules", "traffic")}
                for s in doc["services"]]
    assert stripped == offline["services"]
    assert doc["skipped"] == offline["skipped"]
    for entry in doc["services"]:
        key = next(k for k in model.state.ports
                   if k.service == entry["service"] and k.port == entry["port"])
        assert entry["applied_rules"] == [f"rule for {key}"]
        shown = {k: v for k, v in entry.items() if k not in ("applied_rules", "traffic")}
        assert shown == service_port_view(model.state.ports[key])
        assert entry["traffic"] is None  # no reading given


def test_service_filter_and_busy_note() -> None:
    model, _ = example_model()
    doc = dump(model, service="demo/web", note="busy")
    assert {s["service"] for s in doc["services"]} == {"demo/web"}
    assert len(doc["services"]) == 2  # http and dns
    assert all(s["applied_rules"] is None for s in doc["services"])
    assert doc["applied_rules_note"] == "busy" and doc["filter"] == {"service": "demo/web"}
    assert dump(model, service="demo/nope")["services"] == []


class Source:
    def __init__(self, model: ClusterModel) -> None:
        self.model = model
        self.asked: list[str | None] = []

    async def debug_dump(self, service: str | None) -> dict[str, Any]:
        self.asked.append(service)
        applied = {k: ["x"] for k in self.model.state.ports}
        return dump(self.model, service, applied)


def test_http_endpoints() -> None:
    model, _ = example_model()
    source = Source(model)

    async def go() -> None:
        async with TestClient(TestServer(metrics_app(AgentMetrics(), source))) as client:
            resp = await client.get("/debug/dump?service=demo/nearby")
            assert resp.status == 200
            doc = json.loads(await resp.text())
            assert [s["service"] for s in doc["services"]] == ["demo/nearby"]
            resp = await client.get("/debug/dump?service=nearby")
            assert resp.status == 400 and "NAMESPACE/NAME" in await resp.text()
            resp = await client.get("/metrics")
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            assert "kubeproxy_sync_proxy_rules_duration_seconds" in await resp.text()

    asyncio.run(go())
    assert source.asked == ["demo/nearby"]


def test_keys_sort_by_service_then_port_then_family() -> None:
    model, _ = example_model()
    doc = dump(model)
    order = [(s["service"], s["port"]) for s in doc["services"]]
    assert order == sorted(order)
    assert ServicePortKey("demo", "web", "http", 4) in model.state.ports  # type: ignore[arg-type]


def test_dump_switched_off_answers_404_and_keeps_metrics() -> None:
    async def go() -> None:
        async with TestClient(TestServer(metrics_app(AgentMetrics(), None))) as client:
            resp = await client.get("/debug/dump")
            assert resp.status == 404
            assert json.loads(await resp.text()) == {"error": DUMP_DISABLED}
            assert "--debug-dump=false" in DUMP_DISABLED
            resp = await client.get("/metrics")
            assert resp.status == 200
            assert "kubeproxy_sync_proxy_rules_duration_seconds" in await resp.text()

    asyncio.run(go())


def test_agent_serves_the_dump_only_when_the_flag_allows() -> None:
    """The agent's own wiring: --debug-dump reaches the metrics server; a client on
    127.0.0.1 is local, so only `false` turns it away."""
    import socket

    from proxy.agent.app import Agent
    from proxy.config.options import parse_args

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
            return port

    async def status(flag: str) -> int:
        port = free_port()
        agent = Agent(parse_args(["--hostname-override", "node-a", flag,
                                  "--healthz-bind-address", "127.0.0.1:0",
                                  "--metrics-bind-address", f"127.0.0.1:{port}"]))
        try:
            await agent._start_http()
            async with aiohttp.ClientSession() as session:
                async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
                    assert resp.status == 200
                async with session.get(f"http://127.0.0.1:{port}/debug/dump") as resp:
                    return resp.status
        finally:
            await agent.shutdown()

    assert asyncio.run(status("--debug-dump=false")) == 404
    assert asyncio.run(status("--debug-dump=local")) == 200
    assert asyncio.run(status("--debug-dump=true")) == 200


def dump_status(app: web.Application, peer: tuple[Any, ...] | None) -> tuple[int, Any]:
    """What /debug/dump answers a client connecting from `peer` (the socket's address)."""
    transport = mock.Mock()
    transport.get_extra_info.side_effect = lambda key, default=None: (
        peer if key == "peername" else default)

    async def go() -> tuple[int, Any]:
        request = make_mocked_request("GET", "/debug/dump", app=app, transport=transport)
        match = await app.router.resolve(request)
        response = await match.handler(request)
        assert isinstance(response, web.Response) and response.body is not None
        body = response.body if isinstance(response.body, bytes) else b"{}"
        return response.status, json.loads(body)

    return asyncio.run(go())


@pytest.mark.parametrize(("peer", "local"), [
    (("127.0.0.1", 40000), True),
    (("127.9.9.9", 40000), True),
    (("::1", 40000, 0, 0), True),
    (("::ffff:127.0.0.1", 40000, 0, 0), True),  # IPv4 on a dual-stack socket
    (("198.18.0.2", 40000), False),
    (("fd00:18::2", 40000, 0, 0), False),
    (("::ffff:198.18.0.2", 40000, 0, 0), False),
    (("198.18.0.1", 40000), False),  # the node's own address: not loopback
    (None, False),  # no peer (a closed transport)
])
def test_the_dump_answers_loopback_clients_only_by_default(
        peer: tuple[Any, ...] | None, local: bool) -> None:
    model, _ = example_model()
    app = metrics_app(AgentMetrics(), Source(model))
    status, doc = dump_status(app, peer)
    if local:
        assert status == 200 and "services" in doc
    else:
        assert status == 403
        assert doc == {"error": DUMP_LOCAL_ONLY, "client": peer[0] if peer else None}
        assert "--debug-dump=true" in DUMP_LOCAL_ONLY  # says how to change it
    # --debug-dump=true: everyone who reaches the server.
    anyone = metrics_app(AgentMetrics(), Source(model), loopback_only=False)
    assert dump_status(anyone, peer)[0] == 200


def test_the_dump_command_finds_an_agent_on_ipv6_loopback(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`python -m proxy dump` with no address: 127.0.0.1, then ::1 where nothing listens
    on 127.0.0.1 (an IPv6 cluster's agent: kube-proxy's bindAddress "::" puts metrics on
    [::1]:10249)."""
    import socket

    from proxy.cmd import dump_client
    from proxy.server import http

    if http.ipv6_missing() is not None:
        pytest.skip("the host has no IPv6 loopback")
    model, _ = example_model()

    async def go() -> int:
        runner, listening = await http.serve(metrics_app(AgentMetrics(), Source(model)),
                                             "::1", 0)
        try:
            with socket.socket() as free:  # nothing listens on 127.0.0.1 at that port
                free.bind(("127.0.0.1", listening.port))
            monkeypatch.setattr(dump_client, "DEFAULT_ADDRESSES",
                                (f"127.0.0.1:{listening.port}", f"[::1]:{listening.port}"))
            return await asyncio.to_thread(dump_client.main, ["-o", "json"])
        finally:
            await runner.cleanup()

    assert asyncio.run(go()) == 0
    assert {s["service"] for s in json.loads(capsys.readouterr().out)["services"]} >= {
        "demo/web"}
