"""Talking to the API server: authenticated GETs that return raw JSON bytes and streams.

Where the server is and how to authenticate comes from `kubeconfig.py` (a kubeconfig
file, the pod's service account, `--master` overriding the address); requests go
through one aiohttp session. Responses are never deserialised into model classes: the
bodies go straight to orjson and our decoder (FINDINGS: the official client's models
cost ~10x the parse time and 4x the memory), and the list/watch loop is ours
(`reflector.py`).

A kubeconfig that needs more than kubeconfig.py reads (`exec` or `auth-provider`
plugins, a proxy, impersonation) is loaded by the official `kubernetes` package
(`kubernetes.aio`), imported only then, and its ApiClient makes the requests: its
loaders run the plugins and refresh what they hand out.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from proxy.kube import kubeconfig
from proxy.kube.kubeconfig import IN_CLUSTER_HOST_ENV, SERVICE_ACCOUNT_DIR, KubeconfigError

log = logging.getLogger(__name__)



class ConfigError(Exception):
    """The API server cannot be configured from the given flags and environment."""


class Response(Protocol):
    status: int
    headers: Mapping[str, str]

    async def read(self) -> bytes: ...

    async def readany(self) -> bytes:
        """Some of the bytes that have arrived, at least one (b"" at the end of the
        stream); waits only if none have."""
        ...

    def close(self) -> None: ...


class BodyTooLarge(Exception):
    """A response body over the caller's bound (see `read_body`)."""


async def read_body(resp: Response, limit: int, *, truncate: bool = False) -> bytearray:
    """The body of `resp`, read in the chunks that arrive, never more than `limit` bytes
    held: over it, raise BodyTooLarge (the caller names what was too large), or with
    `truncate` return the first `limit` bytes and stop reading (for error bodies, where
    the start is all a log line needs). `read()` would hold a body of any size, and a
    server that streams one forever would take all the memory there is."""
    buf = bytearray()
    while chunk := await resp.readany():
        room = limit - len(buf)
        if len(chunk) > room:
            if truncate:
                buf += chunk[:room]
                return buf
            raise BodyTooLarge(f"response body over {limit} bytes")
        buf += chunk
    return buf


