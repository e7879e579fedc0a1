"""The workload every real-node test runs (tests/nodes/workload.py's objects), and the
checks of what its clients see: every answer from the pods it should be, every such pod
answering, within a deadline.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import Any

from labs.realcp.addressing import IPV4_ONLY, dual, url_host
from proxy.netns_lab import probe
from proxy.netns_lab.poll import wait
from tests.nodes import workload as wl
from tests.nodes.cluster import ClusterError, NodeCluster
from tests.nodes.conftest import LONG
from tests.nodes.dns import cluster_dns_ip

CONVERGE = 60.0
ASKS = 60 if LONG else 20  # fresh connections per client and check
# Run in a pod: its nameservers, and the address of a name only the cluster DNS knows
# (`kubernetes.default`, completed by the pod's search path).
RESOLVE = ("import socket\n"
           "ns = [ln.split()[1] for ln in open('/etc/resolv.conf')\n"
           "      if ln.startswith('nameserver')]\n"
           "print(' '.join(ns), socket.getaddrinfo('kubernetes.default', 443,\n"
           "                                       type=socket.SOCK_STREAM)[0][4][0])\n")


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
    # service -> its cluster IPs, one per family (dual-stack), the primary first
    family_ips: dict[str, list[str]] = field(default_factory=dict)

    def deploy(self) -> None:
        """The echo Deployment (two pods per node), its Services and a client pod per
        node; returns once all of them are Ready."""
        c = self.cluster
        listen = "0.0.0.0" if c.stack == IPV4_ONLY else "::"
        c.kubectl("apply", "-f", "-", stdin=wl.as_list(
            wl.namespace(), wl.echo_deployment(c.image.ref, 2 * len(c.nodes), listen),
            *wl.services(dual(c.stack)),
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
            self.family_ips[svc["metadata"]["name"]] = (svc["spec"].get("clusterIPs")
                                                        or [svc["spec"]["clusterIP"]])

    def check_cluster_dns(self, what: str) -> None:
        """An echo pod on every node (the default dnsPolicy: its only nameserver is the
        cluster DNS Service's ClusterIP) resolves a cluster name, which only the cluster
        DNS server behind that Service knows: its questions went through the proxy."""
        pods = {node: pod for pod, node in sorted(self.echo.items(), reverse=True)}
        for node, pod in sorted(pods.items()):
            self._resolves(pod, f"kubernetes.default from {pod} on {node} ({what})")

    def _resolves(self, pod: str, what: str) -> None:
        answer = ""

        def resolved() -> bool:
            nonlocal answer
            out = self.cluster.kubectl("-n", wl.NAMESPACE, "exec", pod, "--", "python",
                                       "-c", RESOLVE, check=False, timeout=60)
            answer = (out.stdout + out.stderr).strip()
            return out.returncode == 0

        wait(resolved, CONVERGE, what, interval=0.5, detail=lambda: answer)
        primary = self.cluster.stack[0]
        assert answer.split() == [str(cluster_dns_ip(primary)),
                                  str(primary.kubernetes_service_ip)], answer

    def check_cluster_ip(self, what: str) -> None:
        """Every client pod reaches every echo pod through the ClusterIP, TCP and UDP."""
        for node, netns in sorted(self.clients.items()):
            for proto, port in (("tcp", 80), ("udp", 81)):
                eventually_served(netns, self.ips["echo"], port, set(self.echo), proto,
                                  f"echo {proto} from a pod on {node} ({what})")

    def check_every_family(self, mode: str, counts: Counts) -> list[str]:
        """Over each of the cluster's families: echo's ClusterIP (TCP and UDP) from a pod
        on every node, and the NodePort from outside to every node's address; each
        first until every pod answers (the agents may still be syncing), then counted
        (`counts`). Returns what failed of the counted connections."""
        c, echo, failed = self.cluster, set(self.echo), []
        for ip in self.family_ips["echo"]:
            family = f"IPv{ip_address(ip).version}"
            for name, netns in sorted(self.clients.items()):
                for proto, port in (("tcp", 80), ("udp", 81)):
                    eventually_served(netns, ip, port, echo, proto,
                                      f"echo {ip} {proto} from a pod on {name} ({mode})")
                    failed += counts.ask(f"{mode} {family} ClusterIP {proto.upper()}",
                                         netns, ip, port, echo, proto)
        for node in c.nodes.values():
            for addr in map(str, node.addresses):
                family = f"IPv{ip_address(addr).version}"
                eventually_served(c.outside, addr, wl.NODE_PORT, echo,
                                  what=f"NodePort on {node.name} {addr} from outside ({mode})")
                failed += counts.ask(f"{mode} {family} NodePort", c.outside, addr,
                                     wl.NODE_PORT, echo)
        return failed


@dataclass
class Counts:
    """Fresh connections (or datagrams) counted by kind ("nftables IPv6 NodePort"):
    attempted and failed, for the report."""
    kinds: dict[str, Counter[str]] = field(default_factory=dict)

    def ask(self, kind: str, netns: str, ip: str, port: int, want: set[str],
            proto: str = "tcp", count: int = ASKS) -> list[str]:
        """`count` of them from `netns`; those answered by none of `want`, as text."""
        got = asks(netns, ip, port, proto, count)
        failed = {answer: n for answer, n in got.items() if answer not in want}
        tally = self.kinds.setdefault(kind, Counter())
        tally["attempted"] += count
        tally["failed"] += sum(failed.values())
        return [f"{kind} to {url_host(ip)}:{port} from {netns}: {answer} x{n}"
                for answer, n in failed.items()]

    def summary(self) -> str:
        return "; ".join(f"{kind} {n['attempted']} attempted, {n['failed']} failed"
                         for kind, n in self.kinds.items())


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
