"""kubeconfig.py: what a kubeconfig or a service account says, read without the
`kubernetes` package; and what it leaves to that package (None)."""

from __future__ import annotations

import base64
import os
import ssl
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.kube.kubeconfig import KubeconfigError, TokenFile, in_cluster, load


def _pair(tmp: Path, name: str = "c") -> tuple[Path, Path]:
    cert, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={name}", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def _write(tmp: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None,
           current: str | None = "main") -> Path:
    doc = {"apiVersion": "v1", "kind": "Config", "current-context": current,
           "contexts": [{"name": "main", "context": {"cluster": "c1", "user": "u1"}},
                        {"name": "other", "context": {"cluster": "c2", "user": "u2"}}],
           "clusters": [{"name": "c1", "cluster": cluster or {"server": "http://198.18.0.1:8080"}},
                        {"name": "c2", "cluster": {"server": "http://198.18.0.2:8080/"}}],
           "users": [{"name": "u1", "user": user}, {"name": "u2", "user": {"token": "two"}}]}
    path = tmp / "config"
    path.write_text(yaml.safe_dump(doc))
    return path


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def test_token_and_the_current_context(tmp_path: Path) -> None:
    conn = load(str(_write(tmp_path, {"token": "abc"})))
    assert conn is not None and conn.server == "http://198.18.0.1:8080" and conn.ssl is None
    assert conn.auth_headers() == {"Authorization": "Bearer abc"}


def test_a_named_context_wins_and_the_trailing_slash_goes(tmp_path: Path) -> None:
    conn = load(str(_write(tmp_path, {"token": "abc"})), context="other")
    assert conn is not None and conn.server == "http://198.18.0.2:8080"
    assert conn.auth_headers() == {"Authorization": "Bearer two"}


def test_https_with_a_ca_path_relative_to_the_file_and_a_client_certificate(
        tmp_path: Path) -> None:
    _pair(tmp_path, "ca")
    _cert, key = _pair(tmp_path, "client")
    path = _write(tmp_path, {"client-certificate": "client.crt", "client-key": str(key)},
                  {"server": "https://198.18.0.1:6443", "certificate-authority": "ca.crt",
                   "tls-server-name": "api.example"})
    os.chdir("/")  # relative to the kubeconfig, not to where the agent runs
    conn = load(str(path))
    assert conn is not None and isinstance(conn.ssl, ssl.SSLContext)
    assert conn.ssl.verify_mode is ssl.CERT_REQUIRED and conn.tls_server_name == "api.example"
    assert [c["subject"] for c in conn.ssl.get_ca_certs()] == [((("commonName", "ca"),),)]
    assert conn.auth_headers() == {}


def test_inline_data_as_kubeadm_writes_it(tmp_path: Path) -> None:
    ca, _ = _pair(tmp_path, "ca")
    cert, key = _pair(tmp_path, "admin")
    conn = load(str(_write(tmp_path, {"client-certificate-data": _b64(cert),
                                      "client-key-data": _b64(key)},
                           {"server": "https://198.18.0.1:6443",
                            "certificate-authority-data": _b64(ca)})))
    assert conn is not None and conn.ssl is not None
    assert [c["subject"] for c in conn.ssl.get_ca_certs()] == [((("commonName", "ca"),),)]
    assert not list(Path("/tmp").glob("sliceproxy-cert-*"))  # the key's copy is gone


def test_insecure_skip_tls_verify(tmp_path: Path) -> None:
    conn = load(str(_write(tmp_path, {"token": "t"}, {"server": "https://198.18.0.1:6443",
                                                      "insecure-skip-tls-verify": True})))
    assert conn is not None and conn.ssl is not None
    assert conn.ssl.verify_mode is ssl.CERT_NONE and not conn.ssl.check_hostname


def test_basic_auth(tmp_path: Path) -> None:
    conn = load(str(_write(tmp_path, {"username": "u", "password": "p:w"})))
    assert conn is not None
    assert conn.auth_headers() == {"Authorization": "Basic " + base64.b64encode(b"u:p:w").decode()}


@pytest.mark.parametrize(("user", "cluster"), [
    ({"exec": {"apiVersion": "client.authentication.k8s.io/v1", "command": "true"}}, None),
    ({"auth-provider": {"name": "oidc"}}, None),
    ({"token": "t", "as": "someone"}, None),
    ({"token": "t"}, {"server": "https://198.18.0.1:6443", "proxy-url": "http://198.18.0.9:3128"}),
], ids=["exec", "auth-provider", "impersonation", "proxy-url"])
def test_what_only_the_kubernetes_package_does_is_left_to_it(
        tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None) -> None:
    assert load(str(_write(tmp_path, user, cluster))) is None


@pytest.mark.parametrize(("edit", "message"), [
    ({"current": None}, "no current-context"),
    ({"current": "nope"}, "no context named 'nope'"),
    ({"cluster": {"certificate-authority": "ca.crt"}}, "has no server"),
    ({"user": {"client-certificate-data": "bm90IGEgY2VydA=="},
      "cluster": {"server": "https://198.18.0.1"}}, "without its key"),
    ({"user": {"client-key-data": "%%%"}, "cluster": {"server": "https://198.18.0.1"}},
     "not base64"),
    ({"cluster": {"server": "https://198.18.0.1", "certificate-authority": "missing.crt"}},
     "CA"),
], ids=["no-context", "unknown-context", "no-server", "cert-without-key", "bad-base64",
        "missing-ca"])
def test_a_broken_kubeconfig_says_what_is_wrong(tmp_path: Path, edit: dict[str, Any],
                                                message: str) -> None:
    path = _write(tmp_path, edit.get("user", {"token": "t"}), edit.get("cluster"),
                  edit.get("current", "main"))
    with pytest.raises(KubeconfigError, match=message):
        load(str(path))


def test_a_token_file_is_read_again_when_it_changes(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    token = TokenFile(path)
    assert token.current() == "first"
    path.write_text("second-longer\n")  # kubelet rotates a projected token
    assert token.current() == "second-longer"
    path.unlink()  # gone for a moment during an atomic swap: the last one stays
    assert token.current() == "second-longer"


def test_in_cluster(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca, _ = _pair(tmp_path, "ca")
    sa = tmp_path / "sa"
    sa.mkdir()
    (sa / "token").write_text("sa-token")
    (sa / "ca.crt").write_bytes(ca.read_bytes())
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    conn = in_cluster(str(sa))
    assert conn.server == "https://[fd00::1]:443"
    assert conn.auth_headers() == {"Authorization": "Bearer sa-token"}
    (sa / "ca.crt").unlink()
    with pytest.raises(KubeconfigError, match="CA"):
        in_cluster(str(sa))
