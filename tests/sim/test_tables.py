"""Server-side printing: `meta.k8s.io` Tables as kube-apiserver answers `kubectl get`.

Printer cases mirror upstream's printers.go; the wire format (column definitions, row
objects, watch events, 406 and 400 answers) was measured against kube-apiserver v1.20.2;
the kubectl tests run both real binaries against the examples.
"""

from __future__ import annotations

import http.client
import json
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import urlencode, urlsplit

import pytest

from proxy.kube.manifests import load_paths
from proxy.sim import SimServer
from proxy.sim.errors import ApiError
from proxy.sim.printing import (
    WatchTables,
    columns,
    endpoint_slice_cells,
    endpoints_cells,
    human_duration,
    include_object,
    namespace_cells,
    negotiate,
    node_cells,
    service_cells,
)
from tests.sim.client import SVC, WatchStream, endpoint_slice, service
from tests.sim.test_kubectl import KUBECTL_132, ROOT, Kubectl, ensure_kubectl_120

Obj = dict[str, Any]
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
CREATED = (NOW - timedelta(minutes=5)).strftime("%Y-%m-%dT%H:%M:%SZ")
TABLE = ("application/json;as=Table;v=v1;g=meta.k8s.io,"
         "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json")
ACCEPTED = ("only the following media types are accepted: application/json, "
            "application/yaml, application/vnd.kubernetes.protobuf")


def meta(name: str, **extra: Any) -> Obj:
    return {"name": name, "creationTimestamp": CREATED, **extra}


# ---- printers ------------------------------------------------------------------------

@pytest.mark.parametrize(("seconds", "text"), [
    (-3, "<invalid>"), (-1.5, "0s"), (0, "0s"), (59.9, "59s"), (119, "119s"), (120, "2m"),
    (150, "2m30s"), (599, "9m59s"), (600, "10m"), (3 * 3600 - 1, "179m"), (3 * 3600, "3h"),
    (3 * 3600 + 1800, "3h30m"), (8 * 3600, "8h"), (47 * 3600, "47h"), (48 * 3600, "2d"),
    (50 * 3600, "2d2h"), (8 * 86400, "8d"), (729 * 86400, "729d"), (730 * 86400, "2y"),
    (740 * 86400, "2y10d"), (9 * 365 * 86400, "9y"),
])
def test_age_is_apimachinery_human_duration(seconds: float, text: str) -> None:
    assert human_duration(seconds) == text


def svc(spec: Obj, status: Obj | None = None, **extra_meta: Any) -> Obj:
    return {"kind": "Service", "metadata": meta("s", **extra_meta), "spec": spec,
            "status": status or {"loadBalancer": {}}}


@pytest.mark.parametrize(("obj", "cells"), [
    pytest.param(svc({"type": "ClusterIP", "clusterIPs": ["10.0.0.1"], "selector": {"b": "2",
                 "a": "1"}, "ports": [{"port": 80, "protocol": "TCP"}]}),
                 ["s", "ClusterIP", "10.0.0.1", "<none>", "80/TCP", "5m", "a=1,b=2"],
                 id="cluster-ip"),
    pytest.param(svc({"type": "NodePort", "clusterIPs": ["10.0.0.2", "fd00::2"],
                      "externalIPs": ["1.2.3.4"],
                      "ports": [{"port": 80, "nodePort": 30080, "protocol": "TCP"},
                                {"port": 53, "nodePort": 30053, "protocol": "UDP"}]}),
                 ["s", "NodePort", "10.0.0.2", "1.2.3.4", "80:30080/TCP,53:30053/UDP", "5m",
                  "<none>"], id="node-ports"),
    pytest.param(svc({"type": "LoadBalancer", "clusterIPs": ["10.0.0.3"],
                      "ports": [{"port": 443, "nodePort": 31443, "protocol": "TCP"}]}),
                 ["s", "LoadBalancer", "10.0.0.3", "<pending>", "443:31443/TCP", "5m",
                  "<none>"], id="load-balancer-pending"),
    pytest.param(svc({"type": "LoadBalancer", "clusterIPs": ["10.0.0.4"],
                      "externalIPs": ["9.9.9.9"], "ports": []},
                     {"loadBalancer": {"ingress": [{"ip": "5.6.7.8"},
                                                   {"hostname": "a-long-name.example.com"},
                                                   {"ip": "5.6.7.8"}]}}),
                 # sorted, de-duplicated, then externalIPs; never clipped (server is wide)
                 ["s", "LoadBalancer", "10.0.0.4", "5.6.7.8,a-long-name.example.com,9.9.9.9",
                  "<none>", "5m", "<none>"], id="load-balancer-ingress"),
    pytest.param(svc({"type": "ExternalName", "externalName": "example.com"}),
                 ["s", "ExternalName", "<none>", "example.com", "<none>", "5m", "<none>"],
                 id="external-name"),
    pytest.param(svc({"type": "ClusterIP", "clusterIP": "None", "clusterIPs": ["None"]}),
                 ["s", "ClusterIP", "None", "<none>", "<none>", "5m", "<none>"],
                 id="headless-without-ports"),
    pytest.param({"metadata": {"name": "bare"}, "spec": {"clusterIP": "10.0.0.9"}},
                 # only clusterIPs counts; no type is <unknown>; no timestamp <unknown>
                 ["bare", "", "<none>", "<unknown>", "<none>", "<unknown>", "<none>"],
                 id="nothing-defaulted"),
])
def test_service_cells(obj: Obj, cells: list[str]) -> None:
    assert service_cells(obj, NOW) == cells


