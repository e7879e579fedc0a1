"""The workload every real-node test runs (tests/nodes/workload.py's objects), and the
checks of what its clients see: every answer from the pods it should be, every such pod
answering, within a deadline.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from proxy.lab import probe
from proxy.lab.poll import wait
from tests.nodes import workload as wl
from tests.nodes.cluster import ClusterError, NodeCluster
from tests.nodes.conftest import LONG

CONVERGE = 60.0
ASKS = 60 if LONG else 20  # fresh connections per client and check


def ready(pod: dict[str, Any]) -> bool:
    statuses = pod.get("status", {}).get("containerStatuses") or []
    return bool(statuses) and all(s.get("ready") for s in statuses)


def rollout_status(cluster: NodeCluster, namespace: str, what: str,
                   timeout: float = 180) -> None:
    """`kubectl rollout status`; on failure, what the pods say (status, last logs)."""
    try:
        cluster.kubectl("-n", namespace, "rollout", "status", what,
                        f"--timeout={int(timeout)}s", timeout=timeout + 30)
    except ClusterError as exc:
        pods = cluster.kubectl("-n", namespace, "get", "pods", "-o", "wide", check=False)
        logs = []
        for pod in cluster.get_json("pods", "-n", namespace)["items"]:
            if not ready(pod):
                name = pod["metadata"]["name"]
                out = cluster.kubectl("-n", namespace, "logs", name, "--all-containers",
                                      "--tail=15", check=False)
                logs.append(f"--- {name}: {pod['status'].get('phase')}\n{out.stdout}"
                            f"{out.stderr}")
        raise ClusterError(f"{exc}\n{pods.stdout}\n" + "\n".join(logs)) from None


@dataclass
class Workload:
    cluster: NodeCluster
    echo: dict[str, str] = field(default_factory=dict)  # pod name -> node
    clients: dict[str, str] = field(default_factory=dict)  # node -> netns path
    ips: dict[str, str] = field(default_factory=dict)  # service -> cluster IP

    def deploy(self) -> None:
        """The echo Deployment (two pods per node), its Services and a client pod per
        node; returns once all of them are Ready."""
        c = self.cluster
        c.kubectl("apply", "-f", "-", stdin=wl.as_list(
            wl.namespace(), wl.echo_deployment(c.image.ref, 2 * len(c.nodes)), *wl.services(),
            *(wl.client_pod(n, c.pause.ref) for n in c.nodes)))
        rollout_status(c, wl.NAMESPACE, f"deploy/{wl.APP}")

        def clients_ready() -> bool:
            pods = c.pods(wl.NAMESPACE, "app=client")
            return len(pods) == len(c.nodes) and all(ready(p) for p in pods)

        wait(clients_ready, 120, "client pods Running", interval=0.2)
        self.refresh()

    def refresh(self) -> None:
        c = self.cluster
        self.echo = {p["metadata"]["name"]: p["spec"]["nodeName"]
                     for p in c.pods(wl.NAMESPACE, "app=echo") if ready(p)}
        self.clients = {p["spec"]["nodeName"]: c.pod_netns(p)
                        for p in c.pods(wl.NAMESPACE, "app=client") if ready(p)}
        for svc in c.get_json("services", "-n", wl.NAMESPACE)["items"]:
            self.ips[svc["metadata"]["name"]] = svc["spec"]["clusterIP"]

    def check_cluster_ip(self, what: str) -> None:
        """Every client pod reaches every echo pod through the ClusterIP, TCP and UDP."""
        for node, netns in sorted(self.clients.items()):
            for proto, port in (("tcp", 80), ("udp", 81)):
                eventually_served(netns, self.ips["echo"], port, set(self.echo), proto,
                                  f"echo {proto} from a pod on {node} ({what})")


def asks(netns: str, ip: str, port: int, proto: str = "tcp",
         count: int = ASKS) -> Counter[str]:
    return probe.ask(netns, ip, port, proto, count=count, timeout=2.0)


def eventually_served(netns: str, ip: str, port: int, want: set[str], proto: str = "tcp",
                      what: str = "") -> Counter[str]:
    """Poll until rounds of fresh connections are all answered by pods of `want` and,
    over those rounds, every pod of `want` has answered (the agent may still be syncing
    the newest endpoints). Returns the answers of those rounds; fails with the last."""
    last: Counter[str] = Counter()
    seen: Counter[str] = Counter()

    def ok() -> bool:
        nonlocal last
        last = asks(netns, ip, port, proto)
        if not set(last) <= want:
            seen.clear()
            return False
        seen.update(last)
        return set(seen) == want

    try:
        wait(ok, CONVERGE, what or f"{ip}:{port}/{proto}", interval=0.2)
    except AssertionError as exc:
        raise AssertionError(f"{exc}: answered {dict(last)} (so far {dict(seen)}), want "
                             f"every one of {sorted(want)} and nothing else") from None
    return seen
