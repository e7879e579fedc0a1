"""Where the API server is and how to prove who we are: a kubeconfig file, or the pod's
service account; read here for the cases a node agent meets.

The official `kubernetes` package did this before, at a price measured on the agent's
start (`python -X importtime`, ru_maxrss): importing its asyncio client and config
loaders costs 100 ms and 18 MiB, because its package imports every generated API model
(hundreds of classes) whatever one uses. Against issue 15's goal of 100 MiB at 1,000
services that is a fifth of the budget, for loading a YAML file.

Read here: the server, its CA (file or inline data), `insecure-skip-tls-verify`,
`tls-server-name`; a bearer token (inline or `tokenFile`), a client certificate and key
(files or inline data), basic auth; and in a pod, `KUBERNETES_SERVICE_HOST`/`_PORT`
with the mounted token and CA. The token file is read again when it changes (kubelet
rotates projected tokens; client-go re-reads it too).

Anything else in the chosen user or cluster (`exec` and `auth-provider` plugins,
`proxy-url`, impersonation, a field this module has never heard of) is left to the
`kubernetes` package, loaded only then (`load` returns None): nothing it could do is
lost, and the common case does not pay for it.
"""

from __future__ import annotations

import base64
import os
import ssl
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

IN_CLUSTER_HOST_ENV = "KUBERNETES_SERVICE_HOST"
IN_CLUSTER_PORT_ENV = "KUBERNETES_SERVICE_PORT"
SERVICE_ACCOUNT_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"

# Fields of a kubeconfig's user and cluster entries read here; any other field present
# hands the whole configuration to the `kubernetes` package.
USER_FIELDS = frozenset({"token", "tokenFile", "client-certificate", "client-certificate-data",
                         "client-key", "client-key-data", "username", "password"})
CLUSTER_FIELDS = frozenset({"server", "certificate-authority", "certificate-authority-data",
                            "insecure-skip-tls-verify", "tls-server-name", "extensions"})


class KubeconfigError(Exception):
    """The configuration cannot be used (the message says which field and why)."""


@dataclass
class TokenFile:
    """A bearer token read from a file, again whenever the file changes."""

    path: Path
    _token: str = ""
    _stamp: tuple[float, int] | None = field(default=None, repr=False)

    def current(self) -> str:
        try:
            st = self.path.stat()
        except OSError as exc:
            if self._token:
                return self._token  # gone for a moment (an atomic swap): keep the last
            raise KubeconfigError(f"token file {self.path}: {exc.strerror}") from exc
        stamp = (st.st_mtime, st.st_size)
        if stamp != self._stamp:
            try:
                self._token = self.path.read_text(encoding="utf-8").strip()
            except OSError as exc:
                if not self._token:
                    raise KubeconfigError(f"token file {self.path}: {exc.strerror}") from exc
            else:
                self._stamp = stamp
        return self._token


@dataclass
class Connection:
    """How to reach the API server: its address, TLS, and the headers proving who we are."""

    server: str
    source: str
    ssl: ssl.SSLContext | None = None
    tls_server_name: str | None = None
    token: str | None = None
    token_file: TokenFile | None = None
    basic: tuple[str, str] | None = None

    def auth_headers(self) -> dict[str, str]:
        if self.token_file is not None:
            return {"Authorization": f"Bearer {self.token_file.current()}"}
        if self.token:
            return {"Authorization": f"Bearer {self.token}"}
        if self.basic is not None:
            raw = f"{self.basic[0]}:{self.basic[1]}".encode()
            return {"Authorization": "Basic " + base64.b64encode(raw).decode()}
        return {}


def in_cluster(service_account_dir: str = SERVICE_ACCOUNT_DIR) -> Connection:
    """The pod's own service account, as client-go's InClusterConfig reads it."""
    host, port = os.environ.get(IN_CLUSTER_HOST_ENV, ""), os.environ.get(IN_CLUSTER_PORT_ENV, "")
    if not host or not port:
        raise KubeconfigError(f"{IN_CLUSTER_HOST_ENV} and {IN_CLUSTER_PORT_ENV} must be set")
    sa = Path(service_account_dir)
    token = TokenFile(sa / "token")
    if not token.path.is_file():
        raise KubeconfigError(f"service account token file {token.path} not found")
    token.current()
    ca = sa / "ca.crt"
    if not ca.is_file():
        raise KubeconfigError(f"service account CA {ca} not found")
    server = f"https://{_host(host)}:{port}"
    return Connection(server, "in-cluster service account", _context(cafile=str(ca)),
                      token_file=token)


