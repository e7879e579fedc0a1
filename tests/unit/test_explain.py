"""`python -m proxy explain` as a user runs it: files, stdin, kubectl's List output, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from tests.unit.builders import ep, eps_slice, node, service

ROOT = Path(__file__).resolve().parents[2]


def run_explain(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "proxy", "explain", *args],
        input=stdin, capture_output=True, text=True, cwd=ROOT, timeout=60, check=False,
    )


def entry(result: dict[str, Any], svc: str, port: str = "http") -> dict[str, Any]:
    found = [s for s in result["services"] if s["service"] == svc and s["port"] == port]
    assert len(found) == 1, [(s["service"], s["port"]) for s in result["services"]]
    return found[0]


def test_examples_directory() -> None:
    proc = run_explain("examples/")
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["node"]["name"] == "node-a" and out["node"]["zone"] == "zone-a"
    web = entry(out, "demo/web")
    assert web["cluster_endpoints"] == ["198.18.1.11:8080", "198.18.1.12:8080"]
    assert web["node_port"] == 30080
    dns = entry(out, "demo/web", "dns")
    assert dns["protocol"] == "UDP" and dns["cluster_endpoints"] == [
        "198.18.1.11:5353", "198.18.1.12:5353"]
    draining = entry(out, "demo/draining", "")
    assert draining["cluster_endpoints"] == ["198.18.1.21:8080", "198.18.1.22:8080"]
    local = entry(out, "demo/node-local")
    assert local["cluster_endpoints"] == [] and local["local_endpoints"] == ["198.18.1.31:8080"]
    nearby = entry(out, "demo/nearby")
    assert nearby["topology"]["mode"] == "prefer-zone"
    assert nearby["cluster_endpoints"] == ["198.18.1.41:8080"]
    assert [c["endpoint"] for c in nearby["conflicts"]] == ["198.18.1.42:8080"]


def test_every_documented_field_is_present() -> None:
    out = json.loads(run_explain("examples/").stdout)
    required = {"service", "port", "protocol", "cluster_ips", "cluster_endpoints",
                "local_endpoints", "topology", "conflicts", "endpoints"}
    for svc in out["services"]:
        assert required <= set(svc)
        for e in svc["endpoints"]:
            assert {"endpoint", "ready", "serving", "terminating", "node", "zone", "slices",
                    "selected_for", "reason"} <= set(e)


def test_kubectl_list_on_stdin_with_node_labels_and_ipv6() -> None:
    items = [
        service(ips=("fd00::10",), ipFamilies=["IPv6"], trafficDistribution="PreferSameZone"),
        eps_slice("s1", [ep("fd00::1:1", zone="zone-b"), ep("fd00::1:2", zone="zone-c")],
                  address_type="IPv6"),
    ]
    listing = yaml.safe_dump({"apiVersion": "v1", "kind": "List", "items": items})
    proc = run_explain("--node", "n1", "--node-labels", "topology.kubernetes.io/zone=zone-b",
                       stdin=listing)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    svc = entry(out, "ns/svc")
    assert svc["family"] == "IPv6"
    assert svc["cluster_endpoints"] == ["[fd00::1:1]:8080"]
    assert out["node"]["zone"] == "zone-b"


def test_skipped_objects_are_listed_not_crashed_on(tmp_path: Path) -> None:
    bad_slice = eps_slice("s1", [ep("198.18.1.1"), ep("198.18.1.300")])
    no_label = eps_slice("s2", [ep("198.18.1.2")])
    del no_label["metadata"]["labels"]
    path = tmp_path / "in.json"
    path.write_text(json.dumps({"kind": "List", "items": [
        node(), service(), bad_slice, no_label, "just a string"]}))
    proc = run_explain("-f", str(path))
    assert proc.returncode == 2  # a non-object in the list is unreadable input
    assert "expected an object" in proc.stderr

    path.write_text(json.dumps({"kind": "List", "items": [node(), service(), bad_slice, no_label]}))
    proc = run_explain("-f", str(path))
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert entry(out, "ns/svc")["cluster_endpoints"] == ["198.18.1.1:8080"]
    assert {(s["name"], s["reason"], s.get("part", "")) for s in out["skipped"]} == {
        ("s1", "invalid-ip", "endpoints[1]"), ("s2", "missing-service-name-label", "")}


def test_endpoints_source_flag() -> None:
    endpoints_obj = {
        "apiVersion": "v1", "kind": "Endpoints", "metadata": {"name": "svc", "namespace": "ns"},
        "subsets": [{"addresses": [{"ip": "198.18.1.7"}],
                     "ports": [{"name": "http", "port": 8080}]}],
    }
    text = json.dumps({"kind": "List", "items": [node(), service(), endpoints_obj,
                                                 eps_slice("s1", [ep("198.18.1.1")])]})
    eps = json.loads(run_explain("--endpoints-source", "endpoints", stdin=text).stdout)
    slices = json.loads(run_explain(stdin=text).stdout)
    assert entry(eps, "ns/svc")["cluster_endpoints"] == ["198.18.1.7:8080"]
    assert entry(eps, "ns/svc")["endpoints"][0]["slices"] == ["svc#0/IPv4"]
    assert entry(slices, "ns/svc")["cluster_endpoints"] == ["198.18.1.1:8080"]


def test_unreadable_input_fails_clearly(tmp_path: Path) -> None:
    missing = run_explain("-f", str(tmp_path / "nope.yaml"), "--node", "n")
    assert missing.returncode == 2 and "no such file" in missing.stderr
    (tmp_path / "bad.yaml").write_text("kind: [unclosed\n")
    bad = run_explain(str(tmp_path / "bad.yaml"), "--node", "n")
    assert bad.returncode == 2 and "not valid YAML or JSON" in bad.stderr
    assert "Traceback" not in bad.stderr
    no_node = run_explain(stdin=json.dumps(service()))
    assert no_node.returncode == 2 and "--node is required" in no_node.stderr
    bad_labels = run_explain("--node", "n", "--node-labels", "zone", stdin="{}")
    assert bad_labels.returncode == 2 and "KEY=VALUE" in bad_labels.stderr


def test_service_filter() -> None:
    out = json.loads(run_explain("examples/", "--service", "demo/web").stdout)
    assert {s["service"] for s in out["services"]} == {"demo/web"}


def test_both_policies_local_keeps_the_cluster_set_for_pods_and_the_node() -> None:
    # Upstream's short-circuit: with both policies Local, cluster-IP traffic and traffic
    # from outside use only local endpoints (none here: dropped), but pods and the node
    # reaching the NodePort still get the cluster set, so explain must list it.
    text = json.dumps({"kind": "List", "items": [
        node(),
        service(type="NodePort", internalTrafficPolicy="Local", externalTrafficPolicy="Local",
                ports=({"name": "http", "port": 80, "nodePort": 30080},)),
        eps_slice("s1", [ep("198.18.1.1", node="node-b")]),
    ]})
    proc = run_explain(stdin=text)
    assert proc.returncode == 0, proc.stderr
    svc = entry(json.loads(proc.stdout), "ns/svc")
    assert (svc["cluster_endpoints"], svc["local_endpoints"]) == (["198.18.1.1:8080"], [])
    assert svc["policies"]["sets"] == {
        "cluster_ip": "local", "external": "local", "external_from_pods_and_node": "cluster"}
    assert svc["endpoints"][0]["reason"] == "cluster: ready; local: not on this node"


def test_external_reachability_is_judged_per_family() -> None:
    # An IPv4-only externalIP makes only the IPv4 port externally reachable (upstream
    # filters externalIPs by family), so the IPv6 port with internal policy Local has no
    # cluster set and no external traffic.
    text = json.dumps({"kind": "List", "items": [
        node(),
        service(ips=("198.18.128.1", "fd00::10"), ipFamilies=["IPv4", "IPv6"],
                ipFamilyPolicy="RequireDualStack", internalTrafficPolicy="Local",
                externalIPs=["203.0.113.7"]),
        eps_slice("s4", [ep("198.18.1.1", node="node-b")]),
        eps_slice("s6", [ep("fd00::1:1", node="node-b")], address_type="IPv6"),
    ]})
    out = json.loads(run_explain(stdin=text).stdout)
    by_family = {s["family"]: s for s in out["services"]}
    assert by_family["IPv4"]["cluster_endpoints"] == ["198.18.1.1:8080"]
    assert by_family["IPv4"]["policies"]["sets"]["external_from_pods_and_node"] == "cluster"
    assert by_family["IPv6"]["cluster_endpoints"] == []
    assert by_family["IPv6"]["policies"]["uses_cluster_set"] is False
    assert by_family["IPv6"]["policies"]["sets"] == {
        "cluster_ip": "local", "external": None, "external_from_pods_and_node": None}


def test_the_nodes_primary_addresses_and_where_nodeports_listen() -> None:
    kubelet = node(addresses=[("InternalIP", "198.18.0.1"), ("Hostname", "node-a")])
    listing = json.dumps({"kind": "List", "items": [kubelet, service()]})
    proc = run_explain("--nodeport-addresses", "primary", "--node-labels",
                       "topology.kubernetes.io/zone=zone-b", stdin=listing)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)["node"]
    # --node-labels keeps what the Node object says of its addresses.
    assert out["zone"] == "zone-b" and out["primary_ips"] == ["198.18.0.1"]
    assert out["addresses"] == [{"type": "InternalIP", "address": "198.18.0.1"}]
    assert out["nodeports"] == {"nodeport_addresses": ["primary"],
                                "IPv4": ["198.18.0.1/32"], "IPv6": "every local address"}
    assert "nodeports" not in json.loads(run_explain(stdin=listing).stdout)["node"]
    bad = run_explain("--nodeport-addresses", "primry", stdin=listing)
    assert bad.returncode == 2 and "--nodeport-addresses: 'primry' is not a CIDR" in bad.stderr
    table = run_explain("--nodeport-addresses", "primary", "-o", "table", stdin=listing)
    assert ("  NodePorts  IPv4 198.18.0.1/32; IPv6 every local address  "
            "(--nodeport-addresses primary)") in table.stdout.splitlines()


def test_balancing_shown_with_the_node_default_and_a_bad_annotation_skipped() -> None:
    objects = [node(), service("a", annotations={"sliceproxy.io/balancing": "source-hash",
                                                 "sliceproxy.io/fail-fast": "true"}),
               service("b", ips=("198.18.128.2",),
                       annotations={"sliceproxy.io/traffic-per-endpoint": "false"}),
               service("c", ips=("198.18.128.3",),
                       annotations={"sliceproxy.io/balancing": "fastest"}),
               *(eps_slice(f"{s}-1", [ep("198.18.1.10")], service_name=s) for s in "abc")]
    stdin = "\n---\n".join(yaml.safe_dump(o) for o in objects)
    proc = run_explain("--default-balancing", "maglev", "-o", "json", stdin=stdin)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert [entry(out, f"ns/{s}")["balancing"] for s in "abc"] == [
        "source-hash", "maglev", "maglev"]
    # The other opt-ins: the annotation's value, null where the node's flag decides.
    assert [(entry(out, f"ns/{s}")["fail_fast"], entry(out, f"ns/{s}")["traffic_per_endpoint"])
            for s in "abc"] == [(True, None), (None, False), (None, None)]
    assert [(s["name"], s["reason"]) for s in out["skipped"]] == [("c", "invalid-value")]
