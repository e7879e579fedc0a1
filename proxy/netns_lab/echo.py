"""Backends for the lab: TCP and UDP servers that answer with their own name.

One process serves every backend of a lab: it enters each backend's namespace just
long enough to open its listeners, then serves them all from one selector loop.

Protocol (kept trivial so any client can use it):
- TCP: every line the client sends is answered with `<name>\\n`; the connection stays
  open until the client closes it (so a long-lived flow can be checked repeatedly). A
  first line starting with `GET ` or `HEAD ` gets a minimal HTTP/1.0 response with the
  name as body, then the connection closes (so `curl http://VIP/` works in the demo).
- UDP: every datagram is answered with `<name>\\n`.
- TCP on a backend named `@addr` answers with the local address the connection reached
  instead: one listener on 0.0.0.0 then tells which of many addresses answered.

`python -m proxy.netns_lab.echo --backend NAME=NS=IP[,IP...] ... --tcp 8080 --udp 8081`
prints `ready` on stdout once every listener is bound, then serves until killed. An empty
NS listens where the process already is (a pod: `--backend $(POD_NAME)==0.0.0.0`).
"""

from __future__ import annotations

import argparse
import contextlib
import selectors
import signal
import socket
import sys
from dataclasses import dataclass, field

from proxy.netns_lab.netns import entered

MAX_LINE = 4096
LOCAL_ADDRESS = "@addr"


@dataclass(slots=True)
class _Conn:
    name: str
    buf: bytearray = field(default_factory=bytearray)
    first: bool = True


def _http(name: str) -> bytes:
    body = f"{name}\n".encode()
    return (b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
            + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)


class EchoServer:
    def __init__(self) -> None:
        self.sel = selectors.DefaultSelector()

    def listen(self, name: str, ns: str, addresses: list[str], tcp: list[int],
               udp: list[int]) -> None:
        with entered(ns) if ns else contextlib.nullcontext():
            for addr in addresses:
                family = socket.AF_INET6 if ":" in addr else socket.AF_INET
                for port in tcp:
                    s = socket.socket(family, socket.SOCK_STREAM)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind((addr, port))
                    s.listen(128)
                    s.setblocking(False)
                    self.sel.register(s, selectors.EVENT_READ, ("listen", name))
                for port in udp:
                    u = socket.socket(family, socket.SOCK_DGRAM)
                    u.bind((addr, port))
                    u.setblocking(False)
                    self.sel.register(u, selectors.EVENT_READ, ("udp", name))

    def serve_forever(self) -> None:
        while True:
            for key, _ in self.sel.select():
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                role, data = key.data
                if role == "listen":
                    self._accept(sock, data)
                elif role == "udp":
                    self._datagram(sock, data)
                else:
                    self._read(sock, data)

    def _accept(self, listener: socket.socket, name: str) -> None:
        with contextlib.suppress(BlockingIOError, ConnectionAbortedError):
            conn, _ = listener.accept()
            conn.setblocking(False)
            if name == LOCAL_ADDRESS:
                name = str(conn.getsockname()[0])
            self.sel.register(conn, selectors.EVENT_READ, ("conn", _Conn(name)))

    def _datagram(self, sock: socket.socket, name: str) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            _, peer = sock.recvfrom(MAX_LINE)
            sock.sendto(f"{name}\n".encode(), peer)

    def _close(self, sock: socket.socket) -> None:
        self.sel.unregister(sock)
        sock.close()

    def _read(self, sock: socket.socket, conn: _Conn) -> None:
        try:
            chunk = sock.recv(MAX_LINE)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(sock)
            return
        conn.buf += chunk
        try:
            while b"\n" in conn.buf:
                line, _, rest = bytes(conn.buf).partition(b"\n")
                conn.buf = bytearray(rest)
                if conn.first and line.startswith((b"GET ", b"HEAD ")):
                    sock.setblocking(True)
                    sock.sendall(_http(conn.name))
                    self._close(sock)
                    return
                conn.first = False
                sock.sendall(f"{conn.name}\n".encode())
        except OSError:
            self._close(sock)
            return
        if len(conn.buf) > MAX_LINE:
            self._close(sock)


def _ports(raw: list[str]) -> list[int]:
    return [int(p) for item in raw for p in item.split(",") if p]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m proxy.netns_lab.echo")
    p.add_argument("--backend", action="append", default=[], metavar="NAME=NS=IP[,IP]")
    p.add_argument("--tcp", action="append", default=[], metavar="PORT[,PORT]")
    p.add_argument("--udp", action="append", default=[], metavar="PORT[,PORT]")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    server = EchoServer()
    tcp, udp = _ports(args.tcp), _ports(args.udp)
    for spec in args.backend:
        name, ns, addrs = spec.split("=", 2)
        server.listen(name, ns, addrs.split(","), tcp, udp)
    print("ready", flush=True)
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main())
