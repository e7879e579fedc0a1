"""Helpers for the simulator tests: object builders and a tiny stdlib HTTP client that
can also read watch streams line by line."""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlencode, urlsplit

from labs.realcp.rawapi import WatchStream
from proxy.netns_lab.poll import wait

Obj = dict[str, Any]


def service(name: str, namespace: str = "default", labels: dict[str, str] | None = None,
            **spec: Any) -> Obj:
    spec.setdefault("ports", [{"name": "http", "port": 80}])
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
            "spec": spec}


def endpoint_slice(name: str, service_name: str, addresses: list[str],
                   namespace: str = "default") -> Obj:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": namespace,
                         "labels": {"kubernetes.io/service-name": service_name}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}


class Api:
    """Minimal client: JSON in, (status, JSON, headers) out."""

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json",
                params: dict[str, Any] | None = None) -> tuple[int, Any, dict[str, str]]:
        if params:
            path = f"{path}?{urlencode(params)}"
        conn = http.client.HTTPConnection(self.host, self.port, timeout=10)
        try:
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": content_type} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
            return resp.status, json.loads(raw) if raw else None, dict(resp.getheaders())
        finally:
            conn.close()

    def get(self, path: str, **params: Any) -> tuple[int, Any]:
        status, body, _ = self.request("GET", path, params=params or None)
        return status, body

    def post(self, path: str, body: Any) -> tuple[int, Any]:
        status, data, _ = self.request("POST", path, body)
        return status, data

    def put(self, path: str, body: Any) -> tuple[int, Any]:
        status, data, _ = self.request("PUT", path, body)
        return status, data

    def patch(self, path: str, body: Any, kind: str = "merge") -> tuple[int, Any]:
        status, data, _ = self.request("PATCH", path, body, f"application/{kind}-patch+json")
        return status, data

    def delete(self, path: str, body: Any = None) -> tuple[int, Any]:
        status, data, _ = self.request("DELETE", path, body)
        return status, data

    @contextmanager
    def watch(self, path: str, read_timeout: float = 5.0,
              **params: Any) -> Iterator[WatchStream]:
        params = {"watch": "1", **params}
        conn = http.client.HTTPConnection(self.host, self.port, timeout=read_timeout)
        try:
            conn.request("GET", f"{path}?{urlencode(params)}")
            resp = conn.getresponse()
            yield WatchStream(resp)
        finally:
            conn.close()


def wait_for(pred: Callable[[], bool], what: str = "condition", timeout: float = 5.0,
             detail: Callable[[], object] | None = None) -> None:
    """The project's `wait` with this tier's defaults (a simulator answers within ms, so
    5 s and a 10 ms poll); `detail` says what the failure message should show of the
    state at the deadline."""
    wait(pred, timeout, what, interval=0.01, detail=detail)


SVC = "/api/v1/namespaces/default/services"
EPS = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