class Api(Protocol):
    """The narrow API-server surface the reflector needs (a fake can stand in for it)."""

    @property
    def host(self) -> str: ...

    async def get(self, path: str, query: Mapping[str, str], timeout: float) -> Response: ...

    async def close(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ClientOptions:
    kubeconfig: str | None = None
    master: str | None = None
    context: str | None = None
    # Where the in-cluster service account's `token` and `ca.crt` are mounted.
    service_account_dir: str = SERVICE_ACCOUNT_DIR


def _override_host(configuration: Any, host: str) -> None:
    """Point the configuration at `host`, and keep it there: the in-cluster loader's
    token-refresh hook runs before every request and writes the service's address back."""
    configuration.host = host
    refresh = configuration.refresh_api_key_hook
    if refresh is None:
        return

    async def refresh_and_keep_host(cfg: Any) -> None:
        result = refresh(cfg)
        if inspect.isawaitable(result):
            await result
        cfg.host = host

    configuration.refresh_api_key_hook = refresh_and_keep_host


READ_CHUNK = 256 * 1024
# The host name deploy/daemonset.yaml ships in `master`, for the operator to replace.
MASTER_PLACEHOLDER = "API-SERVER-ADDRESS"


class _AiohttpResponse:
    def __init__(self, resp: Any) -> None:
        self._resp = resp
        self.status: int = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def read(self) -> bytes:
        data: bytes = await self._resp.read()
        return data

    async def readany(self) -> bytes:
        # Not content.readany(), which joins everything buffered into one new bytes:
        # a fast stream buffers megabytes between two turns of the loop, so the copy
        # doubled them. read(n) hands out the buffered chunks, at most n bytes at a time.
        data: bytes = await self._resp.content.read(READ_CHUNK)
        return data

    def close(self) -> None:
        self._resp.close()


class KubeApi:
    """`Api` over one aiohttp session, configured by kubeconfig.py; or, for what only
    the `kubernetes` package can configure, over its ApiClient (`via` says which)."""

    def __init__(self, connection: kubeconfig.Connection | None = None,
                 api_client: Any = None) -> None:
        self._conn = connection
        self._client = api_client
        self._session: Any = None
        self.via = "kubernetes package" if api_client is not None else "sliceproxy"

    @property
    def host(self) -> str:
        if self._conn is not None:
            return self._conn.server
        return str(self._client.configuration.host)

    @classmethod
    async def connect(cls, options: ClientOptions) -> KubeApi:
        try:
            if options.kubeconfig:
                conn = kubeconfig.load(options.kubeconfig, options.context)
                if conn is None:
                    return await cls._connect_with_kubernetes(options)
            elif os.environ.get(IN_CLUSTER_HOST_ENV):
                # Unlike kube-proxy, which ignores the service account once --master is
                # given, we keep its token and CA with --master: the override then only
                # moves the address (e.g. to a load balancer in front of the API servers).
                conn = kubeconfig.in_cluster(options.service_account_dir)
            elif options.master:
                conn = kubeconfig.Connection(options.master, "--master only")
            else:
                raise ConfigError(
                    "no API server configured: pass --kubeconfig or --master, or run in a pod "
                    f"({IN_CLUSTER_HOST_ENV} is not set)")
        except KubeconfigError as exc:
            raise ConfigError(f"cannot load API server configuration: {exc}") from exc
        if options.master:
            if MASTER_PLACEHOLDER in options.master:
                raise ConfigError(
                    f"--master: {options.master!r} is the shipped manifest's placeholder: set "
                    "`master` in the sliceproxy ConfigMap to your API server's address as "
                    "nodes reach it, e.g. https://192.0.2.10:6443 (docs/bootstrap.md)")
            conn.server = options.master.rstrip("/")
            if conn.server.startswith("https://") and conn.ssl is None:
                conn.ssl = kubeconfig.default_context()
            if conn.source != "--master only":
                conn.source += ", address from --master"
        log.info("API server %s (from %s)", conn.server, conn.source)
        return cls(conn)

    async def get(self, path: str, query: Mapping[str, str], timeout: float) -> Response:
        if self._conn is None:
            return await self._get_with_kubernetes(path, query, timeout)
        import aiohttp  # the agent's HTTP servers have loaded it already

        if self._session is None:
            # trust_env: HTTPS_PROXY/NO_PROXY from the environment, as client-go (and
            # the kubernetes package's session before) honour them.
            self._session = aiohttp.ClientSession(trust_env=True)
        conn = self._conn
        raw = await self._session.get(
            conn.server + path, params=dict(query),
            headers={"Accept": "application/json", **conn.auth_headers()},
            ssl=conn.ssl if conn.ssl is not None else True,
            server_hostname=conn.tls_server_name,
            timeout=aiohttp.ClientTimeout(total=timeout))
        return _AiohttpResponse(raw)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._client is not None:
            await self._client.close()

    # --- the `kubernetes` package, for what kubeconfig.py leaves to it -------------------

    @classmethod
    async def _connect_with_kubernetes(cls, options: ClientOptions) -> KubeApi:
        from kubernetes.aio import client as aio_client
        from kubernetes.aio import config as aio_config

        assert options.kubeconfig
        configuration = aio_client.Configuration()
        try:
            await aio_config.load_kube_config(
                config_file=options.kubeconfig, context=options.context,
                client_configuration=configuration, persist_config=False)
        except Exception as exc:  # the config loaders raise a variety of types
            raise ConfigError(f"cannot load API server configuration: {exc}") from exc
        if options.master:
            _override_host(configuration, options.master.rstrip("/"))
        log.info("API server %s (from kubeconfig %s, loaded by the kubernetes package: it "
                 "needs more than sliceproxy reads itself)", configuration.host,
                 options.kubeconfig)
        return cls(api_client=aio_client.ApiClient(configuration))

    async def _get_with_kubernetes(self, path: str, query: Mapping[str, str],
                                   timeout: float) -> Response:
        method, url, headers, body, _ = await self._client.param_serialize(
            "GET", path, query_params=list(query.items()),
            header_params={"Accept": "application/json"}, auth_settings=["BearerToken"])
        raw = await self._client.call_api(
            method, url, header_params=headers, body=body,
            _request_timeout=timeout, _preload_content=False)
        return _AiohttpResponse(raw.response)
