"""A tiny HTTP(S) client for raw API checks, the same for the simulator (plain HTTP, no
auth) and the real API server (TLS verified against our CA, bearer token): the tests see
exactly the status codes, Status bodies and watch lines a client sees."""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlencode, urlsplit

Obj = dict[str, Any]


class WatchStream:
    """A watch response read one JSON event per line (the simulator's tests use it too)."""

    def __init__(self, resp: http.client.HTTPResponse) -> None:
        self.resp = resp
        self.status = resp.status

    def next(self) -> Obj | None:
        """The next event, or None at the end of the stream (read timeout raises)."""
        line = self.resp.readline()
        if not line:
            return None
        event: Obj = json.loads(line)
        return event

    def take(self, count: int) -> list[Obj]:
        out: list[Obj] = []
        for _ in range(count):
            ev = self.next()
            assert ev is not None, f"stream ended after {out}"
            out.append(ev)
        return out

    def until(self, pred: Callable[[Obj], bool], limit: int = 1000) -> list[Obj]:
        """Events up to and including the first that satisfies pred."""
        out: list[Obj] = []
        for _ in range(limit):
            ev = self.next()
            assert ev is not None, f"stream ended before the awaited event; saw {out}"
            out.append(ev)
            if pred(ev):
                return out
        raise AssertionError("awaited event never came")

    def rest(self) -> list[Obj]:
        out = []
        while (ev := self.next()) is not None:
            out.append(ev)
        return out


class RawApi:
    def __init__(self, base: str, token: str | None = None,
                 context: ssl.SSLContext | None = None) -> None:
        parts = urlsplit(base)
        self.https = parts.scheme == "https"
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if self.https else 80)
        self.token = token
        self.context = context

    def _conn(self, timeout: float) -> http.client.HTTPConnection:
        if self.https:
            return http.client.HTTPSConnection(self.host, self.port, timeout=timeout,
                                               context=self.context)
        return http.client.HTTPConnection(self.host, self.port, timeout=timeout)

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        if content_type:
            headers["Content-Type"] = content_type
        return headers

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json",
                params: dict[str, Any] | None = None,
                timeout: float = 30.0) -> tuple[int, Any, dict[str, str]]:
        if params:
            path = f"{path}?{urlencode(params)}"
        conn = self._conn(timeout)
        try:
            data = None if body is None else json.dumps(body).encode()
            conn.request(method, path, body=data,
                         headers=self._headers(content_type if data is not None else None))
            resp = conn.getresponse()
            raw = resp.read()
            try:
                parsed = json.loads(raw) if raw else None
            except ValueError:
                parsed = raw.decode(errors="replace")
            return resp.status, parsed, dict(resp.getheaders())
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

    def must(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        """The request, asserting a 2xx answer; returns the body."""
        status, data, _ = self.request(method, path, body, **kw)
        assert 200 <= status < 300, f"{method} {path}: HTTP {status}: {data}"
        return data

    @contextmanager
    def watch(self, path: str, read_timeout: float = 15.0,
              **params: Any) -> Iterator[WatchStream]:
        params = {"watch": "1", **params}
        conn = self._conn(read_timeout)
        try:
            conn.request("GET", f"{path}?{urlencode(params)}", headers=self._headers())
            yield WatchStream(conn.getresponse())
        finally:
            conn.close()