def subset(ips: list[str], ports: list[int], not_ready: tuple[str, ...] = ()) -> Obj:
    return {"addresses": [{"ip": ip} for ip in ips],
            "notReadyAddresses": [{"ip": ip} for ip in not_ready],
            "ports": [{"port": p} for p in ports]}


@pytest.mark.parametrize(("subsets", "text"), [
    (None, "<none>"),
    ([], "<none>"),
    ([subset(["10.0.0.1", "10.0.0.2"], [80], not_ready=("10.0.0.3",))],
     "10.0.0.1:80,10.0.0.2:80"),
    ([subset(["10.0.0.1", "10.0.0.2"], [80, 81])],
     "10.0.0.1:80,10.0.0.2:80,10.0.0.1:81 + 1 more..."),
    ([subset(["10.0.0.1"], []), subset(["fd00::1"], [8080])], "10.0.0.1,[fd00::1]:8080"),
    ([subset(["10.0.0.1", "10.0.0.2", "10.0.0.3"], [80]), subset(["10.0.1.1"], [80, 81])],
     "10.0.0.1:80,10.0.0.2:80,10.0.0.3:80 + 2 more..."),
    ([subset([], [80])], ""),
])
def test_endpoints_cells(subsets: list[Obj] | None, text: str) -> None:
    obj: Obj = {"metadata": meta("ep")}
    if subsets is not None:
        obj["subsets"] = subsets
    assert endpoints_cells(obj, NOW) == ["ep", text, "5m"]


@pytest.mark.parametrize(("ports", "addresses", "port_text", "address_text"), [
    ([], [], "<unset>", "<unset>"),
    ([{"name": "http", "port": 8080, "protocol": "TCP"}], [["10.1.0.1"]], "8080", "10.1.0.1"),
    # a port without a number shows its name ("" once defaulted), "*" with neither
    ([{"port": 80}, {"name": "x"}, {"name": ""}, {}], [], "80,x, + 1 more...", "<unset>"),
    ([{}], [], "*", "<unset>"),
    ([{"port": 1}, {"port": 2}, {"port": 3}], [["a", "b"], ["c"], ["d"], ["e"]],
     "1,2,3", "a,b,c + 2 more..."),
])
def test_endpoint_slice_cells(ports: list[Obj], addresses: list[list[str]], port_text: str,
                              address_text: str) -> None:
    obj = {"metadata": meta("sl"), "addressType": "IPv4", "ports": ports,
           "endpoints": [{"addresses": a} for a in addresses]}
    assert endpoint_slice_cells(obj, NOW) == ["sl", "IPv4", port_text, address_text, "5m"]


def node(labels: Obj | None = None, spec: Obj | None = None, status: Obj | None = None) -> Obj:
    return {"metadata": meta("n", labels=labels or {}), "spec": spec or {},
            "status": status or {}}


INFO = {"kubeletVersion": "v1.32.4", "osImage": "Debian GNU/Linux 12 (bookworm)",
        "kernelVersion": "6.1.0", "containerRuntimeVersion": "containerd://1.7.24"}


