"""`python -m proxy.sim`: free port, kubeconfig, manifests from files and directories."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from tests.sim.client import Api, service

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def run_sim(*args: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    proc = subprocess.Popen([sys.executable, "-m", "proxy.sim", "--listen", "127.0.0.1:0",
                             *args], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # blocks until the server prints its address
        match = re.fullmatch(r"listening on (http://127\.0\.0\.1:\d+)\n", line)
        assert match, f"unexpected first line {line!r}; stderr: {proc.stderr.read()}" \
            if proc.poll() is not None else line
        yield proc, match.group(1)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)


def test_serves_manifests_and_writes_a_kubeconfig(tmp_path: Path) -> None:
    manifests = tmp_path / "m"
    (manifests / "sub").mkdir(parents=True)
    (manifests / "svc.yaml").write_text(yaml.safe_dump_all([
        service("one", namespace="apps"), service("two", namespace="apps")]))
    (manifests / "sub" / "list.json").write_text(json.dumps({
        "apiVersion": "v1", "kind": "List", "items": [
            {"apiVersion": "v1", "kind": "Node", "metadata": {"name": "node-1"}}]}))
    kubeconfig = tmp_path / "kubeconfig"
    with run_sim("-f", str(manifests), "--kubeconfig-out", str(kubeconfig)) as (proc, url):
        cfg = yaml.safe_load(kubeconfig.read_text())
        assert cfg["clusters"][0]["cluster"]["server"] == url
        api = Api(url)
        _, svcs = api.get("/api/v1/namespaces/apps/services")
        assert [s["metadata"]["name"] for s in svcs["items"]] == ["one", "two"]
        assert api.get("/api/v1/nodes/node-1")[0] == 200
        assert api.get("/api/v1/namespaces/apps")[0] == 200  # created for convenience
    assert proc.returncode == 0


def test_invalid_manifest_fails_unless_no_validate(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(service("bad", ports=[{"port": 0}])))
    proc = subprocess.run([sys.executable, "-m", "proxy.sim", "-f", str(bad)], cwd=ROOT,
                          check=False, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1 and "spec.ports[0].port" in proc.stderr
    with run_sim("-f", str(bad), "--no-validate") as (_, url):
        status, svc = Api(url).get("/api/v1/namespaces/default/services/bad")
        assert status == 200 and svc["spec"]["ports"][0]["port"] == 0
