"""Our nftables script dialect, encoded as one nf_tables netlink batch (pure).

Why: libnftables (and `nft -f`) first fills a cache of the tables a script touches,
reading our big verdict maps and thousands of chains back from the kernel: 39 ms per
change at 10,000 services, against 0.1 ms for the kernel's own work (bench/RESULTS.md);
and a full sync's text (17 MB at 10,000 services x 10 endpoints) took nft 3.7 s to
parse and send. Our scripts use a small, closed set of statements, so this module
encodes them itself, the way nft would, and the kernel gets the same objects.

Input is a script's statements as transaction.py makes them: objects' commands
(`objects.Command`: a table, chain, set or map added, flushed or deleted, encoded from
the object's fields) and statements that stand for many lines (`Chains`, `Rules`,
`Elements`: a full sync's chains, rules and set elements as the renderer made them,
an element's key and value as their typed parts), none of them spelled and parsed
back; each stands for the lines the fallback hands to nft (`statement_lines`). Text
is read too, one statement per line, into the same objects ("text input" below): that
is input (tests, scripts by hand), and the renderer's output never goes through it.
Output is a batch whose message i+1 is line i, so a refusal names its line as nft's
errors do. A statement outside the dialect raises `Unencodable`, and the caller hands
the whole script to nft instead: nothing is ever half-encoded. The dialect, as text
(rules: expressions.py):

    add|delete table <t>
    add chain <t> <name> [{ type nat|filter hook <hook> priority <p>; policy accept; }]
    flush chain|delete chain|delete set|delete map|flush set|flush map <t> <name>
    add set <t> <name> { type <key>; }      (an address, or a concatenation)
    add set <t> <name> { type ipv4_addr|ipv6_addr; flags dynamic,timeout; timeout <n>s; }
    add map <t> <name> { type <key> : verdict; }
    add map <t> <name> { typeof numgen random mod 1 : ip|ip6 daddr . <proto> dport; }
    add map <t> <name> { typeof ip|ip6 daddr . <proto> dport . numgen random mod 1 :
                         ip|ip6 daddr . <proto> dport; }    (a pick map)
    add map <t> <name> { type <key> : counter; }
    add|delete element <t> <set> { <key> [: goto|jump <chain> | drop | accept], ... }
    add|delete element <t> <slot map> { <slot> [: <addr> . <port>], ... }
    add|delete element <t> <pick map> { <addr> . <port> . <slot> [: <addr> . <port>], ... }
    add|delete element <t> <counter map> { <key> [: "<counter>"], ... }
    add rule <t> <chain> <rule> [comment "<text>"]

Equivalence with nft's own encoding is tested against the kernel: each shape added
both ways reads back with the same expressions (tests/e2e/test_nftables_wire_kernel.py), and a
partial sync through this encoder ends where a full sync through nft does.
The wire format is include/uapi/linux/netfilter/nf_tables.h.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import operator
import re
import socket
import struct
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from proxy.dataplane.common.netlink import (
    HEADER,
    MAX_PIECES,
    NFGEN,
    attributes,
    find_attr,
    frame,
    nested,
    nfgen,
    nla,
    parse_attrs,
)
from proxy.dataplane.common.netlink_constants import (
    NF_ACCEPT,
    NF_INET_FORWARD,
    NF_INET_LOCAL_IN,
    NF_INET_LOCAL_OUT,
    NF_INET_POST_ROUTING,
    NF_INET_PRE_ROUTING,
    NF_IP_PRI_FILTER,
    NF_IP_PRI_NAT_DST,
    NF_IP_PRI_NAT_SRC,
    NFNL_MSG_BATCH_BEGIN,
    NFNL_MSG_BATCH_END,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO,
    NFT_DATA_VERDICT,
    NFT_MSG_DELCHAIN,
    NFT_MSG_DELOBJ,
    NFT_MSG_DELRULE,
    NFT_MSG_DELSET,
    NFT_MSG_DELSETELEM,
    NFT_MSG_DELTABLE,
    NFT_MSG_GETCHAIN,
    NFT_MSG_GETTABLE,
    NFT_MSG_NEWCHAIN,
    NFT_MSG_NEWOBJ,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSET,
    NFT_MSG_NEWSETELEM,
    NFT_MSG_NEWTABLE,
    NFT_OBJECT_COUNTER,
    NFT_SET_ANONYMOUS,
    NFT_SET_EVAL,
    NFT_SET_MAP,
    NFT_SET_OBJECT,
    NFT_SET_TIMEOUT,
    NFTA_ANY_TABLE,
    NFTA_CHAIN_HOOK,
    NFTA_CHAIN_NAME,
    NFTA_CHAIN_POLICY,
    NFTA_CHAIN_TABLE,
    NFTA_CHAIN_TYPE,
    NFTA_COUNTER_PACKETS,
    NFTA_HOOK_HOOKNUM,
    NFTA_HOOK_PRIORITY,
    NFTA_LIST_ELEM,
    NFTA_OBJ_DATA,
    NFTA_OBJ_NAME,
    NFTA_OBJ_TABLE,
    NFTA_OBJ_TYPE,
    NFTA_RULE_CHAIN,
    NFTA_RULE_TABLE,
    NFTA_SET_DATA_LEN,
    NFTA_SET_DATA_TYPE,
    NFTA_SET_ELEM_DATA,
    NFTA_SET_ELEM_KEY,
    NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_OBJREF,
    NFTA_SET_FLAGS,
    NFTA_SET_ID,
    NFTA_SET_KEY_LEN,
    NFTA_SET_KEY_TYPE,
    NFTA_SET_NAME,
    NFTA_SET_OBJ_TYPE,
    NFTA_SET_TABLE,
    NFTA_SET_TIMEOUT,
    NFTA_SET_USERDATA,
    NFTA_TABLE_NAME,
    NLM_F_ACK,
    NLM_F_APPEND,
    NLM_F_CREATE,
    NLM_F_REQUEST,
)
from proxy.dataplane.nftables.expressions import (
    ADDRESS_WIDTH,
    INET,
    PROTOCOLS,
    VERDICTS,
    Unencodable,
    address,
    encode_rules,
    string,
    u32,
    unique_string,
    value,
    verdict,
)
from proxy.dataplane.nftables.objects import (
    AnySet,
    Chain,
    Command,
    Counter,
    CounterRef,
    Hook,
    Key,
    Map,
    PickMap,
    Priority,
    Set,
    SlotMap,
    Table,
    Value,
    Verdict,
    named,
    parts_text,
    value_text,
)
from proxy.model.types import Family

# nft's data types for set keys: (its number, bytes); a concatenation's type is their
# numbers, 6 bits each, and its length their lengths in 32-bit register slots.
KEY_TYPES = {"ipv4_addr": (7, 4), "ipv6_addr": (8, 16), "inet_proto": (12, 1),
             "inet_service": (13, 2), "integer": (4, 4)}
TYPE_BITS = 6
# The user data nft 1.0.6 stores with each set declaration (read back from sets it
# made): a plain address set says its key is big endian; a concatenation says its
# byte order is mixed and carries a type description; a verdict map adds its data's.
_KEY_BIG_ENDIAN = b"\x00\x04" + struct.pack("=I", 2)
_CONCAT_KEY = bytes.fromhex("000400000000030800040d0000000100")
_VERDICT_MAP = bytes.fromhex("000400000000010400000000030800040d0000000100060400000000")
# A slot map (render.py): `typeof numgen random mod 1 : ip|ip6 daddr . tcp|udp|sctp
# dport`, whose user data describes those expressions (nft's own bytes, read back from
# maps it made: they differ by the address's header and the protocol's); its key is
# nft's plain integer (type 4). `th dport` would do for every protocol, but nft 1.0.6
# then refuses, as conflicting, any later rule naming the protocol beside the map.
TYPE_INTEGER = 4
_SLOT_MAP_HEAD = "000401000000010400000000031a0004170000000112000401000000010401000000020400000" \
    "000043400040d000000012c0014000407000000010c0004"
_SLOT_MAP_FAMILY = {Family.V4: "0c00000001040c00000001", Family.V6: "0d00000001040900000001"}
_SLOT_MAP_TAIL = "14000407000000010c0004{proto:02x}000000010402000000060400000000"
_SLOT_MAP_PROTO = {"tcp": 0x08, "udp": 0x06, "sctp": 0x0A}  # nft's protocol descriptions
_SLOT_MAP_BODY = re.compile(r"typeof numgen random mod 1 : (ip6?) daddr \. (tcp|udp|sctp) dport")
# A slot map of verdicts (`typeof numgen random mod 1 : verdict`): nft's bytes, the same
# for both families.
_SLOT_VERDICT_MAP = bytes.fromhex("000401000000010400000000031a00041700000001120004010000000104"
                                  "0100000002040000000004080004010000000100060400000000")
_SLOT_VERDICT_BODY = SlotMap("", Family.V4, "", verdicts=True).declaration().rstrip(";")


# A pick map (render.py): `typeof ip|ip6 daddr . <proto> dport . numgen random mod 1 :
# ip|ip6 daddr . <proto> dport`, nft's bytes, which differ by the address's header (the
# slot maps' `_SLOT_MAP_FAMILY`) and the protocol (`_SLOT_MAP_PROTO`); its key a
# concatenation ending in nft's integer. A counter map (`type <concatenation> :
# counter`): nft's bytes, the same for both families.
_PICK_MAP = ("000400000000010400000000035000040d00000001480014000407000000010c0004{f}14000407"
             "000000010c0004{p:02x}000000010402000000021a000417000000011200040100000001040100"
             "0000020400000000043400040d000000012c0014000407000000010c0004{f}14000407000000010c"
             "0004{p:02x}000000010402000000060400000000")
_PICK_MAP_BODY = re.compile(r"typeof (ip6?) daddr \. (tcp|udp|sctp) dport \. numgen random mod 1 "
                            r": \1 daddr \. \2 dport")
_COUNTER_MAP = bytes.fromhex("000400000000030800040d0000000100060400000000")


def _slot_map_userdata(family: Family, proto: str) -> bytes:
    return bytes.fromhex(_SLOT_MAP_HEAD + _SLOT_MAP_FAMILY[family]
                         + _SLOT_MAP_TAIL.format(proto=_SLOT_MAP_PROTO[proto]))


# Base chains: netfilter's hooks and nft's named priorities.
HOOKS = {"prerouting": NF_INET_PRE_ROUTING, "input": NF_INET_LOCAL_IN,
         "forward": NF_INET_FORWARD, "output": NF_INET_LOCAL_OUT,
         "postrouting": NF_INET_POST_ROUTING}
PRIORITIES = {"dstnat": NF_IP_PRI_NAT_DST, "srcnat": NF_IP_PRI_NAT_SRC,
              "filter": NF_IP_PRI_FILTER}
_MESSAGE_HEAD = struct.Struct(HEADER.format + "4s")  # nlmsghdr, then the nfgenmsg
_FLAGS = struct.Struct("=H")
# Bytes per piece of a batch (Batch.pages), at first: a batch of more than MAX_PIECES
# pieces (sendmsg's most) has them joined in pairs, and pieces twice the size after
# (_Pages.add): a full sync of 100,000 services x 10 endpoints is ~400 MB.
PAGE = 256 * 1024


@dataclass(frozen=True, slots=True)
class Batch:
    # The messages, in pieces of about PAGE bytes (never splitting one), sent with one
    # sendmsg as nft does: a full sync's batch is 42 MB at 10,000 services x 10
    # endpoints, and growing or joining one buffer that size doubled the agent's peak.
    pages: list[bytearray]
    begin_seq: int
    count: int  # messages: message i (from 0) has sequence begin_seq + 1 + i
    # The (1-based) line each message encodes, as runs of consecutive lines: (the run's
    # first message, its line), a run after each blank line (which has no message). A
    # list of every message's line was 4 MiB at 10,000 services x 10 endpoints.
    runs: list[tuple[int, int]]

    @property
    def last_seq(self) -> int:
        """The last message's sequence number (the batch's end follows it)."""
        return self.begin_seq + self.count

    @property
    def data(self) -> bytes:
        return b"".join(self.pages)

    @property
    def numbers(self) -> list[int]:
        """The line of each message, in order."""
        return [self._line(i) for i in range(self.count)]

    def line_of(self, seq: int) -> int | None:
        i = seq - self.begin_seq - 1
        return self._line(i) if 0 <= i < self.count else None

    def _line(self, i: int) -> int:
        first, line = self.runs[bisect.bisect_right(self.runs, i, key=lambda run: run[0]) - 1]
        return line + i - first


# --- elements and sets ----------------------------------------------------------------------


# A protocol's byte in a key, padded to its 32-bit register slot.
_KEY_PROTOCOLS = {name: bytes([number]) + b"\0\0\0" for name, number in PROTOCOLS.items()}


@functools.lru_cache(maxsize=1024)
def _key_port(number: int) -> bytes:
    if not 0 <= number <= 0xFFFF:
        raise Unencodable(f"port {number}")
    return struct.pack("!H", number) + b"\0\0"


def _element_key(family: Family, parts: Key) -> bytes:
    """`("198.18.0.1", "tcp", 80)` -> each part in its own 32-bit register slot, as the
    kernel lays out concatenations (an address fills its slots: 4 or 16 bytes). A number
    is a port, or after a port a pick's slot (a pick map's key: numgen's host-order u32)."""
    out = []
    ported = False
    for part in parts:
        if isinstance(part, int):
            out.append(_key_port(part) if not ported else _slot(part))
            ported = True
        else:
            out.append(_KEY_PROTOCOLS.get(part) or address(part, family))
    return b"".join(out)


