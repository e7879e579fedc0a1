"""Clients for the lab: who answers a service address, connection by connection.

Every connection (or datagram) of `ask_once` and `ask` uses a fresh socket, so a fresh
source port and a fresh conntrack entry: each one is a new load-balancing decision, as for
real clients. A datagram's source port is chosen here, not by the kernel (`_UdpPorts`):
the kernel picks ephemeral UDP ports at random, and one chance repeat within IPVS's
300 s UDP timeout joins the earlier datagram's connection, so it is neither a new
decision nor a new connection in IPVS's statistics, and after a fault it inherits
whatever the earlier one met. `Flow` (TCP) and `UdpFlow` keep one socket instead: a
long-lived flow, which must keep its backend. Failures are counted by kind instead of
raised, so a test can assert "all refused" or "never timed out" as plainly as "only web-1
and web-2 answered".
"""

from __future__ import annotations

import contextlib
import errno
import http.client
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from ipaddress import ip_address
from typing import Self

from proxy.netns_lab import poll
from proxy.netns_lab.netns import entered

REFUSED, TIMEOUT, UNREACHABLE, RESET = "refused", "timeout", "unreachable", "reset"


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ip_address(ip).version == 6 else socket.AF_INET


def _kind(exc: OSError) -> str:
    if isinstance(exc, TimeoutError):
        return TIMEOUT
    if isinstance(exc, ConnectionRefusedError):
        return REFUSED
    if isinstance(exc, ConnectionResetError | BrokenPipeError):
        return RESET
    if exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return UNREACHABLE
    return f"error:{errno.errorcode.get(exc.errno or 0, exc.errno)}"


def _readline(sock: socket.socket, deadline: float) -> str:
    data = b""
    while b"\n" not in data:
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        chunk = sock.recv(512)
        if not chunk:
            raise ConnectionResetError(errno.ECONNRESET, "closed before answering")
        data += chunk
    return data.split(b"\n", 1)[0].decode(errors="replace")


class _UdpPorts:
    """Source ports for datagrams, none used twice within ~5 minutes: taken in turn from
    below the kernel's ephemeral range (32768 up), so no kernel-chosen port meets them,
    starting where a clock that goes round the range in 319 s points, so a later process
    in the same namespaces starts past an earlier one's (unless it sent over 40 a
    second)."""

    FIRST, LAST, PER_SECOND = 20000, 32767, 40

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._next = int(time.time() * self.PER_SECOND)

    def bind(self, sock: socket.socket, host: str) -> None:
        size = self.LAST - self.FIRST + 1
        for _ in range(64):  # a port in use (a listener, a held flow): the next one
            with self._lock:
                port, self._next = self.FIRST + self._next % size, self._next + 1
            try:
                sock.bind((host, port))
                return
            except OSError as exc:
                if exc.errno != errno.EADDRINUSE:
                    raise
        sock.bind((host, 0))


_udp_ports = _UdpPorts()


def ask_once(ns: str, ip: str, port: int, proto: str = "tcp", timeout: float = 1.0,
             source: str | None = None) -> str:
    """One fresh connection (or datagram) from namespace `ns`: a backend name or a failure."""
    kind = socket.SOCK_DGRAM if proto == "udp" else socket.SOCK_STREAM
    with entered(ns):
        sock = socket.socket(_family(ip), kind)
    deadline = time.monotonic() + timeout
    try:
        if kind == socket.SOCK_DGRAM:
            _udp_ports.bind(sock, source or ("::" if _family(ip) == socket.AF_INET6 else ""))
        elif source is not None:
            sock.bind((source, 0))
        sock.settimeout(timeout)
        sock.connect((ip, port))
        sock.sendall(b"who\n")
        return _readline(sock, deadline)
    except OSError as exc:
        return _kind(exc)
    finally:
        sock.close()


