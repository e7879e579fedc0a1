"""Drift: our rules changed by someone else between syncs. The data plane's check
against a simulated kernel, the nf_tables announcement decoder, the legacy canary's
bookkeeping. The real kernel and the real agent: tests/faults/test_rule_drift.py."""

from __future__ import annotations

import struct
import threading
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from proxy.dataplane.common.drift_watch import LegacyCanary
from proxy.dataplane.common.netlink import frame, nfgen, nla
from proxy.dataplane.common.netlink_constants import (
    IPCTNL_MSG_CT_NEW,
    NFNL_SUBSYS_CTNETLINK,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO_IPV4,
    NFT_MSG_NEWGEN,
    NFTA_GEN_PROC_NAME,
    NFTA_GEN_PROC_PID,
)
from proxy.dataplane.common.nft_events import Transaction, TransactionReader
from proxy.dataplane.iptables.apply import IptablesDataPlane
from proxy.dataplane.xtables.saved import Saved, Table
from proxy.model.types import Family
from tests.unit.builders import ep, eps_slice, service
from tests.unit.test_iptables_sync import Cluster, foreign, plane


def web() -> list[dict[str, Any]]:
    return [service("web", ips=("198.18.128.10",)),
            eps_slice("web-1", [ep("198.18.1.10"), ep("198.18.1.11", node="node-b")],
                      service_name="web")]


def synced() -> tuple[IptablesDataPlane, dict[Family, Saved]]:
    kernels = foreign()
    dp, _ = plane(kernels)
    dp.sync(Cluster().become(web()))
    return dp, kernels


def test_no_drift_right_after_a_sync() -> None:
    dp, _ = synced()
    assert dp.check_drift() == []


def test_a_flushed_chain_is_drift_and_the_next_sync_is_full() -> None:
    dp, kernels = synced()
    nat = kernels[Family.V4][Table.NAT]
    svc = next(c for c in nat if c.startswith("SPX-SVC-"))
    nat[svc] = []
    found = dp.check_drift()
    assert any(svc in d and "holds 0 rules" in d for d in found), found
    assert found[0].startswith("IPv4: ")
    # The family is now unknown: the next sync rewrites it whole, and then it agrees.
    report = dp.sync(Cluster().become(web()))
    assert report.details["IPv4"]["full"] and not report.details["IPv6"]["full"]
    assert dp.check_drift() == []


def test_deleted_chains_lost_jumps_and_strangers_are_each_named() -> None:
    dp, kernels = synced()
    nat = kernels[Family.V4][Table.NAT]
    sep = next(c for c in nat if c.startswith("SPX-SEP-"))
    del nat[sep]
    nat["PREROUTING"] = [r for r in nat["PREROUTING"] if "SPX-" not in r]
    nat["SPX-SEP-STRANGER"] = []
    found = "\n".join(dp.check_drift())
    assert f"nat chain {sep} is missing" in found
    assert "PREROUTING jumps to none of ours" in found
    assert "SPX-SEP-STRANGER is not in our rules" in found


def test_rules_others_add_are_not_drift() -> None:
    dp, kernels = synced()
    kernels[Family.V4][Table.NAT]["PREROUTING"].append("-p udp -j RETURN")
    kernels[Family.V4][Table.NAT]["CNI-NEW"] = ["-j RETURN"]
    assert dp.check_drift() == []


# --- nf_tables announcements ------------------------------------------------------------


def _message(msg: int, family: int, attrs: bytes, port_id: int = 0) -> bytes:
    body = nfgen(family) + attrs
    data = bytearray(frame(NFNL_SUBSYS_NFTABLES << 8 | msg, 0, 0, body))
    struct.pack_into("=I", data, 12, port_id)
    return bytes(data)


def _object(msg: int, family: int, table: str) -> bytes:
    return _message(msg, family, nla(1, table.encode() + b"\0") + nla(2, b"CHAIN\0"))


def _gen(pid: int | None, name: str, port_id: int) -> bytes:
    attrs = nla(1, struct.pack("!I", 7))
    if pid is not None:
        attrs += nla(NFTA_GEN_PROC_PID, struct.pack("!I", pid))
    attrs += nla(NFTA_GEN_PROC_NAME, name.encode() + b"\0")
    return _message(NFT_MSG_NEWGEN, 0, attrs, port_id)


def test_a_transaction_is_closed_by_its_generation_message() -> None:
    reader = TransactionReader()
    # Delivered one message per datagram, as the kernel multicasts them.
    assert reader.feed(_object(8, 2, "nat")) == []  # DELRULE ip nat
    assert reader.feed(_object(5, 10, "filter")) == []  # DELCHAIN ip6 filter
    assert reader.feed(_gen(4242, "nft", 4243)) == [
        Transaction(4243, 4242, "nft", frozenset({(2, "nat"), (10, "filter")}))]
    # The next transaction starts empty.
    assert reader.feed(_object(6, 1, "mangle") + _gen(None, "", 9)) == [
        Transaction(9, None, "", frozenset({(1, "mangle")}))]


def test_other_subsystems_and_truncated_messages_are_ignored() -> None:
    reader = TransactionReader()
    conntrack = frame(NFNL_SUBSYS_CTNETLINK << 8 | IPCTNL_MSG_CT_NEW, 0, 0, nfgen(NFPROTO_IPV4))
    assert reader.feed(conntrack + _object(8, 2, "nat")[:10]) == []
    assert reader.feed(_gen(1, "x", 1)) == [Transaction(1, 1, "x", frozenset())]


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=512))
# An nf_tables object message whose header claims more bytes than the datagram holds
# (found by this test: the first-attribute shortcut read past the end).
@example(b"\x00\x00\x00\x01\x00\n" + bytes(10))
def test_garbage_never_raises(data: bytes) -> None:
    TransactionReader().feed(data)


def test_description_names_the_process_and_tables() -> None:
    tx = Transaction(5, 1234, "firewalld", frozenset({(2, "nat"), (1, "filter")}))
    assert tx.describe() == "firewalld (pid 1234) changed inet filter, ip nat"


# --- the legacy canary's bookkeeping -------------------------------------------------------


class _Tables:
    def __init__(self) -> None:
        self.summary: dict[str, tuple[int, int]] = {"nat": (10, 1000), "filter": (5, 500)}

    def read(self, table: str) -> tuple[int, int]:
        return self.summary[table]

    def close(self) -> None:
        pass


def _canary(notes: list[str]) -> tuple[LegacyCanary, _Tables, threading.Lock]:
    busy = threading.Lock()
    tables = _Tables()
    canary = LegacyCanary([(Family.V4, "nat"), (Family.V4, "filter")], notes.append, busy,
                          info=lambda family: tables)
    return canary, tables, busy


def test_canary_reports_a_moved_table_once_and_never_while_we_write() -> None:
    notes: list[str] = []
    canary, tables, busy = _canary(notes)
    canary.rebaseline()
    canary.check()
    assert notes == []
    tables.summary["nat"] = (2, 200)  # a flush
    with busy:  # we are writing: whatever moved is ours
        canary.check()
    assert notes == []
    canary.check()
    assert notes == ["legacy IPv4 nat table changed: 10 entries before, 2 now"]
    canary.check()
    assert len(notes) == 1  # reported once; the check that follows re-baselines anyway
