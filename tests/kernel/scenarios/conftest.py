"""Fixtures for scenarios run inside user-mode Linux (collected only there, see run.py).

One lab (namespaces, bridge, echo backends) per module, since building it is the slow
part; one data plane per scenario, cleaned up (virtual servers, dummy interface, ipsets,
chains) and conntrack flushed afterwards, so scenarios do not see each other's state.
Every scenario uses service addresses of its own as well.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from proxy.lab import BackendSpec, Lab
from tests.kernel.ipvs_guest import Cluster, NodeThread

BACKENDS = ("web-1", "web-2", "web-3")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with Lab([BackendSpec(name) for name in BACKENDS]) as lab:
        lab.start_backends(tcp_ports=(8080,), udp_ports=(8081,))
        yield lab


@pytest.fixture
def node(lab: Lab) -> Iterator[NodeThread]:
    thread = NodeThread(lab.node_ns)
    thread.start_plane()
    try:
        yield thread
    finally:
        try:
            if thread.plane is not None:
                plane = thread.plane
                thread.run(plane.cleanup)
            thread.exec("conntrack", "-F")
        finally:
            thread.close()


@pytest.fixture
def cluster() -> Cluster:
    return Cluster()
