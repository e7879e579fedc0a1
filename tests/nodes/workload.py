"""What the cluster tier applies: the shipped manifests with only what the docs tell an
operator to set, and a workload of real pods (Deployment, Services, client pods).

The workload's image is sliceproxy's own, run as the lab's echo server
(`python -m proxy.netns_lab.echo`): each pod answers TCP lines and UDP datagrams with its own
name, so a client sees which pod it reached. Client pods are the sandbox image alone
(`pause`): the test sends from their network namespaces directly.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DAEMONSET = ROOT / "deploy" / "daemonset.yaml"
KUBEADM_DAEMONSET = ROOT / "deploy" / "kubeadm" / "daemonset.yaml"
KUBE_PROXY_CLEANUP = ROOT / "deploy" / "migrate" / "kube-proxy-cleanup.yaml"
SLICEPROXY_CLEANUP = ROOT / "deploy" / "migrate" / "sliceproxy-cleanup.yaml"
SHIPPED_KUBE_PROXY_IMAGE = "image: KUBE-PROXY-IMAGE"
SHIPPED_IMAGE = "image: sliceproxy:0.1.0"
SHIPPED_MASTER = "master: https://API-SERVER-ADDRESS:6443"
SHIPPED_MODE = "proxy-mode: iptables"
SHIPPED_JSON_LOGS = "# logging-format: json"
SHIPPED_CLUSTER_CIDR = "# cluster-cidr: 10.244.0.0/16"
NAMESPACE = "lab"
APP = "echo"
TCP_PORT, UDP_PORT = 8080, 8081
NODE_PORT, LOCAL_NODE_PORT = 30080, 30081
Obj = dict[str, Any]


def _replace_once(text: str, old: str, new: str) -> str:
    if text.count(old) != 1:
        raise AssertionError(f"the shipped manifest should hold {old!r} exactly once "
                             f"(found {text.count(old)}): the docs' instructions no longer "
                             "match it")
    return text.replace(old, new)


def _set_image(text: str, image: str) -> str:
    """Every container's image (the agent's and its init container's) set to `image`."""
    if SHIPPED_IMAGE not in text:
        raise AssertionError(f"the shipped manifest should hold {SHIPPED_IMAGE!r}: the "
                             "docs' instructions no longer match it")
    return text.replace(SHIPPED_IMAGE, f"image: {image}")


def shipped_daemonset(image: str, master: str, mode: str = "iptables",
                      json_logs: bool = False, cluster_cidr: str | None = None) -> str:
    """deploy/daemonset.yaml as an operator applies it: the image and the API server's
    address set (the two things its header says to set); `mode`, JSON logs and the pod
    network (`cluster_cidr`) as the ConfigMap's comments say to set them."""
    text = DAEMONSET.read_text()
    text = _set_image(text, image)
    text = _replace_once(text, SHIPPED_MASTER, f"master: {master}")
    if cluster_cidr is not None:
        text = _replace_once(text, SHIPPED_CLUSTER_CIDR, f"cluster-cidr: {cluster_cidr}")
    if mode != "iptables":
        text = _replace_once(text, SHIPPED_MODE, f"proxy-mode: {mode}")
    if json_logs:
        text = _replace_once(text, SHIPPED_JSON_LOGS, SHIPPED_JSON_LOGS.lstrip("# "))
    return text


def kubeadm_daemonset(image: str) -> str:
    """deploy/kubeadm/daemonset.yaml with the image set (it reads the rest, the API
    server's address included, from kubeadm's kube-proxy ConfigMap)."""
    return _set_image(KUBEADM_DAEMONSET.read_text(), image)


def kube_proxy_cleanup(kube_proxy_image: str, image: str) -> str:
    """deploy/migrate/kube-proxy-cleanup.yaml with its two images set."""
    text = _replace_once(KUBE_PROXY_CLEANUP.read_text(), SHIPPED_KUBE_PROXY_IMAGE,
                         f"image: {kube_proxy_image}")
    return _replace_once(text, SHIPPED_IMAGE, f"image: {image}")


