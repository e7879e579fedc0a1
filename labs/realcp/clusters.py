"""One face for two API servers: the simulator and the real v1.20.2 control plane.

Conformance tests take a `Cluster` and run the same code against both. Whatever is
cluster-specific lives here: how to reach it (raw HTTP and a kubeconfig for
`proxy.kube.client.KubeApi`), how to cut every open stream, and how to compact history
so that old resourceVersions answer 410.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labs.realcp.rawapi import RawApi
from proxy.kube.client import Api, Response

Obj = dict[str, Any]
# Slices written by the tests carry a manager of their own, so that the real
# EndpointSlice controller leaves them alone (it manages only its own).
TEST_MANAGER = "sliceproxy-tests.example.com"


@dataclass
class Cluster:
    name: str  # "sim" or "real"; also the pytest id
    raw: RawApi
    kubeconfig: Path
    server_version: str
    compact: Callable[[], object]  # afterwards every earlier rv answers 410
    compact_storage: Callable[[], object]  # only the storage (continue tokens expire)
    cut_streams: Callable[[], int]  # abort every open connection/stream

    def new_namespace(self, hint: str = "t") -> str:
        name = f"{hint[:40].lower().replace('_', '-').strip('-')}-{secrets.token_hex(3)}"
        self.raw.must("POST", "/api/v1/namespaces", {
            "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
        return name

    def slice_group_version(self) -> str:
        """The EndpointSlice API this server serves (v1 if available, else v1beta1)."""
        status, group = self.raw.get("/apis/discovery.k8s.io")
        assert status == 200, group
        versions = {v["version"] for v in group["versions"]}
        return "discovery.k8s.io/v1" if "v1" in versions else "discovery.k8s.io/v1beta1"


# --- object builders ----------------------------------------------------------------------


def service(name: str, namespace: str, *, labels: Mapping[str, str] | None = None,
            selector: Mapping[str, str] | None = None,
            ports: list[Obj] | None = None, **spec: Any) -> Obj:
    body: Obj = {"ports": ports or [{"name": "http", "port": 80, "targetPort": 8080,
                                     "protocol": "TCP"}], **spec}
    if selector is not None:
        body["selector"] = dict(selector)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": dict(labels or {})},
            "spec": body}


@dataclass(frozen=True, slots=True)
class Ep:
    ip: str
    node: str | None = None
    zone: str | None = None
    ready: bool = True


def endpoint_slice(group_version: str, name: str, namespace: str, service_name: str,
                   endpoints: list[Ep], port: int = 8080, port_name: str = "http",
                   address_type: str = "IPv4") -> Obj:
    """An EndpointSlice in the shape `group_version` serves: v1 has nodeName/zone, v1beta1
    a topology map. `address_type`: "IPv4" or "IPv6", as the endpoints' addresses."""
    beta = group_version.endswith("v1beta1")
    eps = []
    for ep in endpoints:
        e: Obj = {"addresses": [ep.ip], "conditions": {"ready": ep.ready}}
        if beta:
            topo = {}
            if ep.node:
                topo["kubernetes.io/hostname"] = ep.node
            if ep.zone:
                topo["topology.kubernetes.io/zone"] = ep.zone
            if topo:
                e["topology"] = topo
        else:
            if ep.node:
                e["nodeName"] = ep.node
            if ep.zone:
                e["zone"] = ep.zone
        eps.append(e)
    return {"apiVersion": group_version, "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": service_name,
                                    "endpointslice.kubernetes.io/managed-by": TEST_MANAGER}},
            "addressType": address_type, "endpoints": eps,
            "ports": [{"name": port_name, "port": port, "protocol": "TCP"}]}


def services_path(namespace: str | None = None) -> str:
    return f"/api/v1/namespaces/{namespace}/services" if namespace else "/api/v1/services"


def slices_path(group_version: str, namespace: str | None = None) -> str:
    base = f"/apis/{group_version}"
    return f"{base}/namespaces/{namespace}/endpointslices" if namespace else \
        f"{base}/endpointslices"


# --- an Api wrapper for reflector tests ---------------------------------------------------


class GatedApi:
    """Wraps an `Api`: records every GET, and while the gate is closed holds new requests
    back (a client that is "away"), so a test can change and compact the cluster between
    a cut stream and the client's return. `before_get` runs before each request."""

    def __init__(self, inner: Api) -> None:
        self.inner = inner
        self.gate = asyncio.Event()
        self.gate.set()
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.waiting = 0
        self.before_get: Callable[[str, Mapping[str, str]], Awaitable[None]] | None = None

    @property
    def host(self) -> str:
        return self.inner.host

    async def get(self, path: str, query: Mapping[str, str], timeout: float) -> Response:
        self.waiting += 1
        try:
            await self.gate.wait()
        finally:
            self.waiting -= 1
        self.requests.append((path, dict(query)))
        if self.before_get is not None:
            await self.before_get(path, query)
        return await self.inner.get(path, query, timeout)

    async def close(self) -> None:
        await self.inner.close()

    def watches(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if q.get("watch")]

    def lists(self) -> list[dict[str, str]]:
        return [q for _, q in self.requests if not q.get("watch")]
