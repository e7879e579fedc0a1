"""HTTPS and bearer tokens: the simulator served like a real API server, for clients that
only talk TLS (in-cluster configuration) and for kubectl with a kubeconfig it writes."""

from __future__ import annotations

import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from proxy.sim import SimServer
from tests.integration.watchkit import self_signed
from tests.sim.client import service
from tests.sim.test_kubectl import KUBECTL_132, Kubectl


def fetch(url: str, ca: Path, token: str | None = None) -> tuple[int, dict[str, object]]:
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    context = ssl.create_default_context(cafile=str(ca))
    try:
        with urllib.request.urlopen(request, context=context, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_tls_and_token(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    with SimServer(tls_cert=cert, tls_key=key, token="s3cret",
                   objects=[service("web")]) as sim:
        assert sim.url.startswith("https://127.0.0.1:")
        assert fetch(sim.url + "/version", cert)[0] == 200  # public, as upstream
        status, body = fetch(sim.url + "/api/v1/services", cert)
        assert status == 401 and body["reason"] == "Unauthorized"
        assert fetch(sim.url + "/api/v1/services", cert, "wrong")[0] == 401
        status, body = fetch(sim.url + "/api/v1/services", cert, "s3cret")
        assert status == 200 and body["kind"] == "ServiceList"
        if not KUBECTL_132.exists():
            pytest.fail("/usr/bin/kubectl (v1.32) is expected on this machine image")
        kubectl = Kubectl(KUBECTL_132, sim.write_kubeconfig(tmp_path / "kc"), tmp_path / "c")
        assert kubectl("get", "svc", "-o", "name").stdout.strip() == "service/web"


def test_tls_needs_both_files(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="go together"):
        SimServer(tls_cert=tmp_path / "c")
