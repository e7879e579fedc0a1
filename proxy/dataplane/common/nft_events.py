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

from proxy.dataplane.common.netlink import ATTR, NFGEN, messages, parse_attrs
from proxy.dataplane.common.netlink_constants import (
    NFNL_SUBSYS_NFTABLES,
    NFPROTO_NAMES,
    NFT_MSG_NEWGEN,
    NFTA_ANY_TABLE,
    NFTA_GEN_PROC_NAME,
    NFTA_GEN_PROC_PID,
    NLA_TYPE_MASK,
)


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
        self._tables: set[tuple[int, bytes]] = set()  # (family, raw table attribute)

    def reset(self) -> None:
        """Forget a half-read transaction (after the socket lost messages)."""
        self._tables.clear()

    def feed(self, data: bytes) -> list[Transaction]:
        """Read straight from the datagram: our own full sync announces 100,000 objects
        or more, and this thread shares the interpreter with the sync; an object
        message's table is its first attribute (the kernel writes it first), so only
        that is read, raw, and only a NEWGEN is parsed whole."""
        done: list[Transaction] = []
        end = len(data)
        for kind, _flags, _seq, port_id, body, claimed in messages(data):
            stop = min(claimed, end)  # a truncated datagram claims more than it has
            if kind >> 8 == NFNL_SUBSYS_NFTABLES and claimed - body >= NFGEN.size:
                first = body + NFGEN.size
                if kind & 0xFF == NFT_MSG_NEWGEN:
                    attrs = parse_attrs(data[first:stop])
                    pid = attrs.get(NFTA_GEN_PROC_PID, b"")
                    done.append(Transaction(
                        port_id, struct.unpack("!I", pid[:4])[0] if len(pid) >= 4 else None,
                        _text(attrs.get(NFTA_GEN_PROC_NAME, b"")),
                        frozenset((f, _text(t)) for f, t in self._tables)))
                    self._tables.clear()
                elif first + 4 <= stop:
                    length, attr = ATTR.unpack_from(data, first)
                    if attr & NLA_TYPE_MASK == NFTA_ANY_TABLE and length >= 4:
                        self._tables.add((data[body], data[first + 4:first + length]))
                    else:  # not first after all: look through them
                        table = parse_attrs(data[first:stop]).get(NFTA_ANY_TABLE)
                        if table is not None:
                            self._tables.add((data[body], table))
        return done
