"""IPVS smoke test: real TCP traffic through an IPVS virtual server, inside the kernel lab.

Run by tests/kernel/test_ipvs_smoke.py through the kernel harness; it needs a kernel with
IPVS and must not run on the host. Topology (addresses only in 198.18.0.0/15):

    client ns              node ns                                backend ns
    c0 198.18.1.2/24 ----- n-c 198.18.1.1/24
                           slp-ipvs0 (dummy) 198.18.100.10/32 (VIP)
                           n-a 198.18.2.1/24 ----------------- a0 198.18.2.2/24  backend-a
                           n-b 198.18.3.1/24 ----------------- b0 198.18.3.2/24  backend-b

The VIP is local to the node (on the dummy device, as kube-proxy's kube-ipvs0), so IPVS
picks the client's SYN up on input and masquerades it (fwd_method=0, i.e. DNAT) to a real
server on port 8080. The client and both backends have the node as default gateway, so a
backend's reply goes back through the node, where IPVS reverses the translation: no SNAT
rule is needed. Each backend answers every connection with its own name and closes.

Phase 1 sends CONNECTIONS connections to the VIP; phase 2 deletes backend-a's real server
and sends CONNECTIONS more. The JSON result maps each answer to a count per phase.
"""

from __future__ import annotations

import contextlib
import selectors
import socket
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pyroute2 import IPVS, IPRoute, IPVSDest, IPVSService, netns

from labs.kernel.guest import write_result

VIP = "198.18.100.10"
VIP_PORT = 80
BACKEND_PORT = 8080
DUMMY = "slp-ipvs0"
CLIENT = ("client", "c0", "198.18.1.2", "n-c", "198.18.1.1")
# name, backend ifname, backend address, node ifname, node address
BACKENDS = (
    ("backend-a", "a0", "198.18.2.2", "n-a", "198.18.2.1"),
    ("backend-b", "b0", "198.18.3.2", "n-b", "198.18.3.1"),
)
NODE = "node"
CONNECTIONS = 20
CONNECT_TIMEOUT = 2.0


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Run the block in network namespace `name` (this thread only, via setns(2)).

    Sockets keep the namespace they were created in, so a listener made here can be
    served from another thread, and a client socket made here talks from `name`.
    """
    netns.pushns(name)
    try:
        yield
    finally:
        netns.popns()


def sysctl(name: str, value: str) -> None:
    # /proc/sys/net resolves against the opener's network namespace (see in_netns).
    Path("/proc/sys", name.replace(".", "/")).write_text(value)


def wire(ns: str, ifname: str, address: str, node_ifname: str, node_address: str) -> None:
    """A veth pair from the node to `ns`, addressed /24, `ns` routed via the node."""
    with IPRoute() as ipr:
        ipr.link("add", ifname=node_ifname, kind="veth", peer=ifname)
        ipr.link("set", index=ipr.link_lookup(ifname=ifname)[0], net_ns_fd=ns)
        ipr.link("set", index=ipr.link_lookup(ifname=node_ifname)[0], net_ns_fd=NODE)
    with IPRoute(netns=NODE) as ipr:
        idx = ipr.link_lookup(ifname=node_ifname)[0]
        ipr.addr("add", index=idx, address=node_address, prefixlen=24)
        ipr.link("set", index=idx, state="up")
    with IPRoute(netns=ns) as ipr:
        idx = ipr.link_lookup(ifname=ifname)[0]
        ipr.addr("add", index=idx, address=address, prefixlen=24)
        ipr.link("set", index=idx, state="up")
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        ipr.route("add", dst="default", gateway=node_address)


def build_topology() -> None:
    for ns in (NODE, CLIENT[0], *(b[0] for b in BACKENDS)):
        netns.create(ns)
    with in_netns(NODE):
        # Per-namespace settings: the harness set them only in the initial namespace.
        sysctl("net.ipv4.ip_forward", "1")
        sysctl("net.ipv4.vs.conntrack", "1")
    with IPRoute(netns=NODE) as ipr:
        ipr.link("set", index=ipr.link_lookup(ifname="lo")[0], state="up")
        ipr.link("add", ifname=DUMMY, kind="dummy")
        idx = ipr.link_lookup(ifname=DUMMY)[0]
        ipr.addr("add", index=idx, address=VIP, prefixlen=32)
        ipr.link("set", index=idx, state="up")
    for spec in (CLIENT, *BACKENDS):
        wire(*spec)


class Backends:
    """One thread serving every backend's listener: answer with the name, then close."""

    def __init__(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="backends", daemon=True)
        self.served: Counter[str] = Counter()

    def start(self) -> None:
        for name, _ifname, address, _node_ifname, _node_address in BACKENDS:
            with in_netns(name):
                listener = socket.create_server((address, BACKEND_PORT), backlog=64)
            listener.setblocking(False)
            self._selector.register(listener, selectors.EVENT_READ, name)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            # The timeout only bounds how late stop() is noticed.
            for key, _events in self._selector.select(timeout=0.2):
                listener = key.fileobj
                assert isinstance(listener, socket.socket)
                with contextlib.suppress(BlockingIOError):
                    conn, _peer = listener.accept()
                    with conn:
                        conn.setblocking(True)
                        conn.settimeout(CONNECT_TIMEOUT)
                        conn.sendall(key.data.encode())
                    self.served[key.data] += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for key in list(self._selector.get_map().values()):
            self._selector.unregister(key.fileobj)
            key.fileobj.close()  # type: ignore[union-attr]
        self._selector.close()


