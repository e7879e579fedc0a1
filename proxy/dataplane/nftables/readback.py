"""Elements read back from nf_tables (pure): the body of a dump of one set's elements,
and the dumped messages decoded into the renderer's own keys and values (objects.Key,
objects.Verdict), the inverse of wire.py's `_element` for the bases' sets: a restart
compares what the kernel holds with what it would write (restart.py).

A key is decoded by the declared types of its set (each part in its 32-bit register
slots, as wire._element_key lays them out); a key whose length does not fit them is
`Unreadable` (a set another version declared otherwise: the caller rewrites all).
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from proxy.dataplane.common.naming import packed_v6_text
from proxy.dataplane.common.netlink import ATTR as _ATTR
from proxy.dataplane.common.netlink import NFGEN, attributes, nfgen, nla, nla_string
from proxy.dataplane.common.netlink_constants import (
    NFPROTO,
    NFTA_DATA_VALUE,
    NFTA_DATA_VERDICT,
    NFTA_LIST_ELEM,
    NFTA_SET_ELEM_DATA,
    NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_TABLE,
    NFTA_SET_ELEM_OBJREF,
    NFTA_VERDICT_CHAIN,
    NFTA_VERDICT_CODE,
    NLA_F_NESTED,
    NLA_TYPE_MASK,
)
from proxy.dataplane.nftables.expressions import PROTOCOLS, VERDICTS, Unencodable
from proxy.dataplane.nftables.objects import CounterRef, Key, Value, Verdict
from proxy.dataplane.nftables.wire import SLOT, part_width, set_element_head
from proxy.model.types import Family

_VERBS = {code: verb for verb, code in VERDICTS.items()}
_PROTOCOL_NAMES = {number: name for name, number in PROTOCOLS.items()}
_CODE = struct.Struct("!i")
_PORT = struct.Struct("!H")


class Unreadable(Exception):
    """A dumped element this version cannot read as its set is declared here."""


@dataclass
class Held:
    """One set or map of ours as the kernel holds it: a map's elements decoded, and a
    set's keys as the kernel lays them out (`raw`, decoded by the caller only where they
    differ from what it wants: `key_parts`). A set dumped otherwise than by stride is
    decoded whole into `decoded`. `partial`: only some keys were asked for, one by one
    (NftRunner.probe): those held are here, and nothing is known of the others."""

    decoded: dict[Key, Value] = field(default_factory=dict)
    raw: set[bytes] = field(default_factory=set)
    partial: bool = False

    def __len__(self) -> int:
        return len(self.decoded) + len(self.raw)


# Which of a map's elements to keep (key, value) as they are read.
Keep = Callable[[Key, Value], bool]


def read_held(messages: Iterable[tuple[bytes, int, int]], family: Family,
              types: Sequence[str], is_map: bool, keep: Keep | None = None) -> Held:
    """A set's or map's dumped messages (data, body start, end) as `Held`; of a map, only
    the elements `keep` says, if given (the others are decoded, then let go)."""
    held = Held()
    length = key_length(types)
    # A pick map's key ends in its slot (nft's integer); its value is an address . port.
    values = (types[0], "inet_service") if types and types[-1] == "integer" else ()
    for data, start, end in messages:
        keys = None if is_map else set_keys(data, start, end, length)
        if keys is not None:
            held.raw.update(keys)
            continue
        items = map_items(data, start, end) if values else None
        if items is not None:
            pairs: Iterable[tuple[Key, Value]] = (
                (key_parts(family, types, k), key_parts(family, values, v)) for k, v in items)
        else:
            pairs = ((key_parts(family, types, raw),
                      key_parts(family, values, value) if isinstance(value, bytes) else value)
                     for raw, value in decode_elements(data, start, end))
        held.decoded.update(pairs if keep is None or not is_map else
                            ((k, v) for k, v in pairs if keep(k, v)))
    return held


def key_length(types: Sequence[str]) -> int:
    """The bytes of a key of `types`; Unreadable for a type we never declare."""
    try:
        return sum(map(part_width, types))
    except Unencodable as exc:
        raise Unreadable(str(exc)) from None


def element_dump_request(family: Family, table: str, set_name: str) -> bytes:
    """The body of a dump of the elements of set `set_name` of `table`."""
    return (nfgen(NFPROTO[family]) + nla_string(NFTA_SET_ELEM_LIST_TABLE, table)
            + nla_string(NFTA_SET_ELEM_LIST_SET, set_name))


def element_get_request(family: Family, table: str, set_name: str, key: bytes) -> bytes:
    """The body of a request for the one element of set `set_name` of `table` whose
    key is `key` (its bytes, wire.element_keys): the kernel answers with it, or ENOENT.
    O(1) in the kernel, where a dump walks the set from its start for every message."""
    element = nla(NFTA_LIST_ELEM | NLA_F_NESTED,
                  nla(NFTA_SET_ELEM_KEY | NLA_F_NESTED, nla(NFTA_DATA_VALUE, key)))
    return (element_dump_request(family, table, set_name)
            + nla(NFTA_SET_ELEM_LIST_ELEMENTS | NLA_F_NESTED, element))


def decode_elements(data: bytes, start: int, end: int
                    ) -> Iterator[tuple[bytes, Value | bytes]]:
    """(key's bytes, value) of each element in one dumped message (data[start:end], its
    body): a verdict, a counter's name (a counter map's), a value's bytes (a pick map's),
    or () for a set's element."""
    for attr, a, b in attributes(data, start + NFGEN.size, end):
        if attr != NFTA_SET_ELEM_LIST_ELEMENTS:
            continue
        for elem, x, y in attributes(data, a, b):
            if elem != NFTA_LIST_ELEM:
                continue
            key = b""
            value: Value | bytes = ()
            for part, i, j in attributes(data, x, y):
                if part == NFTA_SET_ELEM_KEY:
                    key = data_value(data, i, j)
                elif part == NFTA_SET_ELEM_DATA:
                    value = _verdict(data, i, j) or data_value(data, i, j)
                elif part == NFTA_SET_ELEM_OBJREF:
                    value = CounterRef(data[i:j].split(b"\0", 1)[0].decode(errors="replace"))
            yield key, value


