"""What rules read back from nf_tables refer to (pure): the named counters they count
into, and the addresses they DNAT to. A restart reads the rules of the chains it is
about to rewrite or delete (one dump per chain, which the kernel filters to it) to know
what those chains held: their counters, to delete those nobody counts into any more,
and their endpoints' addresses, whose @hairpin pairs it then asks for one by one (the
dump of @hairpin walks the set from its start for every message it fills: 70 s at
100,000 services x 10, restart_steps.gone_hairpins).

A DNAT's address is known where the rule loads it as an immediate (`dnat to <addr>:<port>`,
render.py's endpoint rules); where a map lookup gives it (a slot map's, a hash map's),
the endpoints are in that map, not the rule, and `RuleRefs.addresses` is None.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field

from proxy.dataplane.common.naming import packed_v6_text
from proxy.dataplane.common.netlink import NFGEN, attributes
from proxy.dataplane.common.netlink_constants import (
    NFT_NAT_DNAT,
    NFTA_EXPR_DATA,
    NFTA_EXPR_NAME,
    NFTA_IMMEDIATE_DATA,
    NFTA_IMMEDIATE_DREG,
    NFTA_LOOKUP_DREG,
    NFTA_NAT_REG_ADDR_MIN,
    NFTA_NAT_TYPE,
    NFTA_OBJREF_IMM_NAME,
    NFTA_RULE_EXPRESSIONS,
)
from proxy.dataplane.nftables.expressions import ADDRESS_WIDTH
from proxy.dataplane.nftables.readback import data_value
from proxy.model.types import Family

_U32 = struct.Struct("!I")


@dataclass
class RuleRefs:
    """What the rules of some chains refer to: (table, name) of the counters they count
    into, and the text of the addresses they DNAT to (as render.py writes an address:
    an @hairpin pair's parts); `addresses` None once a rule DNATs to a map's value."""

    counters: set[tuple[str, str]] = field(default_factory=set)
    addresses: set[str] | None = field(default_factory=set)

    def add(self, table: str, counters: Iterable[str],
            addresses: Iterable[str] | None) -> None:
        """What rules of `table` refer to: counters by name, and addresses."""
        self.counters.update((table, name) for name in counters)
        self._add_addresses(addresses)

    def update(self, other: RuleRefs) -> None:
        self.counters |= other.counters
        self._add_addresses(other.addresses)

    def _add_addresses(self, addresses: Iterable[str] | None) -> None:
        """None (a DNAT to a map's value) leaves every address unknown from then on."""
        if addresses is None or self.addresses is None:
            self.addresses = None
        else:
            self.addresses.update(addresses)

    def add_rule(self, family: Family, table: str, payload: bytes, start: int,
                 end: int) -> None:
        """One dumped rule's message body, payload[start:end]."""
        self.add(table, *rule_refs(family, payload, start, end))


def rule_refs(family: Family, payload: bytes, start: int, end: int
              ) -> tuple[list[str], list[str] | None]:
    """The names of the objects one dumped rule refers to (`objref`: our named counters),
    and the addresses its DNAT statements load as immediates (None: one loads its
    address otherwise, from a map lookup)."""
    names: list[str] = []
    addresses: list[str] | None = []
    registers: dict[int, bytes | None] = {}  # loaded with (None: a map's value)
    for attr, a, b in attributes(payload, start + NFGEN.size, end):
        if attr != NFTA_RULE_EXPRESSIONS:
            continue
        for _elem, x, y in attributes(payload, a, b):
            kind, data = b"", (0, 0)
            for inner, i, j in attributes(payload, x, y):
                if inner == NFTA_EXPR_NAME:
                    kind = payload[i:j].rstrip(b"\0")
                elif inner == NFTA_EXPR_DATA:
                    data = (i, j)
            fields = {inner: (i, j) for inner, i, j in attributes(payload, *data)}
            if kind == b"objref" and NFTA_OBJREF_IMM_NAME in fields:
                i, j = fields[NFTA_OBJREF_IMM_NAME]
                names.append(payload[i:j].rstrip(b"\0").decode(errors="replace"))
            elif kind == b"immediate" and NFTA_IMMEDIATE_DREG in fields:
                registers[_u32(payload, fields[NFTA_IMMEDIATE_DREG])] = \
                    data_value(payload, *fields.get(NFTA_IMMEDIATE_DATA, (0, 0)))
            elif kind == b"lookup" and NFTA_LOOKUP_DREG in fields:
                registers[_u32(payload, fields[NFTA_LOOKUP_DREG])] = None
            elif kind == b"nat" and addresses is not None and NFTA_NAT_TYPE in fields \
                    and _u32(payload, fields[NFTA_NAT_TYPE]) == NFT_NAT_DNAT \
                    and NFTA_NAT_REG_ADDR_MIN in fields:
                loaded = registers.get(_u32(payload, fields[NFTA_NAT_REG_ADDR_MIN]))
                if loaded is None or len(loaded) != ADDRESS_WIDTH[family]:
                    addresses = None
                elif family is Family.V4:
                    addresses.append(socket.inet_ntop(socket.AF_INET, loaded))
                else:
                    addresses.append(packed_v6_text(loaded))
    return names, addresses


def _u32(payload: bytes, span: tuple[int, int]) -> int:
    return int(_U32.unpack_from(payload, span[0])[0])

