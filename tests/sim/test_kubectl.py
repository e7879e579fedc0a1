"""The real kubectl binaries against the simulator: v1.32 (/usr/bin/kubectl, tries
aggregated discovery first) and Debian's v1.20 (classic discovery only).

kubectl 1.20 comes from Debian's `kubernetes-client` package, which conflicts with the
installed kubectl package, so it is unpacked (not installed) into .cache/kubectl-1.20 on
first use.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.kube.manifests import load_paths
from proxy.sim import SimServer
from tests.sim.test_sim_cli import run_sim

ROOT = Path(__file__).resolve().parents[2]
KUBECTL_120 = ROOT / ".cache" / "kubectl-1.20" / "usr" / "bin" / "kubectl"
KUBECTL_132 = Path("/usr/bin/kubectl")


def ensure_kubectl_120() -> Path:
    """Unpack Debian's kubernetes-client (kubectl 1.20) into .cache when it is missing."""
    if KUBECTL_120.exists():
        return KUBECTL_120
    with tempfile.TemporaryDirectory() as tmp:
        # `apt-get download` writes into the current directory; _apt cannot read a private
        # temporary directory, so allow it (the download still works unsandboxed).
        Path(tmp).chmod(0o755)
        subprocess.run(["apt-get", "download", "-q", "kubernetes-client"], cwd=tmp,
                       check=True, capture_output=True, timeout=300)
        (deb,) = Path(tmp).glob("kubernetes-client_*.deb")
        target = KUBECTL_120.parents[2]
        target.mkdir(parents=True, exist_ok=True)
        subprocess.run(["dpkg-deb", "-x", str(deb), str(target)], check=True, timeout=120)
    return KUBECTL_120


@pytest.fixture(scope="module", params=["1.32", "1.20"])
def kubectl(request: pytest.FixtureRequest) -> Path:
    if request.param == "1.20":
        return ensure_kubectl_120()
    if not KUBECTL_132.exists():
        pytest.fail("/usr/bin/kubectl (v1.32) is expected on this machine image")
    return KUBECTL_132


class Kubectl:
    def __init__(self, binary: Path, kubeconfig: Path, cache: Path) -> None:
        self.binary, self.kubeconfig, self.cache = binary, kubeconfig, cache

    def __call__(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        # A fresh --cache-dir per test so discovery is really fetched from the simulator.
        cmd = [str(self.binary), f"--kubeconfig={self.kubeconfig}",
               f"--cache-dir={self.cache}", *args]
        proc = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout}\n{proc.stderr}")
        return proc


@pytest.fixture
def k(kubectl: Path, sim: SimServer, tmp_path: Path) -> Iterator[Kubectl]:
    cfg = sim.write_kubeconfig(tmp_path / "kubeconfig")
    yield Kubectl(kubectl, cfg, tmp_path / "cache")
    shutil.rmtree(tmp_path / "cache", ignore_errors=True)


MANIFEST = """\
apiVersion: v1
kind: Service
metadata:
  name: web
  labels: {app: web}
spec:
  selector: {app: web}
  ports:
  - {name: http, port: 80, targetPort: 8080}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-1
  labels: {kubernetes.io/service-name: web}
addressType: IPv4
endpoints:
- addresses: [198.18.5.1]
  conditions: {ready: true}
ports:
- {name: http, port: 8080, protocol: TCP}
"""


def test_kubectl_create_get_replace_patch_delete(k: Kubectl, sim: SimServer,
                                                 tmp_path: Path) -> None:
    manifest = tmp_path / "web.yaml"
    manifest.write_text(MANIFEST)
    out = k("create", "-f", str(manifest), "--validate=false").stdout
    assert "service/web created" in out and "endpointslice.discovery.k8s.io/web-1 created" in out
    assert sim.get("v1", "Service", "web")["spec"]["ports"][0]["targetPort"] == 8080

    got = json.loads(k("get", "services", "-o", "json").stdout)
    assert [i["metadata"]["name"] for i in got["items"]] == ["web"]
    assert k("get", "svc", "web", "-o", "name").stdout.strip() == "service/web"
    assert k("get", "endpointslices", "-o", "name").stdout.strip() == \
        "endpointslice.discovery.k8s.io/web-1"
    assert "default" in k("get", "namespaces", "-o", "name").stdout
    assert "web" in k("get", "svc").stdout  # the default (human) output

    ip = sim.get("v1", "Service", "web")["spec"]["clusterIP"]
    manifest.write_text(MANIFEST.replace("targetPort: 8080", "targetPort: 9090"))
    assert "service/web replaced" in k("replace", "-f", str(manifest),
                                       "--validate=false").stdout
    svc = sim.get("v1", "Service", "web")
    assert svc["spec"]["ports"][0]["targetPort"] == 9090
    assert svc["spec"]["clusterIP"] == ip  # replace keeps the allocated address

    k("patch", "svc", "web", "--type", "merge", "-p", '{"metadata":{"labels":{"tier":"front"}}}')
    assert sim.get("v1", "Service", "web")["metadata"]["labels"] == {"app": "web",
                                                                     "tier": "front"}

    assert 'service "web" deleted' in k("delete", "svc", "web").stdout
    assert "endpointslice.discovery.k8s.io \"web-1\" deleted" in k(
        "delete", "endpointslice", "web-1").stdout
    assert sim.state()["services"] == [] and sim.state()["endpointslices"] == []

    missing = k("get", "svc", "web", check=False)
    assert missing.returncode != 0 and 'services "web" not found' in missing.stderr


