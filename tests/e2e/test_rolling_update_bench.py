"""The rolling-update benchmark, small: the real agent on the simulator, every endpoint of
a service replaced at 100 a second with traffic flowing. Only behaviour is asserted (no
failed connection, every endpoint replaced, the kernel ending with exactly the new
endpoints); the bench's timings are reported, never asserted here."""

from __future__ import annotations

import os
import struct
import subprocess
from ipaddress import ip_address, ip_network
from pathlib import Path

import pytest

from bench.common import ENDPOINTS_PER_SLICE
from bench.rolling_update import READY, TERMINATING, Roll, Settings, markdown, run
from bench.rolling_update.kernel import KernelView, SlotMapWatch
from bench.rolling_update.workload import POD_NETS, pod_address
from proxy.dataplane.common.netlink import frame, nested, nfgen, nla, nla_string
from proxy.dataplane.common.netlink_constants import (
    NFNL_SUBSYS_NFTABLES,
    NFPROTO_IPV4,
    NFT_MSG_DELSETELEM,
    NFT_MSG_DELTABLE,
    NFT_MSG_NEWGEN,
    NFT_MSG_NEWSETELEM,
    NFTA_DATA_VALUE,
    NFTA_LIST_ELEM,
    NFTA_SET_ELEM_DATA,
    NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_TABLE,
    NFTA_TABLE_NAME,
)
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import NETNS_DIR

pytestmark = pytest.mark.root


def test_the_roll_replaces_every_pod_as_a_deployment_does() -> None:
    roll = Roll(250, rate=100, ready_delay=0.3, grace=0.5, teardown=0.2)
    seen: dict[int, list[tuple[bool, bool, bool] | None]] = {
        p: [READY if p < 250 else None] for p in range(500)}
    writes = []
    for tick in range(roll.ticks):
        writes += roll.step(tick)
        state = roll.api_state()
        for p in range(500):
            if seen[p][-1] != state.get(p):
                seen[p].append(state.get(p))
        assert all(len(sl.endpoints) <= ENDPOINTS_PER_SLICE for sl in roll.slices)
    # Old pods: ready, then terminating, then gone; new pods: absent, not ready, ready.
    assert all(seen[p] == [READY, TERMINATING, None] for p in range(250))
    assert all(seen[p] == [None, (False, False, False), READY] for p in range(250, 500))
    assert set(roll.api_state()) == set(range(250, 500))
    assert {w.op for w, _ in writes} <= {"POST", "PUT", "DELETE"}
    made_ready = [p for w, _ in writes for p in w.adds]
    made_terminating = [p for w, _ in writes for p in w.removes]
    assert sorted(made_ready) == list(range(250, 500))
    assert sorted(made_terminating) == list(range(250))


def test_50000_old_and_50000_new_pods_have_distinct_bench_addresses() -> None:
    addresses = {pod_address(p) for p in range(100_000)}
    assert len(addresses) == 100_000
    assert all(any(ip_address(a) in net for net in POD_NETS) for a in addresses)
    lab_and_service = ip_network("198.18.0.0/22"), ip_network("198.18.255.0/24")
    assert not any(ip_address(a) in net for a in addresses for net in lab_and_service)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["nftables", "iptables"])
def test_rolling_update_small(mode: str, tmp_path: Path) -> None:
    def ours() -> set[str]:
        return {n for n in os.listdir(NETNS_DIR) if n.startswith(f"spx-{os.getpid()}-")}

    before = ours()
    settings = Settings(endpoints=200, rate=100.0, mode=mode, traffic_rate=100.0)
    try:
        result = run(settings, tmp_path)
    finally:
        assert ours() == before, "the bench left namespaces behind"
    traffic = result["traffic"]
    assert traffic["connections"] > 0
    assert traffic["failed"] == 0, traffic["failures"]
    assert result["replaced"] == 200
    assert result["api_exactly_new"]
    assert result["kernel_exactly_new"], (result["kernel_old_left"],
                                          result["kernel_new_missing"])
    assert result["lag"]["never_seen"] == 0 and result["lag"]["flaps"] == 0
    assert not result["agent"]["errors"]
    assert result["pacing"] == "new" and result["agent_flags"] == ""  # the agent's default
    assert f"| {mode} | new | 200 |" in markdown([result])


def _nft(msg: int, attrs: bytes) -> bytes:
    return frame(NFNL_SUBSYS_NFTABLES << 8 | msg, 0, 0, nfgen(NFPROTO_IPV4) + attrs)


