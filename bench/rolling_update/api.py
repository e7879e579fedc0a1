"""The simulator's API, reached from the node's network namespace."""

from __future__ import annotations

import http.client
import json
import re
import socket
import time
from pathlib import Path
from typing import Any

from bench.rolling_update.workload import Obj
from proxy.netns_lab.netns import entered

# --- the API, from the node's namespace ------------------------------------------------


class NsConnection(http.client.HTTPConnection):
    """HTTP whose socket is made in network namespace `ns` (also when it reconnects)."""

    def __init__(self, ns: str, host: str, port: int, timeout: float = 30.0) -> None:
        super().__init__(host, port, timeout=timeout)
        self.ns = ns

    def connect(self) -> None:
        with entered(self.ns):
            self.sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Api:
    """Requests over one kept-alive connection; (status, parsed body, sent, answered)."""

    def __init__(self, ns: str, kubeconfig: Path) -> None:
        match = re.search(r"server:\s*[\"']?http://([0-9.]+):(\d+)", kubeconfig.read_text())
        if not match:
            raise RuntimeError(f"no plain-HTTP server in {kubeconfig}")
        self.conn = NsConnection(ns, match.group(1), int(match.group(2)))

    def call(self, method: str, path: str, body: Obj | None = None
             ) -> tuple[int, Any, float, float]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):
            sent = time.monotonic()
            try:
                self.conn.request(method, path, body=data, headers=headers)
                resp = self.conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()  # an idle connection the server closed: once more
                if attempt == 2:
                    raise
                continue
            return resp.status, json.loads(raw) if raw else None, sent, time.monotonic()
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.conn.close()