@pytest.mark.parametrize(("obj", "cells"), [
    pytest.param(node(), ["n", "Unknown", "<none>", "5m", "", "<none>", "<none>", "<unknown>",
                          "<unknown>", "<unknown>"], id="bare"),
    pytest.param(node(labels={"node-role.kubernetes.io/control-plane": "",
                              "node-role.kubernetes.io/": "", "kubernetes.io/role": "worker",
                              "node-role.kubernetes.io/infra": "x"},
                      spec={"unschedulable": True},
                      status={"conditions": [{"type": "MemoryPressure", "status": "True"},
                                             {"type": "Ready", "status": "True"}],
                              "addresses": [{"type": "Hostname", "address": "n"},
                                            {"type": "InternalIP", "address": "10.0.0.5"},
                                            {"type": "InternalIP", "address": "10.0.0.6"},
                                            {"type": "ExternalIP", "address": "1.2.3.4"}],
                              "nodeInfo": INFO}),
                 ["n", "Ready,SchedulingDisabled", "control-plane,infra,worker", "5m",
                  "v1.32.4", "10.0.0.5", "1.2.3.4", "Debian GNU/Linux 12 (bookworm)", "6.1.0",
                  "containerd://1.7.24"], id="ready-cordoned-with-roles"),
    pytest.param(node(status={"conditions": [{"type": "Ready", "status": "Unknown"}]}),
                 ["n", "NotReady", "<none>", "5m", "", "<none>", "<none>", "<unknown>",
                  "<unknown>", "<unknown>"], id="not-ready"),
])
def test_node_cells(obj: Obj, cells: list[str]) -> None:
    assert node_cells(obj, NOW) == cells


def test_namespace_cells() -> None:
    ns = {"metadata": meta("team"), "status": {"phase": "Terminating"}}
    assert namespace_cells(ns, NOW) == ["team", "Terminating", "5m"]


@pytest.mark.parametrize(("kind", "names", "wide"), [
    ("Service", ["Name", "Type", "Cluster-IP", "External-IP", "Port(s)", "Age"],
     ["Selector"]),
    ("EndpointSlice", ["Name", "AddressType", "Ports", "Endpoints", "Age"], []),
    ("Endpoints", ["Name", "Endpoints", "Age"], []),
    ("Node", ["Name", "Status", "Roles", "Age", "Version"],
     ["Internal-IP", "External-IP", "OS-Image", "Kernel-Version", "Container-Runtime"]),
    ("Namespace", ["Name", "Status", "Age"], []),
])
def test_columns_and_priorities(kind: str, names: list[str], wide: list[str]) -> None:
    cols = columns(kind)
    assert [c.name for c in cols if c.priority == 0] == names
    assert [c.name for c in cols if c.priority == 1] == wide
    assert cols[0].format == "name" and all(c.type == "string" for c in cols)


def test_column_descriptions_follow_the_api_level() -> None:
    new, old = columns("Node", "1.32"), columns("Node", "1.20")
    assert new[0].description.endswith("working-with-objects/names#names")
    assert old[0].description.endswith("http://kubernetes.io/docs/user-guide/identifiers#names")
    assert "docker://1.5.0" in old[-1].description and "containerd" in new[-1].description


# ---- negotiation and options ---------------------------------------------------------

@pytest.mark.parametrize(("accept", "want"), [
    (None, None), ("", None), ("application/json", None), ("*/*", None),
    (TABLE, "v1"),
    ("application/json;as=Table;v=v1beta1;g=meta.k8s.io", "v1beta1"),
    ("application/json;q=0.5, application/json;as=Table;v=v1;g=meta.k8s.io;q=0.9", "v1"),
    # unsupported conversions are skipped; the next clause answers
    ("application/json;as=Table;v=v2;g=meta.k8s.io,application/json", None),
    ("application/json;as=Table;v=v1,application/json", None),  # no group
    ("application/vnd.kubernetes.protobuf;as=Table;v=v1;g=meta.k8s.io,application/json", None),
    ("application/yaml;as=Table;v=v1;g=meta.k8s.io", "v1"),  # answered in JSON here
    ("application/json;stream=watch", None),
    ("*/*;as=Table;v=v1;g=meta.k8s.io", "v1"),
])
def test_negotiate(accept: str | None, want: str | None) -> None:
    assert negotiate(accept) == want


