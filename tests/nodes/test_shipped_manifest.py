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
server through the `kubernetes` Service); with clients connecting throughout: a rollout
to an image whose rules differ in layout and its rollback, nftables mode by the
ConfigMap and its rollback; a fourth node joining with no rules of anyone; the
uninstall as documented.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from labs.realcp.addressing import url_host
from labs.realcp.controlplane import API_PORT, KUBERNETES_SERVICE_IP
from proxy.dataplane.common.node_settings import NodeSettingsOptions, wanted
from proxy.netns_lab.poll import wait, waited
from proxy.netns_lab.probe import http_get
from tests.nodes import workload as wl
from tests.nodes.cluster import SHIPPED_IMAGE_REF, WINDOWS_NODE, NodeCluster
from tests.nodes.conftest import report
from tests.nodes.images import ROOT, Image, layered
from tests.nodes.node import Node, NodeSpec
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


# --- upgrades and rollbacks with traffic flowing ------------------------------------------

# Another version of the agent, whose iptables rules differ in layout from this tree's:
# the chain the built-in POSTROUTING jumps to renamed, the chain every service's chains
# jump to for the masquerade mark renamed, every endpoint chain renamed, and the jumps
# from PREROUTING, OUTPUT and FORWARD written with another comment. (old, new), each
# once in proxy/dataplane/iptables/render.py.
LAYOUT_2 = (
    ('POSTROUTING = f"{_PREFIX}POSTROUTING"', 'POSTROUTING = f"{_PREFIX}POSTROUTING-2"'),
    ('MARK_MASQ = f"{_PREFIX}MARK-MASQ"', 'MARK_MASQ = f"{_PREFIX}MASQ-MARK"'),
    ('return f"{PREFIX}SEP-{', 'return f"{PREFIX}EP-{'),
    ('comment("sliceproxy service portals")', 'comment("sliceproxy service portals, v2")'),
)
RENDER = "proxy/dataplane/iptables/render.py"


def layout_2_image(c: NodeCluster) -> Image:
    text = (ROOT / RENDER).read_text()
    for old, new in LAYOUT_2:
        assert text.count(old) == 1, f"{RENDER} no longer has {old!r} once: update LAYOUT_2"
        text = text.replace(old, new)
    return layered(c.image, "layout2", {RENDER: text})


def nat_layout(c: NodeCluster) -> dict[str, str]:
    """Node -> which layout its nat table holds ("1", "2", or what is wrong)."""
    out = {}
    for node in c.nodes.values():
        nat = node.exec(["iptables-save", "-t", "nat"]).stdout
        one = (":SPX-MARK-MASQ " in nat and ":SPX-POSTROUTING " in nat and ":SPX-SEP-" in nat
               and '"sliceproxy service portals"' in nat)
        two = (":SPX-MASQ-MARK " in nat and ":SPX-POSTROUTING-2 " in nat and ":SPX-EP-" in nat
               and '"sliceproxy service portals, v2"' in nat)
        old_left = [n for n in ("SPX-MARK-MASQ", "SPX-MASQ-MARK", "SPX-SEP-", "SPX-EP-",
                                "SPX-POSTROUTING ", "SPX-POSTROUTING-2") if n in nat]
        out[node.name] = "1" if one and not two and len(old_left) == 3 else \
            "2" if two and not one and len(old_left) == 3 else f"mixed: {old_left}"
    return out


def converged(c: NodeCluster) -> None:
    """Every agent's first sync is done and none of its writes was refused."""
    for pod in agents(c):
        logs = c.kubectl("-n", DS_NS, "logs", pod["metadata"]["name"]).stdout
        assert "first sync done" in logs and "apply failed" not in logs \
            and "transaction failed" not in logs, logs[-3000:]


