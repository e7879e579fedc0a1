"""Fixtures for the real-control-plane tier.

`control_plane` (session): builds kube-apiserver, kube-controller-manager, kube-proxy and
kubeadm v1.20.2 from Debian's source on first use (cached outside the clone; see
labs/realcp/build.py), then starts etcd, the API server and the controller manager in a
network namespace of their own (see labs/realcp/controlplane.py). A failed build or
start FAILS every test of the tier: it is never skipped, except when not running as root
(like every namespace test).

`cluster` (per test, parametrized "sim" and "real"): the same conformance code against
the simulator and the real server.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from labs.realcp.build import Binaries, BuildError, build
from labs.realcp.clusters import Cluster
from labs.realcp.controlplane import ControlPlane, ControlPlaneError
from labs.realcp.rawapi import RawApi
from proxy.sim import SimServer

_report: list[str] = []


def _need_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("the real control plane runs in network namespaces and needs root "
                    "(CI runs as root)")


@pytest.fixture(scope="session")
def realcp_binaries() -> Binaries:
    _need_root()
    try:
        bins = build()
    except BuildError as exc:
        pytest.fail(f"building Kubernetes v1.20.2 from Debian's source failed: {exc}",
                    pytrace=False)
    how = "cache reused" if bins.reused else "built now"
    _report.append(f"binaries: {bins.bin_dir} ({how}; the build took "
                   f"{bins.built_seconds:.0f}s; source package {bins.source_version})")
    return bins


@pytest.fixture(scope="session")
def control_plane(realcp_binaries: Binaries) -> Iterator[ControlPlane]:
    try:
        cp = ControlPlane(realcp_binaries)
        cp.start()
    except ControlPlaneError as exc:
        cp.stop()
        pytest.fail(f"the real control plane did not start: {exc}", pytrace=False)
    try:
        v = cp.version()
        _report.append(f"API server: {v.get('gitVersion')} ({v.get('goVersion')}, "
                       f"{v.get('platform')}) in namespace {cp.namespace}")
        yield cp
    finally:
        cp.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _report:
        terminalreporter.section("real control plane")
        for line in _report:
            terminalreporter.write_line(line)


def _real_cluster(cp: ControlPlane) -> Cluster:
    return Cluster(
        name="real",
        raw=RawApi(cp.host_url, token=cp.token, context=cp.ssl_context()),
        kubeconfig=cp.host_kubeconfig,
        server_version=str(cp.version().get("gitVersion")),
        compact=cp.compact,
        compact_storage=cp.compact_etcd,
        cut_streams=cp.forwarder.cut,
    )


@pytest.fixture(params=["sim", "real"])
def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Cluster]:
    if request.param == "real":
        yield _real_cluster(request.getfixturevalue("control_plane"))
        return
    # The simulator as shipped (its default bookmark interval), not tuned for the tests.
    with SimServer() as sim:
        yield Cluster(
            name="sim", raw=RawApi(sim.url), kubeconfig=sim.write_kubeconfig(
                tmp_path / "sim.kubeconfig"),
            server_version="simulator", compact=sim.compact, compact_storage=sim.compact,
            cut_streams=lambda: sim.cut_watches(abrupt=True))
