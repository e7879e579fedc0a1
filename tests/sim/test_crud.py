"""Create, read, update, delete and patch over HTTP, with the real server's answers."""

from __future__ import annotations

from proxy.sim import SimServer
from tests.sim.client import EPS, SVC, Api, endpoint_slice, service


def rv(obj: dict) -> int:  # type: ignore[type-arg]
    return int(obj["metadata"]["resourceVersion"])


def test_every_write_gets_a_higher_resource_version_and_lists_carry_the_latest(api: Api) -> None:
    seen = []
    status, created = api.post(SVC, service("a"))
    assert status == 201
    seen.append(rv(created))
    created["spec"]["sessionAffinity"] = "ClientIP"
    status, updated = api.put(f"{SVC}/a", created)
    assert status == 200
    seen.append(rv(updated))
    status, other = api.post(EPS, endpoint_slice("a-1", "a", ["198.18.1.1"]))
    assert status == 201
    seen.append(rv(other))
    status, listed = api.get(SVC)
    assert listed["metadata"]["resourceVersion"] == str(seen[-1])
    status, _ = api.delete(f"{SVC}/a")
    status, listed = api.get(SVC)
    seen.append(int(listed["metadata"]["resourceVersion"]))
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert all(isinstance(o["metadata"]["resourceVersion"], str) for o in (created, updated))


def test_created_object_has_server_fields(api: Api) -> None:
    _, svc = api.post(SVC, service("meta"))
    meta = svc["metadata"]
    assert meta["uid"] and meta["creationTimestamp"].endswith("Z")
    assert "generation" not in meta  # upstream services carry no generation
    assert svc["kind"] == "Service" and svc["apiVersion"] == "v1"
    assert svc["status"] == {"loadBalancer": {}}
    _, listed = api.get(SVC)
    assert "kind" not in listed["items"][0]  # typed list items are bare on the wire
    assert listed["kind"] == "ServiceList"


def test_create_twice_is_409_already_exists(api: Api) -> None:
    assert api.post(SVC, service("dup"))[0] == 201
    status, body = api.post(SVC, service("dup"))
    assert status == 409
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                    "message": 'services "dup" already exists', "reason": "AlreadyExists",
                    "details": {"name": "dup", "kind": "services"}, "code": 409}
    status, body = api.post(EPS, endpoint_slice("s", "dup", ["198.18.1.1"]))
    status, body = api.post(EPS, endpoint_slice("s", "dup", ["198.18.1.1"]))
    assert body["message"] == 'endpointslices.discovery.k8s.io "s" already exists'
    assert body["details"] == {"name": "s", "group": "discovery.k8s.io", "kind": "endpointslices"}


def test_stale_update_is_409_conflict_and_unconditional_update_wins(api: Api) -> None:
    _, first = api.post(SVC, service("c"))
    first["metadata"]["labels"] = {"v": "1"}
    status, second = api.put(f"{SVC}/c", first)
    assert status == 200
    first["metadata"]["labels"] = {"v": "stale"}
    status, body = api.put(f"{SVC}/c", first)  # still carries the old resourceVersion
    assert status == 409
    assert body["reason"] == "Conflict" and body["code"] == 409
    assert body["message"] == ('Operation cannot be fulfilled on services "c": the object has '
                               "been modified; please apply your changes to the latest "
                               "version and try again")
    del first["metadata"]["resourceVersion"]
    status, third = api.put(f"{SVC}/c", first)
    assert status == 200 and third["metadata"]["labels"] == {"v": "stale"}
    assert third["spec"]["clusterIP"] == second["spec"]["clusterIP"]


def test_noop_update_keeps_the_resource_version(api: Api) -> None:
    _, svc = api.post(SVC, service("same"))
    status, again = api.put(f"{SVC}/same", svc)
    assert status == 200 and again["metadata"]["resourceVersion"] == svc["metadata"][
        "resourceVersion"]


def test_get_missing_is_404_with_status(api: Api) -> None:
    status, body = api.get(f"{SVC}/nope")
    assert status == 404
    assert body["reason"] == "NotFound" and body["message"] == 'services "nope" not found'
    assert api.get("/api/v1/nonsense")[0] == 404