def roll(c: NodeCluster, clients: Clients, what: str, *command: str) -> None:
    """Run the kubectl command that rolls the agents; wait for every one Ready; then
    traffic on (late failures count too). Reports this step's share of the tally."""
    t = clients.tally
    before = (t.attempts, len(t.failures), len(t.broken_long), len(t.udp_moved))
    started = time.monotonic()
    c.kubectl(*command)
    rollout(c, timeout=300)
    took = time.monotonic() - started
    clients.more_rounds(50)
    attempts, failed, broken, moved = (
        n - b for n, b in zip((t.attempts, len(t.failures), len(t.broken_long),
                               len(t.udp_moved)), before, strict=True))
    report.append(f"{what} over {len(c.nodes)} nodes: {took:.1f}s, {attempts} connections, "
                  f"{failed} failed, {broken} long-lived broken, {moved} UDP flows moved")


def assert_nothing_dropped(clients: Clients) -> None:
    t = clients.tally
    assert t.attempts > 100
    assert t.failures == [], t.failures[:10]
    assert t.broken_long == []
    # An agent clears no conntrack at its first sync (issue 28): every UDP flow keeps
    # its endpoint and every datagram is answered throughout.
    assert t.udp_moved == [] and t.udp_unanswered == 0, t.summary()


def test_a_rollout_to_another_rule_layout_and_its_rollback_drop_nothing(
        workload: Workload) -> None:
    """An upgrade whose rules differ in layout (LAYOUT_2), then `kubectl rollout undo`,
    with clients on every node throughout: each agent starts over rules another version
    of itself wrote and replaces them in one step."""
    c = workload.cluster
    workload.refresh()
    new = layout_2_image(c)
    for node in c.nodes.values():
        node.import_image(new.archive)
    assert set(nat_layout(c).values()) == {"1"}, nat_layout(c)
    before = {p["metadata"]["uid"] for p in agents(c)}
    with Clients(workload.clients, workload.ips["echo"], set(workload.echo)) as clients:
        # The agent and its init container, as docs/upgrade.md says.
        roll(c, clients, "rollout to an image with another rule layout", "-n", DS_NS, "set",
             "image", f"ds/{DS_NAME}", f"sliceproxy={new.ref}", f"node-settings={new.ref}")
        after = agents(c)
        assert not before & {p["metadata"]["uid"] for p in after}
        assert all(p["spec"]["containers"][0]["image"] == new.ref
                   and p["spec"]["initContainers"][0]["image"] == new.ref for p in after)
        assert set(nat_layout(c).values()) == {"2"}, nat_layout(c)
        converged(c)
        roll(c, clients, "rollback to the previous image (rollout undo)", "-n", DS_NS,
             "rollout", "undo", f"ds/{DS_NAME}")
    assert all(p["spec"]["containers"][0]["image"] == c.image.ref for p in agents(c))
    assert set(nat_layout(c).values()) == {"1"}, nat_layout(c)
    converged(c)
    report.append(f"rollout and rollback: {clients.tally.summary()}")
    assert_nothing_dropped(clients)


# --- nftables mode ------------------------------------------------------------------------


def test_nftables_mode_and_json_logs_by_the_configmap(workload: Workload) -> None:
    """The switch as docs/upgrade.md tells it: the ConfigMap changed, the agents
    restarted, with clients on every node throughout; each new agent removes the
    iptables mode's rules only once its own are in the kernel."""
    c = workload.cluster
    workload.refresh()
    ref = agents(workload.cluster)[0]["spec"]["containers"][0]["image"]
    with Clients(workload.clients, workload.ips["echo"], set(workload.echo)) as clients:
        c.kubectl("apply", "-f", "-", stdin=wl.shipped_daemonset(ref, c.api_url, "nftables",
                                                                 json_logs=True))
        roll(c, clients, "mode switch iptables -> nftables by the ConfigMap", "-n", DS_NS,
             "rollout", "restart", f"ds/{DS_NAME}")
    assert_nothing_dropped(clients)
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


