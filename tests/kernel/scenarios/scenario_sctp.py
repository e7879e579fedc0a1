"""SCTP services with real packets, inside the kernel lab (run by tests/kernel/test_sctp.py
through scenarios/run.py; never on the host, whose kernel has no SCTP module).

Every data plane (iptables on both back ends, native nftables, IPVS) serves a Service
with an SCTP port: associations from the client namespace to the cluster IP reach the
backends, both of them, and only the one left once the slice drops the other. The lab's
echo server speaks TCP and UDP only, so this module runs its own SCTP listeners in the
backends' namespaces (one thread, stopped at the end of the module).
"""

from __future__ import annotations

import contextlib
import errno
import selectors
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any, Protocol

import pytest

from proxy.dataplane.base import SyncReport
from proxy.dataplane.xtables.restore_runner import Backend
from proxy.model.snapshot import DesiredState
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from proxy.netns_lab.poll import wait
from tests.e2e.conftest import Cluster, NodePlane
from tests.kernel.scenario_guest import NodeThread, read_kernel
from tests.unit.builders import ep, eps_slice, service

SCTP_PORT = 8082  # what the backends listen on (the lab's TCP and UDP are 8080, 8081)
PORTS = ({"name": "sctp", "port": 9, "protocol": "SCTP"},)
SLICE_PORTS = ({"name": "sctp", "port": SCTP_PORT, "protocol": "SCTP"},)
WEB = ("web-1", "web-2")
FRESH = 30  # fresh associations per check: 2 ** -29 that a random spread misses one
ANSWER_DEADLINE = 20.0
# Long enough for one retransmitted INIT (SCTP's initial RTO is 3 s). IPVS drops an INIT
# whose client port was used by an association it still remembers (conn_reuse_mode 1 with
# its conntrack entry kept, for 10 s after the close); the client sends it again 3 s
# later and is served. Random ephemeral ports meet that in a few runs in a hundred.
ANSWER_TIMEOUT = 5.0


class SctpEcho:
    """SCTP listeners on backends' IPv4 addresses, served by one thread: every line a
    client sends is answered with `<backend name>\\n` (the lab's echo protocol)."""

    def __init__(self, lab: Lab, names: tuple[str, ...], port: int) -> None:
        self.sel = selectors.DefaultSelector()
        self.accepted: Counter[str] = Counter()
        self._stop = threading.Event()
        for name in names:
            backend = lab.backends[name]
            with entered(backend.ns):  # the socket keeps the backend's namespace
                listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM,
                                         socket.IPPROTO_SCTP)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((str(backend.ipv4), port))
            listener.listen(64)
            listener.setblocking(False)
            self.sel.register(listener, selectors.EVENT_READ, (name, None))
        self._thread = threading.Thread(target=self._serve, name="sctp-echo", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            # The timeout only bounds how long close() waits for the loop to notice.
            for key, _ in self.sel.select(timeout=0.2):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                name, buf = key.data
                if buf is None:
                    self._accept(sock, name)
                else:
                    self._read(sock, name, buf)
        for key in list(self.sel.get_map().values()):
            self._close(key.fileobj)  # type: ignore[arg-type]
        self.sel.close()

    def _accept(self, listener: socket.socket, name: str) -> None:
        with contextlib.suppress(BlockingIOError, ConnectionAbortedError):
            conn, _ = listener.accept()
            conn.setblocking(False)
            self.accepted[name] += 1
            self.sel.register(conn, selectors.EVENT_READ, (name, bytearray()))

    def _read(self, conn: socket.socket, name: str, buf: bytearray) -> None:
        try:
            chunk = conn.recv(4096)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._close(conn)
            return
        buf += chunk
        try:
            while b"\n" in buf:
                del buf[:buf.index(b"\n") + 1]
                conn.send(f"{name}\n".encode())
        except OSError:
            self._close(conn)

    def _close(self, sock: socket.socket) -> None:
        self.sel.unregister(sock)
        sock.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        assert not self._thread.is_alive(), "the SCTP echo thread did not stop"


def ask_once(ns: str, ip: str, port: int, timeout: float = ANSWER_TIMEOUT) -> str:
    """One fresh SCTP association from namespace `ns`: the backend's name, or why not."""
    with entered(ns):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_SCTP)
    deadline = time.monotonic() + timeout
    try:
        sock.settimeout(timeout)
        sock.connect((ip, port))
        sock.sendall(b"who\n")
        data = b""
        while b"\n" not in data:
            sock.settimeout(max(0.001, deadline - time.monotonic()))
            chunk = sock.recv(512)
            if not chunk:
                return "closed"
            data += chunk
        return data.split(b"\n", 1)[0].decode(errors="replace")
    except TimeoutError:
        return "timeout"
    except ConnectionRefusedError:
        return "refused"
    except OSError as exc:
        return f"error:{errno.errorcode.get(exc.errno or 0, exc.errno)}"
    finally:
        sock.close()


def ask(ns: str, ip: str, port: int, count: int,
        timeout: float = ANSWER_TIMEOUT) -> Counter[str]:
    return Counter(ask_once(ns, ip, port, timeout) for _ in range(count))