def element_keys(family: Family, keys: Sequence[Key]) -> list[bytes]:
    """Each key's bytes as the kernel holds them (`_element_key`), for comparing with a
    dump (readback.set_keys); keys of addresses alone read by inet_pton in one pass."""
    raws = _address_parts(family, keys)
    if raws is None:
        return [_element_key(family, k) for k in keys]
    parts = len(keys[0]) if keys else 1
    if parts == 1:
        return raws
    return [b"".join(raws[i:i + parts]) for i in range(0, len(raws), parts)]


def _address_parts(family: Family, keys: Sequence[Key]) -> list[bytes] | None:
    """Every part of `keys`, in order, read by inet_pton in one pass (element by element
    took 1.5 us each); None unless every key is as many addresses as the first."""
    if len({len(k) for k in keys}) > 1:
        return None
    try:  # a protocol's name (OSError), a port or a slot (TypeError) is refused here
        return list(map(functools.partial(socket.inet_pton, INET[family]),
                        itertools.chain.from_iterable(keys)))
    except (OSError, TypeError):
        return None


@functools.cache
def _value_head(kind: int, length: int) -> bytes:
    """What `value(kind, data)` puts before `data` of `length` bytes, a multiple of 4 (as
    every key is: then nothing follows it). A full sync has 85,000 elements at 10,000
    x 10, whose headers differ only by the key's length."""
    return value(kind, bytes(length))[:-length]