@pytest.mark.parametrize(("accept", "message", "details"), [
    ("text/plain", "406: Not Acceptable", {}),  # refused by the route (go-restful)
    ("application/json;as=Foo;v=v1;g=meta.k8s.io", ACCEPTED, None),
    ("application/yaml;stream=watch", ACCEPTED, None),
])
def test_negotiate_refuses(accept: str, message: str, details: Obj | None) -> None:
    with pytest.raises(ApiError) as exc:
        negotiate(accept)
    assert (exc.value.code, exc.value.reason, exc.value.message, exc.value.details) == (
        406, "NotAcceptable", message, details)


def test_include_object() -> None:
    assert [include_object(v) for v in (None, "", "None", "Metadata", "Object")] == [
        "Metadata", "Metadata", "None", "Metadata", "Object"]
    with pytest.raises(ApiError) as exc:
        include_object("Bogus")
    assert exc.value.code == 400 and exc.value.message == (
        "Unable to convert to Table as requested: includeObject: Invalid value: \"Bogus\": "
        "must be 'Metadata', 'Object', 'None', or empty")


def test_watch_tables_send_headers_once_and_pass_errors_through() -> None:
    rows = WatchTables("Service", "v1", "None")
    obj = svc({"type": "ClusterIP", "clusterIPs": ["10.0.0.1"]}, resourceVersion="7")
    line = json.dumps({"type": "ADDED", "object": obj}).encode() + b"\n"
    first, second = (json.loads(rows.line(line)) for _ in range(2))
    assert first["object"]["metadata"] == {"resourceVersion": "7"}
    assert len(first["object"]["columnDefinitions"]) == 7
    assert second["object"]["columnDefinitions"] is None  # present, null: as upstream
    assert second["object"]["rows"][0]["object"] is None
    error = b'{"type":"ERROR","object":{"kind":"Status","code":410}}\n'
    assert rows.line(error) == error


# ---- over HTTP -----------------------------------------------------------------------

def request(sim: SimServer, path: str, accept: str | None = TABLE,
            **params: Any) -> tuple[int, Any]:
    parts = urlsplit(sim.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=10)
    try:
        query = f"?{urlencode(params)}" if params else ""
        conn.request("GET", path + query, headers={"Accept": accept} if accept else {})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@contextmanager
def table_watch(sim: SimServer, path: str, **params: Any) -> Iterator[WatchStream]:
    parts = urlsplit(sim.url)
    conn = http.client.HTTPConnection(parts.hostname or "", parts.port or 80, timeout=5)
    try:
        conn.request("GET", f"{path}?{urlencode({'watch': '1', **params})}",
                     headers={"Accept": TABLE})
        yield WatchStream(conn.getresponse())
    finally:
        conn.close()