def test_delete_answers_like_upstream(api: Api) -> None:
    _, svc = api.post(SVC, service("gone"))
    status, body = api.delete(f"{SVC}/gone")
    assert status == 200 and body["kind"] == "Service"  # services return the object
    assert body["metadata"]["uid"] == svc["metadata"]["uid"]
    _, eps = api.post(EPS, endpoint_slice("gone-1", "gone", ["198.18.1.1"]))
    status, body = api.delete(f"{EPS}/gone-1")
    assert status == 200
    assert body == {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                    "details": {"name": "gone-1", "group": "discovery.k8s.io",
                                "kind": "endpointslices", "uid": eps["metadata"]["uid"]}}
    assert api.delete(f"{EPS}/gone-1")[0] == 404


def test_delete_precondition_mismatch_is_409(api: Api) -> None:
    api.post(SVC, service("pre"))
    status, body = api.delete(f"{SVC}/pre", {"kind": "DeleteOptions", "apiVersion": "v1",
                                             "preconditions": {"resourceVersion": "1"}})
    assert status == 409 and "Precondition failed" in body["message"]
    assert api.get(f"{SVC}/pre")[0] == 200


def test_missing_namespace_is_404_and_terminating_namespace_is_403(api: Api) -> None:
    status, body = api.post("/api/v1/namespaces/nowhere/services", service("x", "nowhere"))
    assert status == 404 and body["message"] == 'namespaces "nowhere" not found'
    assert body["details"] == {"name": "nowhere", "kind": "namespaces"}
    for ns in ("default", "kube-system"):
        assert api.get(f"/api/v1/namespaces/{ns}")[0] == 200


def test_deleting_a_namespace_deletes_its_content(api: Api) -> None:
    status, ns = api.post("/api/v1/namespaces", {"metadata": {"name": "team"}})
    assert status == 201 and ns["status"] == {"phase": "Active"}
    assert api.post("/api/v1/namespaces/team/services", service("x", "team"))[0] == 201
    status, body = api.delete("/api/v1/namespaces/team")
    assert status == 200 and body["status"]["phase"] == "Terminating"
    assert body["metadata"]["deletionTimestamp"]
    assert api.get("/api/v1/namespaces/team/services/x")[0] == 404
    assert api.get("/api/v1/namespaces/team")[0] == 404
    assert api.delete("/api/v1/namespaces/default")[0] == 403


def test_merge_json_and_strategic_patch(api: Api) -> None:
    api.post(SVC, service("p", ports=[{"name": "http", "port": 80},
                                      {"name": "dns", "port": 53, "protocol": "UDP"}]))
    status, body = api.patch(f"{SVC}/p", {"metadata": {"labels": {"a": "b"}}})
    assert status == 200 and body["metadata"]["labels"] == {"a": "b"}
    status, body = api.patch(f"{SVC}/p", [{"op": "replace", "path": "/spec/ports/0/port",
                                           "value": 8080}], kind="json")
    assert status == 200 and body["spec"]["ports"][0]["port"] == 8080
    # Strategic merge: ports merge by their key instead of replacing the list.
    status, body = api.patch(f"{SVC}/p", {"spec": {"ports": [{"port": 53, "name": "domain"}]}},
                             kind="strategic-merge")
    assert status == 200 and [p["name"] for p in body["spec"]["ports"]] == ["http", "domain"]
    status, body = api.patch(f"{SVC}/p", [{"op": "test", "path": "/spec/type",
                                           "value": "NodePort"}], kind="json")
    assert status == 422
    assert api.patch(f"{SVC}/missing", {"metadata": {}})[0] == 404
    status, body = api.patch(f"{SVC}/p", {"metadata": {"resourceVersion": "1"}})
    assert status == 409 and body["reason"] == "Conflict"


def test_status_only_changes_through_the_status_subresource(api: Api) -> None:
    svc = service("lb", type="LoadBalancer")
    svc["status"] = {"loadBalancer": {"ingress": [{"ip": "198.18.0.9"}]}}
    _, created = api.post(SVC, svc)
    assert created["status"] == {"loadBalancer": {}}
    created["status"] = {"loadBalancer": {"ingress": [{"ip": "198.18.0.9"}]}}
    _, updated = api.put(f"{SVC}/lb", created)
    assert updated["status"] == {"loadBalancer": {}}
    status, updated = api.put(f"{SVC}/lb/status", created)
    assert status == 200
    assert updated["status"]["loadBalancer"]["ingress"] == [{"ip": "198.18.0.9"}]
    assert updated["spec"] == created["spec"]


