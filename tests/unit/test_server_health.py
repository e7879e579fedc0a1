"""/healthz and /livez: kube-proxy's meaning and JSON body, on a fake clock."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer

from proxy.server.health import ProxyHealth, go_time, node_eligible
from proxy.server.http import health_app
from proxy.server.metrics import AgentMetrics


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(threshold: float = 60.0) -> tuple[ProxyHealth, Clock]:
    clock = Clock()
    return ProxyHealth(threshold, clock=clock, wall=lambda: 1_700_000_000.0 + clock.now), clock


def test_go_time_matches_go_formatting() -> None:
    assert go_time(None) == "0001-01-01 00:00:00 +0000 UTC"
    assert go_time(1_700_000_000.0) == "2023-11-14 22:13:20 +0000 UTC"
    assert go_time(1_700_000_000.25) == "2023-11-14 22:13:20.25 +0000 UTC"


def test_startup_is_live_but_not_ready_until_the_first_sync() -> None:
    h, clock = make()
    st = h.status()
    assert st.healthy and not st.ready and st.last_updated is None
    h.queued()  # the first sync is requested
    h.sync_started()
    clock.now += 5
    h.updated()
    st = h.status()
    assert st.healthy and st.ready and st.first_sync_done


def test_a_change_waiting_past_the_threshold_is_unhealthy_until_applied() -> None:
    h, clock = make(threshold=10.0)
    h.updated()
    h.queued()
    clock.now += 9.9
    assert h.status().ready
    clock.now += 0.2
    assert not h.status().healthy and not h.status().ready
    h.sync_started()  # a stuck sync does not hide the wait
    clock.now += 30
    st = h.status()
    assert not st.healthy and st.oldest_queued_age == pytest.approx(40.1)
    h.updated()
    assert h.status().ready


def test_a_failed_sync_keeps_its_changes_waiting_since_their_arrival() -> None:
    h, clock = make(threshold=10.0)
    h.updated()
    h.queued()
    arrived = clock.now
    h.sync_started()
    clock.now += 4
    h.queued()  # another change while the sync runs
    h.sync_failed()
    clock.now += 7
    st = h.status()
    assert not st.healthy and st.oldest_queued_age == pytest.approx(clock.now - arrived)


def test_changes_arriving_during_a_successful_sync_stay_queued() -> None:
    h, clock = make(threshold=10.0)
    h.updated()
    h.queued()
    h.sync_started()
    clock.now += 1
    h.queued()
    h.updated()
    clock.now += 10.5
    assert not h.status().healthy  # the second change was never applied


@pytest.mark.parametrize(("node", "eligible"), [
    (None, True),
    ({"metadata": {"name": "n"}}, True),
    ({"metadata": {"name": "n", "deletionTimestamp": "2024-01-01T00:00:00Z"}}, False),
    ({"metadata": {"name": "n"}, "spec": {"taints": [
        {"key": "ToBeDeletedByClusterAutoscaler", "effect": "NoSchedule"}]}}, False),
    ({"metadata": {"name": "n"}, "spec": {"taints": [
        {"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]}}, True),
])
def test_node_eligibility(node: dict[str, Any] | None, eligible: bool) -> None:
    assert node_eligible(node) is eligible


@pytest.mark.parametrize("node", [
    {"metadata": []}, {"metadata": ["deletionTimestamp"]}, {"metadata": "n"},
    {"metadata": 7}, {}, {"metadata": {"name": "n"}, "spec": "x"},
    {"metadata": {"name": "n"}, "spec": []}, {"metadata": {"name": "n"}, "spec": ["taints"]},
    {"metadata": {"name": "n"}, "spec": {"taints": 5}},
    {"metadata": {"name": "n"}, "spec": {"taints": "ToBeDeletedByClusterAutoscaler"}},
    {"metadata": {"name": "n"}, "spec": {"taints": {"key": "ToBeDeletedByClusterAutoscaler"}}},
    {"metadata": {"name": "n"}, "spec": {"taints": [5, "x", None, {"key": ["a"]}]}},
    [], "node", 7,
])
def test_a_malformed_node_never_raises_and_is_read_as_eligible(node: Any) -> None:
    """A Node a broken server sends with fields of the wrong type: what cannot be read is
    taken as absent (the decoder records why the object was skipped), never an
    exception in the agent's event handler."""
    assert node_eligible(node) is True


async def _get(h: ProxyHealth, metrics: AgentMetrics, path: str) -> tuple[int, Any, str]:
    async with TestClient(TestServer(health_app(h, metrics))) as client:
        resp = await client.get(path)
        text = await resp.text()
        return resp.status, resp.headers.get("Content-Type"), text


def test_http_bodies_are_upstreams() -> None:
    h, clock = make(threshold=10.0)
    metrics = AgentMetrics()
    status, ctype, text = asyncio.run(_get(h, metrics, "/healthz"))
    assert status == 503 and ctype == "application/json"
    body = json.loads(text)
    assert body == {"lastUpdated": "0001-01-01 00:00:00 +0000 UTC",
                    "currentTime": go_time(1_700_000_000.0 + clock.now), "nodeEligible": True}
    assert asyncio.run(_get(h, metrics, "/livez"))[0] == 200

    h.updated()
    status, _, text = asyncio.run(_get(h, metrics, "/healthz"))
    body = json.loads(text)
    assert status == 200 and body["lastUpdated"] == body["currentTime"]

    h.node_eligible = False
    status, _, text = asyncio.run(_get(h, metrics, "/healthz"))
    assert status == 503 and json.loads(text)["nodeEligible"] is False
    status, _, text = asyncio.run(_get(h, metrics, "/livez"))  # livez ignores the node
    assert status == 200 and set(json.loads(text)) == {"lastUpdated", "currentTime"}

    rendered = metrics.render().decode()
    assert 'kubeproxy_proxy_healthz_total{code="503"} 2.0' in rendered
    assert 'kubeproxy_proxy_healthz_total{code="200"} 1.0' in rendered
    assert 'kubeproxy_proxy_livez_total{code="200"} 2.0' in rendered
