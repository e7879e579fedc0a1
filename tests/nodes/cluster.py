"""A real Kubernetes v1.20.2 cluster on one machine: the real control plane
(labs/realcp/) with kube-scheduler and every default controller, and real nodes
(containerd + kubelet, tests/nodes/node.py) in two zones, running images built here.

    cp ns: etcd, kube-apiserver 198.18.96.1:6443 (api.cluster.test), controller manager,
           scheduler; DNS: the nodes' resolver 198.18.96.2, cluster DNS 198.18.96.3
      spx-cpbr0 198.18.96.0/24 -- node-1 198.18.96.11  pods 198.18.64.0/24  zone-a
                               -- node-2 198.18.96.12  pods 198.18.65.0/24  zone-a
                               -- node-3 198.18.96.13  pods 198.18.66.0/24  zone-b
                               -- outside 198.18.96.14 (a client that is no node)
                               -- node-4 ... (add_node: a node joining later)
    services 198.18.128.0/17 (the `kubernetes` Service is 198.18.128.1, kube-system/
      kube-dns 198.18.128.10: kubelet's --cluster-dns)
    windows-1: a Node labelled kubernetes.io/os=windows with no kubelet (NotReady)

The shape of a kubeadm cluster with an HA endpoint: kubelets (and the manifests the
tests apply) reach the API server by name, which only the nodes' resolver knows; pods
resolve cluster names through the cluster DNS Service (tests/nodes/dns.py). A Windows
Node is registered for the whole life of the cluster, as on a mixed cluster: a
DaemonSet that does not select Linux nodes gets a pod there that never starts, and its
`rollout status` never completes.

`stack` gives the same cluster in other address families (labs/realcp/addressing.py,
docs/lab.md): IPV6_ONLY, every address above in fd00::/8 (API server
[fd00:198:18:96::1]:6443, node-1 fd00:198:18:96::b with pods fd00:198:18:6400::/64,
services fd00:198:18:128::/108), or DUAL_STACK, both (IPv4 first, DNS on IPv4).

Nodes have no service proxy: the test (or a person) applies one with kubectl, as on a
cluster just made by kubeadm without its kube-proxy add-on. The images (sliceproxy's,
built from the repo's Dockerfile, and the sandbox's pause) are imported into each node's
containerd; nothing is pulled. `close()` tears everything down, and puts back the host
sysctls kubelet changes at start (FINDINGS.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labs.debian import CACHE_ROOT, locked
from labs.realcp.addressing import IPV4, IPV4_ONLY, Stack
from labs.realcp.build import PAUSE, Binaries
from labs.realcp.controlplane import API_NAME, API_PORT, ControlPlane
from labs.realcp.rawapi import RawApi
from proxy.netns_lab.poll import wait, waited
from proxy.netns_lab.topology import delete_namespace, ip
from tests.nodes import images as imgs
from tests.nodes.dns import (
    LabDns,
    cluster_dns_ip,
    cluster_dns_server,
    kube_dns_objects,
    resolver_addr,
)
from tests.nodes.node import PRIVATE_DIRS, Node, NodeSpec, sweep_stale

log = logging.getLogger(__name__)

DEFAULT_NODES = (NodeSpec("node-1", "zone-a", 0), NodeSpec("node-2", "zone-a", 1),
                 NodeSpec("node-3", "zone-b", 2))
SPARE_NODES = (NodeSpec("node-4", "zone-b", 3),)  # identities ready for nodes that join
CLUSTER_CIDR = str(IPV4.pods)  # the IPv4 cluster's pod network: node i has its i-th /24
# Host-wide sysctls kubelet v1.20 sets at start (setupKernelTunables).
KUBELET_SYSCTLS = ("vm/overcommit_memory", "vm/panic_on_oom", "kernel/panic",
                   "kernel/panic_on_oops", "kernel/keys/root_maxkeys",
                   "kernel/keys/root_maxbytes")
KUBECTL_PACKAGE = "kubernetes-client"  # Debian's kubectl, v1.20.2 like the server
LIB_MODULES = Path("/lib/modules")
SHIPPED_IMAGE_REF = "docker.io/library/sliceproxy:0.1.0"  # `image: sliceproxy:0.1.0`
WINDOWS_NODE = "windows-1"
CORE_RESOURCES = {"Service": "services", "Endpoints": "endpoints", "Node": "nodes"}


class ClusterError(RuntimeError):
    pass


def windows_node(name: str) -> dict[str, Any]:
    """A Windows node as its kubelet would register it (labels, capacity), with no kubelet
    behind it: it never reports Ready, and its pods never start."""
    resources = {"cpu": "2", "memory": "4Gi", "pods": "30"}
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {
        "kubernetes.io/os": "windows", "kubernetes.io/arch": "amd64",
        "kubernetes.io/hostname": name, "node.kubernetes.io/windows-build": "10.0.17763",
        "topology.kubernetes.io/zone": "zone-a"}},
        "status": {"capacity": resources, "allocatable": resources,
                   "nodeInfo": {"operatingSystem": "windows", "architecture": "amd64",
                                "kubeletVersion": "v1.20.2"}}}


def kubectl_binary() -> Path:
    """Debian's kubectl v1.20.2 (the server's version), unpacked into the cache, not
    installed: the machine's own /usr/bin/kubectl is left alone."""
    root = CACHE_ROOT / "kubectl"
    binary = root / "usr" / "bin" / "kubectl"
    with locked(CACHE_ROOT / "kubectl.lock"):
        if not binary.exists():
            root.mkdir(parents=True, exist_ok=True)
            for old in root.glob("*.deb"):
                old.unlink()
            subprocess.run(["apt-get", "download", KUBECTL_PACKAGE], cwd=root, check=True,
                           capture_output=True, timeout=300)
            (deb,) = root.glob("*.deb")
            subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True,
                           capture_output=True, timeout=300)
    return binary