def test_endpoint_slice_generation_follows_content(api: Api) -> None:
    _, eps = api.post(EPS, endpoint_slice("g", "g", ["198.18.1.1"]))
    assert eps["metadata"]["generation"] == 1
    eps["metadata"]["annotations"] = {"note": "x"}
    _, eps = api.put(f"{EPS}/g", eps)
    assert eps["metadata"]["generation"] == 1
    eps["endpoints"][0]["addresses"] = ["198.18.1.2"]
    _, eps = api.put(f"{EPS}/g", eps)
    assert eps["metadata"]["generation"] == 2


def test_put_creates_endpoint_slices_but_not_services(api: Api) -> None:
    status, _ = api.put(f"{EPS}/new", endpoint_slice("new", "x", ["198.18.1.1"]))
    assert status == 201
    assert api.put(f"{SVC}/new", service("new"))[0] == 404


def test_cluster_ips_and_node_ports_are_allocated(api: Api) -> None:
    _, a = api.post(SVC, service("ip-a"))
    _, b = api.post(SVC, service("ip-b", type="NodePort"))
    ips = {a["spec"]["clusterIP"], b["spec"]["clusterIP"]}
    assert len(ips) == 2 and all(ip.startswith("198.18.1") for ip in ips)
    assert a["spec"]["clusterIPs"] == [a["spec"]["clusterIP"]]
    assert 30000 <= b["spec"]["ports"][0]["nodePort"] <= 32767
    _, v6 = api.post(SVC, service("ip-v6", ipFamilies=["IPv6"]))
    assert v6["spec"]["clusterIP"].startswith("fd00:198:18::")
    _, dual = api.post(SVC, service("ip-dual", ipFamilyPolicy="PreferDualStack"))
    assert [":" in ip for ip in dual["spec"]["clusterIPs"]] == [False, True]
    status, body = api.post(SVC, service("ip-taken", clusterIP=a["spec"]["clusterIP"]))
    assert status == 422 and body["details"]["causes"][0]["field"] == "spec.clusterIPs[0]"
    assert "already allocated" in body["message"]
    status, body = api.post(SVC, service("ip-out", clusterIP="198.19.0.1"))
    assert status == 422 and "not in the valid range" in body["message"]
    status, head = api.post(SVC, service("headless", clusterIP="None"))
    assert status == 201 and head["spec"]["clusterIPs"] == ["None"]
    # Deleting frees the address for reuse.
    api.delete(f"{SVC}/ip-a")
    status, _ = api.post(SVC, service("ip-again", clusterIP=a["spec"]["clusterIP"]))
    assert status == 201


def test_cluster_ip_may_not_change(api: Api) -> None:
    _, svc = api.post(SVC, service("fixed"))
    svc["spec"]["clusterIP"] = svc["spec"]["clusterIPs"][0] = "198.18.200.200"
    status, body = api.put(f"{SVC}/fixed", svc)
    assert status == 422 and "may not change once set" in body["message"]


def test_deletecollection_where_upstream_allows_it(api: Api) -> None:
    for i in range(3):
        api.post(EPS, endpoint_slice(f"dc-{i}", "keep" if i == 0 else "drop", ["198.18.1.1"]))
    status, body = api.delete(f"{EPS}?labelSelector=kubernetes.io%2Fservice-name%3Ddrop")
    assert status == 200 and len(body["items"]) == 2
    _, left = api.get(EPS)
    assert [o["metadata"]["name"] for o in left["items"]] == ["dc-0"]
    assert api.delete(SVC)[0] == 405


def test_python_api_writes_are_visible_over_http(sim: SimServer, api: Api) -> None:
    created = sim.create(service("direct"))
    status, got = api.get(f"{SVC}/direct")
    assert status == 200 and got["metadata"]["uid"] == created["metadata"]["uid"]
    sim.delete("v1", "Service", "direct")
    assert api.get(f"{SVC}/direct")[0] == 404
    state = sim.state()
    assert {o["metadata"]["name"] for o in state["namespaces"]} >= {"default", "kube-system"}
    assert state["services"] == []
