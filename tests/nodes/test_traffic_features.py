"""Issue 39's three features on real nodes, as an operator checks them: the shipped
DaemonSet in nftables mode (the ConfigMap's `cluster-cidr` set to the pod network, as
its comment says), real pods on three kubelet nodes, real connections from pods.

1. Traffic per endpoint: a Service annotated `sliceproxy.io/traffic-per-endpoint` with a
   pod on each node; connections from a client pod on every node; each endpoint's
   `sliceproxy_endpoint_connections_total`, summed over the three agents' `/metrics`,
   equals what its pod answered, exactly, and `/debug/dump` says the same; across an
   agent restart (its pod deleted, the DaemonSet's next one Ready) with connections sent
   while it was away, the counts go on from where they were.
2. Maglev across nodes: a Service annotated `sliceproxy.io/balancing: maglev` with 10
   pods. The same 5-tuples from every node: each node's client pod also holds one shared
   address outside the pod network (SHARED_CLIENT, routed to it by its own node only, and
   masqueraded as any client outside `cluster-cidr`), and sends from fixed source ports;
   every node picks the same endpoint for each, the one the model's Maglev table and the
   kernel's jhash predict. Then the Deployment scaled to 9: the share of the 5-tuples
   that were on the other 9 and moved.
3. Fail fast: a client pod on node-1 holds idle connections (blocked in recv) to a pod on
   node-2 through a ClusterIP annotated `sliceproxy.io/fail-fast` and through one without;
   the pod is deleted (`--grace-period=0 --force`): the first gets ECONNRESET, timed from
   the delete; the second is still answered by the pod. The pod's server ignores SIGTERM
   (its shell holds it), as a process that does not close its connections when told, or
   a pod whose node is gone: what the client sees is the proxy's doing, not the pod's.

`SLICEPROXY_NODES_LONG=1` sends more (10,000 5-tuples per node for Maglev).
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from ipaddress import IPv4Address, ip_address
from typing import Any

import pytest

from proxy.dataplane.nftables.render import HASH_SEED
from proxy.model.balancing import maglev_table
from proxy.netns_lab import probe
from proxy.netns_lab.poll import wait
from tests.fakekernel.jhash import nft_jhash
from tests.nodes import workload as wl
from tests.nodes.cluster import CLUSTER_CIDR, NodeCluster
from tests.nodes.conftest import LONG, report, started_cluster
from tests.nodes.scenario import eventually_served, ready, rollout_status

pytestmark = [pytest.mark.nodes, pytest.mark.root, pytest.mark.slow]

NS, DS_NS = wl.NAMESPACE, "sliceproxy"
AGENTS = "app.kubernetes.io/name=sliceproxy"
METRICS = 10249  # the ConfigMap's metrics-bind-address, on each node's loopback
SENDS = 200 if LONG else 30  # connections per client pod and round, counted per endpoint
TUPLES = 10_000 if LONG else 300  # 5-tuples asked from every node, Maglev
MAGLEV_PODS = 10
# One client address on every node: outside the pod network and the cp network, inside
# 198.18.0.0/15; each node routes it to its own client pod only.
SHARED_CLIENT = IPv4Address("198.18.97.1")
FIRST_SPORT = 20000  # below the ephemeral range: no other socket takes these ports
GOAL = 2.0  # seconds from the delete to the client's ECONNRESET (issue 39)
MOVED_BOUND = 0.05  # the goal is 2%; 300 5-tuples are a small sample
PER_ENDPOINT = {"sliceproxy.io/traffic-per-endpoint": "true"}
FAIL_FAST = {"sliceproxy.io/fail-fast": "true"}
MAGLEV = {"sliceproxy.io/balancing": "maglev"}
# The server as its shell's child: SIGTERM reaches only the shell, which ignores it.
HOLD_ON_TERM = ("trap '' TERM; python -m proxy.netns_lab.echo --backend \"$POD_NAME==0.0.0.0\""
                f" --tcp {wl.TCP_PORT} --udp {wl.UDP_PORT} & wait")
LABEL = re.compile(r'(\w+)="([^"]*)"')
Obj = dict[str, Any]


def deployment(name: str, image: str, replicas: int) -> Obj:
    """The workload's echo Deployment (spread evenly over the nodes) under another name."""
    d = wl.echo_deployment(image, replicas)
    labels = {"app": name}
    d["metadata"]["name"] = name
    d["spec"]["selector"]["matchLabels"] = labels
    template = d["spec"]["template"]
    template["metadata"]["labels"] = labels
    template["spec"]["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"] = labels
    return d


