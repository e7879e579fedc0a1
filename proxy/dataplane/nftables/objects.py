"""nftables objects (pure): what our scripts declare, as typed values that spell their
own `nft` text and that wire.py encodes to netlink from the same fields, so nothing the
renderer makes is parsed back from text (knftables' Table, Chain, Set, Map, Rule and
Element, in this mode's few shapes).

A rule stays text, as knftables' `Rule.Rule` is: a chain holds its rules' texts
(`Chain.rules`), which expressions.py compiles. An element's key is its parts (`Key`:
`("198.18.0.1", "tcp", 80)`, spelled `198.18.0.1 . tcp . 80`), and its value a
`Verdict` (a verdict map's) or parts too (a slot map's address and port): the encoder
reads each part as what it is, an address's text, a protocol's name or a number, and
the text joins them. A full sync holds about 85,000 elements at 10,000 services x 10
endpoints, kept by (table, set, key) in transaction.Owners, and the encoder reads the
addresses of a whole statement's keys in one pass.

Objects are NamedTuples: cheap to make (a port renders a few chains and sets each
time it changes) and compared by value (a set whose declaration changed is declared
again). The table and its family are not fields: a `Command` names the table, and a
script is spelled in one family ("ip" or "ip6").
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

from proxy.model.types import Family


class Priority(NamedTuple):
    """A base chain's priority as nft spells it: a named one (`dstnat`, `srcnat`,
    `filter`) plus `offset`, or with `name` "" the number `offset` itself."""

    name: str
    offset: int = 0

    def text(self) -> str:
        if not self.name:
            return str(self.offset)
        if not self.offset:
            return self.name
        return f"{self.name} {'+' if self.offset > 0 else '-'} {abs(self.offset)}"


class Hook(NamedTuple):
    """What makes a chain a base chain: its type, netfilter hook, priority, policy."""

    type: str  # "nat" | "filter"
    hook: str  # "prerouting", "input", "forward", "output", "postrouting"
    priority: Priority
    policy: str = "accept"

    def text(self) -> str:
        return (f"type {self.type} hook {self.hook} priority {self.priority.text()}; "
                f"policy {self.policy};")


class Chain(NamedTuple):
    """A chain and its rules (each one rule's text, after `add rule <t> <chain>`); a
    base chain with its `hook`."""

    name: str
    rules: tuple[str, ...] = ()
    hook: Hook | None = None

    @property
    def kind(self) -> str:
        return "chain"

    def declaration(self) -> str:
        return self.hook.text() if self.hook is not None else ""


class Set(NamedTuple):
    """A named set: its key's types (several: a concatenation), and for a set the
    packet path fills (`update @set`), its flags and the elements' timeout."""

    name: str
    key: tuple[str, ...]  # nft's type names: ipv4_addr, ipv6_addr, inet_proto, inet_service
    flags: tuple[str, ...] = ()  # "dynamic", "timeout"
    timeout: int | None = None  # seconds

    @property
    def kind(self) -> str:
        return "set"

    def declaration(self) -> str:
        out = f"type {' . '.join(self.key)};"
        if self.flags:
            out += f" flags {','.join(self.flags)};"
        if self.timeout is not None:
            out += f" timeout {self.timeout}s;"
        return out


class Map(NamedTuple):
    """A named map from a key (types as Set's) to a value of type `value` ("verdict":
    a verdict map; "counter": a counter map, whose values name counters)."""

    name: str
    key: tuple[str, ...]
    value: str

    @property
    def kind(self) -> str:
        return "map"

    def declaration(self) -> str:
        return f"type {' . '.join(self.key)} : {self.value};"


class SlotMap(NamedTuple):
    """A slot map (render.py): numgen's or jhash's pick 0..n-1 -> an endpoint's address .
    port, declared by the expressions that use it (`typeof numgen random mod 1 : ip
    daddr . tcp dport`), as nft accepts the rule beside it only then; or, `verdicts`,
    -> `goto` the endpoint's own chain (`typeof numgen random mod 1 : verdict`)."""

    name: str
    family: Family
    protocol: str  # "tcp", "udp", "sctp"
    verdicts: bool = False

    @property
    def kind(self) -> str:
        return "map"

    def declaration(self) -> str:
        if self.verdicts:
            return "typeof numgen random mod 1 : verdict;"
        ip = "ip" if self.family is Family.V4 else "ip6"
        return f"typeof numgen random mod 1 : {ip} daddr . {self.protocol} dport;"


class PickMap(NamedTuple):
    """A pick map (render.py): a cluster IP . port . numgen's pick 0..n-1 -> an endpoint's
    address . port, for every port of one protocol and n endpoints in a shard that has no
    chain of its own. Declared by the expressions that use it (`th dport` would serve
    every protocol, but nft 1.0.6 then refuses any later script over the map)."""

    name: str
    family: Family
    protocol: str  # "tcp", "udp", "sctp"

    @property
    def kind(self) -> str:
        return "map"

    @property
    def key(self) -> tuple[str, ...]:
        """Its key's types (the slot last: nft's integer), as a Set's."""
        addr = "ipv4_addr" if self.family is Family.V4 else "ipv6_addr"
        return (addr, "inet_service", "integer")

    def declaration(self) -> str:
        ip = "ip" if self.family is Family.V4 else "ip6"
        return (f"typeof {ip} daddr . {self.protocol} dport . numgen random mod 1 : "
                f"{ip} daddr . {self.protocol} dport;")


AnySet = Set | Map | SlotMap | PickMap


class Counter(NamedTuple):
    """A named counter (`counter name "<name>"` in a rule counts into it): the kernel
    keeps it apart from the rules, so a rewritten chain, a full sync or a restart keeps
    its count (common/traffic.py). `add` of one that exists leaves it as it is."""

    name: str

    @property
    def kind(self) -> str:
        return "counter"

    def declaration(self) -> str:
        return ""


class Table(NamedTuple):
    """One of our tables (its family is the script's)."""

    name: str

    @property
    def kind(self) -> str:
        return "table"

    def declaration(self) -> str:
        return ""


def named(kind: str, name: str) -> Set | Map:
    """A set or map known by name and kind alone (read back from the kernel), to
    delete or flush: its declaration is never spelled."""
    return Map(name, (), "") if kind == "map" else Set(name, ())


# One part of an element's key or value: an address (as naming.address_text spells it)
# or a protocol's name; a port, or a slot map's slot (numgen's pick).
Part = str | int
Key = tuple[Part, ...]


class Verdict(NamedTuple):
    """A verdict map's value: `goto <chain>`, `jump <chain>`, `drop`, `accept`."""

    verb: str
    chain: str = ""

    def text(self) -> str:
        return f"{self.verb} {self.chain}" if self.chain else self.verb


class CounterRef(NamedTuple):
    """A counter map's value (`type ... : counter`): the named counter a packet whose key
    matches counts into."""

    name: str

    def text(self) -> str:
        return f'"{self.name}"'


# An element's value: a verdict (verdict maps), a named counter (counter maps), the parts
# of an address . port (slot and pick maps), or () (a set's element, which has none).
Value = Verdict | CounterRef | Key


def parts_text(parts: Key) -> str:
    """`("198.18.0.1", "tcp", 80)` -> `198.18.0.1 . tcp . 80`."""
    return " . ".join(map(str, parts))


def value_text(value: Value) -> str:
    return value.text() if isinstance(value, Verdict | CounterRef) else parts_text(value)


class Element(NamedTuple):
    """One element of set or map `set` of `table`: its `key` and, in a map, its `value`
    (module docstring). A tuple: a 50,000-endpoint port renders 100,000 of them per
    change, and a frozen dataclass took 1.6 us each to make."""

    table: str
    set: str
    key: Key
    value: Value = ()

    def text(self) -> str:
        key = parts_text(self.key)
        return f"{key} : {value_text(self.value)}" if self.value else key


Object = Table | Chain | Set | Map | SlotMap | PickMap | Counter


class Command(NamedTuple):
    """`<verb> <kind> <ip> [<table>] <name> [{ <declaration> }]`: add, flush or delete
    one object of `table` (a Table: itself). A chain added is declared only (its
    rules: wire.Rules); the declaration is spelled for `add` alone."""

    verb: str  # "add" | "flush" | "delete"
    table: str
    object: Object

    @property
    def size(self) -> int:
        return 1

    def lines(self, ip: str) -> Iterator[str]:
        obj = self.object
        if type(obj) is Table:
            yield f"{self.verb} table {ip} {obj.name}"
            return
        line = f"{self.verb} {obj.kind} {ip} {self.table} {obj.name}"
        body = obj.declaration() if self.verb == "add" else ""
        yield f"{line} {{ {body} }}" if body else line
