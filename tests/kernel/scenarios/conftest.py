"""Fixtures for scenarios run inside the kernel lab (collected only there, see run.py).

One lab (namespaces, bridge, echo backends) per module, since building it is the slow
part; one data plane per scenario, cleaned up (virtual servers, dummy interface, ipsets,
chains) and conntrack flushed afterwards, so scenarios do not see each other's state.
Every scenario uses service addresses of its own as well. Scenarios that run the real
agent get a simulator (`sim`) listening in the node namespace and a `workdir` for the
agent's log and kubeconfig.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.netns_lab import BackendSpec, Lab
from proxy.sim import SimServer
from tests.e2e.agent_support import namespace_object, node_object, start_sim
from tests.kernel.scenario_guest import Cluster, NodeThread

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


@pytest.fixture
def workdir(request: pytest.FixtureRequest) -> Path:
    """Where a scenario's agents keep their logs and kubeconfig. The root file system is
    the host's, read-only, so not pytest's tmp_path: the run's result folder, which is
    the host test's own folder, so the logs are still there to read after a failure."""
    name: str = request.node.name
    result = os.environ.get("KERNEL_RESULT")
    base = Path(result).parent / "agents" if result else Path(os.environ["KERNEL_SCRATCH"])
    path = base / name
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture
def sim(lab: Lab) -> Iterator[SimServer]:
    with start_sim(lab, [node_object(), namespace_object("demo")]) as server:
        yield server