def holding_pod(name: str, node: str, image: str) -> Obj:
    """An echo pod on `node` that keeps serving after SIGTERM (HOLD_ON_TERM)."""
    pod = deployment(name, image, 1)["spec"]["template"]
    spec = pod["spec"]
    del spec["topologySpreadConstraints"]
    spec["nodeName"] = node
    (container,) = spec["containers"]
    container["command"], container["args"] = ["sh", "-c", HOLD_ON_TERM], []
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS, "labels": {"app": name}},
            "spec": spec}


def service(name: str, app: str, annotations: dict[str, str] | None = None) -> Obj:
    meta: Obj = {"name": name, "namespace": NS, "annotations": annotations or {}}
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"selector": {"app": app}, "ports": [wl.TCP]}}


@dataclass
class Lab:
    cluster: NodeCluster
    clients: dict[str, str] = field(default_factory=dict)  # node -> its client pod's netns
    client_ips: dict[str, str] = field(default_factory=dict)  # node -> its client pod's IP
    ips: dict[str, str] = field(default_factory=dict)  # service -> ClusterIP

    def pods(self, app: str) -> dict[str, tuple[str, str]]:
        """Ready pods of `app` not being deleted: name -> (node, pod IP)."""
        return {p["metadata"]["name"]: (p["spec"]["nodeName"], p["status"]["podIP"])
                for p in self.cluster.pods(NS, f"app={app}")
                if ready(p) and not p["metadata"].get("deletionTimestamp")}


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lab]:
    started = time.monotonic()
    with started_cluster(tmp_path_factory.mktemp("traffic")) as c:
        c.kubectl("apply", "-f", "-", stdin=wl.shipped_daemonset(
            c.image.ref, c.api_url, "nftables", cluster_cidr=CLUSTER_CIDR))
        rollout_status(c, DS_NS, "ds/sliceproxy")
        c.kubectl("apply", "-f", "-", stdin=wl.as_list(
            wl.namespace(), deployment("count", c.image.ref, len(c.nodes)),
            deployment("mag", c.image.ref, MAGLEV_PODS),
            holding_pod("held", "node-2", c.image.ref),
            service("counted", "count", PER_ENDPOINT), service("mag", "mag", MAGLEV),
            service("fail-fast", "held", FAIL_FAST), service("plain", "held"),
            *(wl.client_pod(n, c.pause.ref) for n in c.nodes)))
        for name in ("count", "mag"):
            rollout_status(c, NS, f"deploy/{name}")
        lab = Lab(c)
        wait(lambda: len(lab.pods("client")) == len(c.nodes) and lab.pods("held"), 120,
             "the client pods and the held pod Ready", interval=0.2)
        for pod in c.pods(NS, "app=client"):
            lab.clients[pod["spec"]["nodeName"]] = c.pod_netns(pod)
            lab.client_ips[pod["spec"]["nodeName"]] = pod["status"]["podIP"]
        lab.ips = {s["metadata"]["name"]: s["spec"]["clusterIP"]
                   for s in c.get_json("services", "-n", NS)["items"]}
        yield lab
    report.append(f"traffic features module: {time.monotonic() - started:.0f}s")


# --- what each agent says -----------------------------------------------------------------


def endpoint_counts(c: NodeCluster, node: str, svc: str) -> dict[str, int]:
    """`node`'s agent's per-endpoint connection counts of `svc` by endpoint (ip:port),
    with the port's own total under ""."""
    status, body = probe.http_get(c.nodes[node].netns, "127.0.0.1", METRICS, "/metrics")
    assert status == 200, f"{node}: /metrics answered {status}"
    out: dict[str, int] = {}
    for line in body.decode().splitlines():
        name, _, rest = line.partition("{")
        if name not in ("sliceproxy_endpoint_connections_total",
                        "sliceproxy_service_connections_total"):
            continue
        labels = dict(LABEL.findall(rest.rpartition("}")[0]))
        if labels["namespace"] == NS and labels["service"] == svc:
            out[labels.get("endpoint", "")] = int(float(line.rpartition(" ")[2]))
    return out


def dump_port(c: NodeCluster, node: str, svc: str) -> dict[str, Any] | None:
    """`node`'s agent's /debug/dump entry of `svc`'s port; None while it has none."""
    status, body = probe.http_get(c.nodes[node].netns, "127.0.0.1", METRICS,
                                  f"/debug/dump?service={NS}/{svc}")
    if status != 200:
        return None
    ports = [s for s in json.loads(body)["services"] if s["port"] == "tcp"]
    return ports[0] if ports else None