def _elements(kind: int, table: str, slot_map: str, elements: dict[int, str | None]) -> bytes:
    """One NEWSETELEM or DELSETELEM message as nf_tables announces it."""
    def value(kind: int, data: bytes) -> bytes:
        return nla(kind, nla(NFTA_DATA_VALUE, data))

    items = b"".join(nla(NFTA_LIST_ELEM,
                         value(NFTA_SET_ELEM_KEY, struct.pack("=I", slot))  # the slot
                         + (value(NFTA_SET_ELEM_DATA, ip_address(a).packed + b"\x1f\x90\0\0")
                            if a else b""))
                     for slot, a in elements.items())
    return _nft(kind, nla_string(NFTA_SET_ELEM_LIST_TABLE, table)
                + nla_string(NFTA_SET_ELEM_LIST_SET, slot_map)
                + nested(NFTA_SET_ELEM_LIST_ELEMENTS, items))


def _newgen() -> bytes:
    return _nft(NFT_MSG_NEWGEN, b"")


def test_a_slot_map_is_followed_from_the_announcements_of_its_elements() -> None:
    watch = SlotMapWatch(KernelView("unused", "nftables"), "sliceproxy-3",
                         ("slots-svc-x", "tail-svc-x"))
    watch._slots = {("slots-svc-x", struct.pack("=I", 0)): "198.19.0.1",
                    ("slots-svc-x", struct.pack("=I", 1)): "198.19.0.2"}
    # One transaction: slot 1 moves to a new pod; another map's element is not ours.
    watch._feed(_elements(NFT_MSG_DELSETELEM, "sliceproxy-3", "slots-svc-x", {1: "198.19.0.2"})
                + _elements(NFT_MSG_NEWSETELEM, "sliceproxy-3", "slots-svc-x", {1: "198.19.0.9"})
                + _elements(NFT_MSG_NEWSETELEM, "sliceproxy-3", "slots-svc-y", {2: "198.19.0.7"}))
    assert watch.timeline == []  # nothing recorded in the middle of a transaction
    watch._feed(_newgen())
    assert watch.latest() == frozenset({"198.19.0.1", "198.19.0.9"}) and watch.commits == 1
    watch._feed(_newgen())  # a transaction that did not touch the map: nothing new
    assert len(watch.timeline) == 1 and watch.commits == 2
    # The table rebuilt (deleted, then made again by a full sync): only what is re-added.
    deleted = _nft(NFT_MSG_DELTABLE, nla_string(NFTA_TABLE_NAME, "sliceproxy-3"))
    watch._feed(deleted
                + _elements(NFT_MSG_NEWSETELEM, "sliceproxy-3", "slots-svc-x", {0: "198.19.0.9"})
                + _newgen())
    assert watch.latest() == frozenset({"198.19.0.9"})
    # The tail's slot 0 is not the main map's: both are followed.
    watch._feed(_elements(NFT_MSG_NEWSETELEM, "sliceproxy-3", "tail-svc-x", {0: "198.19.0.5"})
                + _newgen())
    assert watch.latest() == frozenset({"198.19.0.9", "198.19.0.5"})
    watch._feed(_elements(NFT_MSG_DELSETELEM, "sliceproxy-3", "tail-svc-x", {0: None})
                + _newgen())
    assert watch.latest() == frozenset({"198.19.0.9"})


def test_a_split_service_is_read_from_its_policy_chain_and_both_maps() -> None:
    """From 1,024 endpoints a path's last slots are in a tail chain and map of their own
    (nftables/slot_tail.py), which nft lists first: the view reads the policy chain and
    the endpoints of both maps."""
    with Lab([]) as lab:
        ns = lab.node_ns
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], check=True, text=True,
                       input="""table ip t {
  map slots-svc-x { typeof numgen random mod 1 : ip daddr . tcp dport;
                    elements = { 0 : 198.19.0.1 . 8080, 1 : 198.19.0.2 . 8080 } }
  map tail-svc-x { typeof numgen random mod 1 : ip daddr . tcp dport;
                   elements = { 0 : 198.19.0.3 . 8080 } }
  chain tail-svc-x {
    meta l4proto tcp numgen random mod 3 < 1 dnat ip to numgen random mod 1 map @tail-svc-x
  }
  chain svc-x {
    jump tail-svc-x
    meta l4proto tcp dnat ip to numgen random mod 2 map @slots-svc-x
  }
}
""")
        view = KernelView(ns, "nftables")
        assert view.locate() and view.chain[-1] == "svc-x"
        assert view.slot_map() == ("t", ("slots-svc-x", "tail-svc-x"))
        assert view.read() == frozenset({"198.19.0.1", "198.19.0.2", "198.19.0.3"})
