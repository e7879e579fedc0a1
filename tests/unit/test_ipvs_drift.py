"""Drift detection of the IPVS plane, the pure parts: what an rtnetlink announcement says
about our dummy interface (`drift.link_change`) and how our iptables chains read back
differ from what we write (`netfilter.differences`). The listener and the check against
a real kernel: tests/kernel/scenarios/scenario_faults.py."""

from __future__ import annotations

import socket
import struct
from ipaddress import ip_address, ip_network

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.netlink import Reply, nla
from proxy.dataplane.common.netlink_constants import (
    IFF_UP,
    IFLA_IFNAME,
    RTM_DELADDR,
    RTM_DELLINK,
    RTM_NEWADDR,
    RTM_NEWLINK,
)
from proxy.dataplane.common.rtnetlink import address_body
from proxy.dataplane.ipvs.drift import link_change
from proxy.dataplane.ipvs.netfilter import differences, restore_text
from proxy.dataplane.xtables.saved import Table, parse_save
from proxy.dataplane.xtables.simulate import SimulatedRunner
from proxy.model.types import Family

NAME, INDEX, OURS = "spx-ipvs0", 7, 4242


def ours(port: int) -> bool:
    return port == OURS


def addr(kind: int, address: str, index: int = INDEX, port: int = 0) -> Reply:
    return Reply(kind, 0, address_body(index, ip_address(address)), port)


def link(kind: int, index: int = INDEX, flags: int = IFF_UP, name: str = NAME,
         port: int = 0) -> Reply:
    body = struct.pack("=BxHiII", socket.AF_UNSPEC, 1, index, flags, 0)
    return Reply(kind, 0, body + nla(IFLA_IFNAME, name.encode() + b"\0"), port)


@pytest.mark.parametrize(("msg", "want"), [
    (addr(RTM_DELADDR, "198.18.128.10"), "address 198.18.128.10 deleted from spx-ipvs0"),
    (addr(RTM_NEWADDR, "fd00::10"), "address fd00::10 added to spx-ipvs0"),
    (link(RTM_DELLINK), "interface spx-ipvs0 deleted"),
    # Deleted by name, even before we learnt its index.
    (link(RTM_DELLINK, index=99), "interface spx-ipvs0 deleted"),
    (link(RTM_NEWLINK, flags=0), "interface spx-ipvs0 is down"),
    (link(RTM_NEWLINK, name="other0"), "interface spx-ipvs0 renamed to other0"),
])
def test_foreign_changes_to_our_interface_are_reported(msg: Reply, want: str) -> None:
    assert link_change(msg, NAME, INDEX, ours) == want


@pytest.mark.parametrize("msg", [
    addr(RTM_DELADDR, "198.18.128.10", port=OURS),  # our own partial sync
    addr(RTM_NEWADDR, "198.18.128.10", port=OURS),
    addr(RTM_DELADDR, "198.18.128.10", index=3),  # another interface
    addr(RTM_NEWADDR, "fe80::1"),  # the kernel's own link-local address
    link(RTM_NEWLINK),  # up, same name: nothing happened to us
    link(RTM_NEWLINK, flags=0, port=OURS),  # our own change
    link(RTM_NEWLINK, index=8, flags=0),  # our full sync creating it (announced down)
    link(RTM_NEWLINK, index=3, flags=0, name="eth0"),
    link(RTM_DELLINK, index=3, name="eth0"),
    Reply(2, 0, b"\0" * 4),  # not an announcement at all
])
def test_our_own_changes_and_other_interfaces_are_not(msg: Reply) -> None:
    assert link_change(msg, NAME, INDEX, ours) is None


def test_address_change_before_the_index_is_known_is_ignored() -> None:
    assert link_change(addr(RTM_DELADDR, "198.18.128.10"), NAME, None, ours) is None


OPTIONS = DataplaneOptions(node_name="n", cluster_cidrs=(ip_network("198.18.1.0/24"),))


def written(extra: str = "") -> SimulatedRunner:
    runner = SimulatedRunner(Family.V4)
    if extra:
        runner.restore(extra)
    runner.restore(restore_text(Family.V4, OPTIONS, {}))
    return runner


def test_what_we_wrote_has_no_differences_others_rules_alongside() -> None:
    runner = written("*nat\n:OTHER - [0:0]\n-A PREROUTING -j OTHER\nCOMMIT\n")
    assert differences(Family.V4, OPTIONS, parse_save(runner.save())) == []


def test_a_flushed_table_a_deleted_chain_and_a_lost_jump_are_differences() -> None:
    saved = parse_save(written().save())
    # `iptables -t nat -F`: every rule of the table gone, the chains stay.
    saved[Table.NAT] = {chain: [] for chain in saved[Table.NAT]}
    found = differences(Family.V4, OPTIONS, saved)
    assert "nat chain SPX-IPVS-SERVICES holds 0 rules, we wrote 5" in found
    assert found[-1].startswith("and ") and len(found) == 6

    runner = written()
    runner.restore("*filter\n-D FORWARD -m comment --comment \"sliceproxy ipvs forward\" "
                   "-j SPX-IPVS-FORWARD\n:SPX-IPVS-FORWARD - [0:0]\n-X SPX-IPVS-FORWARD\nCOMMIT\n")
    assert differences(Family.V4, OPTIONS, parse_save(runner.save())) == [
        "filter chain SPX-IPVS-FORWARD is missing",
        "filter FORWARD has no jump to SPX-IPVS-FORWARD"]


def test_nothing_at_all_is_every_chain_missing() -> None:
    found = differences(Family.V4, OPTIONS, {}, limit=100)
    assert len(found) == 8 + 5  # every chain, every jump