def every_agent_has(c: NodeCluster, svc: str, endpoints: set[str]) -> None:
    """Wait until every agent's dump lists exactly `endpoints` for `svc`."""
    def synced() -> bool:
        return all((d := dump_port(c, n, svc)) is not None
                   and set(d["cluster_endpoints"]) == endpoints for n in c.nodes)

    wait(synced, 60, f"every agent's {svc} at {sorted(endpoints)}", interval=0.2,
         detail=lambda: {n: (dump_port(c, n, svc) or {}).get("cluster_endpoints")
                         for n in c.nodes})


def agent_pod(c: NodeCluster, node: str) -> dict[str, Any] | None:
    mine = [p for p in c.pods(DS_NS, AGENTS) if p["spec"]["nodeName"] == node
            and not p["metadata"].get("deletionTimestamp")]
    return mine[0] if mine else None


# --- 1. traffic per endpoint --------------------------------------------------------------


def send(lab: Lab, nodes: list[str], want: set[str]) -> Counter[str]:
    """SENDS fresh connections from the client pod of each of `nodes`: answers by pod."""
    served: Counter[str] = Counter()
    for node in nodes:
        served += probe.ask(lab.clients[node], lab.ips["counted"], 80, count=SENDS,
                            timeout=2.0)
    assert set(served) <= want and sum(served.values()) == SENDS * len(nodes), served
    return served


def summed(lab: Lab, names: dict[str, str]) -> Counter[str]:
    """Every agent's per-endpoint counts of `counted`, summed, by pod name (`names`:
    endpoint -> pod); each agent's port total is the sum of its endpoints', and its dump
    says what its /metrics says."""
    c, total = lab.cluster, Counter[str]()
    for node in c.nodes:
        counts = endpoint_counts(c, node, "counted")
        port = counts.pop("")
        assert set(counts) <= set(names) and port == sum(counts.values()), (node, counts)
        dump = dump_port(c, node, "counted")
        assert dump is not None
        assert dump["traffic"]["connections"] == port, (node, dump["traffic"])
        in_dump = {e: v["connections"] for e, v in dump["traffic"]["endpoints"].items()}
        assert in_dump == counts, (node, dump["traffic"], counts)
        total += Counter({names[e]: n for e, n in counts.items()})
    return total


def test_each_endpoints_count_is_what_its_pod_served_across_an_agent_restart(
        lab: Lab) -> None:
    c = lab.cluster
    pods = lab.pods("count")
    assert sorted(node for node, _ in pods.values()) == sorted(c.nodes), pods
    names = {f"{addr}:{wl.TCP_PORT}": name for name, (_, addr) in pods.items()}
    every_agent_has(c, "counted", set(names))
    for node, netns in sorted(lab.clients.items()):
        eventually_served(netns, lab.ips["counted"], 80, set(pods),
                          what=f"counted from {node}")
    base = summed(lab, names)  # what the waits above sent counts too
    served = send(lab, sorted(c.nodes), set(pods))
    counted = summed(lab, names)
    assert counted - base == served, (dict(counted - base), dict(served))

    # An agent restart: its pod deleted, connections sent from its node while the
    # DaemonSet brings the next one up; the kernel's counters go on through it.
    node = "node-1"
    old = agent_pod(c, node)
    assert old is not None
    kept = endpoint_counts(c, node, "counted")
    c.kubectl("-n", DS_NS, "delete", "pod", old["metadata"]["name"])
    away = send(lab, [node], set(pods))
    wait(lambda: (p := agent_pod(c, node)) is not None and ready(p)
         and p["metadata"]["uid"] != old["metadata"]["uid"], 120,
         f"the next agent on {node} Ready", interval=0.5)
    now = endpoint_counts(c, node, "counted")
    assert now[""] == kept[""] + SENDS, (kept, now)
    assert {names[e]: n - kept.get(e, 0) for e, n in now.items() if e
            and n != kept.get(e, 0)} == away, (kept, now, away)
    more = send(lab, sorted(c.nodes), set(pods))
    after = summed(lab, names)
    assert after - counted == away + more, (dict(after - counted), dict(away + more))
    report.append(f"traffic per endpoint: {sum((served + away + more).values())} "
                  f"connections from {len(c.nodes)} nodes, each of {len(pods)} endpoints' "
                  f"counts (summed over every agent's /metrics) exactly what its pod "
                  f"served, {SENDS} of them sent while {node}'s agent restarted")


# --- 2. Maglev across nodes ---------------------------------------------------------------


