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

Also what the lab cannot run and is modelled instead: kubeadm v1.20's `upgrade apply`
needs a control plane kubeadm made (static pods, its certificates), which the lab has not.
Its kube-proxy step is `upgrade_apply_addon_phase`: v1.20's rule, read in its source and
present in this very binary (the add-on phase runs unless the kube-system/kube-proxy
ConfigMap is missing; docs/migrate.md, "kubeadm upgrades").

And the docs' procedures as an operator pastes them (`run_documented`): the shell
blocks of docs/migrate.md and docs/deploy.md (tests/procedures.py), run by bash with the
cluster's kubectl on PATH, so the tests run the commands the pages show, not a copy.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import yaml

from labs.realcp.addressing import IPV4_ONLY, Stack, dual
from labs.realcp.controlplane import API_NAME, API_PORT
from tests.nodes.cluster import NodeCluster
from tests.nodes.images import IMAGE_REPOSITORY
from tests.procedures import ROOT

SYSTEM = "kube-system"
# kubeadm's own warning when `upgrade apply` leaves kube-proxy out (postupgrade.go).
SKIPPED = ("the ConfigMap \"kube-proxy\" in the namespace \"kube-system\" was not found. "
           "Assuming that kube-proxy was not deployed for this cluster.")


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
    return _kubeadm(cluster, workdir, "addon", "kube-proxy")


def _kubeadm(cluster: NodeCluster, workdir: Path, *phase: str) -> str:
    config = workdir / "kubeadm.yaml"
    config.write_text(kubeadm_config(cluster.stack))
    proc = subprocess.run(
        [str(cluster.bins.path("kubeadm")), "init", "phase", *phase, f"--config={config}",
         f"--kubeconfig={cluster.kubeconfig}"],
        capture_output=True, text=True, check=False, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"kubeadm init phase {' '.join(phase)}: {proc.stderr.strip()}")
    return proc.stdout


def upload_kubeadm_config(cluster: NodeCluster, workdir: Path) -> str:
    """kube-system/kubeadm-config as `kubeadm init` uploads it (its upload-config phase):
    the ClusterConfiguration a new cluster's procedure reads (docs/deploy.md)."""
    return _kubeadm(cluster, workdir, "upload-config", "kubeadm")


def upgrade_apply_addon_phase(cluster: NodeCluster, workdir: Path) -> str:
    """kube-proxy's part of kubeadm v1.20's `upgrade apply`: the add-on phase, unless
    kube-proxy's ConfigMap is missing, then kubeadm's warning and nothing else."""
    found = cluster.kubectl("-n", SYSTEM, "get", "configmap", "kube-proxy", check=False)
    if found.returncode != 0 and "NotFound" in found.stderr:
        return SKIPPED
    return install_kube_proxy(cluster, workdir)


def run_documented(cluster: NodeCluster, lines: str, workdir: Path) -> str:
    """`lines` as an operator pastes them into bash in `workdir` (where `deploy/` is
    this repository's): kubectl v1.20.2 on PATH, the cluster's kubeconfig; the first
    failing command fails the run."""
    link = workdir / "deploy"
    if not link.exists():
        link.symlink_to(ROOT / "deploy")
    env = {**os.environ, "KUBECONFIG": str(cluster.kubeconfig),
           "PATH": f"{cluster.kubectl_path.parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", lines], cwd=workdir, env=env,
                          capture_output=True, text=True, check=False, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{lines}\nexited {proc.returncode}: {proc.stderr.strip()}")
    return proc.stdout