def load(path: str, context: str | None = None) -> Connection | None:
    """The connection a kubeconfig file describes, or None if it needs what only the
    `kubernetes` package does (module docstring)."""
    try:
        doc = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise KubeconfigError(f"kubeconfig {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise KubeconfigError(f"kubeconfig {path}: not valid YAML: {exc}") from exc
    if not isinstance(doc, dict):
        raise KubeconfigError(f"kubeconfig {path}: not a mapping")
    name = context or doc.get("current-context")
    if not name:
        raise KubeconfigError(f"kubeconfig {path}: no current-context, and none given")
    ctx = _named(doc, "contexts", "context", str(name), path)
    cluster = _named(doc, "clusters", "cluster", str(ctx.get("cluster") or ""), path)
    user_name = ctx.get("user")
    user = _named(doc, "users", "user", str(user_name), path) if user_name else {}
    if set(user) - USER_FIELDS or set(cluster) - CLUSTER_FIELDS:
        return None
    server = cluster.get("server")
    if not isinstance(server, str) or not server:
        raise KubeconfigError(f"kubeconfig {path}: cluster {ctx.get('cluster')!r} has no server")
    base = Path(path).resolve().parent
    conn = Connection(server.rstrip("/"), f"kubeconfig {path}")
    if server.startswith("https://"):
        conn.ssl = _context(
            cafile=_file(cluster, "certificate-authority", base),
            cadata=_data(cluster, "certificate-authority-data", path),
            insecure=cluster.get("insecure-skip-tls-verify") is True)
        conn.tls_server_name = cluster.get("tls-server-name") or None
        _client_certificate(conn.ssl, user, base, path)
    if "tokenFile" in user and not user.get("token"):
        conn.token_file = TokenFile(Path(_file(user, "tokenFile", base) or ""))
        conn.token_file.current()
    conn.token = user.get("token") or None
    if user.get("username") is not None:
        conn.basic = (str(user.get("username")), str(user.get("password") or ""))
    return conn


def _named(doc: Mapping[str, Any], section: str, key: str, name: str,
           path: str) -> dict[str, Any]:
    for entry in doc.get(section) or ():
        if isinstance(entry, dict) and entry.get("name") == name:
            value = entry.get(key) or {}
            if not isinstance(value, dict):
                raise KubeconfigError(f"kubeconfig {path}: {section} {name!r} is not a mapping")
            return value
    raise KubeconfigError(f"kubeconfig {path}: no {key} named {name!r} in {section}")


def _file(entry: Mapping[str, Any], key: str, base: Path) -> str | None:
    """A path field, relative to the kubeconfig's directory as kubectl reads it."""
    value = entry.get(key)
    if not value:
        return None
    return str(base / os.path.expanduser(str(value)))


def _data(entry: Mapping[str, Any], key: str, path: str) -> bytes | None:
    value = entry.get(key)
    if not value:
        return None
    try:
        return base64.b64decode(str(value), validate=True)
    except ValueError as exc:
        raise KubeconfigError(f"kubeconfig {path}: {key} is not base64: {exc}") from exc


def default_context() -> ssl.SSLContext:
    """The system's CAs (an https `--master` with nothing else configured)."""
    return ssl.create_default_context()


def _context(cafile: str | None = None, cadata: bytes | None = None,
             insecure: bool = False) -> ssl.SSLContext:
    if insecure:
        ctx = ssl.create_default_context()
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    try:
        # The cluster's CA alone, as client-go: not the system's CAs beside it.
        return ssl.create_default_context(
            cafile=cafile, cadata=cadata.decode("ascii") if cadata else None)
    except (OSError, ssl.SSLError, UnicodeDecodeError, ValueError) as exc:
        raise KubeconfigError(f"cannot load the cluster's CA: {exc}") from exc


def _client_certificate(ctx: ssl.SSLContext, user: Mapping[str, Any], base: Path,
                        path: str) -> None:
    cert_file, key_file = _file(user, "client-certificate", base), _file(user, "client-key", base)
    cert_data = _data(user, "client-certificate-data", path)
    key_data = _data(user, "client-key-data", path)
    if not (cert_file or cert_data):
        return
    if not (key_file or key_data):
        raise KubeconfigError(f"kubeconfig {path}: a client certificate without its key")
    # load_cert_chain reads files only: inline data goes through a private temporary
    # directory, removed at once (the context keeps what it loaded).
    with tempfile.TemporaryDirectory(prefix="sliceproxy-cert-") as tmp:
        if cert_data is not None:
            cert_file = os.path.join(tmp, "cert.pem")
            Path(cert_file).write_bytes(cert_data)
        if key_data is not None:
            key_file = os.path.join(tmp, "key.pem")
            Path(key_file).write_bytes(key_data)
        try:
            ctx.load_cert_chain(str(cert_file), str(key_file))
        except (OSError, ssl.SSLError) as exc:
            raise KubeconfigError(f"kubeconfig {path}: cannot load the client certificate: "
                                  f"{exc}") from exc


def _host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