def choices(lab: Lab) -> dict[str, list[str]]:
    """Node -> the answer to each of the TUPLES 5-tuples, asked from every node at once.
    A 5-tuple that timed out is asked once more: a timeout says nothing of which pod
    Maglev picks (one of 900 did in two CI runs, the second beside the kernel tier's
    emulated guests on the same two cores), while a pod answering it is compared."""
    def from_node(node: str) -> list[str]:
        def ask(i: int) -> str:
            return probe.ask_from(lab.clients[node], lab.ips["mag"], 80,
                                  str(SHARED_CLIENT), FIRST_SPORT + i)

        answers = [ask(i) for i in range(TUPLES)]
        again = [i for i, a in enumerate(answers) if a == probe.TIMEOUT]
        for i in again:
            answers[i] = ask(i)
        if again:
            report.append(f"maglev: {len(again)} 5-tuples from {node} timed out and were "
                          "asked again")
        return answers

    forget_flows(lab)
    with ThreadPoolExecutor(len(lab.clients)) as pool:
        return dict(zip(lab.clients, pool.map(from_node, lab.clients), strict=True))


def forget_flows(lab: Lab) -> None:
    """Each node's conntrack entries of SHARED_CLIENT's TCP flows deleted, so that a round
    asks Maglev, not the last round's entries. The rounds reuse each 5-tuple, and a SYN
    meeting an entry in CLOSE whose last packet was the server's late FIN (the client's
    reset went first) passes on that entry's NAT for up to its 10 s (an "ignored" SYN in
    nf_conntrack_proto_tcp.c): to the last round's pick. After the scale-down that can be
    the gone pod, a timeout, and the retry meets the same entry (one CI run)."""
    for node in lab.cluster.nodes.values():
        done = node.exec(["conntrack", "-D", "-p", "tcp", "-s", str(SHARED_CLIENT)])
        assert "flow entries have been deleted" in done.stderr, done.stderr  # 0 is rc 1


def agreed(lab: Lab, by_node: dict[str, list[str]], pods: set[str]) -> list[str]:
    """The answer of each 5-tuple, asserted the same pod from every node; reports the
    share that agreed. A disagreement says what each node's conntrack holds of the
    first such 5-tuples (the probes use the same 5-tuples in each round)."""
    rows = list(zip(*by_node.values(), strict=True))
    same = sum(len(set(row)) == 1 and row[0] in pods for row in rows)
    report.append(f"maglev: {same} of {len(rows)} 5-tuples ({100 * same / len(rows):.2f}%) "
                  f"on the same endpoint from all {len(by_node)} nodes")
    odd = [(FIRST_SPORT + i, row) for i, row in enumerate(rows)
           if len(set(row)) != 1 or row[0] not in pods]
    assert not odd, "\n".join([repr(odd[:10]), *flows_of(lab, [s for s, _ in odd[:3]])])
    return [row[0] for row in rows]


def flows_of(lab: Lab, sports: list[int]) -> list[str]:
    """Each node's conntrack entries of SHARED_CLIENT's TCP flows from `sports`."""
    out = []
    for name, node in sorted(lab.cluster.nodes.items()):
        for sport in sports:
            done = node.exec(["conntrack", "-L", "-p", "tcp", "-s", str(SHARED_CLIENT),
                              "--sport", str(sport)])
            out.append(f"{name} sport {sport}: {(done.stdout or done.stderr).strip()}")
    return out


def predicted(pods: dict[str, tuple[str, str]]) -> list[str]:
    """The pod of each 5-tuple by the model's Maglev table, indexed by the kernel's
    jhash of the client's address and port as nft_hash.c computes it."""
    by_address = {ip_address(addr): name for name, (_, addr) in pods.items()}
    table = maglev_table((ip_address(addr), wl.TCP_PORT) for _, addr in pods.values())
    return [by_address[table[nft_jhash([SHARED_CLIENT.packed, (FIRST_SPORT + i).to_bytes(
        2, "big")], len(table), HASH_SEED)][0]] for i in range(TUPLES)]


def shared_client(lab: Lab, on: bool) -> None:
    """SHARED_CLIENT on (or off) every client pod, each node routing it to its own."""
    verb = "add" if on else "del"
    for node, netns in lab.clients.items():
        subprocess.run(["nsenter", f"--net={netns}", "ip", "addr", verb,
                        f"{SHARED_CLIENT}/32", "dev", "eth0"], check=on, timeout=30,
                       capture_output=True)
        done = lab.cluster.nodes[node].exec(["ip", "route", verb, f"{SHARED_CLIENT}/32",
                                             "via", lab.client_ips[node], "dev", "cni0"])
        assert done.returncode == 0 or not on, done.stderr


