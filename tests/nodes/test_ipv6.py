"""Both shipped manifests on a single-stack IPv6 cluster (tests/nodes/cluster.py with
IPV6_ONLY: nodes, pods, Services, the API server and the cluster DNS all in fd00::/8;
no IPv4 address anywhere but loopback), as an operator of such a cluster applies them.

One cluster, two rollouts, in order:
1. kubeadm's kube-proxy add-on phase writes its ConfigMap for an IPv6 cluster
   (`bindAddress: "::"`); deploy/kubeadm/daemonset.yaml reads it, copied into
   sliceproxy's ConfigMap as docs/migrate.md does (iptables mode, kubeadm's
   default; the API server by the control-plane endpoint's name, an AAAA record): every
   agent Ready through the kubelet's probes of the node's IPv6 address; ClusterIP (TCP,
   UDP) from a pod on every node, NodePort from outside to every node, the API server
   through the `kubernetes` Service; every connection counted, none may fail.
2. deploy/daemonset.yaml with `master: https://[fd00:198:18:96::1]:6443` in nftables
   mode, in place of the first, with clients busy on every node throughout the switch;
   the same checks.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from ipaddress import ip_address, ip_network
from typing import Any

import pytest
import yaml

from labs.realcp.addressing import IPV6, IPV6_ONLY, url_host
from labs.realcp.controlplane import API_PORT
from proxy.netns_lab.poll import wait
from tests.nodes import workload as wl
from tests.nodes.cluster import NodeCluster
from tests.nodes.conftest import LONG, report, started_cluster
from tests.nodes.kubeadm import install_kube_proxy, run_documented
from tests.nodes.scenario import Counts, Workload, ready, rollout_status
from tests.nodes.traffic import Clients
from tests.procedures import doc_block, steps

pytestmark = [pytest.mark.nodes, pytest.mark.root, pytest.mark.slow]

SYSTEM, SHIPPED_NS = "kube-system", "sliceproxy"
AGENTS = "app.kubernetes.io/name=sliceproxy"
ULA = ip_network("fd00::/8")
SETTLE_ROUNDS = 200 if LONG else 50  # client rounds after the switch's last agent Ready
counts = Counts()  # every counted connection of the module, by mode and kind


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    started = time.monotonic()
    with started_cluster(tmp_path_factory.mktemp("ipv6"), stack=IPV6_ONLY) as c:
        yield c
    report.append(f"IPv6 module: {time.monotonic() - started:.0f}s; {counts.summary()}")


@pytest.fixture(scope="module")
def kubeadm_variant(cluster: NodeCluster, tmp_path_factory: pytest.TempPathFactory) -> str:
    """kubeadm's add-on phase for this cluster, its kube-proxy DaemonSet deleted at once
    (kube-proxy never runs: the ConfigMap is what counts), sliceproxy's ConfigMap copied
    from it (docs/migrate.md, step 1), then the kubeadm variant; returns kubeadm's
    config.conf."""
    c = cluster
    workdir = tmp_path_factory.mktemp("kubeadm")
    install_kube_proxy(c, workdir)
    c.kubectl("-n", SYSTEM, "delete", "daemonset", "kube-proxy")
    run_documented(c, steps(doc_block("migrate.md", "## kube-proxy → sliceproxy"))["1"],
                   workdir)
    started = time.monotonic()
    c.kubectl("apply", "-f", "-", stdin=wl.kubeadm_daemonset(c.image.ref))
    rollout_status(c, SYSTEM, "ds/sliceproxy")
    report.append(f"IPv6, kubeadm variant: apply -> every agent Ready "
                  f"{time.monotonic() - started:.1f}s")
    config: str = c.get_json("configmap", "-n", SYSTEM, "kube-proxy")["data"]["config.conf"]
    return config


@pytest.fixture(scope="module")
def workload(cluster: NodeCluster, kubeadm_variant: str) -> Workload:
    w = Workload(cluster)
    w.deploy()
    return w


def is_v6(text: str) -> bool:
    return ip_address(text) in ULA


def agents(c: NodeCluster, namespace: str) -> list[dict[str, Any]]:
    return c.pods(namespace, AGENTS)


def check_agents(c: NodeCluster, namespace: str, what: str) -> None:
    """One agent per node, Ready (the kubelet probes it at the node's IPv6 address),
    never restarted, no error in its log."""
    running = agents(c, namespace)
    assert sorted(p["spec"]["nodeName"] for p in running) == sorted(c.nodes)
    for pod in running:
        assert ready(pod), pod["status"]
        assert is_v6(pod["status"]["podIP"]), pod["status"]  # hostNetwork: the node's
        (status,) = pod["status"]["containerStatuses"]
        assert status["restartCount"] == 0, status
        logs = c.kubectl("-n", namespace, "logs", pod["metadata"]["name"]).stdout
        assert "level=error" not in logs and "Traceback" not in logs, logs[-3000:]
    report.append(f"IPv6, {what}: {sum(map(ready, running))} of {len(c.nodes)} agents Ready")


def check_traffic(w: Workload, mode: str) -> None:
    """ClusterIP (TCP, UDP) and NodePort over IPv6, every connection counted, none failing
    (Workload.check_every_family); pods resolve a cluster name through the cluster DNS
    Service's IPv6 ClusterIP."""
    assert all(is_v6(ip) for ips in w.family_ips.values() for ip in ips), w.family_ips
    assert w.check_every_family(mode, counts) == []
    w.check_cluster_dns(f"{mode} mode")


def check_kubernetes_service(w: Workload, namespace: str) -> None:
    """A pod reaches the API server through the `kubernetes` Service (its IPv6 ClusterIP
    from the pod's environment) with its own token; every agent resolved the Service to
    the API server's IPv6 address."""
    c = w.cluster
    script = (
        "import json, os, ssl, urllib.request\n"
        "sa = '/var/run/secrets/kubernetes.io/serviceaccount'\n"
        "host = os.environ['KUBERNETES_SERVICE_HOST']\n"
        "req = urllib.request.Request(f'https://[{host}]:443/version', headers={\n"
        "    'Authorization': 'Bearer ' + open(sa + '/token').read()})\n"
        "ctx = ssl.create_default_context(cafile=sa + '/ca.crt')\n"
        "print(host, json.load(urllib.request.urlopen(req, context=ctx, timeout=10))"
        "['gitVersion'])\n")
    pod = next(iter(w.echo))
    out = c.kubectl("-n", wl.NAMESPACE, "exec", pod, "--", "python", "-c", script).stdout
    assert out.split() == [str(IPV6.kubernetes_service_ip), "v1.20.2"], out
    for agent in agents(c, namespace):
        out = c.kubectl("-n", namespace, "exec", agent["metadata"]["name"], "--", "python",
                        "-m", "proxy", "dump", "--service", "default/kubernetes", "-o",
                        "json").stdout
        (entry,) = [s for s in json.loads(out)["services"] if s["port"] == "https"]
        assert entry["cluster_endpoints"] == [f"{url_host(c.cp.api_addr)}:{API_PORT}"], entry


def rules(c: NodeCluster) -> dict[str, str]:
    """Every node's IPv6 nat table (both iptables back ends) and nf_tables tables."""
    return {n.name: "".join(n.exec([tool, "-t", "nat"]).stdout for tool in (
        "ip6tables-nft-save", "ip6tables-legacy-save")) + n.exec(["nft", "list", "tables"]).stdout
        for n in c.nodes.values()}


# --- the cluster ----------------------------------------------------------------------------


def test_nodes_services_and_the_api_server_are_ipv6_only(cluster: NodeCluster) -> None:
    c = cluster
    for node in c.nodes.values():
        status = c.node_status(node.name)
        assert status is not None
        internal = [a["address"] for a in status["status"]["addresses"]
                    if a["type"] == "InternalIP"]
        assert internal == [str(node.address)] and is_v6(internal[0]), status["status"]
    svc = c.get_json("service", "-n", "default", "kubernetes")["spec"]
    assert svc["clusterIP"] == str(IPV6.kubernetes_service_ip), svc
    endpoints = c.get_json("endpoints", "-n", "default", "kubernetes")
    assert [a["ip"] for s in endpoints["subsets"] for a in s["addresses"]] == [
        str(IPV6.api_addr)], endpoints


# --- the kubeadm variant, iptables mode -----------------------------------------------------


def test_kubeadm_variant_every_agent_ready(cluster: NodeCluster, kubeadm_variant: str) -> None:
    # What kubeadm writes for a cluster whose API server advertises an IPv6 address.
    config = yaml.safe_load(kubeadm_variant)
    assert config["bindAddress"] == "::", kubeadm_variant
    assert config["clusterCIDR"] == str(IPV6.pods), kubeadm_variant
    check_agents(cluster, SYSTEM, "kubeadm variant (bindAddress ::)")


def test_kubeadm_variant_traffic_over_ipv6(workload: Workload) -> None:
    assert all("SPX-SERVICES" in r for r in rules(workload.cluster).values())
    check_traffic(workload, "iptables")
    check_kubernetes_service(workload, SYSTEM)


# --- the shipped DaemonSet, nftables mode -------------------------------------------------


def test_shipped_daemonset_in_nftables_mode_replaces_it_with_clients_busy(
        workload: Workload) -> None:
    c, w = workload.cluster, workload
    w.refresh()
    manifest = wl.shipped_daemonset(c.image.ref, c.cp.node_url, "nftables")
    assert f"master: https://[{IPV6.api_addr}]:{API_PORT}" in manifest
    with Clients(w.clients, w.ips["echo"], set(w.echo)) as clients:
        started = time.monotonic()
        c.kubectl("-n", SYSTEM, "delete", "daemonset", "sliceproxy")
        wait(lambda: not agents(c, SYSTEM), 120, "the kubeadm variant's pods gone",
             interval=0.2)
        c.kubectl("apply", "-f", "-", stdin=manifest)
        rollout_status(c, SHIPPED_NS, "ds/sliceproxy")
        took = time.monotonic() - started
        clients.more_rounds(SETTLE_ROUNDS)
    t = clients.tally
    report.append(f"IPv6, kubeadm variant (iptables) -> shipped (nftables): {took:.1f}s, "
                  f"{t.summary()}")
    check_agents(c, SHIPPED_NS, "shipped DaemonSet (nftables)")
    assert t.attempts > SETTLE_ROUNDS
    assert t.failures == [], t.failures[:10]
    # The new agent clears no conntrack at its first sync: every UDP flow keeps its pod.
    assert t.broken_long == [] and t.udp_moved == [] and t.udp_unanswered == 0, t.summary()
    for node, text in rules(c).items():
        assert "ip6 sliceproxy" in text, (node, text)
        assert "SPX-" not in text, f"{node}: the iptables mode's chains were left: {text}"


def test_shipped_daemonset_traffic_over_ipv6(workload: Workload) -> None:
    check_traffic(workload, "nftables")
    check_kubernetes_service(workload, SHIPPED_NS)
