"""Keys, certificates, the token file and kubeconfigs for a throw-away control plane.

The API server gets a serving certificate from our own CA (instead of the self-signed one
it would make up) so that clients verify TLS for real: the certificate names every address
a client uses (127.0.0.1 inside the control-plane namespace and through the host-side
forwarder, the bridge address node namespaces use, and the `kubernetes` service IP).
"""

from __future__ import annotations

import base64
import secrets
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ADMIN_USER = "sliceproxy-admin"


class PkiError(RuntimeError):
    pass


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, text=True,
                          check=False, timeout=60)
    if proc.returncode != 0:
        raise PkiError(f"openssl {' '.join(args)}: {proc.stderr.strip()}")


@dataclass(frozen=True, slots=True)
class Pki:
    ca_cert: Path
    server_cert: Path
    server_key: Path
    sa_key: Path  # service-account signing key (private)
    sa_pub: Path
    token: str  # bearer token of ADMIN_USER (system:masters)
    token_file: Path
    # user -> bearer token, for the identities asked of make_pki (components, kubelets)
    tokens: Mapping[str, str] = field(default_factory=dict)

    def kubeconfig(self, server: str, user: str = ADMIN_USER) -> dict[str, Any]:
        ca = base64.b64encode(self.ca_cert.read_bytes()).decode()
        token = self.token if user == ADMIN_USER else self.tokens[user]
        return {
            "apiVersion": "v1", "kind": "Config",
            "clusters": [{"name": "realcp", "cluster": {
                "server": server, "certificate-authority-data": ca}}],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": "realcp", "context": {"cluster": "realcp", "user": user}}],
            "current-context": "realcp",
        }

    def write_kubeconfig(self, path: Path, server: str, user: str = ADMIN_USER) -> Path:
        path.write_text(yaml.safe_dump(self.kubeconfig(server, user)), encoding="utf-8")
        path.chmod(0o600)
        return path


def make_pki(directory: Path, ips: Sequence[str], dns: Sequence[str],
             identities: Mapping[str, Sequence[str]] | None = None) -> Pki:
    """A CA, a serving certificate for `ips`/`dns`, a service-account key pair, a token
    for the admin and one for each of `identities` (user -> groups)."""
    directory.mkdir(parents=True, exist_ok=True)
    d = directory
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key",
             "-out", "ca.crt", "-days", "3", "-subj", "/CN=sliceproxy-realcp-ca", cwd=d)
    san = ",".join([*(f"IP:{ip}" for ip in ips), *(f"DNS:{n}" for n in dns)])
    (d / "server.ext").write_text(
        f"subjectAltName={san}\nbasicConstraints=CA:FALSE\n"
        "keyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out",
             "server.csr", "-subj", "/CN=kube-apiserver", cwd=d)
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-out", "server.crt", "-days", "3", "-extfile", "server.ext",
             cwd=d)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=d)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=d)
    token = secrets.token_hex(24)
    token_file = d / "tokens.csv"
    # token,user,uid,"group1,group2": system:masters so that RBAC would not matter either.
    lines = [f'{token},{ADMIN_USER},{ADMIN_USER},"system:masters"']
    tokens = {}
    for user, groups in (identities or {}).items():
        tokens[user] = secrets.token_hex(24)
        line = f"{tokens[user]},{user},{user}"
        lines.append(f'{line},"{",".join(groups)}"' if groups else line)
    token_file.write_text("\n".join(lines) + "\n")
    token_file.chmod(0o600)
    return Pki(d / "ca.crt", d / "server.crt", d / "server.key", d / "sa.key", d / "sa.pub",
               token, token_file, tokens)