@functools.cache
def set_element_head(length: int) -> bytes:
    """What comes before a set element's key of `length` bytes (it has no value)."""
    return nested(NFTA_LIST_ELEM, _value_head(NFTA_SET_ELEM_KEY, length) + bytes(length))[:-length]


def _slot(number: int) -> bytes:
    """A slot (numgen's or jhash's pick) as a key holds it."""
    if not 0 <= number <= 0xFFFFFFFF:
        raise Unencodable(f"slot {number}")
    return SLOT.pack(number)


def _element(family: Family, key: Key, data: Value) -> bytes:
    """One element: its key and, in a map, its value (`data`; () in a set)."""
    if len(key) == 1 and isinstance(key[0], int):  # a slot map's key: numgen's host-order u32
        return nested(NFTA_LIST_ELEM, value(NFTA_SET_ELEM_KEY, _slot(key[0]))
                      + _slot_data(family, data))

    raw = _element_key(family, key)
    if not data:
        return set_element_head(len(raw)) + raw
    head = _value_head(NFTA_SET_ELEM_KEY, len(raw)) + raw
    if type(data) is CounterRef:
        return nested(NFTA_LIST_ELEM, head + string(NFTA_SET_ELEM_OBJREF, data.name))
    if type(data) is not Verdict:  # a pick map's address . port
        return nested(NFTA_LIST_ELEM, head + value(NFTA_SET_ELEM_DATA,
                                                   _element_key(family, data)))
    if data.verb not in VERDICTS or bool(data.chain) != (data.verb in ("jump", "goto")):
        raise Unencodable(f"element value {data!r}")
    return nested(NFTA_LIST_ELEM, head + verdict(NFTA_SET_ELEM_DATA, data.verb, data.chain))


def _elements(family: Family, items: Sequence[tuple[Key, Value]]) -> bytes:
    """The (key, value) elements of one statement, one after the other."""
    return _address_elements(family, items) or _pick_elements(family, items) \
        or _slot_elements(family, items) \
        or b"".join([_element(family, key, data) for key, data in items])


def _pick_elements(family: Family, items: Sequence[tuple[Key, Value]]) -> bytes | None:
    """`_elements` of a pick map's elements (cluster IP . port . slot -> an endpoint's
    address . port: render._pick), as `_element` spells them, every element's headers
    the same: a first start at 100,000 services x 10 endpoints writes a million, and
    element by element each took two address reads and five helpers. None when any
    element is not one, or is refused (then `_element` says why)."""
    if not items:
        return None
    pton = functools.partial(socket.inet_pton, INET[family])
    head, between = _pick_heads(family)
    out: list[bytes] = []
    try:
        for (address_, port_, slot), data in items:
            if type(data) is not tuple or type(address_) is not str \
                    or type(port_) is not int or type(slot) is not int:
                return None
            to, to_port = data
            if type(to) is not str or type(to_port) is not int:
                return None
            out += (head, pton(address_), _key_port(port_), _slot(slot), between, pton(to),
                    _key_port(to_port))
    except (OSError, TypeError, ValueError, Unencodable):
        return None
    return b"".join(out)


@functools.cache
def _pick_heads(family: Family) -> tuple[bytes, bytes]:
    """What comes before a pick element's key (the element's header and the key's), and
    between its key and its value, in `family` (`_element`'s layout: every part is a
    multiple of 4 bytes, so nothing pads)."""
    width = ADDRESS_WIDTH[family]
    key, data = bytes(width + 8), bytes(width + 4)  # address . port . slot, address . port
    between = value(NFTA_SET_ELEM_DATA, data)[:-len(data)]
    whole = nested(NFTA_LIST_ELEM, _value_head(NFTA_SET_ELEM_KEY, len(key)) + key
                   + between + data)
    return whole[:len(whole) - len(key) - len(between) - len(data)], between