def test_the_mode_switch_rolled_back_by_the_configmap(workload: Workload) -> None:
    """Back to iptables mode as the operator got there: the manifest as it was,
    applied again, and the agents restarted, with clients on every node throughout."""
    c = workload.cluster
    workload.refresh()
    ref = agents(workload.cluster)[0]["spec"]["containers"][0]["image"]
    with Clients(workload.clients, workload.ips["echo"], set(workload.echo)) as clients:
        c.kubectl("apply", "-f", "-", stdin=wl.shipped_daemonset(ref, c.api_url))
        roll(c, clients, "mode switch rolled back, nftables -> iptables", "-n", DS_NS,
             "rollout", "restart", f"ds/{DS_NAME}")
    assert_nothing_dropped(clients)
    for node in c.nodes.values():
        assert "sliceproxy" not in node.exec(["nft", "list", "tables"]).stdout
    assert set(nat_layout(c).values()) == {"1"}, nat_layout(c)
    converged(c)


# --- a node with no rules of anyone (after the rollouts: they roll over three nodes, not
# four) ----------------------------------------------------------------------------------


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


# --- uninstall (last: it leaves the cluster without a proxy) ------------------------------

UNINSTALL = wl.ROOT / "deploy" / "uninstall.yaml"
# Every node setting the init step may write, in any mode and configuration
# (proxy/dataplane/common/node_settings.py), read in each node's network namespace.
NODE_SETTINGS = tuple(sorted({"/" + s.path for s in wanted(
    NodeSettingsOptions(tcp_be_liberal=True, udp_timeout=30, udp_stream_timeout=120,
                        ipvs=True, strict_arp=True), 1, "5.4.0")}))
SETTINGS_BEFORE: dict[str, dict[str, str]] = {}


def node_settings_now(c: NodeCluster) -> dict[str, dict[str, str]]:
    """Node -> setting file -> value, for the files that exist (ip_vs's only when it is
    loaded)."""
    out = {}
    for node in c.nodes.values():
        lines = node.exec(["grep", "-H", "", *NODE_SETTINGS]).stdout.splitlines()
        out[node.name] = dict(line.split(":", 1) for line in lines)
    return out


@pytest.fixture(scope="module", autouse=True)
def node_settings_before_any_agent(node_cluster: NodeCluster) -> None:
    """Taken before the module's first agent starts (autouse: before `deployed`)."""
    SETTINGS_BEFORE.clear()
    SETTINGS_BEFORE.update(node_settings_now(node_cluster))


def sliceproxy_in_the_kernel(node: Node) -> list[str]:
    """What of sliceproxy's the node's network namespace holds, one line per find."""
    found = []
    for save in ("iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save",
                 "ip6tables-nft-save"):
        out = node.exec([save]).stdout
        found += [f"{save}: {ln}" for ln in out.splitlines()
                  if "SPX-" in ln or "sliceproxy" in ln]
    ruleset = node.exec(["nft", "list", "ruleset"]).stdout
    found += [f"nft: {ln.strip()}" for ln in ruleset.splitlines()
              if "SPX-" in ln or "sliceproxy" in ln]
    if Path("/sys/module/ip_set").exists():  # no set without the module; none loaded here
        found += [f"ipset: {n}" for n in node.exec(["ipset", "list", "-n"]).stdout.split()
                  if n.startswith("SPX-")]
    links = node.exec(["ip", "-o", "link", "show"]).stdout
    found += [f"link: {ln}" for ln in links.splitlines() if "spx-ipvs0" in ln]
    ipvs = node.exec(["cat", "/proc/net/ip_vs"])
    if ipvs.returncode == 0:  # the table exists once ip_vs is loaded
        found += [f"ipvs: {ln}" for ln in ipvs.stdout.splitlines()[3:]]
    record = node.workdir / "host" / "run" / "sliceproxy"  # the node's /run/sliceproxy
    found += [f"record: {p}" for p in record.glob("*")]
    return found


