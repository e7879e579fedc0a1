"""kube-proxy v1.20.2 as kubeadm deploys it, by kubeadm itself.

`kubeadm init phase addon kube-proxy` (the phase `kubeadm init` runs, and what an
operator runs again to bring kube-proxy back) writes the kube-system/kube-proxy
ServiceAccount, ConfigMap (config.conf, kubeconfig.conf with the control-plane
endpoint), RBAC and DaemonSet into the cluster. The lab gives it one configuration file:
the control-plane endpoint (the API server's name, as with an HA load balancer), the
pod network, the image repository the lab's images are named under, and one change to
the KubeProxyConfiguration: conntrack.maxPerCore and min 0, so that kube-proxy leaves
nf_conntrack_max and the conntrack hash size alone: those are global to the host the
lab's nodes share, not per node.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml

from labs.realcp.addressing import IPV4_ONLY, Stack, dual
from labs.realcp.controlplane import API_NAME, API_PORT
from tests.nodes.cluster import NodeCluster
from tests.nodes.images import IMAGE_REPOSITORY


def kubeadm_config(stack: Stack = IPV4_ONLY) -> str:
    """For a cluster of `stack`'s families: the API server's own address is the local
    endpoint's advertiseAddress, from whose family kubeadm picks kube-proxy's
    bindAddress (`0.0.0.0`, or `::` for IPv6)."""
    join = ",".join
    cluster: dict[str, object] = {
        "apiVersion": "kubeadm.k8s.io/v1beta2", "kind": "ClusterConfiguration",
        "kubernetesVersion": "v1.20.2", "imageRepository": IMAGE_REPOSITORY,
        "controlPlaneEndpoint": f"{API_NAME}:{API_PORT}",
        "networking": {"podSubnet": join(str(f.pods) for f in stack),
                       "serviceSubnet": join(str(f.services) for f in stack)}}
    if dual(stack):
        cluster["featureGates"] = {"IPv6DualStack": True}
    docs = [
        {"apiVersion": "kubeadm.k8s.io/v1beta2", "kind": "InitConfiguration",
         "localAPIEndpoint": {"advertiseAddress": str(stack[0].api_addr),
                              "bindPort": API_PORT}},
        cluster,
        {"apiVersion": "kubeproxy.config.k8s.io/v1alpha1", "kind": "KubeProxyConfiguration",
         "conntrack": {"maxPerCore": 0, "min": 0}},
    ]
    return yaml.safe_dump_all(docs)


def install_kube_proxy(cluster: NodeCluster, workdir: Path) -> str:
    """Run kubeadm's kube-proxy add-on phase against the cluster; its output."""
    config = workdir / "kubeadm.yaml"
    config.write_text(kubeadm_config(cluster.stack))
    proc = subprocess.run(
        [str(cluster.bins.path("kubeadm")), "init", "phase", "addon", "kube-proxy",
         f"--config={config}", f"--kubeconfig={cluster.kubeconfig}"],
        capture_output=True, text=True, check=False, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"kubeadm init phase addon kube-proxy: {proc.stderr.strip()}")
    return proc.stdout