def ask_from(ns: str, ip: str, port: int, source: str, sport: int,
             timeout: float = 2.0) -> str:
    """One TCP connection from `source`:`sport` (a chosen 5-tuple, as hashing balancers
    see it): a backend name or a failure. Closed with a reset, so that no TIME_WAIT
    keeps the 5-tuple from being used again at once."""
    with entered(ns):
        sock = socket.socket(_family(ip), socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.settimeout(timeout)
        sock.bind((source, sport))
        sock.connect((ip, port))
        sock.sendall(b"who\n")
        return _readline(sock, time.monotonic() + timeout)
    except OSError as exc:
        return _kind(exc)
    finally:
        sock.close()


def ask(ns: str, ip: str, port: int, proto: str = "tcp", count: int = 20,
        timeout: float = 1.0, source: str | None = None) -> Counter[str]:
    """`count` fresh connections; how many each backend (or failure kind) answered."""
    return Counter(ask_once(ns, ip, port, proto, timeout, source) for _ in range(count))


class _Held:
    """A socket kept for a long-lived flow; closed on exit."""

    sock: socket.socket

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Flow(_Held):
    """One long-lived TCP connection: `ask()` checks it still reaches the same backend."""

    def __init__(self, ns: str, ip: str, port: int, timeout: float = 2.0) -> None:
        with entered(ns):
            self.sock = socket.socket(_family(ip), socket.SOCK_STREAM)
        self.timeout = timeout
        self.sock.settimeout(timeout)
        self.sock.connect((ip, port))

    def ask(self) -> str:
        """The backend's name; raises OSError if the flow broke."""
        self.sock.sendall(b"who\n")
        return _readline(self.sock, time.monotonic() + self.timeout)


class UdpFlow(_Held):
    """One UDP socket, so one source port and one conntrack entry, asked again and again:
    what a resolver, a QUIC or a media client does."""

    def __init__(self, ns: str, ip: str, port: int, timeout: float = 1.0) -> None:
        with entered(ns):
            self.sock = socket.socket(_family(ip), socket.SOCK_DGRAM)
        self.timeout = timeout
        self.sock.connect((ip, port))

    def ask(self) -> str | None:
        """Send one datagram: the name of the backend that answered it, or None if none
        did within the timeout (or the send or the answer was refused)."""
        self._drain()
        try:
            self.sock.settimeout(self.timeout)
            self.sock.send(b"who\n")
            return self.sock.recv(512).split(b"\n", 1)[0].decode(errors="replace")
        except OSError:
            return None

    def _drain(self) -> None:
        """Drop answers that came after their datagram's timeout, so that they are not
        taken for the next datagram's."""
        self.sock.setblocking(False)
        for _ in range(64):  # bounded: at most a few are ever late
            try:
                self.sock.recv(512)
            except BlockingIOError:  # nothing left
                return
            except OSError:  # a pending ICMP error (refused...), consumed by reading it
                continue


def http_get(ns: str, host: str, port: int, path: str,
             timeout: float = 5.0) -> tuple[int, bytes]:
    """GET from inside namespace `ns` (the agent's /healthz, /metrics, /debug/dump):
    (status, body), or (0, b"") if nothing answers."""
    try:
        with entered(ns):
            sock = socket.create_connection((host, port), timeout)
    except OSError:
        return 0, b""
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    conn.sock = sock
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    except OSError:
        return 0, b""
    finally:
        conn.close()


class Idle(_Held):
    """A TCP connection asked once, whose client then waits in recv() and sends nothing
    (an idle connection). `ended`: how the wait ended (an exception's name, or the data
    that came) and when (monotonic); None while it waits."""

    def __init__(self, ns: str, ip: str, port: int, timeout: float = 5.0) -> None:
        with entered(ns):
            self.sock = socket.socket(_family(ip), socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect((ip, port))
        self.sock.sendall(b"who\n")
        self.backend = _readline(self.sock, time.monotonic() + timeout)
        self.sock.settimeout(None)
        self.ended: tuple[str, float] | None = None
        self._thread = threading.Thread(target=self._wait, daemon=True)
        self._thread.start()

    def _wait(self) -> None:
        try:
            what = f"data {self.sock.recv(100)!r}"
        except OSError as exc:
            what = type(exc).__name__
        self.ended = (what, time.monotonic())

    def reset_since(self, since: float, within: float,
                    detail: Callable[[], object] | None = None) -> float:
        """Seconds from `since` (monotonic) to the connection's reset, polled for `within`
        seconds; fails on anything but a reset."""
        ended = poll.wait(lambda: self.ended, within, "the client's error", interval=0.005,
                          detail=detail)
        assert ended[0] == "ConnectionResetError", ended[0]
        return ended[1] - since

    def close(self) -> None:
        with contextlib.suppress(OSError):  # not connected: reset already
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self._thread.join(timeout=5)