def test_kubectl_reports_server_errors(k: Kubectl, tmp_path: Path) -> None:
    manifest = tmp_path / "bad.yaml"
    manifest.write_text(MANIFEST.split("---", maxsplit=1)[0].replace("port: 80,", "port: 70000,"))
    bad = k("create", "-f", str(manifest), "--validate=false", check=False)
    assert bad.returncode != 0 and "spec.ports[0].port: Invalid value: 70000" in bad.stderr
    manifest.write_text(MANIFEST.split("---", maxsplit=1)[0])
    k("create", "-f", str(manifest), "--validate=false")
    again = k("create", "-f", str(manifest), "--validate=false", check=False)
    assert again.returncode != 0 and "AlreadyExists" in again.stderr


def test_kubectl_namespaces_and_cluster_scoped_objects(k: Kubectl, sim: SimServer,
                                                      tmp_path: Path) -> None:
    # `create -f`: `kubectl create namespace NAME` in 1.32 sends protobuf, which the
    # simulator does not decode (it answers 415).
    manifest = tmp_path / "ns.json"
    manifest.write_text(json.dumps({"apiVersion": "v1", "kind": "Namespace",
                                    "metadata": {"name": "team"}}))
    k("create", "-f", str(manifest), "--validate=false")
    sim.create({"apiVersion": "v1", "kind": "Node", "metadata": {
        "name": "node-a", "labels": {"topology.kubernetes.io/zone": "z1"}}})
    assert k("get", "nodes", "-l", "topology.kubernetes.io/zone=z1", "-o", "name"
             ).stdout.strip() == "node/node-a"
    svc = MANIFEST.split("---", maxsplit=1)[0].replace("name: web", "name: web\n  namespace: team")
    (tmp_path / "svc.yaml").write_text(svc)
    k("create", "-f", str(tmp_path / "svc.yaml"), "--validate=false")
    assert k("get", "svc", "-n", "team", "-o", "name").stdout.strip() == "service/web"
    assert k("get", "svc", "-A", "-o", "name").stdout.strip() == "service/web"
    k("delete", "namespace", "team")
    assert "team" not in k("get", "ns", "-o", "name").stdout
    assert sim.state()["services"] == []


@pytest.mark.parametrize("level", ["1.32", "1.20"])
def test_kubectl_against_python_m_proxy_sim_with_the_examples(kubectl: Path, tmp_path: Path,
                                                              level: str) -> None:
    """What the README tells a user to do: serve examples/, point kubectl at it."""
    expected = sorted((o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
                      for o in load_paths([str(ROOT / "examples")]))
    kubeconfig = tmp_path / "kubeconfig"
    with run_sim("-f", str(ROOT / "examples"), "--kubeconfig-out", str(kubeconfig),
                 "--api-level", level):
        k = Kubectl(kubectl, kubeconfig, tmp_path / "cache")
        got = json.loads(k("get", "services,endpointslices,nodes", "-A", "-o", "json").stdout)
        slices = json.loads(k("get", "endpointslices", "-A", "-o", "json").stdout)
    assert sorted((o["kind"], o["metadata"].get("namespace", ""), o["metadata"]["name"])
                  for o in got["items"]) == expected
    version = "discovery.k8s.io/v1" if level == "1.32" else "discovery.k8s.io/v1beta1"
    assert {o["apiVersion"] for o in slices["items"]} == {version}
