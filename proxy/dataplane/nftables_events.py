"""nf_tables change notifications, decoded into transactions (pure: no kernel access).

Every committed nf_tables transaction is announced to the NFNLGRP_NFTABLES multicast
group: one message per object it touched (table, chain, rule, set, element...), then one
NEWGEN message that closes it and says who committed it. This is how iptables' nf_tables
back end, `nft` and anything else that edits the ruleset show up, our own restores
included; `TransactionReader` turns the stream into one `Transaction` per commit, with
the tables it touched, so the listener can ask "did someone else touch our tables?"
without reading any ruleset back.

Who committed: the NEWGEN header's port id (a socket's first port id is its process id
as that process sees it, so it matches the pids our own children have, even inside a
container's pid namespace) and NFTA_GEN_PROC_PID (the process id as the kernel's initial
pid namespace sees it). Either may name one of ours.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from proxy.dataplane.netlink import replies

NFNLGRP_NFTABLES = 7
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_NEWGEN = 15
NFTA_GEN_PROC_PID, NFTA_GEN_PROC_NAME = 2, 3
# Attribute 1 names the table in every object message (NFTA_TABLE_NAME for tables,
# NFTA_{CHAIN,RULE,SET,SET_ELEM_LIST,OBJ,FLOWTABLE}_TABLE for the rest).
TABLE_ATTRIBUTE = 1
NFPROTO_NAMES = {1: "inet", 2: "ip", 3: "arp", 5: "netdev", 7: "bridge", 10: "ip6"}

_NFGEN = 4  # nfgenmsg: family, version, resource id


@dataclass(frozen=True, slots=True)
class Transaction:
    """One committed nf_tables transaction."""

    port_id: int  # the committing socket's netlink port id
    pid: int | None  # the committing process (initial pid namespace), when the kernel says
    process: str  # its command name, when the kernel says
    tables: frozenset[tuple[int, str]]  # (NFPROTO family, table name) it touched

    def describe(self) -> str:
        who = self.process or "unknown process"
        tables = ", ".join(sorted(f"{NFPROTO_NAMES.get(f, f)} {t}" for f, t in self.tables))
        return f"{who} (pid {self.pid if self.pid is not None else self.port_id}) " \
               f"changed {tables or 'no table'}"


def _text(value: bytes) -> str:
    return value.split(b"\0", 1)[0].decode("utf-8", "replace")


class TransactionReader:
    """Feed it what the multicast socket receives; it returns the transactions each
    datagram closed. Messages before a NEWGEN are held until it comes."""

    def __init__(self) -> None:
        self._tables: set[tuple[int, str]] = set()

    def reset(self) -> None:
        """Forget a half-read transaction (after the socket lost messages)."""
        self._tables.clear()

    def feed(self, data: bytes) -> list[Transaction]:
        done: list[Transaction] = []
        for msg in replies(data):
            if msg.kind >> 8 != NFNL_SUBSYS_NFTABLES or len(msg.payload) < _NFGEN:
                continue
            attrs = msg.attrs(_NFGEN)
            if msg.kind & 0xFF == NFT_MSG_NEWGEN:
                pid = attrs.get(NFTA_GEN_PROC_PID, b"")
                done.append(Transaction(
                    msg.port_id, struct.unpack("!I", pid[:4])[0] if len(pid) >= 4 else None,
                    _text(attrs.get(NFTA_GEN_PROC_NAME, b"")), frozenset(self._tables)))
                self._tables.clear()
            elif TABLE_ATTRIBUTE in attrs:
                self._tables.add((msg.payload[0], _text(attrs[TABLE_ATTRIBUTE])))
        return done