def test_list_and_get_answer_tables(sim: SimServer) -> None:
    sim.create(service("web", labels={"app": "web"}, selector={"app": "web"}))
    sim.create(service("db", type="NodePort"))
    status, tbl = request(sim, SVC)
    assert status == 200 and (tbl["kind"], tbl["apiVersion"]) == ("Table", "meta.k8s.io/v1")
    assert list(tbl) == ["kind", "apiVersion", "metadata", "columnDefinitions", "rows"]
    assert tbl["metadata"] == {"resourceVersion": str(sim.resource_version)}
    assert [c["name"] for c in tbl["columnDefinitions"]][-1] == "Selector"
    assert [r["cells"][0] for r in tbl["rows"]] == ["db", "web"]
    web = tbl["rows"][1]
    assert web["cells"][1:5] == ["ClusterIP", sim.get("v1", "Service", "web")["spec"][
        "clusterIP"], "<none>", "80/TCP"] and web["cells"][6] == "app=web"
    stored = sim.get("v1", "Service", "web")
    assert web["object"] == {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": stored["metadata"]}

    _, full = request(sim, SVC, includeObject="Object")
    assert full["rows"][1]["object"] == stored  # kind and apiVersion included
    _, bare = request(sim, SVC, includeObject="None")
    assert [r["object"] for r in bare["rows"]] == [None, None]
    _, beta = request(sim, SVC, "application/json;as=Table;v=v1beta1;g=meta.k8s.io")
    assert beta["apiVersion"] == "meta.k8s.io/v1beta1"
    assert beta["rows"][0]["object"]["apiVersion"] == "meta.k8s.io/v1beta1"

    status, one = request(sim, f"{SVC}/web")
    assert status == 200 and one["kind"] == "Table" and len(one["rows"]) == 1
    assert one["metadata"] == {"resourceVersion": stored["metadata"]["resourceVersion"]}

    status, plain = request(sim, SVC, "application/json")
    assert status == 200 and plain["kind"] == "ServiceList"
    _, empty = request(sim, "/api/v1/namespaces/kube-public/services")
    assert empty["rows"] == [] and len(empty["columnDefinitions"]) == 7


def test_table_errors(sim: SimServer) -> None:
    sim.create(service("web"))
    assert request(sim, SVC, includeObject="Bogus")[0] == 400
    status, body = request(sim, f"{SVC}/missing", includeObject="Bogus")
    assert status == 404 and body["reason"] == "NotFound"  # the lookup fails first
    status, body = request(sim, SVC, "application/json;as=Foo;v=v1;g=meta.k8s.io")
    assert (status, body["reason"], body["message"]) == (406, "NotAcceptable", ACCEPTED)
    assert request(sim, SVC, "text/html")[0] == 406


def test_paging_keeps_working_with_tables(sim: SimServer) -> None:
    for name in ("a", "b", "c"):
        sim.create(service(name))
    _, first = request(sim, SVC, limit=2)
    assert [r["cells"][0] for r in first["rows"]] == ["a", "b"]
    token = first["metadata"]["continue"]
    assert first["metadata"]["remainingItemCount"] == 1
    sim.create(service("d"))  # after the first page: not in this list
    _, second = request(sim, SVC, limit=2, **{"continue": token})
    assert [r["cells"][0] for r in second["rows"]] == ["c"]
    assert "continue" not in second["metadata"]
    assert second["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]


def test_watch_events_are_one_row_tables(sim: SimServer) -> None:
    sim.create(service("a"))
    sim.create(service("b"))
    with table_watch(sim, SVC, timeoutSeconds=5) as w:
        events = w.take(2)
        sim.delete("v1", "Service", "a")
        events += w.take(1)
    assert [(e["type"], e["object"]["rows"][0]["cells"][0]) for e in events] == [
        ("ADDED", "a"), ("ADDED", "b"), ("DELETED", "a")]
    assert all(e["object"]["kind"] == "Table" for e in events)
    assert len(events[0]["object"]["columnDefinitions"]) == 7
    assert [e["object"]["columnDefinitions"] for e in events[1:]] == [None, None]
    deleted = events[2]["object"]
    assert deleted["metadata"]["resourceVersion"] == deleted["rows"][0]["object"][
        "metadata"]["resourceVersion"]


def test_v1beta1_endpoint_slices_print_at_api_level_1_20() -> None:
    with SimServer(api_level="1.20") as sim:
        sim.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "demo"}})
        sim.load([endpoint_slice("web-1", "web", ["10.1.0.1", "10.1.0.2"], "demo")])
        path = "/apis/discovery.k8s.io/v1beta1/namespaces/demo/endpointslices"
        status, tbl = request(sim, path, includeObject="Object")
    assert status == 200
    assert tbl["rows"][0]["cells"][:4] == ["web-1", "IPv4", "8080", "10.1.0.1,10.1.0.2"]
    assert tbl["rows"][0]["object"]["apiVersion"] == "discovery.k8s.io/v1beta1"
    assert tbl["columnDefinitions"][0]["description"].endswith("user-guide/identifiers#names")


# ---- real kubectl against the examples ------------------------------------------------

EXTRA = [
    {"apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "web", "namespace": "demo"},
     "subsets": [{"addresses": [{"ip": "198.18.1.11"}, {"ip": "198.18.1.12"}],
                  "ports": [{"name": "http", "port": 8080, "protocol": "TCP"},
                            {"name": "dns", "port": 5353, "protocol": "UDP"}]}]},
]


@pytest.fixture(scope="module", params=["1.32", "1.20"])
def examples_sim(request: pytest.FixtureRequest) -> Iterator[SimServer]:
    objects = load_paths([str(ROOT / "examples")]) + EXTRA
    with SimServer(objects=objects, api_level=request.param) as server:
        yield server


@pytest.fixture(scope="module", params=["kubectl-1.32", "kubectl-1.20"])
def kubectl_binary(request: pytest.FixtureRequest) -> Path:
    return ensure_kubectl_120() if request.param == "kubectl-1.20" else KUBECTL_132


@pytest.fixture
def kc(kubectl_binary: Path, examples_sim: SimServer, tmp_path: Path) -> Iterator[Kubectl]:
    cfg = examples_sim.write_kubeconfig(tmp_path / "kubeconfig")
    yield Kubectl(kubectl_binary, cfg, tmp_path / "cache")
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