def _slot_elements(family: Family, items: Sequence[tuple[Key, Value]]) -> bytes | None:
    """`_elements` of a slot map's elements (slot -> address and port, a `goto`, or the
    slot alone), as `_element` spells them, each endpoint's value encoded once: a Maglev
    table is thousands of slots over a few endpoints (element by element took 11 us
    each). None when any element is not one."""
    if not items or len(items[0][0]) != 1 or not isinstance(items[0][0][0], int):
        return None
    data_of: dict[Value, bytes] = {}
    out = []
    for key, data in items:
        if len(key) != 1 or type(slot := key[0]) is not int or not 0 <= slot <= 0xFFFFFFFF:
            return None
        encoded = data_of.get(data)
        if encoded is None:
            encoded = data_of[data] = _slot_data(family, data)
        out.append(_slot_head(len(encoded)))
        out.append(SLOT.pack(slot))
        out.append(encoded)
    return b"".join(out)


SLOT = struct.Struct("=I")  # numgen's and jhash's result: a host-order u32


def _slot_data(family: Family, data: Value) -> bytes:
    """A slot's value: an address . port, a `goto` (a map of verdicts), or nothing (a
    delete names the slot alone)."""
    if not data:
        return b""
    if type(data) is Verdict:
        if data.verb != "goto" or not data.chain:
            raise Unencodable(f"slot value {data!r}")
        return verdict(NFTA_SET_ELEM_DATA, data.verb, data.chain)
    return value(NFTA_SET_ELEM_DATA, _element_key(family, data))


@functools.cache
def _slot_head(data_length: int) -> bytes:
    """What comes before a slot element's key (4 bytes), its value attribute of
    `data_length` bytes after it."""
    return nested(NFTA_LIST_ELEM, value(NFTA_SET_ELEM_KEY, bytes(4)) + bytes(data_length)
                  )[:-(data_length + 4)]


def _address_elements(family: Family, items: Sequence[tuple[Key, Value]]) -> bytes | None:
    """`_elements` of a set's elements whose keys are addresses, or concatenations of as
    many addresses each (at 10,000 services x 10 endpoints, a full sync's 75,000
    hairpin pairs and cluster IPs): the parts read in one pass (`_address_parts`), the
    elements joined in another. None for
    anything else (a map's elements, a key with another part), for `_element`."""
    if not items:
        return b""
    keys, values = zip(*items, strict=True)
    if any(values):
        return None
    raws = _address_parts(family, keys)
    if raws is None:
        return None
    parts_per_key = len(keys[0])
    stride = parts_per_key + 1  # an element: its head, then its parts
    out = [set_element_head(parts_per_key * ADDRESS_WIDTH[family])] * (len(keys) * stride)
    for i in range(parts_per_key):
        out[i + 1::stride] = raws[i::parts_per_key]
    return b"".join(out)


def _key_type(types: tuple[str, ...]) -> tuple[int, int, bool]:
    """(`ipv4_addr`, `inet_proto`, `inet_service`) -> (nft's type number, key length,
    whether it is a concatenation)."""
    number, length = 0, 0
    for part in types:
        length += part_width(part)
        number = number << TYPE_BITS | KEY_TYPES[part][0]
    return number, length, len(types) > 1


def part_width(part: str) -> int:
    """The bytes a key's part of type `part` fills: its 32-bit register slots."""
    known = KEY_TYPES.get(part)
    if known is None:
        raise Unencodable(f"key type {part!r}")
    return (known[1] + 3) // 4 * 4


# A set's flags as nft spells them (objects.Set.flags).
SET_FLAG_BITS = {"timeout": NFT_SET_TIMEOUT, "dynamic": NFT_SET_EVAL}


def _set_attrs(declared: AnySet) -> bytes:
    """A set's or map's declaration (objects.py): our four shapes, a set of addresses or
    of concatenations, a verdict map, the affinity sets (flags dynamic,timeout and a
    timeout), and the slot maps' typeof."""
    if isinstance(declared, SlotMap) and declared.verdicts:
        return (nla(NFTA_SET_FLAGS, u32(NFT_SET_MAP)) + nla(NFTA_SET_KEY_TYPE, u32(TYPE_INTEGER))
                + nla(NFTA_SET_KEY_LEN, u32(4)) + nla(NFTA_SET_DATA_TYPE, u32(NFT_DATA_VERDICT))
                + nla(NFTA_SET_DATA_LEN, u32(0)) + nla(NFTA_SET_USERDATA, _SLOT_VERDICT_MAP))
    if isinstance(declared, SlotMap):
        addr = "ipv4_addr" if declared.family is Family.V4 else "ipv6_addr"
        data_type, data_len, _ = _key_type((addr, "inet_service"))
        if declared.protocol not in _SLOT_MAP_PROTO:
            raise Unencodable(f"slot map of {declared.protocol!r}")
        return (nla(NFTA_SET_FLAGS, u32(NFT_SET_MAP)) + nla(NFTA_SET_KEY_TYPE, u32(TYPE_INTEGER))
                + nla(NFTA_SET_KEY_LEN, u32(4)) + nla(NFTA_SET_DATA_TYPE, u32(data_type))
                + nla(NFTA_SET_DATA_LEN, u32(data_len))
                + nla(NFTA_SET_USERDATA, _slot_map_userdata(declared.family, declared.protocol)))
    if isinstance(declared, PickMap):
        number, length, _ = _key_type(declared.key)
        data_type, data_len, _ = _key_type((declared.key[0], "inet_service"))
        if declared.protocol not in _SLOT_MAP_PROTO:
            raise Unencodable(f"pick map of {declared.protocol!r}")
        userdata = _PICK_MAP.format(f=_SLOT_MAP_FAMILY[declared.family],
                                    p=_SLOT_MAP_PROTO[declared.protocol])
        return (nla(NFTA_SET_FLAGS, u32(NFT_SET_MAP)) + nla(NFTA_SET_KEY_TYPE, u32(number))
                + nla(NFTA_SET_KEY_LEN, u32(length)) + nla(NFTA_SET_DATA_TYPE, u32(data_type))
                + nla(NFTA_SET_DATA_LEN, u32(data_len))
                + nla(NFTA_SET_USERDATA, bytes.fromhex(userdata)))
    number, length, concat = _key_type(declared.key)
    attrs = nla(NFTA_SET_KEY_TYPE, u32(number)) + nla(NFTA_SET_KEY_LEN, u32(length))
    if isinstance(declared, Map) and declared.value == "counter":
        return (nla(NFTA_SET_FLAGS, u32(NFT_SET_OBJECT)) + attrs
                + nla(NFTA_SET_OBJ_TYPE, u32(NFT_OBJECT_COUNTER))
                + nla(NFTA_SET_USERDATA, _COUNTER_MAP))
    if isinstance(declared, Map):
        if declared.value != "verdict":
            raise Unencodable(f"map of {declared.value!r}")
        return (nla(NFTA_SET_FLAGS, u32(NFT_SET_MAP)) + attrs
                + nla(NFTA_SET_DATA_TYPE, u32(NFT_DATA_VERDICT))
                + nla(NFTA_SET_USERDATA, _VERDICT_MAP))
    assert isinstance(declared, Set)
    if not declared.flags and declared.timeout is None:
        return attrs + nla(NFTA_SET_USERDATA, _CONCAT_KEY if concat else _KEY_BIG_ENDIAN)
    if concat or set(declared.flags) != set(SET_FLAG_BITS) or declared.timeout is None:
        raise Unencodable(f"set {{ {declared.declaration()} }}")
    return (nla(NFTA_SET_FLAGS, u32(NFT_SET_TIMEOUT | NFT_SET_EVAL)) + attrs
            + nla(NFTA_SET_TIMEOUT, struct.pack("!Q", declared.timeout * 1000))
            + nla(NFTA_SET_USERDATA, _KEY_BIG_ENDIAN))