def sliceproxy_in_the_api(c: NodeCluster) -> list[str]:
    """Every object of any listable kind, in any namespace, named or labelled as
    sliceproxy's (events about its pods included)."""
    kinds = c.kubectl("api-resources", "--verbs=list", "-o", "name").stdout.split()
    every = ",".join(kinds)
    named = [n for n in c.kubectl("get", every, "-A", "-o", "name").stdout.split()
             if "sliceproxy" in n]
    labelled = c.kubectl("get", every, "-A", "-o", "name", "-l",
                         "app.kubernetes.io/name in (sliceproxy,sliceproxy-uninstall)"
                         ).stdout.split()
    return sorted({*named, *labelled})


def test_uninstall_as_documented_leaves_nothing_of_sliceproxys(workload: Workload) -> None:
    """docs/uninstall.md's commands as written, with the shipped files (the uninstall
    DaemonSet's image set, as it says): after them no rule, set, interface or virtual
    server of sliceproxy's on any node, every node setting the init step changed back
    to what the node held before the first agent, and no object of sliceproxy's in the
    API."""
    c = workload.cluster
    # Every node's namespace starts from the kernel's values; the fourth node, which
    # joined later, from the same.
    first, *others = SETTINGS_BEFORE.values()
    assert all(o == first for o in others), SETTINGS_BEFORE
    before = {name: SETTINGS_BEFORE.get(name, first) for name in c.nodes}
    in_kernel = {n.name: sliceproxy_in_the_kernel(n) for n in c.nodes.values()}
    assert all(in_kernel.values()), in_kernel  # the agents' rules, before
    in_api = sliceproxy_in_the_api(c)

    def changed() -> int:
        now = node_settings_now(c)
        return sum(now[n].get(k) != v for n in before for k, v in before[n].items())

    changed_before = changed()
    steps = [time.monotonic()]
    # 1. Stop the agents, and wait until each has exited.
    c.kubectl("-n", DS_NS, "delete", "daemonset", DS_NAME)
    c.kubectl("-n", DS_NS, "delete", "pods", "-l", "app.kubernetes.io/name=sliceproxy")
    steps.append(time.monotonic())
    # 2. Rules and node settings, on every node.
    text = UNINSTALL.read_text()
    assert text.count(wl.SHIPPED_IMAGE) == 3, "the doc says to set the image three times"
    uninstall = text.replace(wl.SHIPPED_IMAGE, f"image: {c.image.ref}")
    c.kubectl("apply", "-f", "-", stdin=uninstall)
    rollout_status(c, "sliceproxy-uninstall", "ds/sliceproxy-uninstall", timeout=120)
    steps.append(time.monotonic())
    c.kubectl("delete", "-f", "-", stdin=uninstall)
    steps.append(time.monotonic())
    # 3. What the manifest created.
    c.kubectl("delete", "-f", str(wl.DAEMONSET), "--ignore-not-found")
    steps.append(time.monotonic())
    took = ", ".join(f"{what} {b - a:.1f}s" for what, a, b in zip(
        ("agents stopped", "uninstall DaemonSet done", "its namespace deleted",
         "the manifest's objects deleted"), steps, steps[1:], strict=False))
    left_kernel = {n.name: sliceproxy_in_the_kernel(n) for n in c.nodes.values()}
    left_api = sliceproxy_in_the_api(c)
    report.append(
        f"uninstall as documented over {len(c.nodes)} nodes: {took}; kernel lines of "
        f"sliceproxy's {sum(map(len, in_kernel.values()))} -> "
        f"{sum(map(len, left_kernel.values()))}, API objects {len(in_api)} -> "
        f"{len(left_api)}, node settings not as before {changed_before} -> {changed()}")
    assert left_kernel == {n: [] for n in c.nodes}, left_kernel
    assert left_api == [], left_api
    assert changed_before > 0, "the init step changed nothing: nothing was tested"
    assert node_settings_now(c) == before
