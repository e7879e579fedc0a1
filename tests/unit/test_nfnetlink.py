"""The nf_tables probe's batch, checked against an independent codec: pyroute2's
nf_tables message classes decode what we encode (the kernel's answers are checked in
tests/e2e/test_iptables_kernel.py and, for a kernel without nat chains, in the kernel lab)."""

from __future__ import annotations

import socket

import pytest
from pyroute2.netlink.nfnetlink import nfgen_msg
from pyroute2.netlink.nfnetlink.nftsocket import nft_chain_msg, nft_table_msg

from proxy.dataplane.common.netlink import HEADER, NLM_F_ACK, NLM_F_CREATE, NLM_F_REQUEST
from proxy.dataplane.common.nfnetlink import (
    NFNL_MSG_BATCH_BEGIN,
    NFNL_MSG_BATCH_END,
    NFNL_SUBSYS_NFTABLES,
    NFT_MSG_DELTABLE,
    NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWTABLE,
    SCRATCH_TABLE,
    probe_batch,
)
from proxy.model.types import Family


def frames(data: bytes) -> list[tuple[int, int, int, bytes]]:
    """(type, flags, seq, whole message) of each netlink message in `data`."""
    out, i = [], 0
    while i < len(data):
        size, kind, flags, seq, _pid = HEADER.unpack_from(data, i)
        out.append((kind, flags, seq, data[i:i + size]))
        i += (size + 3) & ~3
    assert i == len(data)
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
    for frame in (begin, end):  # the batch names the subsystem it is for
        msg = nfgen_msg(frame[3])
        msg.decode()
        assert (msg["nfgen_family"], msg["res_id"]) == (socket.AF_UNSPEC,
                                                        NFNL_SUBSYS_NFTABLES)
    for frame in (table, delete):
        msg = nft_table_msg(frame[3])
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
