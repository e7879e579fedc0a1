"""Watching the controllers' output: the namespace's EndpointSlices, and the writer of changes."""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from urllib.parse import urlencode

from bench.realcp_latency.settings import SLICES, Obj
from labs.realcp.rawapi import RawApi

# --- watching the controllers' output ---------------------------------------------------


def ready_addresses(obj: Obj) -> frozenset[str]:
    return frozenset(e["addresses"][0] for e in obj.get("endpoints") or []
                     if e.get("addresses")
                     and (e.get("conditions") or {}).get("ready", True) is not False)


class SliceWatch:
    """A watch on one namespace's EndpointSlices from this process: when each controller
    write reached a watcher, with the service's ready addresses after it."""

    MAX_STREAMS = 100

    def __init__(self, api: RawApi, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.path = SLICES.format(ns=namespace)
        self._slices: dict[str, tuple[str, frozenset[str]]] = {}  # slice -> (svc, ready)
        self._events: list[tuple[float, str, frozenset[str]]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self) -> None:
        rv = self._list()
        self._thread = threading.Thread(target=self._run, args=(rv,), name="slice-watch",
                                        daemon=True)
        self._thread.start()

    def _list(self) -> str:
        status, body = self.api.get(self.path)
        if status != 200:
            raise RuntimeError(f"listing slices: HTTP {status}: {body}")
        now = time.monotonic()
        with self._lock:
            self._slices.clear()
            for obj in body["items"]:
                self._apply("ADDED", obj, now)
        return str(body["metadata"]["resourceVersion"])

    def _apply(self, kind: str, obj: Obj, now: float) -> None:
        name = obj["metadata"]["name"]
        svc = (obj["metadata"].get("labels") or {}).get("kubernetes.io/service-name", "")
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = (svc, ready_addresses(obj))
        ready = frozenset().union(*(r for s, r in self._slices.values() if s == svc))
        self._events.append((now, svc, ready))

    @staticmethod
    def connect(api: RawApi, timeout: float | None = None) -> http.client.HTTPConnection:
        if api.https:
            return http.client.HTTPSConnection(api.host, api.port, timeout=timeout,
                                               context=api.context)
        return http.client.HTTPConnection(api.host, api.port, timeout=timeout)

    def _run(self, rv: str) -> None:
        headers = {"Accept": "application/json"}
        if self.api.token:
            headers["Authorization"] = f"Bearer {self.api.token}"
        for _ in range(self.MAX_STREAMS):
            if self._stopping.is_set():
                return
            conn = self.connect(self.api)
            self._conn = conn
            try:
                query = urlencode({"watch": "1", "resourceVersion": rv,
                                   "timeoutSeconds": "600", "allowWatchBookmarks": "true"})
                conn.request("GET", f"{self.path}?{query}", headers=headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    rv = self._list()
                    continue
                while line := resp.readline():
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":  # 410 Gone: start over
                        rv = self._list()
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        with self._lock:
                            self._apply(event["type"], obj, time.monotonic())
            except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                if self._stopping.is_set():
                    return
                self.error = f"{type(exc).__name__}: {exc}"
                try:
                    rv = self._list()
                except (OSError, http.client.HTTPException, RuntimeError):
                    return
            finally:
                conn.close()

    def stop(self) -> None:
        self._stopping.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def first(self, svc: str, ready: frozenset[str], after: float) -> float | None:
        """When the watcher first saw `svc` with exactly these ready addresses, after
        monotonic time `after`."""
        with self._lock:
            for t, s, r in self._events:
                if t >= after and s == svc and r == ready:
                    return t
        return None


class Writer:
    """The measured writes, over one kept-alive connection: no TCP or TLS handshake
    (~10-20 ms through the host's forwarder) inside the timed path."""

    def __init__(self, api: RawApi) -> None:
        self.api = api
        self.conn: http.client.HTTPConnection | None = None

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.conn is not None:
            self.conn.close()

    def _connected(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = SliceWatch.connect(self.api, timeout=30)
        if self.conn.sock is None:
            self.conn.connect()
        return self.conn

    def patch(self, path: str, body: Obj,
              kind: str = "application/strategic-merge-patch+json") -> tuple[float, float]:
        """PATCH; returns (monotonic time sent, time answered). A connection the server
        closed while idle is opened again (outside the timing) and the write retried."""
        headers = {"Accept": "application/json", "Content-Type": kind}
        if self.api.token:
            headers["Authorization"] = f"Bearer {self.api.token}"
        data = json.dumps(body).encode()
        for attempt in (1, 2):
            conn = self._connected()
            sent = time.monotonic()
            try:
                conn.request("PATCH", path, body=data, headers=headers)
                resp = conn.getresponse()
                answer = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                if attempt == 2:
                    raise
                continue
            acked = time.monotonic()
            if not 200 <= resp.status < 300:
                raise RuntimeError(f"PATCH {path}: HTTP {resp.status}: {answer[:300]!r}")
            return sent, acked
        raise AssertionError("unreachable")
