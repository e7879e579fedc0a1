"""The kubeadm procedures of docs/deploy.md and docs/migrate.md, run as written by bash
with a stand-in kubectl that answers from kubeadm's own objects: the files they write
are what deploy/kubeadm/daemonset.yaml mounts, and the agent reads them as kube-proxy
would, with nothing ignored. The same blocks run on real nodes in
tests/nodes/test_migration.py; this catches a broken page in seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.config.options import parse_args
from tests.procedures import doc_block, steps, uncommented
from tests.unit.test_kubeproxy_file import KUBEADM_CONFIGMAP

KUBEADM_MANIFEST = Path(__file__).resolve().parents[2] / "deploy" / "kubeadm" / "daemonset.yaml"
ENDPOINT, PODS = "api.example.test:6443", "198.18.64.0/18"
# kube-system/kubeadm-config's ClusterConfiguration as kubeadm v1.20 uploads it
# (v1beta2), and as v1.31 and later do (v1beta4, with the proxy disabled).
V1BETA2 = f"""apiServer:
  extraArgs:
    authorization-mode: Node,RBAC
  timeoutForControlPlane: 4m0s
apiVersion: kubeadm.k8s.io/v1beta2
certificatesDir: /etc/kubernetes/pki
clusterName: kubernetes
controlPlaneEndpoint: {ENDPOINT}
controllerManager: {{}}
dns:
  type: CoreDNS
etcd:
  local:
    dataDir: /var/lib/etcd
imageRepository: k8s.gcr.io
kind: ClusterConfiguration
kubernetesVersion: v1.20.2
networking:
  dnsDomain: cluster.local
  podSubnet: {PODS}
  serviceSubnet: 10.96.0.0/12
scheduler: {{}}
"""
V1BETA4 = f"""apiServer: {{}}
apiVersion: kubeadm.k8s.io/v1beta4
caCertificateValidityPeriod: 87600h0m0s
certificateValidityPeriod: 8760h0m0s
certificatesDir: /etc/kubernetes/pki
clusterName: kubernetes
controlPlaneEndpoint: {ENDPOINT}
controllerManager: {{}}
dns: {{}}
encryptionAlgorithm: RSA-2048
etcd:
  local:
    dataDir: /var/lib/etcd
imageRepository: registry.k8s.io
kind: ClusterConfiguration
kubernetesVersion: v1.33.0
networking:
  dnsDomain: cluster.local
  podSubnet: {PODS}
  serviceSubnet: 10.96.0.0/12
proxy:
  disabled: true
scheduler: {{}}
"""
# kubectl as the procedures call it: the two ConfigMaps' keys by go-template, every call
# recorded.
STAND_IN = """import json, sys
from pathlib import Path
args = sys.argv[1:]
with open("calls", "a") as calls:
    calls.write(json.dumps(args) + "\\n")
data = json.loads(Path("objects.json").read_text())
for arg in args:
    if arg.startswith("go-template="):
        name = args[args.index("configmap") + 1]
        key = arg.split('"')[1]
        sys.stdout.write(data[name][key])
"""


def kubectl(tmp_path: Path, objects: dict[str, dict[str, str]]) -> dict[str, str]:
    """A stand-in kubectl first on PATH, answering from `objects` (ConfigMap -> data)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stand_in = bin_dir / "kubectl"
    stand_in.write_text(f"#!{sys.executable}\n{STAND_IN}")
    stand_in.chmod(0o755)
    (tmp_path / "objects.json").write_text(json.dumps(objects))
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}


def run(block: str, tmp_path: Path, env: dict[str, str]) -> list[list[str]]:
    proc = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=tmp_path, env=env,
                          capture_output=True, text=True, check=False, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]


def variant() -> tuple[dict[str, Any], dict[str, Any]]:
    """deploy/kubeadm/daemonset.yaml's agent container and its ConfigMap volume."""
    (ds,) = [d for d in yaml.safe_load_all(KUBEADM_MANIFEST.read_text())
             if d and d["kind"] == "DaemonSet"]
    pod = ds["spec"]["template"]["spec"]
    (agent,) = pod["containers"]
    (volume,) = [v for v in pod["volumes"] if "configMap" in v]
    return agent, volume


def created_configmap(calls: list[list[str]]) -> tuple[str, list[str]]:
    (create,) = [c for c in calls if c[2:4] == ["create", "configmap"]]
    assert create[:2] == ["-n", "kube-system"]
    return create[4], sorted(a.removeprefix("--from-file=") for a in create[5:])


def agent_reads(tmp_path: Path) -> Any:
    """The written config.conf as the variant's agent reads it, mounted where the
    manifest mounts sliceproxy's ConfigMap."""
    agent, volume = variant()
    (mount,) = [m for m in agent["volumeMounts"] if m["name"] == volume["name"]]
    (flag,) = [a for a in agent["args"] if a.startswith("--config=")]
    path = Path(flag.removeprefix("--config="))
    assert path.parent == Path(mount["mountPath"])
    cfg = parse_args([f"--config={tmp_path / path.name}", "--hostname-override=node-1"])
    assert cfg.kubeconfig == f"{mount['mountPath']}/kubeconfig.conf"  # the other file
    return cfg


