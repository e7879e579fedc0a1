"""The namespace test bed itself: reachability, isolation from the host, teardown."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from proxy.netns_lab import BackendSpec, Lab, LabError, sweep_stale
from proxy.netns_lab.topology import ip

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