def _hook_attrs(hook: Hook) -> bytes:
    """A base chain's hook, priority, policy and type (objects.Hook)."""
    priority = hook.priority
    if hook.hook not in HOOKS or hook.type not in ("nat", "filter") \
            or hook.policy != "accept" or (priority.name and priority.name not in PRIORITIES):
        raise Unencodable(f"chain {{ {hook.text()} }}")
    number = PRIORITIES.get(priority.name, 0) + priority.offset
    attrs = (nla(NFTA_HOOK_HOOKNUM, u32(HOOKS[hook.hook]))
             + nla(NFTA_HOOK_PRIORITY, struct.pack("!i", number)))
    return (nested(NFTA_CHAIN_HOOK, attrs) + nla(NFTA_CHAIN_POLICY, u32(NF_ACCEPT))
            + string(NFTA_CHAIN_TYPE, hook.type))


def _command(t: bytes, command: Command, set_id: int) -> tuple[int, int, bytes]:
    """(message type, flags, attributes) of `command` on the table whose name attribute
    is `t`."""
    verb, obj = command.verb, command.object
    kind = type(obj)
    if kind is Table:
        if verb == "add":
            return NFT_MSG_NEWTABLE, NLM_F_CREATE, t
        if verb == "delete":
            return NFT_MSG_DELTABLE, 0, t
    elif kind is Chain:
        assert isinstance(obj, Chain)
        name = string(NFTA_CHAIN_NAME, obj.name)
        if verb == "add":
            hook = _hook_attrs(obj.hook) if obj.hook else b""
            return NFT_MSG_NEWCHAIN, NLM_F_CREATE, t + name + hook
        if verb == "delete":
            return NFT_MSG_DELCHAIN, 0, t + name
        if verb == "flush":  # every rule of the chain: a rule deletion naming no rule
            return NFT_MSG_DELRULE, 0, t + string(NFTA_RULE_CHAIN, obj.name)
    elif kind is Counter:
        # Without NLM_F_EXCL an existing counter is "updated" with this empty one, which
        # the counter type ignores: its count stays (tests/e2e/test_nftables_wire_kernel.py).
        attrs = t + string(NFTA_OBJ_NAME, obj.name) + nla(NFTA_OBJ_TYPE, u32(NFT_OBJECT_COUNTER))
        if verb == "add":
            return NFT_MSG_NEWOBJ, NLM_F_CREATE, attrs + nested(NFTA_OBJ_DATA, b"")
        if verb == "delete":
            return NFT_MSG_DELOBJ, 0, attrs
    else:
        assert isinstance(obj, Set | Map | SlotMap | PickMap)
        if verb == "add":
            return NFT_MSG_NEWSET, NLM_F_CREATE, (t + string(NFTA_SET_NAME, obj.name)
                                                  + _set_attrs(obj)
                                                  + nla(NFTA_SET_ID, u32(set_id)))
        if verb == "delete":
            return NFT_MSG_DELSET, 0, t + string(NFTA_SET_NAME, obj.name)
        if verb == "flush":  # every element: an element deletion naming none
            return NFT_MSG_DELSETELEM, 0, t + string(NFTA_SET_ELEM_LIST_SET, obj.name)
    raise Unencodable(f"{verb} {obj.kind}")


# --- text input: lines of the dialect, read into objects ------------------------------------
# For scripts given as text (by tests, or by hand): the renderer's own scripts come as
# objects and statements, never through here.


def _parse_set(body: str, is_map: bool) -> AnySet:
    """A declaration's body -> the object it declares (the shapes `_set_attrs` takes)."""
    parts = [p.strip() for p in body.strip().rstrip(";").split(";")]
    if len(parts) == 1 and is_map and parts[0] == _SLOT_VERDICT_BODY:
        return SlotMap("", Family.V4, "", verdicts=True)
    slot_map = _SLOT_MAP_BODY.fullmatch(parts[0]) if len(parts) == 1 and is_map else None
    if slot_map is not None:
        return SlotMap("", Family.V4 if slot_map[1] == "ip" else Family.V6, slot_map[2])
    pick_map = _PICK_MAP_BODY.fullmatch(parts[0]) if len(parts) == 1 and is_map else None
    if pick_map is not None:
        return PickMap("", Family.V4 if pick_map[1] == "ip" else Family.V6, pick_map[2])
    if not parts[0].startswith("type "):
        raise Unencodable(f"set {{ {body} }}")
    key, sep, data = parts[0].removeprefix("type ").partition(" : ")
    types = tuple(key.split(" . "))
    if is_map != bool(sep) or (sep and len(parts) != 1):
        raise Unencodable(f"{'map' if is_map else 'set'} {{ {body} }}")
    if is_map:
        return Map("", types, data)
    if len(parts) == 1:
        return Set("", types)
    seconds = parts[2].removeprefix("timeout ").removesuffix("s") if len(parts) == 3 else ""
    if not parts[1].startswith("flags ") or not parts[2].startswith("timeout ") \
            or not seconds.isdigit():
        raise Unencodable(f"set {{ {body} }}")
    return Set("", types, tuple(parts[1].removeprefix("flags ").split(",")), int(seconds))