def resolved(kubeconfig: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The cluster and user a kubeconfig's current context names."""
    doc = yaml.safe_load(kubeconfig)
    (ctx,) = [c["context"] for c in doc["contexts"] if c["name"] == doc["current-context"]]
    (cluster,) = [c["cluster"] for c in doc["clusters"] if c["name"] == ctx["cluster"]]
    (user,) = [u["user"] for u in doc["users"] if u["name"] == ctx["user"]]
    return cluster, user


@pytest.mark.parametrize("cluster_configuration", [V1BETA2, V1BETA4], ids=["v1.20", "v1.31+"])
def test_a_new_clusters_block_writes_what_kubeadms_addon_would(
        tmp_path: Path, cluster_configuration: str) -> None:
    """docs/deploy.md, "A new kubeadm cluster": from kubeadm-config, the two files
    kubeadm's add-on would have put in kube-proxy's ConfigMap, in sliceproxy's."""
    env = kubectl(tmp_path, {"kubeadm-config": {"ClusterConfiguration": cluster_configuration}})
    calls = run(doc_block("deploy.md", "### A new kubeadm cluster",
                          "kubectl -n kube-system create configmap sliceproxy"), tmp_path, env)
    name, keys = created_configmap(calls)
    assert name == variant()[1]["configMap"]["name"]
    assert keys == ["config.conf", "kubeconfig.conf"]
    assert ["apply", "-f", "deploy/kubeadm/daemonset.yaml"] in calls
    cfg = agent_reads(tmp_path)
    assert cfg.proxy_mode == "iptables" and cfg.ignored_settings == ()
    assert [str(c) for c in cfg.cluster_cidr] == [PODS]
    kubeadms = yaml.safe_load(KUBEADM_CONFIGMAP.read_text())["data"]["kubeconfig.conf"]
    cluster, user = resolved((tmp_path / "kubeconfig.conf").read_text())
    want_cluster, want_user = resolved(kubeadms)
    assert cluster == {**want_cluster, "server": f"https://{ENDPOINT}"}
    assert user == want_user


@pytest.mark.parametrize("mode", ["iptables", "nftables"])
def test_the_switch_copies_kube_proxys_two_files_as_they_are(tmp_path: Path, mode: str) -> None:
    """docs/migrate.md, step 1: kubeadm's kube-proxy ConfigMap's two keys, byte for byte
    but for `mode` when asked, into sliceproxy's ConfigMap."""
    kube_proxy = yaml.safe_load(KUBEADM_CONFIGMAP.read_text())["data"]
    env = kubectl(tmp_path, {"kube-proxy": kube_proxy})
    step = steps(doc_block("migrate.md", "## kube-proxy → sliceproxy"))["1"]
    if mode == "nftables":
        step = uncommented(step, "sed -i")
    name, keys = created_configmap(run(step, tmp_path, env))
    assert name == variant()[1]["configMap"]["name"]
    assert keys == sorted(kube_proxy)
    assert (tmp_path / "kubeconfig.conf").read_text() == kube_proxy["kubeconfig.conf"]
    written = (tmp_path / "config.conf").read_text()
    want = kube_proxy["config.conf"]
    if mode == "nftables":
        want = want.replace('\nmode: ""\n', "\nmode: nftables\n")
    assert written == want
    cfg = agent_reads(tmp_path)
    assert cfg.proxy_mode == mode


def test_the_procedures_tell_kubeadm_kube_proxy_is_gone_and_back() -> None:
    """The switch ends with kube-proxy's ConfigMap saved, then deleted (kubeadm v1.19 to
    v1.31 skip the add-on by it) and proxy.disabled set (v1.32.1 on); the way back
    undoes both before kube-proxy's DaemonSet returns; the recovery deletes both
    objects kubeadm's add-on phase brought back."""
    switch = steps(doc_block("migrate.md", "## kube-proxy → sliceproxy"))
    assert sorted(switch) == ["0", "1", "2", "3", "4", "5"]
    assert "get configmap kube-proxy -o yaml > kube-proxy-cm.yaml" in switch["0"]
    assert "kubectl -n kube-system delete configmap kube-proxy\n" in switch["5"]
    assert "edit configmap kubeadm-config" in switch["5"] and "disabled: true" in switch["5"]
    back = steps(doc_block("migrate.md", "## sliceproxy → kube-proxy"))
    assert "edit configmap kubeadm-config" in back["1"]
    assert "kubectl create -f kube-proxy-cm.yaml" in back["2"]
    assert "kubectl create -f kube-proxy-ds.yaml" in back["4"]
    recovery = doc_block("migrate.md", "## If kube-proxy comes back anyway", "kubectl")
    assert recovery.splitlines()[:2] == ["kubectl -n kube-system delete daemonset kube-proxy",
                                         "kubectl -n kube-system delete configmap kube-proxy"]
