"""deploy/daemonset.yaml: what operators apply. Checked for structure, least privilege
(exactly what the agent watches, read-only), the flags it passes, and by the real kubectl
(`create --dry-run=client`) against the simulator."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config import parse_args
from proxy.kube.resources import ENDPOINT_SLICES_V1, ENDPOINTS, NODES, SERVICES
from proxy.sim import SimServer

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "deploy" / "daemonset.yaml"
KUBECTL = Path("/usr/bin/kubectl")


def documents() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object of each kind"
    return by_kind


def container() -> dict[str, Any]:
    (c,) = documents()["DaemonSet"]["spec"]["template"]["spec"]["containers"]
    return c


def test_kinds() -> None:
    assert set(documents()) == {"Namespace", "ServiceAccount", "ClusterRole",
                                "ClusterRoleBinding", "ConfigMap", "DaemonSet"}


def test_cluster_role_is_read_only_and_exactly_what_the_agent_watches() -> None:
    rules = documents()["ClusterRole"]["rules"]
    granted = {(g, r) for rule in rules for g in rule["apiGroups"] for r in rule["resources"]}
    watched = {(res.group_version.rpartition("/")[0], res.plural)
               for res in (SERVICES, ENDPOINTS, NODES, ENDPOINT_SLICES_V1)}
    assert granted == watched
    for rule in rules:
        assert sorted(rule["verbs"]) == ["list", "watch"]


def test_binding_ties_the_role_to_the_daemonsets_service_account() -> None:
    docs = documents()
    binding, ds = docs["ClusterRoleBinding"], docs["DaemonSet"]
    (subject,) = binding["subjects"]
    assert binding["roleRef"]["name"] == docs["ClusterRole"]["metadata"]["name"]
    assert subject["name"] == ds["spec"]["template"]["spec"]["serviceAccountName"]
    assert subject["namespace"] == ds["metadata"]["namespace"] == \
        docs["ServiceAccount"]["metadata"]["namespace"]


def test_pod_runs_on_every_node_in_the_host_network_with_just_enough_privilege() -> None:
    ds = documents()["DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["priorityClassName"] == "system-node-critical"
    assert pod["tolerations"] == [{"operator": "Exists"}]
    assert ds["spec"]["updateStrategy"]["type"] == "RollingUpdate"
    sec = container()["securityContext"]
    assert sec["privileged"] is False and sec["allowPrivilegeEscalation"] is False
    assert sec["capabilities"] == {"drop": ["ALL"], "add": ["NET_ADMIN", "NET_RAW"]}
    assert container()["resources"]["requests"]


def test_mounts_xtables_lock_and_modules() -> None:
    pod = documents()["DaemonSet"]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    lock = volumes[mounts["/run/xtables.lock"]["name"]]["hostPath"]
    assert lock == {"path": "/run/xtables.lock", "type": "FileOrCreate"}
    assert volumes[mounts["/lib/modules"]["name"]]["hostPath"]["path"] == "/lib/modules"
    assert mounts["/lib/modules"]["readOnly"] is True


def test_probes_hit_the_agents_health_server(tmp_path: Path) -> None:
    c = container()
    assert c["livenessProbe"]["httpGet"]["path"] == "/livez"
    assert c["readinessProbe"]["httpGet"]["path"] == "/healthz"
    config_file = tmp_path / "config.yaml"
    config_file.write_text(documents()["ConfigMap"]["data"]["config.yaml"])
    args = [a.replace("$(NODE_NAME)", "node-1") for a in c["args"]]
    args = [a.replace("/etc/sliceproxy/config.yaml", str(config_file)) for a in args]
    cfg = parse_args(args)  # the shipped config file and args are valid flags
    assert cfg.node_name == "node-1" and cfg.proxy_mode == "iptables"
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["port"] == cfg.healthz_bind_address[1]
    assert cfg.healthz_bind_address[0] == "0.0.0.0"  # the kubelet probes the node IP
    mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/sliceproxy")
    assert mount["name"] in {v["name"] for v in
                             documents()["DaemonSet"]["spec"]["template"]["spec"]["volumes"]}


def test_kubectl_dry_run_accepts_it(tmp_path: Path) -> None:
    if not KUBECTL.exists():
        pytest.fail("/usr/bin/kubectl (v1.32) is expected on this machine image")
    with SimServer() as sim:
        kubeconfig = sim.write_kubeconfig(tmp_path / "kubeconfig")
        proc = subprocess.run(
            [str(KUBECTL), f"--kubeconfig={kubeconfig}", f"--cache-dir={tmp_path / 'cache'}",
             "create", "--dry-run=client", "--validate=false", "-f", str(MANIFEST),
             "-o", "name"],
            capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert sorted(proc.stdout.split()) == sorted([
        "namespace/sliceproxy", "serviceaccount/sliceproxy",
        "clusterrole.rbac.authorization.k8s.io/sliceproxy",
        "clusterrolebinding.rbac.authorization.k8s.io/sliceproxy",
        "configmap/sliceproxy", "daemonset.apps/sliceproxy"])
