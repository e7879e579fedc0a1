"""The one question we ask nf_tables here: can this kernel's nf_tables do NAT? Asked in
one transaction that changes nothing.

iptables' nf_tables back end (Debian's default `iptables`) writes the nat table as
nf_tables chains of type "nat" (module nft_chain_nat). A kernel may have nf_tables without
that chain type (Debian's user-mode Linux does): listing the nat table still works, so the
tools look usable, and then every restore that creates a nat chain fails. The probe sends
one nf_tables batch: create a scratch table, a nat chain in it, delete the table. The
kernel runs a batch as one transaction and, being told to, loads the chain type's module
first; either way nothing of the batch stays, and nobody else sees the scratch table.

The wire format is include/uapi/linux/netfilter/nf_tables.h over nfnetlink; a batch is
framed by NFNL_MSG_BATCH_BEGIN / NFNL_MSG_BATCH_END messages.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import struct
from contextlib import closing

from proxy.dataplane.common.netlink import NetlinkSocket, frame, nested, nfgen, nla, nla_string
from proxy.dataplane.common.netlink_constants import (
    NETLINK_NETFILTER,
    NF_INET_POST_ROUTING,
    NF_IP_PRI_NAT_SRC,
    NFNL_MSG_BATCH_BEGIN,
    NFNL_MSG_BATCH_END,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO,
    NFT_MSG_DELTABLE,
    NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWTABLE,
    NFTA_CHAIN_HOOK,
    NFTA_CHAIN_NAME,
    NFTA_CHAIN_TABLE,
    NFTA_CHAIN_TYPE,
    NFTA_HOOK_HOOKNUM,
    NFTA_HOOK_PRIORITY,
    NFTA_TABLE_NAME,
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_REQUEST,
)
from proxy.model.types import Family

log = logging.getLogger(__name__)

SCRATCH_TABLE = "sliceproxy-nat-probe"


def _message(msg: int, flags: int, seq: int, family: int, attrs: bytes) -> bytes:
    kind = NFNL_SUBSYS_NFTABLES << 8 | msg
    return frame(kind, NLM_F_REQUEST | flags, seq, nfgen(family) + attrs)


def probe_batch(family: Family, chain_type: str = "nat",
                first_seq: int = 1) -> tuple[bytes, list[int]]:
    """The probe's batch (pure) and the sequence numbers of its opening message and of its
    three acknowledged requests: new table, new base chain of `chain_type` in it (at
    postrouting, source-NAT priority), delete the table."""
    nfproto = NFPROTO[family]
    begin = frame(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, first_seq,
                  nfgen(socket.AF_UNSPEC, NFNL_SUBSYS_NFTABLES))
    seqs = [first_seq + 1, first_seq + 2, first_seq + 3]
    table = nla_string(NFTA_TABLE_NAME, SCRATCH_TABLE)
    hook = nested(NFTA_CHAIN_HOOK,
                  nla(NFTA_HOOK_HOOKNUM, struct.pack("!I", NF_INET_POST_ROUTING))
                  + nla(NFTA_HOOK_PRIORITY, struct.pack("!i", NF_IP_PRI_NAT_SRC)))
    chain = (nla_string(NFTA_CHAIN_TABLE, SCRATCH_TABLE) + nla_string(NFTA_CHAIN_NAME, "probe")
             + hook + nla_string(NFTA_CHAIN_TYPE, chain_type))
    body = [
        _message(NFT_MSG_NEWTABLE, NLM_F_CREATE | NLM_F_ACK, seqs[0], nfproto, table),
        _message(NFT_MSG_NEWCHAIN, NLM_F_CREATE | NLM_F_ACK, seqs[1], nfproto, chain),
        _message(NFT_MSG_DELTABLE, NLM_F_ACK, seqs[2], nfproto, table),
    ]
    end = frame(NFNL_MSG_BATCH_END, NLM_F_REQUEST, first_seq + 4,
                nfgen(socket.AF_UNSPEC, NFNL_SUBSYS_NFTABLES))
    return begin + b"".join(body) + end, [first_seq, *seqs]


# What a kernel without the feature answers; anything else (EPERM above all) means this
# process cannot tell.
_MISSING = (errno.ENOENT, errno.EOPNOTSUPP, errno.EAFNOSUPPORT, errno.EPROTONOSUPPORT)


def chain_type_unsupported(family: Family, chain_type: str) -> str | None:
    """Why nf_tables cannot make a base chain of `chain_type` for `family` in this network
    namespace, or None when it can, or when this process cannot tell (no permission, no
    netlink): the caller's own tools will say so then."""
    data, seqs = probe_batch(family, chain_type)
    what = {seqs[0]: "the batch", seqs[1]: "a scratch table", seqs[2]: "creating the chain",
            seqs[3]: "deleting the scratch table"}
    try:
        with closing(NetlinkSocket(NETLINK_NETFILTER)) as sock:
            refused = sock.first_refusal((data,), acked=seqs[1:], watched=seqs[:1])
    except OSError as exc:  # no netlink for netfilter at all, or no answer (NetlinkError)
        log.debug("nf_tables probe inconclusive", extra={"error": str(exc)})
        return None
    if refused is None:
        return None
    seq, code = refused
    if code not in _MISSING:
        log.debug("nf_tables probe inconclusive",
                  extra={"error": f"{what[seq]}: {os.strerror(code)}"})
        return None
    return (f"nf_tables refused a {chain_type} chain for {family.label} "
            f"({what[seq]}: {os.strerror(code)})")


def nat_unsupported(family: Family) -> str | None:
    """Why nf_tables cannot do NAT for `family` here (see chain_type_unsupported)."""
    return chain_type_unsupported(family, "nat")
