"""Fault injection: failing and slow requests, cut watches, restarts with and without
state; the same through the /_sim admin endpoints."""

from __future__ import annotations

import contextlib
import http.client
import time
from collections.abc import Callable

from proxy.sim import SimServer
from tests.sim.client import SVC, Api, service, wait_for


def test_fail_next_requests_with_500_then_recover(sim: SimServer, api: Api) -> None:
    sim.fail_next(2, 500)
    for _ in range(2):
        status, body = api.get(SVC)
        assert status == 500 and body["reason"] == "InternalError" and body["code"] == 500
    assert api.get(SVC)[0] == 200
    assert sim.faults.injected_failures == 2


def test_fail_next_with_429_sends_retry_after(sim: SimServer, api: Api) -> None:
    sim.fail_next(1, 429, retry_after=3)
    status, body, headers = api.request("POST", SVC, service("x"))
    assert status == 429 and headers["Retry-After"] == "3"
    assert body["reason"] == "TooManyRequests" and body["details"]["retryAfterSeconds"] == 3
    assert api.get(f"{SVC}/x")[0] == 404  # the failed create did not happen


def test_latency_is_added_to_every_request(sim: SimServer, api: Api) -> None:
    sim.set_latency(0.3)
    began = time.monotonic()
    assert api.get(SVC)[0] == 200
    assert time.monotonic() - began >= 0.3
    sim.set_latency(0)
    began = time.monotonic()
    api.get(SVC)
    assert time.monotonic() - began < 0.3


def test_abrupt_cut_drops_the_connection(sim: SimServer, api: Api) -> None:
    with api.watch(SVC) as w:
        wait_for(lambda: sim.open_watches() == 1, what="watch registered")
        sim.cut_watches(abrupt=True)
        # The connection is closed under the client: EOF, IncompleteRead or a reset.
        with contextlib.suppress(http.client.HTTPException, OSError):
            assert w.rest() == []
    wait_for(lambda: sim.open_watches() == 0, what="watch cleaned up")


def test_restart_keeping_state_lets_watches_resume(sim: SimServer, api: Api) -> None:
    _, created = api.post(SVC, service("kept"))
    url = sim.url
    rv = created["metadata"]["resourceVersion"]
    with api.watch(SVC, resourceVersion=rv) as w:
        wait_for(lambda: sim.open_watches() == 1, what="watch registered")
        sim.restart(keep_state=True)
        # The stream may end cleanly or by a reset; either way nothing more arrives.
        with contextlib.suppress(http.client.HTTPException, OSError):
            assert w.rest() == []
    assert sim.url == url
    status, got = api.get(f"{SVC}/kept")
    assert status == 200 and got["metadata"]["uid"] == created["metadata"]["uid"]
    sim.create(service("after"))
    with api.watch(SVC, resourceVersion=rv, timeoutSeconds=1) as w:
        assert [e["object"]["metadata"]["name"] for e in w.rest()] == ["after"]


def test_restart_losing_state_is_a_new_cluster(sim: SimServer, api: Api) -> None:
    for i in range(5):
        api.post(SVC, service(f"lost{i}"))
    _, before = api.get(SVC)
    sim.restart(keep_state=False)
    status, after = api.get(SVC)
    assert status == 200 and after["items"] == []
    assert int(after["metadata"]["resourceVersion"]) < int(before["metadata"]["resourceVersion"])
    assert api.get("/api/v1/namespaces/default")[0] == 200


def test_admin_endpoints(sim: SimServer, api: Api) -> None:
    api.post(SVC, service("adm"))
    status, state, _ = api.request("GET", "/_sim/state")
    assert status == 200 and [o["metadata"]["name"] for o in state["objects"]["services"]] \
        == ["adm"]
    status, body, _ = api.request("POST", "/_sim/fail", params={"count": 1, "code": 503})
    assert status == 200
    assert api.get(SVC)[0] == 503
    status, body, _ = api.request("POST", "/_sim/compact")
    assert body["compactedResourceVersion"] == str(sim.resource_version)
    with api.watch(SVC) as w:
        w.take(1)
        status, body, _ = api.request("POST", "/_sim/watches/cut")
        assert body == {"cut": 1}
        assert w.rest() == []
    status, body, _ = api.request("POST", "/_sim/latency", params={"seconds": "0"})
    assert body == {"latency": 0.0}
    status, body, _ = api.request("POST", "/_sim/validate", params={"enabled": "false"})
    assert api.post(SVC, service("bad", ports=[{"port": 0}]))[0] == 201


def test_admin_expire_and_compact_with_expiry(sim: SimServer, api: Api) -> None:
    with api.watch(SVC) as w:
        wait_for(lambda: sim.open_watches() == 1, what="watch registered")
        status, body, _ = api.request("POST", "/_sim/watches/expire")
        assert status == 200 and body == {"expired": 1}
        assert [e["object"]["code"] for e in w.rest()] == [410]
    api.post(SVC, service("c"))
    with api.watch(SVC) as w:
        w.take(1)
        status, body, _ = api.request("POST", "/_sim/compact",
                                      params={"expireWatches": "true"})
        assert body == {"compactedResourceVersion": str(sim.resource_version), "expired": 1}
        assert [e["type"] for e in w.rest()] == ["ERROR"]


def wait_until_serving(api: Api, pred: Callable[[], bool]) -> None:
    def ready() -> bool:
        try:
            return pred()
        except OSError:  # refused while the server is down
            return False

    wait_for(ready, timeout=20, what="server back")


def test_admin_restart_keeping_and_losing_state(sim: SimServer, api: Api) -> None:
    api.post(SVC, service("kept"))
    url, before, starts = sim.url, sim.resource_version, sim.starts
    status, body, _ = api.request("POST", "/_sim/restart")
    assert status == 200 and body == {"restarting": True, "keepState": True}
    wait_until_serving(api, lambda: sim.starts == starts + 1 and api.get(f"{SVC}/kept")[0] == 200)
    assert sim.url == url and sim.resource_version == before
    status, body, _ = api.request("POST", "/_sim/restart", params={"keepState": "false"})
    assert body == {"restarting": True, "keepState": False}
    wait_until_serving(api, lambda: sim.starts == starts + 2 and api.get(f"{SVC}/kept")[0] == 404)
    assert sim.url == url and sim.resource_version < before