def parse(text: str) -> dict[str, list[dict[str, str]]]:
    """kubectl's tables by their NAME prefix ("service/", "node/", ...): one dict per row,
    cut at the header's column starts (cells may be empty)."""
    out: dict[str, list[dict[str, str]]] = {}
    for block in text.strip().split("\n\n"):
        header, *lines = block.splitlines()
        heads = list(re.finditer(r"\S+", header))  # column names have no spaces
        names, starts = [m.group() for m in heads], [m.start() for m in heads]
        bounds = [*starts[1:], None]
        rows = [{n: line[s:e].strip() for n, s, e in zip(names, starts, bounds, strict=True)}
                for line in lines]
        kind = rows[0]["NAME"].split("/")[0] if rows and "/" in rows[0]["NAME"] else ""
        out[kind] = rows
    return out


def by_name(rows: list[dict[str, str]]) -> dict[str, dict[str, str]]:
    return {r["NAME"].split("/")[-1]: r for r in rows}


def test_kubectl_get_shows_the_servers_columns(kc: Kubectl) -> None:
    out = parse(kc("get", "svc,endpointslices,endpoints,nodes,ns", "-A").stdout)
    web = by_name(out["service"])["web"]
    assert (web["NAMESPACE"], web["TYPE"], web["CLUSTER-IP"], web["EXTERNAL-IP"]) == (
        "demo", "NodePort", "198.18.128.10", "<none>")
    assert web["PORT(S)"].startswith("80:30080/TCP,53:3") and web["PORT(S)"].endswith("/UDP")
    assert re.fullmatch(r"\d+[smhd]\S*", web["AGE"]) and "SELECTOR" not in web
    assert by_name(out["service"])["draining"]["PORT(S)"] == "80/TCP"
    slices = by_name(out["endpointslice.discovery.k8s.io"])
    assert (slices["web-abc12"]["ADDRESSTYPE"], slices["web-abc12"]["PORTS"],
            slices["web-abc12"]["ENDPOINTS"]) == (
        "IPv4", "8080,5353", "198.18.1.11,198.18.1.12,198.18.1.13")
    assert by_name(out["endpoints"])["web"]["ENDPOINTS"] == (
        "198.18.1.11:8080,198.18.1.12:8080,198.18.1.11:5353 + 1 more...")
    node_a = by_name(out["node"])["node-a"]
    assert (node_a["STATUS"], node_a["ROLES"], node_a["VERSION"]) == ("Unknown", "<none>", "")
    assert by_name(out["namespace"])["demo"]["STATUS"] == "Active"


def test_kubectl_wide_shows_priority_columns(kc: Kubectl) -> None:
    out = parse(kc("get", "svc,nodes", "-A", "-o", "wide", "--show-labels").stdout)
    web = by_name(out["service"])["web"]
    assert web["SELECTOR"] == "<none>" and web["LABELS"] == "<none>"
    node_a = by_name(out["node"])["node-a"]
    assert (node_a["INTERNAL-IP"], node_a["EXTERNAL-IP"], node_a["OS-IMAGE"],
            node_a["KERNEL-VERSION"], node_a["CONTAINER-RUNTIME"]) == (
        "<none>", "<none>", "<unknown>", "<unknown>", "<unknown>")
    assert node_a["LABELS"] == "kubernetes.io/hostname=node-a,topology.kubernetes.io/zone=zone-a"
    # --sort-by asks for includeObject=Object and sorts on the full objects
    ordered = parse(kc("get", "svc", "-A", "--sort-by=.spec.clusterIP").stdout)[""]
    assert [r["NAME"] for r in ordered] == ["web", "draining", "node-local", "nearby"]


def test_kubectl_json_and_yaml_still_return_objects(kc: Kubectl) -> None:
    listed = json.loads(kc("get", "svc,endpointslices", "-A", "-o", "json").stdout)
    kinds = {i["kind"] for i in listed["items"]}
    assert kinds == {"Service", "EndpointSlice"}
    web = next(i for i in listed["items"] if i["metadata"]["name"] == "web")
    assert web["spec"]["clusterIP"] == "198.18.128.10"
    text = kc("get", "svc", "web", "-n", "demo", "-o", "yaml").stdout
    assert "kind: Service" in text and "clusterIP: 198.18.128.10" in text
    assert "Table" not in text