def _parse_hook(body: str) -> Hook:
    """A base chain's `type nat|filter hook <hook> priority <p>; policy accept;`: its
    priority a name of nft's, `name + n`, or a number."""
    parts = [p.strip() for p in body.strip().rstrip(";").split(";")]
    words = parts[0].split()
    if len(parts) != 2 or not parts[1].startswith("policy ") or len(words) < 6 \
            or words[0] != "type" or words[2] != "hook" or words[4] != "priority":
        raise Unencodable(f"chain {{ {body} }}")
    priority = words[5:]
    if len(priority) == 1 and priority[0].lstrip("-").isdigit():
        at = Priority("", int(priority[0]))
    elif priority[0] in PRIORITIES and (len(priority) == 1 or (
            len(priority) == 3 and priority[1] in "+-" and priority[2].isdigit())):
        offset = int(priority[2]) if len(priority) == 3 else 0
        at = Priority(priority[0], offset if priority[1:2] != ["-"] else -offset)
    else:
        raise Unencodable(f"priority {' '.join(priority)!r}")
    return Hook(words[1], words[3], at, parts[1].removeprefix("policy "))


def _braced(rest: str) -> tuple[str, str]:
    """`name { inner }` -> (name, inner)."""
    name, sep, inner = rest.partition(" { ")
    if not sep or not inner.endswith(" }") or " " in name:
        raise Unencodable(f"{rest!r}")
    return name, inner[:-2]


def _plain_name(rest: str) -> str:
    if not rest or " " in rest:
        raise Unencodable(f"{rest!r}")
    return rest


def _element_item(text: str) -> tuple[Key, Value]:
    """(key, value or ()) of one element as a line spells it: `<key> [: <value>]`, a
    value a verdict or parts as a key's."""
    key, sep, data = text.partition(" : ")
    data = data.strip()
    if sep and not data:
        raise Unencodable(f"element {text!r} without its value")
    verb, _, chain = data.partition(" ")
    if verb in VERDICTS:
        return _parts(key.strip()), Verdict(verb, chain)
    if len(data) > 2 and data[0] == data[-1] == '"' and '"' not in data[1:-1]:
        return _parts(key.strip()), CounterRef(data[1:-1])
    return _parts(key.strip()), _parts(data) if data else ()


def _parts(text: str) -> Key:
    """`198.18.0.1 . tcp . 80` -> ("198.18.0.1", "tcp", 80): a number is a port or a slot."""
    return tuple(int(p) if p.isdigit() else p for p in text.split(" . "))


def _read_command(verb: str, kind: str, table: str, rest: str) -> Command:
    """One line's table, chain, set or map command as an object (the line split)."""
    if kind == "chain":
        if verb == "add" and " { " in rest:  # a base chain
            name, body = _braced(rest)
            return Command(verb, table, Chain(name, (), _parse_hook(body)))
        return Command(verb, table, Chain(_plain_name(rest)))
    if kind in ("set", "map"):
        if verb == "add":
            name, body = _braced(rest)
            return Command(verb, table, _parse_set(body, kind == "map")._replace(name=name))
        return Command(verb, table, named(kind, _plain_name(rest)))
    if kind == "counter" and verb in ("add", "delete"):
        return Command(verb, table, Counter(_plain_name(rest)))
    raise Unencodable(f"{verb} {kind}")


# --- statements that stand for lines --------------------------------------------------------


# Chains of one table, as render.py keeps a port's, in write order.
ChainRules = Sequence[Chain]
_SECOND = operator.itemgetter(1)


class Chains(NamedTuple):
    """`add chain <ip> <table> <name>` for each chain of each (table, chains) of `tables`
    (regular chains, declared: their rules are not written here)."""

    tables: Sequence[tuple[str, ChainRules]]

    @classmethod
    def one(cls, table: str, name: str) -> Chains:
        return cls(((table, (Chain(name),)),))

    @property
    def size(self) -> int:
        """How many lines this stands for."""
        return sum(map(len, map(_SECOND, self.tables)))

    def lines(self, ip: str) -> Iterator[str]:
        for table, chains in self.tables:
            for chain in chains:
                yield f"add chain {ip} {table} {chain.name}"


class Rules(NamedTuple):
    """For each chain of each (table, chains) of `tables`: `flush chain <ip> <table>
    <name>` (unless `flush` is False), then `add rule <ip> <table> <name> <rule>` for
    each of its rules."""

    tables: Sequence[tuple[str, ChainRules]]
    flush: bool = True

    @classmethod
    def one(cls, table: str, chain: Chain, flush: bool = True) -> Rules:
        return cls(((table, (chain,)),), flush)

    @property
    def size(self) -> int:
        chains = list(itertools.chain.from_iterable(map(_SECOND, self.tables)))
        return self.flush * len(chains) + sum(map(len, map(_SECOND, chains)))

    def lines(self, ip: str) -> Iterator[str]:
        for table, chains in self.tables:
            for chain in chains:
                if self.flush:
                    yield f"flush chain {ip} {table} {chain.name}"
                prefix = f"add rule {ip} {table} {chain.name} "
                for rule in chain.rules:
                    yield prefix + rule


class Elements(NamedTuple):
    """`add|delete element <ip> <table> <set> { <key> [: <value>], ... }`: one line of
    `items`, (key, value) pairs (objects.Element's; a set's elements have the value ())."""

    verb: str
    table: str
    set: str
    items: Sequence[tuple[Key, Value]]

    @property
    def size(self) -> int:
        return 1

    def lines(self, ip: str) -> Iterator[str]:
        texts = ", ".join(f"{parts_text(key)} : {value_text(data)}" if data else parts_text(key)
                          for key, data in self.items)
        yield f"{self.verb} element {ip} {self.table} {self.set} {{ {texts} }}"


class Commit(NamedTuple):
    """Not a line: where a script that leaves nothing live before its last part
    (transaction.first_lines) may be cut into transactions of its own, each committed
    before the next is sent. Encoders that take a script whole ignore it."""

    @property
    def size(self) -> int:
        return 0

    def lines(self, ip: str) -> Iterator[str]:
        return iter(())


COMMIT = Commit()

# A statement of a script: an object's command, or lines the encoder takes as they are
# made, without spelling them and parsing them back (at 10,000 services x 10 endpoints,
# a full sync's 100,000 rules, 20,000 chains and 85,000 set elements); or, from text
# (tests, by hand), one line of it.
Statement = str | Command | Chains | Rules | Elements | Commit