def data_value(data: bytes, start: int, end: int) -> bytes:
    """The bytes of the NFTA_DATA_VALUE inside an nft_data attribute (data[start:end]);
    b"" where it holds none (a verdict)."""
    return next((data[p:q] for kind, p, q in attributes(data, start, end)
                 if kind == NFTA_DATA_VALUE), b"")


def set_keys(data: bytes, start: int, end: int, length: int) -> list[bytes] | None:
    """The keys of a set's elements (no value) in one dumped message, each `length`
    bytes, read by stride: every element the same 12 bytes of headers then its key, as
    the kernel dumps a set without flags, timeouts or expressions (our bases' sets).
    100,000 hairpin pairs took 0.6 s through `decode_elements` and `key_parts`. None
    when the message is laid out otherwise (then `decode_elements`)."""
    expected = _heads(set_element_head(length))
    for attr, a, b in attributes(data, start + NFGEN.size, end):
        if attr != NFTA_SET_ELEM_LIST_ELEMENTS:
            continue
        size = 12 + length
        if b == a:
            return []
        if (b - a) % size or _heads(data[a:a + 12]) != expected:
            return None
        head = data[a:a + 12]
        stops = range(a, b, size)
        if any(data[i:i + 12] != head for i in stops):
            return None
        return [data[i + 12:i + size] for i in stops]
    return []