def sliceproxy_cleanup(image: str) -> str:
    """deploy/migrate/sliceproxy-cleanup.yaml with sliceproxy's image set (twice)."""
    text = SLICEPROXY_CLEANUP.read_text()
    if text.count(SHIPPED_IMAGE) != 2:
        raise AssertionError(f"{SLICEPROXY_CLEANUP} should name the image twice")
    return text.replace(SHIPPED_IMAGE, f"image: {image}")


def namespace() -> Obj:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}


def echo_deployment(image: str, replicas: int, listen: str = "0.0.0.0") -> Obj:
    """`listen`: "::" on a cluster with IPv6 (one socket answers both families)."""
    labels = {"app": APP}
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": APP, "namespace": NAMESPACE},
        "spec": {
            "replicas": replicas, "selector": {"matchLabels": labels},
            "template": {"metadata": {"labels": labels}, "spec": {
                # Linux nodes only, as on any mixed cluster: the spread below counts every
                # node the pod may select, the cluster's Windows Node too, as a domain.
                "nodeSelector": {"kubernetes.io/os": "linux"},
                # Evenly over the nodes, so every node has local endpoints.
                "topologySpreadConstraints": [{
                    "maxSkew": 1, "topologyKey": "kubernetes.io/hostname",
                    "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {
                        "matchLabels": labels}}],
                "terminationGracePeriodSeconds": 5,
                "containers": [{
                    "name": "echo", "image": image,
                    "command": ["python", "-m", "proxy.netns_lab.echo"],
                    "args": ["--backend", f"$(POD_NAME)=={listen}", "--tcp", str(TCP_PORT),
                             "--udp", str(UDP_PORT)],
                    "env": [{"name": "POD_NAME", "valueFrom": {
                        "fieldRef": {"fieldPath": "metadata.name"}}}],
                    "ports": [{"name": "tcp", "containerPort": TCP_PORT},
                              {"name": "udp", "containerPort": UDP_PORT, "protocol": "UDP"}],
                    "readinessProbe": {"tcpSocket": {"port": TCP_PORT},
                                       "periodSeconds": 1},
                }],
            }},
        },
    }


def _service(name: str, ports: list[Obj], **spec: Any) -> Obj:
    annotations = spec.pop("annotations", None)
    meta: Obj = {"name": name, "namespace": NAMESPACE}
    if annotations:
        meta["annotations"] = annotations
    return {"apiVersion": "v1", "kind": "Service", "metadata": meta,
            "spec": {"selector": {"app": APP}, "ports": ports, **spec}}


TCP = {"name": "tcp", "port": 80, "targetPort": TCP_PORT, "protocol": "TCP"}
UDP = {"name": "udp", "port": 81, "targetPort": UDP_PORT, "protocol": "UDP"}


def services(dual_stack: bool = False) -> list[Obj]:
    """`dual_stack`: every Service with a ClusterIP of each family (v1.20's
    IPv6DualStack gate), the primary family's first."""
    family: Obj = {"ipFamilyPolicy": "RequireDualStack"} if dual_stack else {}
    return [
        _service("echo", [TCP, UDP], **family),
        _service("echo-np", [{**TCP, "nodePort": NODE_PORT}], type="NodePort", **family),
        # externalTrafficPolicy: Local (v1.20 has no internalTrafficPolicy, 1.21+).
        _service("echo-local", [{**TCP, "nodePort": LOCAL_NODE_PORT}], type="NodePort",
                 externalTrafficPolicy="Local", **family),
        # This node first, then this zone, then anywhere (sliceproxy's annotation: v1.20's
        # EndpointSlice controller writes no hints and knows no trafficDistribution).
        _service("echo-near", [TCP], annotations={
            "sliceproxy.io/topology-preference":
                "kubernetes.io/hostname,topology.kubernetes.io/zone,*"}, **family),
    ]


def client_pod(node: str, image: str) -> Obj:
    """A pod that only holds a network namespace on `node` (the sandbox image)."""
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": f"client-{node}", "namespace": NAMESPACE,
                         "labels": {"app": "client"}},
            "spec": {"nodeName": node, "terminationGracePeriodSeconds": 0,
                     "containers": [{"name": "pause", "image": image}]}}


def as_list(*objects: Obj) -> str:
    return json.dumps({"apiVersion": "v1", "kind": "List", "items": list(objects)})