def statement_size(statement: Statement) -> int:
    """How many lines `statement` stands for."""
    return 1 if isinstance(statement, str) else statement.size


def statement_lines(statement: Statement, ip: str) -> Iterator[str]:
    """The lines `statement` stands for, in a table of family `ip` ("ip" or "ip6")."""
    if isinstance(statement, str):
        yield statement
    else:
        yield from statement.lines(ip)


def stages(statements: Iterable[Statement]) -> Iterator[list[Statement]]:
    """`statements` cut at each COMMIT (dropped), each part made only when asked for,
    so a part can be sent while the next is still being made."""
    part: list[Statement] = []
    for statement in statements:
        if statement is COMMIT:
            if part:
                yield part
            part = []
        else:
            part.append(statement)
    if part:
        yield part


# --- lines -----------------------------------------------------------------------------------


def _element_message(verb: str, t: bytes, name: str, elements: bytes
                     ) -> tuple[int, int, bytes]:
    """An `add|delete element` of the encoded `elements` of set `name` of table `t`."""
    attrs = t + string(NFTA_SET_ELEM_LIST_SET, name) + nested(NFTA_SET_ELEM_LIST_ELEMENTS, elements)
    if verb == "add":
        return NFT_MSG_NEWSETELEM, NLM_F_CREATE, attrs
    if verb == "delete":
        return NFT_MSG_DELSETELEM, 0, attrs
    raise Unencodable(f"{verb} element")


def _line(family: Family, tables: Collection[str], line: str,
          set_id: int) -> tuple[int, int, bytes]:
    """(message type, flags, attributes) for one line."""
    words = line.split(" ", 4)
    ip = "ip" if family is Family.V4 else "ip6"
    if len(words) == 4 and words[1] == "table" and words[0] in ("add", "delete"):
        if words[2] != ip or words[3] not in tables:
            raise Unencodable(f"not our {family.label} table: {line!r}")
        return _command(string(NFTA_TABLE_NAME, words[3]),
                        Command(words[0], words[3], Table(words[3])), set_id)
    if len(words) < 5:
        raise Unencodable(f"{line!r}")
    verb, kind, fam, table, rest = words
    if fam != ip or table not in tables:
        raise Unencodable(f"not our {family.label} table: {line!r}")
    t = string(NFTA_ANY_TABLE, table)
    if kind == "rule" and verb == "add":
        chain, _, rule = rest.partition(" ")
        return (NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND,
                t + string(NFTA_RULE_CHAIN, _plain_name(chain)) + encode_rules(family, (rule,))[0])
    if kind == "element" and verb in ("add", "delete"):
        name, inner = _braced(rest)
        return _element_message(verb, t, name, _elements(
            family, [_element_item(e) for e in inner.split(", ")]))
    return _command(t, _read_command(verb, kind, table, rest), set_id)


def _lines(script: str) -> Iterator[str]:
    """The lines of `script`, one at a time (io.StringIO would copy 17 MB of ASCII into
    68 MB of UCS-4 first; splitlines, a list of every line)."""
    start, end = 0, len(script)
    while start < end:
        stop = script.find("\n", start)
        if stop < 0:
            stop = end
        yield script[start:stop]
        start = stop + 1


class _Pages:
    """A batch as it is framed: messages appended to pages of about PAGE bytes."""

    def __init__(self, family: Family, first_seq: int, first_line: int = 1) -> None:
        self.family_head = nfgen(NFPROTO[family])
        self.first_seq = self.seq = first_seq
        self.out = bytearray(frame(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, first_seq,
                                   nfgen(socket.AF_UNSPEC, NFNL_SUBSYS_NFTABLES)))
        self.pages = [self.out]
        self.page = PAGE  # bytes per piece now
        self.runs = [(0, first_line)]
        self.blank = first_line - 1  # blank lines so far (and lines before this batch)
        self.last = -1  # where the last message starts, in the last page

    def add(self, msg: int, flags: int, head: bytes, tails: Iterable[bytes] = (b"",)) -> None:
        """The next lines' messages: `head` then a tail, for each of `tails`."""
        kind, flags = NFNL_SUBSYS_NFTABLES << 8 | msg, NLM_F_REQUEST | flags
        out, seq, family_head, pack = self.out, self.seq, self.family_head, _MESSAGE_HEAD.pack
        fixed = _MESSAGE_HEAD.size + len(head)
        size = 0
        for tail in tails:
            size = fixed + len(tail)
            if len(out) + size > self.page:
                if len(self.pages) == MAX_PIECES:
                    self._join_pairs()
                out = bytearray()
                self.pages.append(out)
            seq += 1
            # Past 2**32 - 1 the numbers wrap; such a batch is never sent, the caller
            # numbers it again from 1 (NetlinkSocket.reserve), but it must encode.
            out += pack(size, kind, flags, seq & 0xFFFFFFFF, 0, family_head)
            out += head
            out += tail
        if size:
            self.out, self.seq, self.last = out, seq, len(out) - size

    def _join_pairs(self) -> None:
        """Every two pieces made one, in place (the first grows), and pieces of twice the
        size from now on: a batch stays within MAX_PIECES without a copy of it whole.
        Only when a new piece begins: no message is split, and `last` is in that one."""
        pages = self.pages
        for i in range(0, len(pages) - 1, 2):
            pages[i] += pages[i + 1]
        self.pages = pages[::2]
        self.page *= 2

    def line(self) -> int:
        """The next message's line, if it has no blank line before it."""
        return self.seq - self.first_seq + self.blank + 1

    def skip(self) -> None:
        """A blank line: no message, and the next message's line one further on."""
        self.blank += 1
        run = (self.seq - self.first_seq, self.line())
        if self.runs[-1][0] == run[0]:
            self.runs[-1] = run
        else:
            self.runs.append(run)

    def batch(self) -> Batch:
        """The batch: its last message asks for an acknowledgement, then its end."""
        out = self.out
        if self.last >= 0:  # nlmsghdr: length (4 bytes), type (2), then the flags
            (flags,) = _FLAGS.unpack_from(out, self.last + 6)
            _FLAGS.pack_into(out, self.last + 6, flags | NLM_F_ACK)
        out += frame(NFNL_MSG_BATCH_END, NLM_F_REQUEST, (self.seq + 1) & 0xFFFFFFFF,
                     nfgen(socket.AF_UNSPEC, NFNL_SUBSYS_NFTABLES))
        return Batch(self.pages, self.first_seq, self.seq - self.first_seq, self.runs)


