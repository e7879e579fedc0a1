"""The shipped DaemonSet on real nodes, as an operator runs it: the image built from the
repo's Dockerfile, `kubectl apply -f deploy/daemonset.yaml` with only the image and the
API server's address set, then real pods talking through it.

The cluster (tests/nodes/cluster.py) has the shape most clusters have: the API server
reached by a name only the nodes' resolver knows (`master: https://api.cluster.test:
6443`), kubelets configured with a cluster DNS Service, and a Windows Node, on which no
agent may land (every `rollout status` below would wait for it forever).

Checked in order on one cluster: one agent per Linux node, Ready through its own probes,
on its service account under RBAC; its logs, /metrics and dump on every node; traffic
from pods on every node (ClusterIP TCP and UDP, cluster DNS through its ClusterIP,
NodePort from outside, externalTrafficPolicy Local, a topology preference, the API
server through the `kubernetes` Service); a fourth node joining with no rules of anyone;
a rollout to another image with clients connecting throughout; nftables mode by the
ConfigMap.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest

from labs.realcp.addressing import url_host
from labs.realcp.controlplane import API_PORT, KUBERNETES_SERVICE_IP
from proxy.lab.poll import wait, waited
from proxy.lab.probe import http_get
from tests.nodes import workload as wl
from tests.nodes.cluster import SHIPPED_IMAGE_REF, WINDOWS_NODE, NodeCluster
from tests.nodes.conftest import report
from tests.nodes.images import retag
from tests.nodes.node import NodeSpec
from tests.nodes.scenario import Workload, asks, eventually_served, ready, rollout_status
from tests.nodes.traffic import Clients

pytestmark = [pytest.mark.nodes, pytest.mark.root, pytest.mark.slow]

DS_NS, DS_NAME = "sliceproxy", "sliceproxy"


def rollout(cluster: NodeCluster, timeout: float = 180) -> None:
    rollout_status(cluster, DS_NS, f"ds/{DS_NAME}", timeout)


def agents(cluster: NodeCluster) -> list[dict[str, Any]]:
    return cluster.pods(DS_NS, "app.kubernetes.io/name=sliceproxy")


@pytest.fixture(scope="module")
def deployed(node_cluster: NodeCluster) -> Iterator[Workload]:
    c = node_cluster
    manifest = wl.shipped_daemonset(c.image.ref, c.api_url)
    started = time.monotonic()
    c.kubectl("apply", "-f", "-", stdin=manifest)
    rollout(c)
    report.append(f"kubectl apply -> every agent Ready: {time.monotonic() - started:.1f}s")
    yield Workload(c)
    c.kubectl("delete", "-f", "-", "--wait=false", stdin=manifest, check=False)


@pytest.fixture(scope="module")
def workload(deployed: Workload) -> Workload:
    deployed.deploy()
    return deployed


# --- the agents ---------------------------------------------------------------------------


def test_one_ready_agent_per_node_on_its_service_account(deployed: Workload) -> None:
    c = deployed.cluster
    running = agents(c)
    # Linux nodes only: the Windows Node is there, and is no place for an agent.
    assert c.node_status(WINDOWS_NODE) is not None
    assert sorted(p["spec"]["nodeName"] for p in running) == sorted(c.nodes)
    for pod in running:
        assert ready(pod), pod["status"]
        (status,) = pod["status"]["containerStatuses"]
        assert status["restartCount"] == 0, status
        # The image built from this checkout (containerd reports either of its names).
        assert pod["spec"]["containers"][0]["image"] == c.image.ref
        assert status["image"] in {c.image.ref, SHIPPED_IMAGE_REF}, status
        # The service account's token, under RBAC (authorization Node,RBAC): the
        # ClusterRole as shipped is enough to list and watch everything it needs.
        assert pod["spec"]["serviceAccountName"] == "sliceproxy"
        logs = c.kubectl("-n", DS_NS, "logs", pod["metadata"]["name"]).stdout
        assert f"API server {c.api_url} (from in-cluster service account, address from " \
               "--master)" in logs, logs[:2000]
        # The configured (default text) format, one key=value line each.
        first = [ln for ln in logs.splitlines() if 'msg="first sync done' in ln]
        assert len(first) == 1 and re.match(r"^time=\S+ level=info logger=\S+ msg=", first[0])
        assert "level=error" not in logs and "forbidden" not in logs.lower(), logs


def test_metrics_and_dump_on_every_node(deployed: Workload) -> None:
    c = deployed.cluster
    for pod in agents(deployed.cluster):
        node = c.nodes[pod["spec"]["nodeName"]]
        # /metrics stays on the node's loopback (the ConfigMap's metrics-bind-address).
        status, body = http_get(node.netns, "127.0.0.1", 10249, "/metrics")
        assert status == 200
        stamp = re.search(rb"^kubeproxy_sync_proxy_rules_last_timestamp_seconds (\S+)$",
                          body, re.M)
        assert stamp and float(stamp.group(1)) > 0
        assert http_get(node.netns, "127.0.0.1", 10256, "/healthz")[0] == 200
        out = c.kubectl("-n", DS_NS, "exec", pod["metadata"]["name"], "--", "python", "-m",
                        "proxy", "dump", "--service", "default/kubernetes", "-o", "json")
        dump = json.loads(out.stdout)
        assert dump["node"]["name"] == node.name
        (entry,) = [s for s in dump["services"] if s["port"] == "https"]
        assert entry["cluster_endpoints"] == [f"{url_host(c.cp.api_addr)}:{API_PORT}"]


# --- traffic from real pods ---------------------------------------------------------------


def test_cluster_ip_tcp_and_udp_from_pods_on_every_node(workload: Workload) -> None:
    assert len(workload.echo) == 2 * len(workload.cluster.nodes)
    # Every pod of the Deployment answers, on every node, and nothing else does.
    workload.check_cluster_ip("iptables mode")


def test_pods_resolve_cluster_names_through_the_cluster_dns_service(
        workload: Workload) -> None:
    workload.check_cluster_dns("iptables mode")


def test_node_port_from_outside_the_cluster_to_every_node(workload: Workload) -> None:
    d = workload
    for node in d.cluster.nodes.values():
        eventually_served(d.cluster.outside, str(node.address), wl.NODE_PORT, set(d.echo),
                          what=f"NodePort on {node.name} from outside")


def test_external_traffic_policy_local_answers_only_with_local_pods(
        workload: Workload) -> None:
    d = workload
    for node in d.cluster.nodes.values():
        local = {p for p, n in d.echo.items() if n == node.name}
        assert local, f"no echo pod on {node.name}"
        eventually_served(d.cluster.outside, str(node.address), wl.LOCAL_NODE_PORT, local,
                          what=f"Local NodePort on {node.name}")


def test_topology_preference_keeps_traffic_on_the_node(workload: Workload) -> None:
    d = workload
    for node, netns in d.clients.items():
        local = {p for p, n in d.echo.items() if n == node}
        eventually_served(netns, d.ips["echo-near"], 80, local,
                          what=f"echo-near from {node}")


def test_a_pod_reaches_the_api_server_through_the_kubernetes_service(
        workload: Workload) -> None:
    c = workload.cluster
    pod = next(iter(workload.echo))
    # The pod's own service account token and CA, at the address the kubelet gave it
    # (KUBERNETES_SERVICE_HOST: the ClusterIP). The API server refuses anonymous
    # requests here, so a 200 means the token was accepted.
    script = (
        "import json, os, ssl, urllib.request\n"
        "sa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
        "host = os.environ['KUBERNETES_SERVICE_HOST']\n"
        "req = urllib.request.Request(f'https://{host}:443/version', headers={\n"
        "    'Authorization': 'Bearer ' + open(sa + '/token').read()})\n"
        "ctx = ssl.create_default_context(cafile=sa + '/ca.crt')\n"
        "print(host, json.load(urllib.request.urlopen(req, context=ctx, timeout=10))"
        "['gitVersion'])\n")
    out = c.kubectl("-n", wl.NAMESPACE, "exec", pod, "--", "python", "-c", script).stdout
    assert out.split() == [KUBERNETES_SERVICE_IP, "v1.20.2"], out


# --- a node with no rules of anyone -------------------------------------------------------


def test_a_fourth_node_without_any_rules_serves_within_30s(workload: Workload) -> None:
    c = workload.cluster
    spec = NodeSpec("node-4", "zone-b", 3)
    node = c.add_node(spec, wait=False)
    # Nothing programs service addresses on it: no proxy ever ran there.
    rules = node.exec(["iptables-save", "-t", "nat"]).stdout + \
        node.exec(["nft", "list", "ruleset"]).stdout
    assert "SPX-" not in rules and "KUBE-SERVICES" not in rules and "sliceproxy" not in rules
    c.kubectl("apply", "-f", "-", stdin=wl.as_list(wl.client_pod(spec.name, c.pause.ref)))

    def served() -> bool:
        pods = [p for p in c.pods(wl.NAMESPACE, "app=client")
                if p["spec"]["nodeName"] == spec.name and ready(p)]
        if not pods:
            return False
        got = asks(c.pod_netns(pods[0]), workload.ips["echo"], 80, count=3)
        return set(got) <= set(workload.echo)

    took = waited(served, 120, "a pod on the new node served through a ClusterIP",
                interval=0.5)
    since_kubelet = time.monotonic() - node.kubelet_started
    report.append(f"fourth node: kubelet start -> its pod served {since_kubelet:.1f}s "
                  f"({took:.1f}s after the node was made)")
    assert since_kubelet <= 30.0, f"{since_kubelet:.1f}s from kubelet start to traffic"

    def agent_ready() -> bool:
        mine = [p for p in agents(c) if p["spec"]["nodeName"] == spec.name]
        assert len(mine) <= 1, mine
        return bool(mine) and ready(mine[0])

    # Ready follows through its readiness probe (every 5 s in the shipped manifest).
    wait(agent_ready, 60, "the new node's agent Ready", interval=0.5)
    report.append(f"fourth node: its agent Ready {time.monotonic() - node.kubelet_started:.1f}s"
                  " after kubelet start")


# --- a rollout with traffic flowing -------------------------------------------------------


def test_a_rollout_to_a_new_image_drops_no_connection(workload: Workload) -> None:
    c = workload.cluster
    workload.refresh()
    # The same build under a new name: what a rollout replaces is the pods.
    new = retag(c.image, "rollout")
    for node in c.nodes.values():
        node.import_image(new.archive)
    before = {p["metadata"]["uid"] for p in agents(c)}
    with Clients(workload.clients, workload.ips["echo"], set(workload.echo)) as clients:
        started = time.monotonic()
        c.kubectl("-n", DS_NS, "set", "image", f"ds/{DS_NAME}", f"sliceproxy={new.ref}")
        rollout(c, timeout=300)
        took = time.monotonic() - started
        # Traffic after the last agent is Ready, so late failures are counted too.
        clients.more_rounds(50)
    after = agents(c)
    assert not before & {p["metadata"]["uid"] for p in after}
    assert all(p["spec"]["containers"][0]["image"] == new.ref for p in after)
    t = clients.tally
    report.append(f"rollout to a new image over {len(after)} nodes: {took:.1f}s, "
                  f"{t.summary()}")
    assert t.attempts > 50
    assert t.failures == [], t.failures[:10]
    assert t.broken_long == []
    # A new agent clears no conntrack at its first sync (issue 28): every UDP flow keeps
    # its endpoint and every datagram is answered across the rollout.
    assert t.udp_moved == [] and t.udp_unanswered == 0, t.summary()


# --- nftables mode ------------------------------------------------------------------------


def test_nftables_mode_and_json_logs_by_the_configmap(workload: Workload) -> None:
    c = workload.cluster
    ref = agents(workload.cluster)[0]["spec"]["containers"][0]["image"]
    c.kubectl("apply", "-f", "-", stdin=wl.shipped_daemonset(ref, c.api_url, "nftables",
                                                             json_logs=True))
    c.kubectl("-n", DS_NS, "rollout", "restart", f"ds/{DS_NAME}")
    rollout(c, timeout=300)
    for pod in agents(c):
        lines = c.kubectl("-n", DS_NS, "logs", pod["metadata"]["name"]).stdout.splitlines()
        records = [json.loads(line) for line in lines]  # every line one JSON object
        first = [r for r in records if r["msg"].startswith("first sync done")]
        assert len(first) == 1 and first[0]["level"] == "info", records[:5]
        assert any(r.get("mode") == "nftables" for r in records)
    workload.refresh()
    for node in c.nodes.values():
        tables = node.exec(["nft", "list", "tables"]).stdout
        assert "ip sliceproxy" in tables, tables
        nat = node.exec(["iptables-save", "-t", "nat"]).stdout
        assert "SPX-" not in nat, "the iptables mode's chains were not cleaned up"
    workload.check_cluster_ip("nftables mode")
    workload.check_cluster_dns("nftables mode")
    for node in c.nodes.values():
        eventually_served(c.outside, str(node.address), wl.NODE_PORT, set(workload.echo),
                          what=f"NodePort on {node.name} in nftables mode")
