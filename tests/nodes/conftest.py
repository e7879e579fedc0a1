"""Fixtures for the real-node tier: a real v1.20.2 cluster (control plane, scheduler,
three kubelet + containerd nodes in two zones) running the image built from the repo's
Dockerfile (tests/nodes/cluster.py). A failed build or start FAILS the tier: it is never
skipped, except when not running as root (like every namespace test).

SLICEPROXY_NODES_LONG=1 runs the long version (more traffic, longer checks).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from labs.realcp.build import BuildError, build
from labs.realcp.controlplane import ControlPlaneError
from tests.nodes.cluster import ClusterError, NodeCluster
from tests.nodes.images import ImageError
from tests.nodes.node import NodeError

LONG = bool(os.environ.get("SLICEPROXY_NODES_LONG"))
report: list[str] = []


@contextmanager
def started_cluster(workdir: Path, **options: Any) -> Iterator[NodeCluster]:
    """A cluster for one module (each module starts from nodes no proxy ran on)."""
    if os.geteuid() != 0:
        pytest.skip("real nodes run in network namespaces and need root (CI runs as root)")
    try:
        bins = build()
    except BuildError as exc:
        pytest.fail(f"building Kubernetes v1.20.2 from Debian's source failed: {exc}",
                    pytrace=False)
    cluster = NodeCluster(bins, workdir, **options)
    try:
        cluster.start()
    except (ClusterError, ControlPlaneError, ImageError, NodeError) as exc:
        cluster.close()
        pytest.fail(f"the real-node cluster did not start: {exc}", pytrace=False)
    except BaseException:
        cluster.close()
        raise
    img = cluster.image
    line = (f"image {img.ref}: {img.size}, "
            + (f"built in {img.build_seconds:.0f}s" if img.built_now else "cached"))
    if line not in report:
        report.append(line)
    report.append("cluster up: " + ", ".join(f"{k} {v:.1f}s"
                                             for k, v in cluster.timings.items()))
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeCluster]:
    with started_cluster(tmp_path_factory.mktemp("nodes")) as cluster:
        yield cluster


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if report:
        terminalreporter.section("real nodes")
        for line in report:
            terminalreporter.write_line(line)
