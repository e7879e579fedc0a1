"""Our nftables script dialect, encoded as one nf_tables netlink batch (pure).

Why: a change's script is a few lines, but libnftables (and `nft -f`) first fills a
cache of the table it touches, reading our big verdict maps and thousands of chains
back from the kernel: 39 ms per transaction at 10,000 services, against 0.1 ms for the
kernel's own work (bench/RESULTS.md). The partial scripts of transaction.py use a small,
closed set of statements, so this module encodes them itself, the way nft would, and
the kernel gets the same objects without anything being read back.

Input is the very text the fallback would hand to nft, one statement per line; output
is a batch whose message i+1 is line i, so a refusal names its line as nft's errors do.
A line outside the dialect raises `Unencodable`, and the caller hands the whole script
to nft instead: nothing is ever half-encoded. What is encoded here:

    add|delete element <t> <set> { <key> [: goto|jump <chain> | drop | accept], ... }
    add chain|flush chain|delete chain|delete set|delete map <t> <name>
    add set <t> <name> { type ipv4_addr|ipv6_addr; flags dynamic,timeout; timeout <n>s; }
    add rule <t> <chain> <matches> <statement> [comment "<text>"]
      matches:   ip|ip6 saddr|daddr [!=] <addr>|<net>|@<set>;  tcp|udp|sctp dport <n>;
                 meta l4proto <proto>;  fib saddr|daddr type local;
                 numgen random mod <n> 0
      statement: jump|goto <chain>;  drop;  accept;  return;
                 dnat to <addr>:<port> | [<addr6>]:<port>;  update @<set> { ip|ip6 saddr }

Equivalence with nft's own encoding is tested against the kernel: each shape added
both ways reads back with the same expressions (tests/e2e/test_nftables_wire.py), and a
partial sync through this encoder ends where a full sync through nft does.
The wire format is include/uapi/linux/netfilter/nf_tables.h.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Collection
from dataclasses import dataclass

from proxy.dataplane.netlink import (
    NLM_F_ACK,
    NLM_F_CREATE,
    NLM_F_REQUEST,
    frame,
    nested,
    nla,
    parse_attrs,
)
from proxy.dataplane.nftables_probe import NFNL_MSG_BATCH_BEGIN, NFNL_MSG_BATCH_END, NFPROTO
from proxy.dataplane.nftables_probe import NFNL_SUBSYS_NFTABLES as SUBSYS
from proxy.model.types import Family

NLM_F_APPEND = 0x800
# Messages.
GETTABLE, GETCHAIN, GETSET = 1, 4, 10
NEWCHAIN, DELCHAIN, NEWRULE, DELRULE = 3, 5, 6, 8
NEWSET, DELSET, NEWSETELEM, DELSETELEM = 9, 11, 12, 14
# Attributes, per object.
CHAIN_TABLE, CHAIN_NAME = 1, 3
RULE_TABLE, RULE_CHAIN, RULE_EXPRESSIONS, RULE_USERDATA = 1, 2, 4, 7
SET_TABLE, SET_NAME, SET_FLAGS, SET_KEY_TYPE, SET_KEY_LEN = 1, 2, 3, 4, 5
SET_ID, SET_TIMEOUT, SET_USERDATA = 10, 11, 13
ELEMS_TABLE, ELEMS_SET, ELEMS_LIST = 1, 2, 3
ELEM_KEY, ELEM_DATA = 1, 2
LIST_ELEM = 1
DATA_VALUE, DATA_VERDICT = 1, 2
VERDICT_CODE, VERDICT_CHAIN = 1, 2
EXPR_NAME, EXPR_DATA = 1, 2
# Verdicts (netfilter's NF_DROP/NF_ACCEPT, nf_tables' own negative codes).
VERDICTS = {"drop": 0, "accept": 1, "jump": -3, "goto": -4, "return": -5}
REG_VERDICT, REG_1, REG_2 = 0, 1, 2
CMP_EQ, CMP_NEQ = 0, 1
BASE_NETWORK, BASE_TRANSPORT = 1, 2
META_L4PROTO = 16
NG_RANDOM = 1
FIB_RESULT_ADDRTYPE, FIB_F_SADDR, FIB_F_DADDR = 3, 1, 2
RTN_LOCAL = 2
NAT_DNAT, NAT_RANGE_PROTO_SPECIFIED = 1, 2
DYNSET_OP_UPDATE = 1
SET_F_TIMEOUT, SET_F_EVAL = 0x10, 0x20
# nft's data types for set keys, and its user data saying the key is big endian.
KEY_TYPES = {"ipv4_addr": (7, 4), "ipv6_addr": (8, 16)}
_KEY_BIG_ENDIAN = b"\x00\x04" + struct.pack("=I", 2)
PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP, "sctp": 132}
# Where the addresses are in each family's header.
ADDRESS_OFFSETS = {Family.V4: {"saddr": 12, "daddr": 16}, Family.V6: {"saddr": 8, "daddr": 24}}
_NFGEN = struct.Struct("!BBH")
_U32 = struct.Struct("!I")


class Unencodable(ValueError):
    """A line outside the dialect this module encodes (the caller uses nft instead)."""


@dataclass(frozen=True, slots=True)
class Batch:
    data: bytes
    begin_seq: int
    # Sequence number of each message -> the (1-based) line it encodes.
    lines: dict[int, int]


def _u32(value: int) -> bytes:
    return _U32.pack(value)


def _string(kind: int, text: str) -> bytes:
    return nla(kind, text.encode() + b"\0")


def _value(kind: int, data: bytes) -> bytes:
    return nested(kind, nla(DATA_VALUE, data))


def _verdict(kind: int, verb: str, chain: str = "") -> bytes:
    code = struct.pack("!i", VERDICTS[verb])
    body = nla(VERDICT_CODE, code) + (_string(VERDICT_CHAIN, chain) if chain else b"")
    return nested(kind, nested(DATA_VERDICT, body))


def _expr(name: str, attrs: bytes) -> bytes:
    return nested(LIST_ELEM, _string(EXPR_NAME, name) + nested(EXPR_DATA, attrs))


# --- expressions ------------------------------------------------------------------------


def _payload(base: int, offset: int, length: int) -> bytes:
    return _expr("payload", nla(1, _u32(REG_1)) + nla(2, _u32(base)) + nla(3, _u32(offset))
                 + nla(4, _u32(length)))


def _cmp(op: int, data: bytes) -> bytes:
    return _expr("cmp", nla(1, _u32(REG_1)) + nla(2, _u32(op)) + _value(3, data))


def _meta_l4proto() -> bytes:
    return _expr("meta", nla(2, _u32(META_L4PROTO)) + nla(1, _u32(REG_1)))


def _immediate_verdict(verb: str, chain: str = "") -> bytes:
    return _expr("immediate", nla(1, _u32(REG_VERDICT)) + _verdict(2, verb, chain))


def _immediate_data(reg: int, data: bytes) -> bytes:
    return _expr("immediate", nla(1, _u32(reg)) + _value(2, data))


def _protocol(name: str) -> int:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise Unencodable(f"protocol {name!r}") from None


def _address(text: str, family: Family) -> bytes:
    try:
        addr = ipaddress.ip_address(text)
    except ValueError:
        raise Unencodable(f"address {text!r}") from None
    if addr.version != family.value:
        raise Unencodable(f"address {text!r} in the other family's table")
    return addr.packed


def _port(text: str) -> bytes:
    if not text.isdigit() or not 0 <= int(text) <= 0xFFFF:
        raise Unencodable(f"port {text!r}")
    return struct.pack("!H", int(text))


def _address_match(family: Family, field: str, op: int, operand: str) -> list[bytes]:
    """`ip saddr 198.18.0.0/17` and its kin, as nft encodes them: a prefix on a byte
    boundary loads only its bytes; any other is masked."""
    offset = ADDRESS_OFFSETS[family][field]
    width = 4 if family is Family.V4 else 16
    if operand.startswith("@"):
        if op != CMP_EQ:
            raise Unencodable("a negated set lookup")
        lookup = _expr("lookup", nla(2, _u32(REG_1)) + _string(1, operand[1:]))
        return [_payload(BASE_NETWORK, offset, width), lookup]
    if "/" not in operand:
        return [_payload(BASE_NETWORK, offset, width), _cmp(op, _address(operand, family))]
    try:
        net = ipaddress.ip_network(operand, strict=True)
    except ValueError:
        raise Unencodable(f"network {operand!r}") from None
    if net.version != family.value:
        raise Unencodable(f"network {operand!r} in the other family's table")
    bits = net.prefixlen
    if bits and bits % 8 == 0:
        size = bits // 8
        return [_payload(BASE_NETWORK, offset, size),
                _cmp(op, net.network_address.packed[:size])]
    mask = net.netmask.packed
    bitwise = _expr("bitwise", nla(1, _u32(REG_1)) + nla(2, _u32(REG_1))
                    + nla(3, _u32(width)) + _value(4, mask) + _value(5, bytes(width)))
    return [_payload(BASE_NETWORK, offset, width), bitwise,
            _cmp(op, net.network_address.packed)]


def _dnat(family: Family, target: str) -> list[bytes]:
    host, sep, port = target.rpartition(":")
    if not sep:
        raise Unencodable(f"dnat target {target!r} without a port")
    if family is Family.V6:
        if not (host.startswith("[") and host.endswith("]")):
            raise Unencodable(f"dnat target {target!r}")
        host = host[1:-1]
    nat = (nla(1, _u32(NAT_DNAT)) + nla(2, _u32(NFPROTO[family])) + nla(3, _u32(REG_1))
           + nla(5, _u32(REG_2)) + nla(7, _u32(NAT_RANGE_PROTO_SPECIFIED)))
    return [_immediate_data(REG_1, _address(host, family)),
            _immediate_data(REG_2, _port(port)), _expr("nat", nat)]


def _rule_expressions(family: Family, tokens: list[str]) -> bytes:
    ip = "ip" if family is Family.V4 else "ip6"
    out: list[bytes] = []
    i = 0
    n = len(tokens)

    def take(count: int) -> list[str]:
        nonlocal i
        if i + count > n:
            raise Unencodable(f"{' '.join(tokens[i:])!r} ends too soon")
        got = tokens[i:i + count]
        i += count
        return got

    final = False
    while i < n:
        if final:
            raise Unencodable(f"{' '.join(tokens[i:])!r} after the verdict")
        word = tokens[i]
        if word == ip and i + 1 < n and tokens[i + 1] in ("saddr", "daddr"):
            _, field, operand = take(3)
            op = CMP_EQ
            if operand == "!=":
                op, operand = CMP_NEQ, take(1)[0]
            out += _address_match(family, field, op, operand)
        elif word in PROTOCOLS and i + 1 < n and tokens[i + 1] == "dport":
            proto, _, port = take(3)
            out += [_meta_l4proto(), _cmp(CMP_EQ, bytes([_protocol(proto)])),
                    _payload(BASE_TRANSPORT, 2, 2), _cmp(CMP_EQ, _port(port))]
        elif word == "meta":
            _, key, proto = take(3)
            if key != "l4proto":
                raise Unencodable(f"meta {key}")
            out += [_meta_l4proto(), _cmp(CMP_EQ, bytes([_protocol(proto)]))]
        elif word == "fib":
            _, field, kw, what = take(4)
            if field not in ("saddr", "daddr") or kw != "type" or what != "local":
                raise Unencodable(f"fib {field} {kw} {what}")
            flag = FIB_F_SADDR if field == "saddr" else FIB_F_DADDR
            fib = nla(3, _u32(flag)) + nla(2, _u32(FIB_RESULT_ADDRTYPE)) + nla(1, _u32(REG_1))
            out += [_expr("fib", fib), _cmp(CMP_EQ, struct.pack("=I", RTN_LOCAL))]
        elif word == "numgen":
            _, kind, mod, modulus, value = take(5)
            if kind != "random" or mod != "mod" or not modulus.isdigit() or value != "0":
                raise Unencodable(f"numgen {kind} {mod} {modulus} {value}")
            ng = (nla(1, _u32(REG_1)) + nla(2, _u32(int(modulus))) + nla(3, _u32(NG_RANDOM))
                  + nla(4, _u32(0)))
            out += [_expr("numgen", ng), _cmp(CMP_EQ, struct.pack("=I", 0))]
        elif word in ("jump", "goto"):
            verb, chain = take(2)
            out.append(_immediate_verdict(verb, chain))
            final = True
        elif word in ("drop", "accept", "return"):
            out.append(_immediate_verdict(take(1)[0]))
            final = True
        elif word == "dnat":
            _, to, target = take(3)
            if to != "to":
                raise Unencodable(f"dnat {to}")
            out += _dnat(family, target)
            final = True
        elif word == "update":
            _, set_ref, open_, proto, field, close = take(6)
            if (not set_ref.startswith("@") or (open_, close) != ("{", "}") or proto != ip
                    or field != "saddr"):
                raise Unencodable(f"update {set_ref} {open_} {proto} {field} {close}")
            width = 4 if family is Family.V4 else 16
            dynset = (nla(4, _u32(REG_1)) + nla(3, _u32(DYNSET_OP_UPDATE))
                      + _string(1, set_ref[1:]))
            out += [_payload(BASE_NETWORK, ADDRESS_OFFSETS[family]["saddr"], width),
                    _expr("dynset", dynset)]
        else:
            raise Unencodable(f"{word!r}")
    if not out:
        raise Unencodable("an empty rule")
    return nested(RULE_EXPRESSIONS, b"".join(out))


def _comment(text: str) -> bytes:
    data = text.encode() + b"\0"
    if len(data) > 255:
        raise Unencodable("a comment over 254 bytes")
    return nla(RULE_USERDATA, bytes([0, len(data)]) + data)


# --- elements and sets ----------------------------------------------------------------------


def _element_key(family: Family, text: str) -> bytes:
    """`198.18.0.1 . tcp . 80` -> each part in its own 32-bit register slot, as the
    kernel lays out concatenations."""
    out = b""
    for part in text.split(" . "):
        if part in PROTOCOLS:
            raw = bytes([PROTOCOLS[part]])
        elif part.isdigit():
            raw = _port(part)
        else:
            raw = _address(part, family)
        out += raw + b"\0" * (-len(raw) % 4)
    return out


def _element(family: Family, text: str) -> bytes:
    key, sep, value = text.partition(" : ")
    attrs = _value(ELEM_KEY, _element_key(family, key.strip()))
    if sep:
        verb, _, chain = value.strip().partition(" ")
        if verb not in VERDICTS or bool(chain) != (verb in ("jump", "goto")):
            raise Unencodable(f"element value {value!r}")
        attrs += _verdict(ELEM_DATA, verb, chain)
    return nested(LIST_ELEM, attrs)


def _set_body(body: str) -> bytes:
    """The affinity sets' one shape: an address, dynamic, with a timeout."""
    parts = [p.strip() for p in body.strip().rstrip(";").split(";")]
    if len(parts) != 3 or not parts[0].startswith("type ") \
            or parts[1] != "flags dynamic,timeout" or not parts[2].startswith("timeout "):
        raise Unencodable(f"set {{ {body} }}")
    key = KEY_TYPES.get(parts[0].removeprefix("type "))
    seconds = parts[2].removeprefix("timeout ").removesuffix("s")
    if key is None or not seconds.isdigit():
        raise Unencodable(f"set {{ {body} }}")
    return (nla(SET_FLAGS, _u32(SET_F_TIMEOUT | SET_F_EVAL)) + nla(SET_KEY_TYPE, _u32(key[0]))
            + nla(SET_KEY_LEN, _u32(key[1]))
            + nla(SET_TIMEOUT, struct.pack("!Q", int(seconds) * 1000))
            + nla(SET_USERDATA, _KEY_BIG_ENDIAN))


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