def test_maglev_same_endpoint_from_every_node_and_a_removal_moves_few(lab: Lab) -> None:
    c = lab.cluster
    pods = lab.pods("mag")
    assert len(pods) == MAGLEV_PODS, pods
    every_agent_has(c, "mag", {f"{a}:{wl.TCP_PORT}" for _, a in pods.values()})
    assert all((dump_port(c, n, "mag") or {}).get("balancing") == "maglev" for n in c.nodes)
    shared_client(lab, True)
    try:
        before = agreed(lab, choices(lab), set(pods))
        assert before == predicted(pods)
        assert set(before) == set(pods)  # spread over all ten, not one answering all
        c.kubectl("-n", NS, "scale", "deploy/mag", f"--replicas={MAGLEV_PODS - 1}")
        wait(lambda: len(lab.pods("mag")) == MAGLEV_PODS - 1, 60, "one mag pod leaving",
             interval=0.2)
        rest = lab.pods("mag")
        (gone,) = set(pods) - set(rest)
        every_agent_has(c, "mag", {f"{a}:{wl.TCP_PORT}" for _, a in rest.values()})
        after = agreed(lab, choices(lab), set(rest))
    finally:
        shared_client(lab, False)
    assert after == predicted(rest)
    stayed = [i for i, pod in enumerate(before) if pod != gone]
    moved = [i for i in stayed if after[i] != before[i]]
    share = len(moved) / len(stayed)
    report.append(f"maglev, 1 of {MAGLEV_PODS} endpoints removed: {len(moved)} of the "
                  f"{len(stayed)} 5-tuples on the other {MAGLEV_PODS - 1} moved "
                  f"({100 * share:.2f}%; goal 2%)")
    assert share <= MOVED_BOUND, (len(moved), len(stayed))


# --- 3. fail fast ---------------------------------------------------------------------------


def fail_fast_detail(c: NodeCluster, node: str) -> str:
    """What `node`'s agent said and did about vanished endpoints, for a failure."""
    agent = agent_pod(c, node)
    logs = "" if agent is None else c.kubectl(
        "-n", DS_NS, "logs", agent["metadata"]["name"], check=False).stdout
    said = [ln for ln in logs.splitlines() if "flows" in ln or "level=warn" in ln
            or "level=error" in ln]
    n = c.nodes[node]
    table = n.exec(["nft", "list", "table", "inet", "sliceproxy-fail-fast"])
    flows = n.exec(["conntrack", "-L", "-p", "tcp", "--dport", "80"])
    return (f"{node}'s agent: {said[-10:]}\nits table: {table.stdout}{table.stderr}\n"
            f"its TCP flows to port 80: {flows.stdout[-3000:]}")


def test_a_held_connection_to_a_deleted_pod_is_reset_only_where_asked(lab: Lab) -> None:
    c, node = lab.cluster, "node-1"
    ((held, (where, _)),) = lab.pods("held").items()
    assert where != node
    for svc in ("fail-fast", "plain"):
        eventually_served(lab.clients[node], lab.ips[svc], 80, {held},
                          what=f"{svc} from {node}")
    # Each asked once, then idle: its client blocked in recv().
    fast = probe.Idle(lab.clients[node], lab.ips["fail-fast"], 80)
    plain = probe.Idle(lab.clients[node], lab.ips["plain"], 80)
    try:
        assert fast.backend == plain.backend == held
        deleted = time.monotonic()
        c.kubectl("-n", NS, "delete", "pod", held, "--grace-period=0", "--force")
        ended = wait(lambda: fast.ended, GOAL + 3, "the fail-fast client's error",
                     interval=0.005)
        why = fail_fast_detail(c, node) if ended[0] != "ConnectionResetError" else ""
        took = ended[1] - deleted
        report.append(f"fail fast: {ended[0]} {took:.3f}s after `kubectl delete pod "
                      f"--force` (client on {node}, pod on {where}); the same pod's "
                      "connection through the Service without the annotation "
                      f"{plain.ended[0] if plain.ended else 'still open'}")
        assert ended[0] == "ConnectionResetError", f"{ended}: {why}"
        assert took <= GOAL
        # Without the annotation, today's behaviour: the connection stays, and the pod,
        # still running until the kubelet kills it, still answers on it.
        assert plain.ended is None, plain.ended
        plain.sock.sendall(b"who\n")
        answer = wait(lambda: plain.ended, 2, "the deleted pod's answer", interval=0.005)
        assert answer[0] == f"data {(held + chr(10)).encode()!r}", answer
    finally:
        fast.close()
        plain.close()