def encode(script: str | Iterable[Statement], family: Family, tables: Collection[str],
           first_seq: int, first_line: int = 1) -> Batch:
    """The batch for `script` (text, one statement per line, or the statements
    themselves, in `family`'s tables) on `tables` of `family`; message sequence numbers
    from `first_seq` on, its lines numbered from `first_line` (a later part of a script
    cut by `stages`). The last message asks for an acknowledgement: the kernel
    answers a batch in order, so any refusal of an earlier line arrives before it.
    Raises Unencodable for anything outside the dialect (module docstring).

    Framed straight into pages, statement by statement: a full sync's batch is tens of
    megabytes, and a list of its messages beside it (or of its lines) would double
    that at the agent's peak, in small objects the allocator keeps afterwards."""
    pages = _Pages(family, first_seq, first_line)
    add = pages.add
    # Encoded when first used: a change touches one or two of our 65 tables per family.
    table_names: dict[str, bytes] = {}

    def table_name(table: str) -> bytes:
        found = table_names.get(table)
        if found is None:
            if table not in tables:
                raise Unencodable(f"not our {family.label} table: {table!r}")
            found = table_names[table] = string(NFTA_ANY_TABLE, table)
        return found

    for statement in _lines(script) if isinstance(script, str) else script:
        if isinstance(statement, str):
            if statement:
                add(*_line(family, tables, statement, pages.line()))
            else:
                pages.skip()
        elif isinstance(statement, Rules):
            for table, chains in statement.tables:
                t = table_name(table)
                for chain in chains:
                    head = t + unique_string(NFTA_RULE_CHAIN, _plain_name(chain.name))
                    if statement.flush:
                        add(NFT_MSG_DELRULE, 0, head)
                    add(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, head,
                        encode_rules(family, chain.rules))
        elif isinstance(statement, Chains):
            for table, chains in statement.tables:
                add(NFT_MSG_NEWCHAIN, NLM_F_CREATE, table_name(table),
                    [unique_string(NFTA_CHAIN_NAME, _plain_name(chain.name)) for chain in chains])
        elif isinstance(statement, Command):
            add(*_command(table_name(statement.table), statement, pages.line()))
        elif isinstance(statement, Commit):
            continue  # a whole script in one transaction: nothing to cut
        else:
            add(*_element_message(statement.verb, table_name(statement.table), statement.set,
                                  _elements(family, statement.items)))
    return pages.batch()


# --- reading names back (pure) ---------------------------------------------------------------

def dump_request(family: Family) -> bytes:
    """The body of a dump of every table, chain or set of `family`."""
    return nfgen(NFPROTO[family])


def counter_requests(family: Family, keys: Iterable[tuple[str, str]]) -> Iterator[bytes]:
    """The body of a request for each named counter of `keys` ((table, name); NFT_MSG_GETOBJ,
    no dump): the kernel finds each by name, whatever the number of objects."""
    head, kind = nfgen(NFPROTO[family]), nla(NFTA_OBJ_TYPE, u32(NFT_OBJECT_COUNTER))
    tables: dict[str, bytes] = {}
    for table, name in keys:
        prefix = tables.get(table)
        if prefix is None:
            prefix = tables[table] = head + string(NFTA_OBJ_TABLE, table)
        yield prefix + string(NFTA_OBJ_NAME, name) + kind


def decode_names(kind: int, payload: bytes) -> tuple[str, str, str]:
    """(table, name, "set" | "map" | "") of one dumped table, chain or set (for a table:
    its name twice). Anonymous sets (nft's `{ ... }` in a rule) have kind ""."""
    attrs = parse_attrs(payload[NFGEN.size:])

    def text(attr: int) -> str:
        return attrs.get(attr, b"").split(b"\0", 1)[0].decode(errors="replace")

    if kind == NFT_MSG_GETTABLE:
        return text(NFTA_TABLE_NAME), text(NFTA_TABLE_NAME), ""
    if kind == NFT_MSG_GETCHAIN:
        return text(NFTA_CHAIN_TABLE), text(NFTA_CHAIN_NAME), ""
    flags = int.from_bytes(attrs.get(NFTA_SET_FLAGS, b"\0\0\0\0"), "big")
    what = "" if flags & NFT_SET_ANONYMOUS else "map" if flags & NFT_SET_MAP else "set"
    return text(NFTA_SET_TABLE), text(NFTA_SET_NAME), what


def decode_counter(payload: bytes, start: int = 0, end: int | None = None
                   ) -> tuple[str, str, int] | None:
    """(table, name, packets) of one dumped named counter (the message body in
    payload[start:end]); None for another object. Read in place, no dict per message: a
    scrape reads one message per service port (parse_attrs took 0.2 s for 20,000)."""
    table = name = b""
    kind = packets = 0
    for attr, a, b in attributes(payload, start + NFGEN.size, end):
        if attr == NFTA_OBJ_TABLE:
            table = payload[a:b].rstrip(b"\0")
        elif attr == NFTA_OBJ_NAME:
            name = payload[a:b].rstrip(b"\0")
        elif attr == NFTA_OBJ_TYPE:
            kind = int.from_bytes(payload[a:b], "big")
        elif attr == NFTA_OBJ_DATA:
            packets = next((int.from_bytes(payload[x:y], "big")
                            for inner, x, y in attributes(payload, a, b)
                            if inner == NFTA_COUNTER_PACKETS), 0)
    if kind != NFT_OBJECT_COUNTER:
        return None
    return table.decode(errors="replace"), name.decode(errors="replace"), packets


def counter_packets(body: bytes) -> int:
    """The packets of one named counter the kernel answered a get with (the message
    body): its data's packets attribute alone, what a reading of 100,000 wants."""
    data = find_attr(body, NFGEN.size, NFTA_OBJ_DATA)
    packets = None if data is None else find_attr(data, 0, NFTA_COUNTER_PACKETS)
    return 0 if packets is None else int.from_bytes(packets, "big")


def rule_dump_request(family: Family, table: str, chain: str) -> bytes:
    """The body of a dump of one chain's rules (the kernel filters it to that chain)."""
    return nfgen(NFPROTO[family]) + string(NFTA_RULE_TABLE, table) \
        + unique_string(NFTA_RULE_CHAIN, chain)