# --- lines -----------------------------------------------------------------------------------


def _line(family: Family, tables: Collection[str], line: str,
          set_id: int) -> tuple[int, int, bytes]:
    """(message type, flags, attributes) for one line."""
    words = line.split(" ", 4)
    if len(words) < 5:
        raise Unencodable(f"{line!r}")
    verb, kind, fam, table, rest = words
    if fam != ("ip" if family is Family.V4 else "ip6") or table not in tables:
        raise Unencodable(f"not our {family.label} table: {line!r}")
    t = _string(1, table)
    if kind == "rule" and verb == "add":
        chain, _, rule = rest.partition(" ")
        body, mark, note = rule.partition(' comment "')
        if mark and (not note.endswith('"') or '"' in note[:-1]):
            raise Unencodable(f"comment in {line!r}")
        attrs = (t + _string(RULE_CHAIN, _plain_name(chain))
                 + _rule_expressions(family, body.split()))
        if mark:
            attrs += _comment(note[:-1])
        return NEWRULE, NLM_F_CREATE | NLM_F_APPEND, attrs
    if kind == "element" and verb in ("add", "delete"):
        name, inner = _braced(rest)
        elements = b"".join(_element(family, e) for e in inner.split(", "))
        attrs = t + _string(ELEMS_SET, name) + nested(ELEMS_LIST, elements)
        return (NEWSETELEM, NLM_F_CREATE, attrs) if verb == "add" else (DELSETELEM, 0, attrs)
    if kind == "chain":
        named = _string(CHAIN_NAME, _plain_name(rest))
        if verb == "add":
            return NEWCHAIN, NLM_F_CREATE, t + named
        if verb == "delete":
            return DELCHAIN, 0, t + named
        if verb == "flush":  # every rule of the chain: a rule deletion naming no rule
            return DELRULE, 0, t + _string(RULE_CHAIN, _plain_name(rest))
    if kind in ("set", "map"):
        if verb == "add" and kind == "set":
            name, body = _braced(rest)
            return NEWSET, NLM_F_CREATE, (t + _string(SET_NAME, name) + _set_body(body)
                                          + nla(SET_ID, _u32(set_id)))
        if verb == "delete":
            return DELSET, 0, t + _string(SET_NAME, _plain_name(rest))
    raise Unencodable(f"{verb} {kind}")


