"""The iptables and nftables data planes written into fake kernels, so one behaviour
case can be traced against either mode: `FakePlane(mode).become(*objects)` feeds a
cluster state through the model and the real data plane (render, transaction, apply)
into the fake kernel; `trace` says where a packet goes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from ipaddress import ip_address, ip_network
from typing import Any

from proxy.dataplane.base import DataplaneOptions, SyncReport, housekeep_all
from proxy.dataplane.iptables.apply import IptablesDataPlane
from proxy.dataplane.nftables.apply import NftablesDataPlane
from proxy.dataplane.xtables.simulate import SimulatedRunner
from proxy.kube.ingest import apply_object, delete_object
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.model.types import Family
from tests.fakekernel.iptables import IptablesTracer
from tests.fakekernel.nftables import FakeNft
from tests.fakekernel.packet import Node, Packet, Trace

MODES = ("iptables", "nftables")
NODE_NAME = "node-a"
NODE_IPS = ("198.18.0.1", "fd00:18::1")
POD_CIDRS = ("198.18.1.0/24", "fd00:18:1::/64")


def node_object(name: str = NODE_NAME, zone: str = "zone-a") -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name,
                                                  "topology.kubernetes.io/zone": zone}}}


class FakePlane:
    """One mode's data plane over a fake kernel, on node `node-a` (NODE_IPS, pods in
    POD_CIDRS unless `options` say otherwise). `shards`: nftables shard tables."""

    def __init__(self, mode: str, options: DataplaneOptions | None = None,
                 node_ips: Sequence[str] = NODE_IPS, shards: int = 1) -> None:
        self.mode = mode
        self._shape = (node_ips, shards)
        self.options = options or DataplaneOptions(
            NODE_NAME, cluster_cidrs=tuple(ip_network(c) for c in POD_CIDRS))
        self.node = Node.of(*node_ips)
        addresses = [ip_address(a) for a in node_ips]
        self.model = ClusterModel(NODE_NAME)
        apply_object(self.model, node_object())
        self._objects: dict[tuple[str, str, str], dict[str, Any]] = {}
        self.dp: IptablesDataPlane | NftablesDataPlane
        if mode == "iptables":
            self.runners = {f: SimulatedRunner(f) for f in Family}
            self.dp = IptablesDataPlane(self.options, runners=self.runners,
                                        addresses=lambda: addresses, clear_conntrack=False)
        elif mode == "nftables":
            self.nft = FakeNft()
            self.dp = NftablesDataPlane(self.options, runner=self.nft,  # type: ignore[arg-type]
                                        addresses=lambda: addresses, clear_conntrack=False,
                                        probe=False, shards=shards)
        else:
            raise ValueError(f"no fake kernel for mode {mode!r}")

    def restarted(self) -> FakePlane:
        """The agent started again on this node (nftables): a plane that knows nothing,
        over the same fake kernel."""
        assert self.mode == "nftables"
        other = FakePlane(self.mode, self.options, *self._shape)
        other.nft = self.nft
        assert isinstance(other.dp, NftablesDataPlane)
        other.dp.runner = self.nft  # type: ignore[assignment]
        return other

    def settle(self) -> FakePlane:
        """What the agent does when idle after a sync (the data plane's housekeeping,
        again while it has work left: nftables adds its ports' input marks then, a part
        at a time)."""
        housekeep_all(self.dp)
        return self

    def become(self, *objects: dict[str, Any], full: bool = False) -> SyncReport:
        """The cluster now holds exactly `objects` (besides the node): model, render,
        apply (a partial sync unless `full` or the first)."""
        wanted = {(o["kind"], o["metadata"].get("namespace", "ns"), o["metadata"]["name"]): o
                  for o in objects}
        for kind, namespace, name in set(self._objects) - set(wanted):
            delete_object(self.model, kind, namespace, name)
        for obj in objects:
            apply_object(self.model, obj)
        self._objects = wanted
        return self.sync(self.model.resolve(), full)

    def sync(self, state: DesiredState, full: bool = False) -> SyncReport:
        return self.dp.sync(state, full)

    def written(self) -> object:
        """Everything the fake kernel holds, comparable with another plane's."""
        if self.mode == "iptables":
            return {f: copy.deepcopy(r.kernel) for f, r in self.runners.items()}
        return copy.deepcopy(self.nft.tables)

    def trace(self, packet: Packet, remembered: frozenset[str] = frozenset()) -> Trace:
        if self.mode == "iptables":
            kernel = self.runners[Family.of(packet.destination)].kernel
            return IptablesTracer(kernel, self.node).trace(packet, remembered)
        return self.nft.trace(packet, self.node, remembered)
