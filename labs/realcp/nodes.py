"""Node-side pieces of the real-control-plane tier: real Pods made ready by hand, and
proxies (sliceproxy's agent, upstream kube-proxy v1.20.2) in lab node namespaces.

There is no kubelet: a Pod is created with `spec.nodeName` and its `status` is patched
(podIP, phase Running, Ready condition) through the API, which is all the real Endpoints
and EndpointSlice controllers look at. Pod IPs are lab backend addresses, so the
"pods" answer traffic with their names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Self

from labs.realcp.rawapi import RawApi
from proxy.netns_lab import Lab
from proxy.netns_lab.poll import wait
from proxy.netns_lab.probe import http_get

ROOT = Path(__file__).resolve().parents[2]
POD_CIDR = "198.18.1.0/24"
METRICS_PORT, HEALTHZ_PORT = 10249, 10256
Obj = dict[str, Any]


# --- the workload -------------------------------------------------------------------------


def node_object(name: str, ip: str, zone: str = "zone-a") -> Obj:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                  "topology.kubernetes.io/zone": zone}},
            "status": {"addresses": [{"type": "InternalIP", "address": ip},
                                     {"type": "Hostname", "address": name}]}}


def ensure_node(api: RawApi, name: str, ip: str, zone: str = "zone-a") -> None:
    status, body = api.post("/api/v1/nodes", node_object(name, ip, zone))
    assert status in (201, 409), body
    # Node addresses are status: the create ignores them (no kubelet to report them).
    api.must("PATCH", f"/api/v1/nodes/{name}/status",
             {"status": node_object(name, ip, zone)["status"]},
             content_type="application/merge-patch+json")


def pod(name: str, namespace: str, labels: Mapping[str, str], node: str,
        ports: Sequence[tuple[str, int, str]] = (("http", 8080, "TCP"),)) -> Obj:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
            "spec": {"nodeName": node, "containers": [{
                "name": "echo", "image": "sliceproxy.invalid/echo",
                "ports": [{"name": n, "containerPort": p, "protocol": proto}
                          for n, p, proto in ports]}]}}


def pod_status(ip: str, ready: bool) -> Obj:
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    state = "True" if ready else "False"
    return {"status": {
        "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "hostIP": "198.18.0.1",
        "conditions": [{"type": "Ready", "status": state, "lastTransitionTime": now},
                       {"type": "ContainersReady", "status": state,
                        "lastTransitionTime": now}]}}


class Workload:
    """Pods of one app in one namespace, created and made (un)ready through the API."""

    def __init__(self, api: RawApi, namespace: str, app: str) -> None:
        self.api, self.namespace, self.app = api, namespace, app
        self.pods: dict[str, str] = {}  # pod name -> IP

    @property
    def path(self) -> str:
        return f"/api/v1/namespaces/{self.namespace}/pods"

    def add(self, name: str, ip: str, node: str, ready: bool = True,
            ports: Sequence[tuple[str, int, str]] = (("http", 8080, "TCP"),)) -> None:
        self.api.must("POST", self.path, pod(name, self.namespace, {"app": self.app}, node,
                                             ports))
        self.set_ready(name, ip, ready)
        self.pods[name] = ip

    def set_ready(self, name: str, ip: str, ready: bool) -> None:
        self.api.must("PATCH", f"{self.path}/{name}/status", pod_status(ip, ready),
                      content_type="application/strategic-merge-patch+json")

    def remove_all(self) -> None:
        for name in list(self.pods):
            self.remove(name)

    def remove(self, name: str) -> None:
        # Grace period 0: with no kubelet a graceful delete would never complete.
        self.api.must("DELETE", f"{self.path}/{name}",
                      {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0})
        self.pods.pop(name, None)


def endpoints_ips(api: RawApi, namespace: str, service: str) -> set[str]:
    status, body = api.get(f"/api/v1/namespaces/{namespace}/endpoints/{service}")
    if status != 200:
        return set()
    return {a["ip"] for s in body.get("subsets") or [] for a in s.get("addresses") or []}


def slice_ips(api: RawApi, namespace: str, service: str, ready_only: bool = True) -> set[str]:
    status, body = api.get(f"/apis/discovery.k8s.io/v1beta1/namespaces/{namespace}/"
                           "endpointslices", labelSelector=f"kubernetes.io/service-name={service}")
    assert status == 200, body
    return {e["addresses"][0] for s in body["items"] for e in s.get("endpoints") or []
            if not ready_only or (e.get("conditions") or {}).get("ready", True)}


# --- proxies in node namespaces -----------------------------------------------------------


class NodeProxy:
    """A proxy process in a lab's node namespace, logging to a file, killed at exit."""

    name = "proxy"

    def __init__(self, lab: Lab, argv: Sequence[str], log_path: Path,
                 env: Mapping[str, str] | None = None) -> None:
        self.lab, self.argv, self.log_path = lab, list(argv), log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.cwd = ROOT  # where it runs (a sliceproxy: the checkout it runs from)

    def start(self) -> Self:
        out = self.log_path.open("ab")
        try:
            self.proc = self.lab.popen(self.lab.node_ns, self.argv, stdout=out,
                                       stderr=subprocess.STDOUT, env=self.env, cwd=str(self.cwd))
        finally:
            out.close()
        self.started = time.monotonic()
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def check_alive(self) -> None:
        if not self.alive():
            code = self.proc.returncode if self.proc else None
            raise AssertionError(f"{self.name} exited ({code}); log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def get(self, path: str, port: int = METRICS_PORT) -> tuple[int, bytes]:
        return http_get(self.lab.node_ns, "127.0.0.1", port, path)

    def wait_healthy(self, timeout: float = 60.0) -> float:
        """Until /healthz answers 200 (both proxies: the first sync is done)."""
        def healthy() -> bool:
            self.check_alive()
            return self.get("/healthz", HEALTHZ_PORT)[0] == 200

        wait(healthy, timeout, f"{self.name} to become healthy",
             detail=lambda: f"log:\n{self.log_tail()}")
        return time.monotonic() - self.started

    def stop(self, timeout: float = 20.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)


class Sliceproxy(NodeProxy):
    name = "sliceproxy"

    @classmethod
    def make(cls, lab: Lab, kubeconfig: Path, workdir: Path, source: str,
             *flags: str, root: Path = ROOT, cluster_cidr: str = POD_CIDR) -> Sliceproxy:
        """The agent of the checkout `root` (this one by default); `cluster_cidr` its pod
        network (an IPv6 one on a single-stack IPv6 cluster)."""
        argv = [sys.executable, "-m", "proxy", "--kubeconfig", str(kubeconfig),
                "--hostname-override", lab.node_name, "--proxy-mode", "iptables",
                "--endpoints-source", source, "--cluster-cidr", cluster_cidr,
                "--metrics-bind-address", f"127.0.0.1:{METRICS_PORT}",
                "--healthz-bind-address", f"127.0.0.1:{HEALTHZ_PORT}", "-v", "2", *flags]
        proxy = cls(lab, argv, workdir / f"sliceproxy-{lab.node_ns}.log",
                    {"PYTHONPATH": str(root)})
        proxy.cwd = root
        return proxy

    def dump(self, service: str | None = None) -> dict[str, Any]:
        status, body = self.get("/debug/dump" + (f"?service={service}" if service else ""))
        assert status == 200, f"/debug/dump answered {status}: {body[:300]!r}"
        doc: dict[str, Any] = json.loads(body)
        return doc

    def endpoints(self, service: str, port: str = "http") -> set[str] | None:
        """The cluster endpoints the agent last resolved for `ns/name:port` (IPv4), or
        None if it does not know the service port."""
        for entry in self.dump(service)["services"]:
            if entry["port"] == port and entry["family"] in ("IPv4", "ipv4", "4"):
                return set(entry["cluster_endpoints"])
        return None


class KubeProxy(NodeProxy):
    name = "kube-proxy"

    @classmethod
    def make(cls, lab: Lab, binary: Path, kubeconfig: Path, workdir: Path, source: str,
             *flags: str) -> KubeProxy:
        argv = [str(binary), f"--kubeconfig={kubeconfig}",
                f"--hostname-override={lab.node_name}", "--proxy-mode=iptables",
                f"--cluster-cidr={POD_CIDR}",
                f"--metrics-bind-address=127.0.0.1:{METRICS_PORT}",
                f"--healthz-bind-address=127.0.0.1:{HEALTHZ_PORT}",
                # Leave conntrack sysctls alone: nf_conntrack_max is global to the host.
                "--conntrack-max-per-core=0", "--conntrack-min=0",
                "--conntrack-tcp-timeout-established=0", "--conntrack-tcp-timeout-close-wait=0",
                "--v=2", *flags]
        if source == "endpoints":
            # v1.20 reads EndpointSlices by default; this makes it read Endpoints.
            argv.append("--feature-gates=EndpointSliceProxying=false")
        return cls(lab, argv, workdir / f"kube-proxy-{lab.node_ns}.log")


def nat_rules(lab: Lab) -> str:
    """The node namespace's IPv4 nat table, from both iptables back ends."""
    out = []
    for tool in ("iptables-nft-save", "iptables-legacy-save"):
        res = lab.exec(lab.node_ns, [tool, "-t", "nat"])
        out.append(res.stdout)
    return "\n".join(out)


def dnat_targets(rules: str, service_port: str) -> set[str]:
    """ip:port DNAT targets of one service port (`ns/name:port`), from iptables-save text.
    Both sliceproxy and kube-proxy comment each endpoint's DNAT rule with it."""
    out = set()
    for line in rules.splitlines():
        m = re.search(r"--comment (\"[^\"]*\"|\S+) .*-j DNAT --to-destination (\S+)", line)
        if m and m.group(1).strip('"') == service_port:
            out.add(m.group(2))
    return out