def encode(script: str, family: Family, tables: Collection[str], first_seq: int) -> Batch:
    """The batch for `script` (one statement per line) on `tables` of `family`; message
    sequence numbers from `first_seq` on. The last message asks for an
    acknowledgement: the kernel answers a batch in order, so any refusal of an earlier
    line arrives before it. Raises Unencodable for anything outside the
    dialect (module docstring)."""
    nfproto = NFPROTO[family]
    header = _NFGEN.pack(nfproto, 0, 0)
    seq = first_seq
    chunks = [frame(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, seq,
                    _NFGEN.pack(socket.AF_UNSPEC, 0, SUBSYS))]
    lines: dict[int, int] = {}
    messages = [(number, _line(family, tables, line, number))
                for number, line in enumerate(script.splitlines(), start=1) if line]
    for i, (number, (msg, flags, attrs)) in enumerate(messages):
        seq += 1
        lines[seq] = number
        if i == len(messages) - 1:
            flags |= NLM_F_ACK
        chunks.append(frame(SUBSYS << 8 | msg, NLM_F_REQUEST | flags, seq, header + attrs))
    seq += 1
    chunks.append(frame(NFNL_MSG_BATCH_END, NLM_F_REQUEST, seq,
                        _NFGEN.pack(socket.AF_UNSPEC, 0, SUBSYS)))
    return Batch(b"".join(chunks), first_seq, lines)


# --- reading names back (pure) ---------------------------------------------------------------

SET_F_ANONYMOUS, SET_F_MAP = 0x1, 0x8


def dump_request(family: Family) -> bytes:
    """The body of a dump of every table, chain or set of `family`."""
    return _NFGEN.pack(NFPROTO[family], 0, 0)


def decode_names(kind: int, payload: bytes) -> tuple[str, str, str]:
    """(table, name, "set" | "map" | "") of one dumped table, chain or set (for a table:
    its name twice). Anonymous sets (nft's `{ ... }` in a rule) have kind ""."""
    attrs = parse_attrs(payload[_NFGEN.size:])

    def text(attr: int) -> str:
        return attrs.get(attr, b"").split(b"\0", 1)[0].decode(errors="replace")

    if kind == GETTABLE:
        return text(1), text(1), ""
    if kind == GETCHAIN:
        return text(CHAIN_TABLE), text(CHAIN_NAME), ""
    flags = int.from_bytes(attrs.get(SET_FLAGS, b"\0\0\0\0"), "big")
    what = "" if flags & SET_F_ANONYMOUS else "map" if flags & SET_F_MAP else "set"
    return text(SET_TABLE), text(SET_NAME), what
