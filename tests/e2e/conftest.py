"""Shared e2e fixtures. The iptables ones drive `IptablesDataPlane` directly (no agent)
inside a lab's node namespace, from the test's own thread."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from ipaddress import ip_network
from typing import Any

import pytest

from proxy.dataplane.base import DataplaneOptions, SyncReport, housekeep_all
from proxy.dataplane.iptables.apply import IptablesDataPlane
from proxy.dataplane.nftables.apply import NftablesDataPlane
from proxy.dataplane.xtables.restore_runner import Backend
from proxy.kube.ingest import apply_object, delete_object
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.netns_lab.netns import entered
from tests.unit.builders import node

POD_CIDRS = (ip_network("198.18.1.0/24"), ip_network("fd00:18:1::/64"))


class Cluster:
    """A model fed whole cluster states in turn, as the agent feeds it events:
    service ports that did not change stay the same objects between snapshots."""

    def __init__(self, node_name: str = "node-a") -> None:
        self.model = ClusterModel(node_name)
        apply_object(self.model, node(node_name))
        self.objects: dict[tuple[str, str, str], dict[str, Any]] = {}

    def become(self, *objects: dict[str, Any]) -> DesiredState:
        wanted = {(o["kind"], o["metadata"].get("namespace", "ns"), o["metadata"]["name"]): o
                  for o in objects}
        for kind, namespace, name in set(self.objects) - set(wanted):
            delete_object(self.model, kind, namespace, name)
        for obj in objects:
            apply_object(self.model, obj)
        self.objects = wanted
        return self.model.resolve()


class NodePlane:
    """An IptablesDataPlane (or, `mode="nftables"`, an NftablesDataPlane) whose every
    kernel call happens in network namespace `ns`."""

    def __init__(self, ns: str, backend: Backend | None = None,
                 options: DataplaneOptions | None = None, mode: str = "iptables",
                 **kw: Any) -> None:
        self.ns = ns
        self.options = options or DataplaneOptions("node-a", cluster_cidrs=POD_CIDRS)
        self.dp: IptablesDataPlane | NftablesDataPlane
        with entered(ns):
            if mode == "nftables":
                self.dp = NftablesDataPlane(self.options, **kw)
            else:
                self.dp = IptablesDataPlane(self.options, backend=backend, **kw)

    def sync(self, state: DesiredState, full: bool = False) -> SyncReport:
        with entered(self.ns):
            return self.dp.sync(state, full)

    def settle(self) -> NodePlane:
        """What the agent does when idle after a sync (housekeeping, again while it has
        work left: in nftables mode, its ports' input marks are added then, a part at a
        time)."""
        with entered(self.ns):
            housekeep_all(self.dp)
        return self

    def cleanup(self) -> None:
        with entered(self.ns):
            self.dp.cleanup()


def host_iptables() -> str:
    """The host namespace's rules of both back ends (read only)."""
    out = []
    for tool in ("iptables-legacy-save", "ip6tables-legacy-save", "iptables-nft-save",
                 "ip6tables-nft-save"):
        result = subprocess.run([tool], capture_output=True, text=True, check=False)
        out.append("\n".join(line for line in result.stdout.splitlines()
                             if not line.startswith("#")))
    out.append(subprocess.run(["nft", "list", "tables"], capture_output=True, text=True,
                              check=False).stdout)
    return "\n".join(out)


@pytest.fixture(scope="module")
def host_untouched() -> Iterator[None]:
    """Fails the module if anything of ours ever shows up in the host's own tables."""
    assert "SPX-" not in host_iptables(), "the host already holds SPX- chains"
    assert " sliceproxy" not in host_iptables(), "the host already holds our nft tables"
    yield
    assert "SPX-" not in host_iptables()
    assert " sliceproxy" not in host_iptables()


@pytest.fixture(params=[Backend.LEGACY, Backend.NFT], ids=["legacy", "nft"])
def backend(request: pytest.FixtureRequest) -> Backend:
    value: Backend = request.param
    return value