@dataclass
class NodeCluster:
    bins: Binaries
    workdir: Path
    specs: Sequence[NodeSpec] = DEFAULT_NODES
    spare: Sequence[NodeSpec] = SPARE_NODES
    # Also import kube-proxy v1.20.2's image (localhost/kube-proxy:v1.20.2) into every
    # node, for kubeadm's kube-proxy add-on (tests/nodes/kubeadm.py).
    with_kube_proxy: bool = False
    # Its address families, the primary first (labs/realcp/addressing.py): IPV6_ONLY
    # gives a single-stack IPv6 cluster, DUAL_STACK one with v1.20's IPv6DualStack gate.
    stack: Stack = IPV4_ONLY
    cp: ControlPlane = field(init=False)
    dns: LabDns | None = field(init=False, default=None)
    nodes: dict[str, Node] = field(init=False, default_factory=dict)
    outside: str = field(init=False, default="")  # a client namespace that is no node
    image: imgs.Image = field(init=False)
    pause: imgs.Image = field(init=False)
    kube_proxy: imgs.Image | None = field(init=False, default=None)
    kubectl_path: Path = field(init=False)
    kubeconfig: Path = field(init=False)  # the admin's, for the host (forwarder)
    timings: dict[str, float] = field(init=False, default_factory=dict)
    _sysctls: dict[str, str] = field(init=False, default_factory=dict)
    _made_dirs: list[Path] = field(init=False, default_factory=list)

    @property
    def api(self) -> RawApi:
        return RawApi(self.cp.host_url, token=self.cp.token, context=self.cp.ssl_context())

    @property
    def api_url(self) -> str:
        """The API server as nodes reach it, by name: what an operator writes in
        `master`."""
        return f"https://{API_NAME}:{API_PORT}"

    def __enter__(self) -> NodeCluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        sweep_stale()
        self.workdir.mkdir(parents=True, exist_ok=True)
        imgs.ensure_tools()
        self.kubectl_path = kubectl_binary()
        started = time.monotonic()
        self.image = imgs.build_sliceproxy()
        self.pause = imgs.build_pause(self.bins.path(PAUSE))
        if self.with_kube_proxy:
            self.kube_proxy = imgs.build_kube_proxy(self.bins.path("kube-proxy"))
        self.timings["images"] = time.monotonic() - started
        # The nodes mount their own copies over PRIVATE_DIRS, which must exist; and every
        # real node has /lib/modules, which kube-proxy's DaemonSet mounts (hostPath), where
        # this machine's kernel has none. Whichever this makes, close() removes.
        for d in (*map(Path, PRIVATE_DIRS), LIB_MODULES):
            if not d.exists():
                d.mkdir(parents=True)
                self._made_dirs.append(d)
        for key in KUBELET_SYSCTLS:
            with contextlib.suppress(OSError):
                self._sysctls[key] = Path("/proc/sys", key).read_text().strip()
        started = time.monotonic()
        self.cp = ControlPlane(self.bins, with_nodes=True,
                               node_names=[s.name for s in (*self.specs, *self.spare)],
                               stack=self.stack)
        self.cp.start()
        self.kubeconfig = self.cp.host_kubeconfig
        # DNS on the primary family's addresses (a dual-stack cluster's: IPv4).
        self.dns = LabDns(self.cp.namespace, self.workdir / "dns", family=self.stack[0])
        self.dns.start()
        for obj in kube_dns_objects(cluster_dns_server(self.stack[0]),
                                    cluster_dns_ip(self.stack[0])):
            self._create(obj)
        self._create(windows_node(WINDOWS_NODE))
        self.timings["control_plane"] = time.monotonic() - started
        started = time.monotonic()
        # Made one by one (addresses, routes), started together (the image import into
        # each containerd is most of a node's start).
        made = [self._make_node(spec) for spec in self.specs]
        with ThreadPoolExecutor(len(made)) as pool:
            for future in [pool.submit(self._start_node, n) for n in made]:
                future.result()
        self.outside = f"{self.cp.prefix}-outside"
        ip("netns", "add", self.outside)
        ip("-n", self.outside, "link", "set", "lo", "up")
        self.cp.attach(self.outside)
        for node in self.nodes.values():
            self.wait_node_ready(node.name)
        self.timings["nodes_ready"] = time.monotonic() - started

    def add_node(self, spec: NodeSpec, *, wait: bool = True) -> Node:
        """Make a node and start its containerd and kubelet; with `wait`, until Ready."""
        node = self._make_node(spec)
        self._start_node(node)
        if wait:
            self.wait_node_ready(spec.name)
        return node

    def _create(self, obj: dict[str, Any]) -> None:
        """Create `obj` (a core/v1 object) as the admin, and a Node's status, which a
        create ignores. Until the API server has made its system namespaces, kube-system
        may not exist yet (404)."""
        ns = obj["metadata"].get("namespace")
        path = f"/api/v1/{f'namespaces/{ns}/' if ns else ''}{CORE_RESOURCES[obj['kind']]}"
        answer: tuple[int, Any] = (0, None)

        def created() -> bool:
            nonlocal answer
            answer = self.api.post(path, obj)
            if answer[0] not in (201, 404):
                raise ClusterError(f"POST {path}: HTTP {answer[0]}: {answer[1]}")
            return answer[0] == 201

        wait(created, 30, f"{obj['kind']} {obj['metadata']['name']} created", interval=0.2,
             detail=lambda: answer)
        if "status" in obj:
            self.api.must("PATCH", f"{path}/{obj['metadata']['name']}/status",
                          {"status": obj["status"]},
                          content_type="application/merge-patch+json")

    def _start_node(self, node: Node) -> None:
        images = [self.pause, self.image, *([self.kube_proxy] if self.kube_proxy else [])]
        node.start([i.archive for i in images])
        # Also under the name the manifests ship with, so that a person trying them by
        # hand (./run cluster) needs to set only the API server's address.
        node.ctr("images", "tag", "--force", self.image.ref, SHIPPED_IMAGE_REF)

    def _make_node(self, spec: NodeSpec) -> Node:
        node = Node(spec, self.cp.prefix, self.workdir / spec.name,
                    self.cp.identity_kubeconfig(f"system:node:{spec.name}",
                                                self.workdir / f"{spec.name}.kubeconfig",
                                                server=self.api_url),
                    self.bins.path("kubelet"), self.pause.ref,
                    resolver=str(resolver_addr(self.stack[0])),
                    cluster_dns=str(cluster_dns_ip(self.stack[0])), stack=self.stack)
        self.nodes[spec.name] = node
        node.make_namespace()
        node.addresses = self.cp.attach(node.netns)
        # Every node (and the control plane, answering pods that reach the API server
        # through the `kubernetes` Service) routes each node's pod range to that node.
        for other in self.nodes.values():
            if other is not node:
                other.route_to(node)
                node.route_to(other)
        for pods, via in zip(node.pod_ranges, node.addresses, strict=True):
            ip("-n", self.cp.namespace, "route", "replace", str(pods), "via", str(via))
        return node

    def node_status(self, name: str) -> dict[str, Any] | None:
        status, body = self.api.get(f"/api/v1/nodes/{name}")
        return body if status == 200 else None

    def wait_node_ready(self, name: str, timeout: float = 120.0) -> float:
        def ready() -> bool:
            if (dead := self.nodes[name].exited()) is not None:
                raise ClusterError(f"{name}: {dead}")
            body = self.node_status(name)
            conds = (body or {}).get("status", {}).get("conditions") or []
            return any(c["type"] == "Ready" and c["status"] == "True" for c in conds)

        try:
            return waited(ready, timeout, f"node {name} Ready", interval=0.2)
        except AssertionError as exc:
            raise ClusterError(f"{exc}; kubelet log:\n"
                               f"{self.nodes[name].log_tail('kubelet')}") from None

    def close(self) -> None:
        for node in self.nodes.values():
            node.stop()
        self.nodes.clear()
        if self.outside:
            delete_namespace(self.outside)
            self.outside = ""
        if self.dns is not None:
            self.dns.stop()
            self.dns = None
        if hasattr(self, "cp"):
            self.cp.stop()
        for key, value in self._sysctls.items():
            with contextlib.suppress(OSError):
                Path("/proc/sys", key).write_text(value)
        for d in reversed(self._made_dirs):
            with contextlib.suppress(OSError):
                d.rmdir()  # only if still empty: another cluster may be using it
        self._made_dirs.clear()

    # --- kubectl ------------------------------------------------------------------------

    def kubectl(self, *args: str, stdin: str | None = None, check: bool = True,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.kubectl_path), f"--kubeconfig={self.kubeconfig}",
                               *args], input=stdin, capture_output=True, text=True,
                              check=False, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} exited {proc.returncode}: "
                               f"{proc.stderr.strip()}")
        return proc

    def get_json(self, *args: str) -> Any:
        return json.loads(self.kubectl("get", "-o", "json", *args).stdout)

    def pods(self, namespace: str, selector: str) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = self.get_json("pods", "-n", namespace, "-l",
                                                    selector)["items"]
        return items

    def pod_netns(self, pod: dict[str, Any]) -> str:
        """The pod's network namespace, to send traffic from it (probe.ask takes a path)."""
        return self.nodes[pod["spec"]["nodeName"]].pod_netns(pod["metadata"]["uid"])