def map_items(data: bytes, start: int, end: int) -> list[tuple[bytes, bytes]] | None:
    """The (key, value) bytes of each element in one dumped message of a map whose
    values are data (a pick map's), read by stride: every element laid out as the first
    (the same bytes around its key and its value), as the kernel dumps our maps. None
    when the message is laid out otherwise (then `decode_elements`, 4.7 us an element:
    a million of them in the pick maps at 100,000 x 10)."""
    for attr, a, b in attributes(data, start + NFGEN.size, end):
        if attr != NFTA_SET_ELEM_LIST_ELEMENTS:
            continue
        if b == a:
            return []
        spans = _item_spans(data, a, b)
        if spans is None:
            return None
        size, (k0, k1), (v0, v1) = spans
        if (b - a) % size:
            return None
        around = ((0, k0), (k1, v0), (v1, size))
        first = [data[a + p:a + q] for p, q in around]
        stops = range(a, b, size)
        if any(data[i + p:i + q] != f for i in stops for (p, q), f in zip(around, first,
                                                                            strict=True)):
            return None
        return [(data[i + k0:i + k1], data[i + v0:i + v1]) for i in stops]
    return []


def _item_spans(data: bytes, a: int, b: int
                ) -> tuple[int, tuple[int, int], tuple[int, int]] | None:
    """The first element's size and where in it its key's and its value's bytes are;
    None unless it holds exactly a key and a data value (no verdict, flags, object)."""
    found = next(attributes(data, a, b), None)
    if found is None or found[0] != NFTA_LIST_ELEM:
        return None
    _, x, y = found
    spans: dict[int, tuple[int, int]] = {}
    for part, i, j in attributes(data, x, y):
        inner = list(attributes(data, i, j))
        if part not in (NFTA_SET_ELEM_KEY, NFTA_SET_ELEM_DATA) or len(inner) != 1 \
                or inner[0][0] != NFTA_DATA_VALUE:
            return None
        spans[part] = (inner[0][1] - a, inner[0][2] - a)
    if len(spans) != 2:
        return None
    return (y - a + 3) & ~3, spans[NFTA_SET_ELEM_KEY], spans[NFTA_SET_ELEM_DATA]


def _heads(raw: bytes) -> tuple[int, ...]:
    """Three nested attribute headers' (length, type without flags), as
    wire.set_element_head writes them: the kernel may or may not flag a nest
    (NLA_F_NESTED)."""
    out: list[int] = []
    for at in (0, 4, 8):
        length, kind = _ATTR.unpack_from(raw, at)
        out += [length, kind & NLA_TYPE_MASK]
    return tuple(out)


def _verdict(data: bytes, start: int, end: int) -> Value:
    for kind, a, b in attributes(data, start, end):
        if kind != NFTA_DATA_VERDICT:
            continue
        code, chain = 0, ""
        for attr, x, y in attributes(data, a, b):
            if attr == NFTA_VERDICT_CODE:
                code = _CODE.unpack_from(data, x)[0]
            elif attr == NFTA_VERDICT_CHAIN:
                chain = data[x:y].split(b"\0", 1)[0].decode(errors="replace")
        verb = _VERBS.get(code)
        if verb is None:
            raise Unreadable(f"verdict code {code}")
        return Verdict(verb, chain)
    return ()


def key_parts(family: Family, types: Sequence[str], raw: bytes) -> Key:
    """A key's bytes as the parts of a key of `types` (wire._element_key's inverse)."""
    if len(raw) != key_length(types):
        raise Unreadable(f"a key of {len(raw)} bytes for {' . '.join(types)}")
    parts: list[str | int] = []
    at = 0
    for t in types:
        width = part_width(t)
        if t == "ipv4_addr":
            parts.append(socket.inet_ntoa(raw[at:at + 4]))
        elif t == "ipv6_addr":
            parts.append(packed_v6_text(raw[at:at + 16]))
        elif t == "inet_proto":
            name = _PROTOCOL_NAMES.get(raw[at])
            if name is None:
                raise Unreadable(f"protocol {raw[at]}")
            parts.append(name)
        elif t == "integer":  # a pick's slot: numgen's host-order u32
            parts.append(SLOT.unpack_from(raw, at)[0])
        else:
            parts.append(_PORT.unpack_from(raw, at)[0])
        at += width
    return tuple(parts)