def wait_for_answer(ns: str, ip: str, port: int, want: set[str]) -> str:
    """Poll until one association is answered by a backend in `want`."""
    last = ""

    def answered() -> str | None:
        nonlocal last
        last = ask_once(ns, ip, port)
        return last if last in want else None

    # No pause between tries: each association waits up to ANSWER_TIMEOUT itself.
    return wait(answered, ANSWER_DEADLINE, f"an SCTP answer from {sorted(want)} at {ip}:{port}",
                interval=0.0, detail=lambda: f"last: {last}")


class Plane(Protocol):
    def sync(self, state: DesiredState, full: bool = False) -> Any: ...

    def close(self) -> None: ...


class RulesPlane:
    """iptables (either back end) or nftables, written in the node namespace."""

    def __init__(self, ns: str, backend: Backend | None, mode: str) -> None:
        self.node = NodePlane(ns, backend, mode=mode)

    def sync(self, state: DesiredState, full: bool = False) -> SyncReport:
        return self.node.sync(state, full)

    def close(self) -> None:
        try:
            self.node.cleanup()
        finally:
            with entered(self.node.ns):
                self.node.dp.close()


class IpvsPlane:
    """The IPVS data plane, on a thread living in the node namespace (as the agent's)."""

    def __init__(self, ns: str) -> None:
        self.thread = NodeThread(ns)
        self.thread.start_plane()

    def sync(self, state: DesiredState, full: bool = False) -> Any:
        return self.thread.sync(state, full)

    def close(self) -> None:
        try:
            plane = self.thread.plane
            if plane is not None:
                self.thread.run(plane.cleanup)
        finally:
            self.thread.close()


MODES = ("iptables-nft", "iptables-legacy", "nftables", "ipvs")
VIPS = dict(zip(MODES, ("198.18.128.60", "198.18.128.61", "198.18.128.62",
                        "198.18.128.63"), strict=True))


@pytest.fixture(scope="module")
def echo(lab: Lab) -> Iterator[SctpEcho]:
    server = SctpEcho(lab, WEB, SCTP_PORT)
    try:
        yield server
    finally:
        server.close()


@pytest.fixture(params=MODES)
def plane(lab: Lab, request: pytest.FixtureRequest) -> Iterator[Plane]:
    mode: str = request.param
    made: Plane
    if mode == "ipvs":
        made = IpvsPlane(lab.node_ns)
    elif mode == "nftables":
        made = RulesPlane(lab.node_ns, None, "nftables")
    else:
        made = RulesPlane(lab.node_ns, Backend.NFT if mode == "iptables-nft"
                          else Backend.LEGACY, "iptables")
    try:
        yield made
    finally:
        try:
            made.close()
        finally:
            lab.exec(lab.node_ns, ["conntrack", "-F"])


def objects(lab: Lab, vip: str, members: tuple[str, ...]) -> tuple[dict[str, Any], ...]:
    endpoints = [ep(str(lab.backends[n].ipv4), node=lab.backends[n].node) for n in members]
    return (service("sctp", ips=(vip,), ports=PORTS),
            eps_slice("sctp-v4", endpoints, service_name="sctp", ports=SLICE_PORTS))


def test_sctp_cluster_ip_reaches_both_backends_then_only_the_one_left(
        lab: Lab, echo: SctpEcho, plane: Plane, request: pytest.FixtureRequest) -> None:
    mode = request.node.callspec.params["plane"]
    vip, c = VIPS[mode], lab.client_ns
    # Nothing answers SCTP at the cluster IP until the data plane serves it.
    before = ask(c, vip, 9, count=2, timeout=0.5)
    assert not set(before) & set(WEB), before

    cluster = Cluster()
    plane.sync(cluster.become(*objects(lab, vip, WEB)), full=True)
    if isinstance(plane, IpvsPlane):
        dests = read_kernel(plane.thread).services[f"SCTP {vip}:9"]["dests"]
        assert set(dests) == {f"{lab.backends[n].ipv4}:{SCTP_PORT}" for n in WEB}, dests
    wait_for_answer(c, vip, 9, set(WEB))
    accepted = sum(echo.accepted.values())
    got = ask(c, vip, 9, count=FRESH)
    assert set(got) == set(WEB), got  # every association answered, by both backends
    if mode == "ipvs":
        assert got == {"web-1": FRESH // 2, "web-2": FRESH // 2}, got  # rr: alternation
    # The backends did accept SCTP associations (not a TCP or UDP echo answering).
    assert sum(echo.accepted.values()) - accepted == FRESH, echo.accepted

    plane.sync(cluster.become(*objects(lab, vip, ("web-1",))))
    if isinstance(plane, IpvsPlane):
        dests = read_kernel(plane.thread).services[f"SCTP {vip}:9"]["dests"]
        assert set(dests) == {f"{lab.backends['web-1'].ipv4}:{SCTP_PORT}"}, dests
    got = ask(c, vip, 9, count=FRESH)
    assert got == {"web-1": FRESH}, got
