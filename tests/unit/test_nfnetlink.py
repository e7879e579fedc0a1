"""The nf_tables probe's batch, checked against an independent codec: pyroute2's
nf_tables message classes decode what we encode (the kernel's answers are checked in
tests/e2e/test_iptables_kernel.py and, for a kernel without nat chains, in the kernel lab);
and the walks over netlink messages and attributes every decoder of ours uses."""

from __future__ import annotations

import socket

import pytest
from pyroute2.netlink.nfnetlink import nfgen_msg
from pyroute2.netlink.nfnetlink.nftsocket import nft_chain_msg, nft_table_msg

from proxy.dataplane.common.netlink import (
    HEADER,
    attributes,
    find_attr,
    frame,
    messages,
    nested,
    nfgen,
    nla,
    nla_string,
    parse_attrs,
    replies,
)
from proxy.dataplane.common.netlink_constants import (
    NFNL_MSG_BATCH_BEGIN,
    NFNL_MSG_BATCH_END,
    NFNL_SUBSYS_NFTABLES,
    NFT_MSG_DELTABLE,
    NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWTABLE,
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_REQUEST,
)
from proxy.dataplane.common.nfnetlink import SCRATCH_TABLE, probe_batch
from proxy.model.types import Family


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, seq, whole message) of each netlink message in `data`."""
    out = [(kind, flags, seq, data[body - HEADER.size:end])
           for kind, flags, seq, _pid, body, end in messages(data)]
    assert sum(len(f[3]) for f in out) == len(data)  # nothing left over, nothing cut
    return out


@pytest.mark.parametrize(("family", "nfproto"), [(Family.V4, 2), (Family.V6, 10)])
def test_pyroute2_reads_our_probe_batch(family: Family, nfproto: int) -> None:
    data, seqs = probe_batch(family, "nat", first_seq=40)
    (begin, table, chain, delete, end) = frames(data)
    assert seqs == [40, 41, 42, 43]
    nft = NFNL_SUBSYS_NFTABLES << 8
    assert [(f[0], f[1], f[2]) for f in (begin, table, chain, delete, end)] == [
        (NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 40),
        (nft | NFT_MSG_NEWTABLE, NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK, 41),
        (nft | NFT_MSG_NEWCHAIN, NLM_F_REQUEST | NLM_F_CREATE | NLM_F_ACK, 42),
        (nft | NFT_MSG_DELTABLE, NLM_F_REQUEST | NLM_F_ACK, 43),
        (NFNL_MSG_BATCH_END, NLM_F_REQUEST, 44),
    ]
    for framed in (begin, end):  # the batch names the subsystem it is for
        msg = nfgen_msg(framed[3])
        msg.decode()
        assert (msg["nfgen_family"], msg["res_id"]) == (socket.AF_UNSPEC,
                                                        NFNL_SUBSYS_NFTABLES)
    for framed in (table, delete):
        msg = nft_table_msg(framed[3])
        msg.decode()
        assert msg["nfgen_family"] == nfproto
        assert msg.get_attr("NFTA_TABLE_NAME") == SCRATCH_TABLE
    msg = nft_chain_msg(chain[3])
    msg.decode()
    assert msg["nfgen_family"] == nfproto
    assert msg.get_attr("NFTA_CHAIN_TABLE") == SCRATCH_TABLE
    assert msg.get_attr("NFTA_CHAIN_TYPE") == "nat"
    hook = msg.get_attr("NFTA_CHAIN_HOOK")
    assert hook.get_attr("NFTA_HOOK_HOOKNUM") == 4  # postrouting
    assert hook.get_attr("NFTA_HOOK_PRIORITY") == 100  # source NAT


def test_chain_type_is_what_we_ask() -> None:
    data, _ = probe_batch(Family.V4, "route")
    msg = nft_chain_msg(frames(data)[2][3])
    msg.decode()
    assert msg.get_attr("NFTA_CHAIN_TYPE") == "route"


def test_the_attribute_walk_reads_types_without_flags_and_stops_at_a_malformed_one() -> None:
    data = (nfgen(2) + nla_string(1, "nat") + nested(4, nla(1, b"\0\0\0\4"))
            + nla(3, b"\x01") + b"\x02\x00\x07\x00" + nla(5, b"never read"))
    assert [kind for kind, _a, _b in attributes(data, 4)] == [1, 4, 3]  # 2 < its header
    assert parse_attrs(data[4:])[4] == nla(1, b"\0\0\0\4")  # NLA_F_NESTED dropped
    assert find_attr(data, 4, 3) == b"\x01"  # its payload, not its padding
    assert find_attr(data, 4, 5) is None


def test_the_message_walk_splits_a_datagram_and_ignores_a_cut_tail() -> None:
    one, two = frame(0x0A00, 0, 7, nfgen(2) + b"\x01"), frame(3, 0, 8, b"")  # one: padded
    data = one + b"\0" * (-len(one) % 4) + two + two[:10]
    assert [(r.kind, r.seq, r.payload) for r in replies(data)] == [
        (0x0A00, 7, nfgen(2) + b"\x01"), (3, 8, b"")]
    assert [m[4] for m in messages(data)] == [HEADER.size, 24 + HEADER.size]
