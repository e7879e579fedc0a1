"""The namespace test bed itself: reachability, isolation from the host, teardown."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from proxy.netns_lab import BackendSpec, Lab, LabError, probe, sweep_stale
from proxy.netns_lab.netns import entered
from proxy.netns_lab.topology import NODE_LAN4, ip

pytestmark = pytest.mark.root


def _host_links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True,
                          check=True).stdout


def _namespaces() -> set[str]:
    return set(os.listdir("/run/netns")) if os.path.isdir("/run/netns") else set()


def test_backends_answer_on_both_families_and_protocols() -> None:
    host_before = _host_links()
    with Lab([BackendSpec("web-1"), BackendSpec("web-2", node="node-b")]) as lab:
        lab.start_backends()
        for b in lab.backends.values():
            assert lab.ask(lab.client_ns, b.ipv4, 8080, count=3) == {b.name: 3}
            assert lab.ask(lab.client_ns, b.ipv6, 8080, count=3) == {b.name: 3}
            assert lab.ask(lab.node_ns, b.ipv4, 8081, proto="udp", count=3) == {b.name: 3}
            assert lab.ask(lab.node_ns, b.ipv6, 8081, proto="udp", count=3) == {b.name: 3}
        with lab.hold(lab.client_ns, lab.backends["web-2"].ipv4, 8080) as flow:
            assert [flow.ask() for _ in range(3)] == ["web-2"] * 3
        # Nothing listens on a service IP without rules: the node forwards the packet
        # to its default route (the client), which drops it.
        assert lab.ask(lab.client_ns, "198.18.128.9", 80, count=1, timeout=0.3) == {
            "timeout": 1}
        # The lab never adds anything to the host's own namespace.
        assert _host_links() == host_before


def test_datagram_probes_never_repeat_a_source_port() -> None:
    """Each datagram is a new flow for the balancer (and a new connection in IPVS's
    statistics) only if its 5-tuple is new: the kernel's random ephemeral ports repeat
    by chance (one in ~16 over 60 datagrams), so the probe picks ports below that range
    itself, never the same twice in a run."""
    count = 300
    with Lab([]) as lab:
        with entered(lab.node_ns):
            server = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        server.bind((str(NODE_LAN4), 9053))
        server.settimeout(5)
        seen: list[int] = []

        def echo_port() -> None:  # answers each datagram with the port it came from
            for _ in range(count):
                _, peer = server.recvfrom(64)
                seen.append(peer[1])
                server.sendto(b"%d\n" % peer[1], peer)

        thread = threading.Thread(target=echo_port, daemon=True)
        thread.start()
        try:
            answers = [probe.ask_once(lab.client_ns, str(NODE_LAN4), 9053, "udp", 2.0)
                       for _ in range(count)]
        finally:
            thread.join(10)
            server.close()
    assert answers == [str(p) for p in seen], answers[:5]
    assert len(set(seen)) == count and max(seen) < 32768, sorted(seen)[:5]


def test_teardown_removes_namespaces_and_processes_even_after_a_failure() -> None:
    before = _namespaces()
    with pytest.raises(RuntimeError, match="boom"), Lab([BackendSpec("a")]) as lab:
        lab.start_backends()
        sleeper = lab.popen(lab.node_ns, ["sleep", "300"])
        created = _namespaces() - before
        assert len(created) == 3  # node, client, one backend
        raise RuntimeError("boom")
    assert _namespaces() == before
    assert sleeper.poll() is not None


def test_namespaces_of_a_dead_process_are_swept() -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    name = f"spx-{proc.pid}-abcdef-node"
    ip("netns", "add", name)
    try:
        assert name in sweep_stale()
        assert name not in _namespaces()
    finally:
        ip("netns", "delete", name, check=False)


def test_bad_specs_are_refused() -> None:
    with pytest.raises(LabError, match="unique"):
        Lab([BackendSpec("a"), BackendSpec("a")])


def test_echo_speaks_http_for_curl() -> None:
    with Lab([BackendSpec("web-1")]) as lab:
        lab.start_backends()
        out = lab.exec(lab.node_ns, ["curl", "-s", "--max-time", "5",
                                     f"http://{lab.backends['web-1'].ipv4}:8080/"])
        assert out.stdout == "web-1\n", out
        assert Path("/run/netns", lab.node_ns).exists()
