"""The official `kubernetes` Python client against the simulator: typed and raw lists,
and its Watch helper (resume from a list's resourceVersion)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from kubernetes import client, watch

from proxy.sim import SimServer
from tests.sim.client import endpoint_slice, service


@pytest.fixture
def core(sim: SimServer) -> Iterator[client.CoreV1Api]:
    cfg = client.Configuration()
    cfg.host = sim.url
    with client.ApiClient(cfg) as api_client:
        yield client.CoreV1Api(api_client)


def test_typed_and_raw_service_lists(sim: SimServer, core: client.CoreV1Api) -> None:
    sim.create(service("web", labels={"app": "web"}, type="NodePort"))
    sim.create(service("db", labels={"app": "db"}))
    typed = core.list_namespaced_service("default", label_selector="app=web")
    assert [s.metadata.name for s in typed.items] == ["web"]
    assert typed.items[0].spec.ports[0].node_port >= 30000
    assert typed.metadata.resource_version == str(sim.resource_version)
    raw = core.list_namespaced_service("default", limit=1, _preload_content=False)
    body = json.loads(raw.data)
    assert body["kind"] == "ServiceList" and len(body["items"]) == 1
    assert body["metadata"]["continue"] and body["metadata"]["remainingItemCount"] == 1


def test_watch_helper_resumes_from_a_list(sim: SimServer, core: client.CoreV1Api) -> None:
    listed = core.list_namespaced_service("default")
    sim.create(service("w1"))
    sim.create(endpoint_slice("w1-a", "w1", ["198.18.2.1"]))  # another type: not seen
    sim.delete("v1", "Service", "w1")
    stream = watch.Watch().stream(core.list_namespaced_service, "default",
                                  resource_version=listed.metadata.resource_version,
                                  timeout_seconds=1)
    events = [(e["type"], e["object"].metadata.name) for e in stream]
    assert events == [("ADDED", "w1"), ("DELETED", "w1")]


def test_api_errors_surface_as_api_exceptions(sim: SimServer, core: client.CoreV1Api) -> None:
    sim.create(service("dup"))
    with pytest.raises(client.ApiException) as err:
        core.create_namespaced_service("default", service("dup"))
    assert err.value.status == 409
    assert json.loads(err.value.body)["reason"] == "AlreadyExists"