def ask_vip() -> str:
    """One connection from the client namespace to the VIP: the answer, or what went wrong."""
    with in_netns(CLIENT[0]):
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    deadline = time.monotonic() + CONNECT_TIMEOUT
    try:
        sock.settimeout(CONNECT_TIMEOUT)
        sock.connect((VIP, VIP_PORT))
        chunks = []
        while time.monotonic() < deadline:
            sock.settimeout(max(0.01, deadline - time.monotonic()))
            chunk = sock.recv(256)
            if not chunk:
                return b"".join(chunks).decode(errors="replace")
            chunks.append(chunk)
        return "error: no EOF before the deadline"
    except OSError as exc:
        return f"error: {type(exc).__name__}: {exc}"
    finally:
        sock.close()


def dump_dests(ipvs: IPVS, service: IPVSService) -> list[dict[str, Any]]:
    # Read the raw attributes: IPVSDest.from_message (pyroute2 0.9.7) leaves fwd_method at
    # its default, 3 (direct routing), whatever the kernel reports.
    return [
        {
            "addr": msg.get_nested("IPVS_CMD_ATTR_DEST", "IPVS_DEST_ATTR_ADDR"),
            "port": msg.get_nested("IPVS_CMD_ATTR_DEST", "IPVS_DEST_ATTR_PORT"),
            "fwd_method": msg.get_nested("IPVS_CMD_ATTR_DEST", "IPVS_DEST_ATTR_FWD_METHOD"),
            "weight": msg.get_nested("IPVS_CMD_ATTR_DEST", "IPVS_DEST_ATTR_WEIGHT"),
        }
        for msg in ipvs.dest("dump", service=service)
    ]


def phase(ipvs: IPVS, service: IPVSService) -> dict[str, Any]:
    started = time.monotonic()
    answers = Counter(ask_vip() for _ in range(CONNECTIONS))
    return {
        "answers": dict(answers),
        "seconds": round(time.monotonic() - started, 3),
        "dests": dump_dests(ipvs, service),
    }


def main() -> int:
    started = time.monotonic()
    build_topology()
    topology_seconds = time.monotonic() - started
    backends = Backends()
    backends.start()
    result: dict[str, Any] = {"topology_seconds": round(topology_seconds, 3)}
    try:
        with IPVS(netns=NODE) as ipvs:
            service = IPVSService(
                addr=VIP, port=VIP_PORT, protocol=socket.IPPROTO_TCP, sched_name="rr"
            )
            ipvs.service("add", service=service)
            dests = {
                name: IPVSDest(addr=address, port=BACKEND_PORT, fwd_method=0, weight=1)
                for name, _ifname, address, _node_ifname, _node_address in BACKENDS
            }
            for dest in dests.values():
                ipvs.dest("add", service=service, dest=dest)
            result["both"] = phase(ipvs, service)
            ipvs.dest("del", service=service, dest=dests["backend-a"])
            result["after_delete"] = phase(ipvs, service)
    finally:
        backends.stop()
        result["served"] = dict(backends.served)
        result["total_seconds"] = round(time.monotonic() - started, 3)
        write_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
