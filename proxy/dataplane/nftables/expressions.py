"""nf_tables rule expressions for the rules of our nftables dialect (pure).

One rule's text (after `add rule <family> <table> <chain>`; with its comment, in
`encode_rules`) becomes the expressions nft would send for it, so the kernel holds the
same rule whichever way it came (tests/e2e/test_nftables_wire_kernel.py compares both, byte
for byte, as the kernel dumps them).
The dialect, closed; anything else raises `Unencodable`:

    matches:   ip|ip6 saddr|daddr [!=] <addr>|<net>|@<set>;  tcp|udp|sctp dport <n>;
               meta l4proto <proto>;  fib saddr|daddr type local;  numgen random mod <n> 0;
               numgen random mod <n> < <k>;
               ct state new;  ct status dnat;  meta mark & <mask> == <value>;
               <selector> . <selector> [. ...] @<set>   (selectors: ip|ip6 saddr|daddr,
               meta l4proto, th dport, tcp|udp|sctp dport, numgen random mod <n>)
    statement: jump|goto <chain>;  drop;  accept;  return;  reject;
               dnat to <addr>:<port> | [<addr6>]:<port>;  update @<set> { ip|ip6 saddr };
               dnat ip|ip6 to numgen random mod <n> map @<slot map>;
               dnat ip|ip6 to jhash <hashed> mod <n> seed <seed> map @<slot map>
               (hashed: ip|ip6 saddr [. tcp|udp|sctp sport]);
               jhash <hashed> mod <n> seed <seed> vmap @<slot map of verdicts>;
               dnat ip|ip6 to ip|ip6 daddr . <proto> dport . numgen random mod <n>
                   map @<pick map>;
               counter name <concatenation> map @<counter map>;
               masquerade fully-random;  meta mark set meta mark ^ <bits> (or |);
               counter name "<counter>" (before another statement or a verdict);
               <concatenation> vmap @<map>

Speed matters here: a full sync at 10,000 services is 100,000 rules, and most of a
rule is the same bytes as the rule before (the protocol match, the numgen, the nat
expression): those parts are built once and cached.
The wire format is include/uapi/linux/netfilter/nf_tables.h.
"""

from __future__ import annotations

import functools
import socket
import struct
from collections.abc import Callable, Iterable

from proxy.dataplane.common.netlink import nested, nla
from proxy.dataplane.common.netlink_constants import (
    ICMP_PORT_UNREACH,
    ICMPV6_PORT_UNREACH,
    IPS_DST_NAT,
    NF_ACCEPT,
    NF_CT_STATE_NEW,
    NF_DROP,
    NF_NAT_RANGE_PROTO_RANDOM_FULLY,
    NF_NAT_RANGE_PROTO_SPECIFIED,
    NFPROTO,
    NFT_BYTEORDER_HTON,
    NFT_CMP_EQ,
    NFT_CMP_LT,
    NFT_CMP_NEQ,
    NFT_CT_STATE,
    NFT_CT_STATUS,
    NFT_DYNSET_OP_UPDATE,
    NFT_FIB_RESULT_ADDRTYPE,
    NFT_GOTO,
    NFT_HASH_JENKINS,
    NFT_JUMP,
    NFT_META_L4PROTO,
    NFT_META_MARK,
    NFT_NAT_DNAT,
    NFT_NG_RANDOM,
    NFT_OBJECT_COUNTER,
    NFT_PAYLOAD_NETWORK_HEADER,
    NFT_PAYLOAD_TRANSPORT_HEADER,
    NFT_REG32_00,
    NFT_REG_1,
    NFT_REG_2,
    NFT_REG_VERDICT,
    NFT_REJECT_ICMP_UNREACH,
    NFT_RETURN,
    NFTA_BITWISE_DREG,
    NFTA_BITWISE_LEN,
    NFTA_BITWISE_MASK,
    NFTA_BITWISE_SREG,
    NFTA_BITWISE_XOR,
    NFTA_BYTEORDER_DREG,
    NFTA_BYTEORDER_LEN,
    NFTA_BYTEORDER_OP,
    NFTA_BYTEORDER_SIZE,
    NFTA_BYTEORDER_SREG,
    NFTA_CMP_DATA,
    NFTA_CMP_OP,
    NFTA_CMP_SREG,
    NFTA_CT_DREG,
    NFTA_CT_KEY,
    NFTA_DATA_VALUE,
    NFTA_DATA_VERDICT,
    NFTA_DYNSET_OP,
    NFTA_DYNSET_SET_NAME,
    NFTA_DYNSET_SREG_KEY,
    NFTA_EXPR_DATA,
    NFTA_EXPR_NAME,
    NFTA_FIB_DREG,
    NFTA_FIB_F_DADDR,
    NFTA_FIB_F_SADDR,
    NFTA_FIB_FLAGS,
    NFTA_FIB_RESULT,
    NFTA_HASH_DREG,
    NFTA_HASH_LEN,
    NFTA_HASH_MODULUS,
    NFTA_HASH_OFFSET,
    NFTA_HASH_SEED,
    NFTA_HASH_SREG,
    NFTA_HASH_TYPE,
    NFTA_IMMEDIATE_DATA,
    NFTA_IMMEDIATE_DREG,
    NFTA_LIST_ELEM,
    NFTA_LOOKUP_DREG,
    NFTA_LOOKUP_SET,
    NFTA_LOOKUP_SREG,
    NFTA_MASQ_FLAGS,
    NFTA_META_DREG,
    NFTA_META_KEY,
    NFTA_META_SREG,
    NFTA_NAT_FAMILY,
    NFTA_NAT_FLAGS,
    NFTA_NAT_REG_ADDR_MIN,
    NFTA_NAT_REG_PROTO_MIN,
    NFTA_NAT_TYPE,
    NFTA_NG_DREG,
    NFTA_NG_MODULUS,
    NFTA_NG_OFFSET,
    NFTA_NG_TYPE,
    NFTA_OBJREF_IMM_NAME,
    NFTA_OBJREF_IMM_TYPE,
    NFTA_OBJREF_SET_NAME,
    NFTA_OBJREF_SET_SREG,
    NFTA_PAYLOAD_BASE,
    NFTA_PAYLOAD_DREG,
    NFTA_PAYLOAD_LEN,
    NFTA_PAYLOAD_OFFSET,
    NFTA_REJECT_ICMP_CODE,
    NFTA_REJECT_TYPE,
    NFTA_RULE_EXPRESSIONS,
    NFTA_RULE_USERDATA,
    NFTA_VERDICT_CHAIN,
    NFTA_VERDICT_CODE,
    RTN_LOCAL,
)
from proxy.model.types import Family

VERDICTS = {"drop": NF_DROP, "accept": NF_ACCEPT, "jump": NFT_JUMP, "goto": NFT_GOTO,
            "return": NFT_RETURN}
PORT_UNREACHABLE = {Family.V4: ICMP_PORT_UNREACH, Family.V6: ICMPV6_PORT_UNREACH}
PROTOCOLS = {"tcp": socket.IPPROTO_TCP, "udp": socket.IPPROTO_UDP, "sctp": 132}
# Where the addresses are in each family's header.
ADDRESS_OFFSETS = {Family.V4: {"saddr": 12, "daddr": 16}, Family.V6: {"saddr": 8, "daddr": 24}}
ADDRESS_WIDTH = {Family.V4: 4, Family.V6: 16}
INET = {Family.V4: socket.AF_INET, Family.V6: socket.AF_INET6}
_U32 = struct.Struct("!I")
_HOST_U32 = struct.Struct("=I")


class Unencodable(ValueError):
    """A line outside the dialect this package encodes (the caller uses nft instead)."""


# --- attributes ------------------------------------------------------------------------------


def u32(value: int) -> bytes:
    return _U32.pack(value)


def unique_string(kind: int, text: str) -> bytes:
    """A string attribute, for a text used once (each of a full sync's 10,000 chains)."""
    return nla(kind, text.encode() + b"\0")


# Small caches: a script names one chain, set or comment on many consecutive lines.
string = functools.lru_cache(maxsize=256)(unique_string)


def value(kind: int, data: bytes) -> bytes:
    return nested(kind, nla(NFTA_DATA_VALUE, data))


def verdict(kind: int, verb: str, chain: str = "") -> bytes:
    if not chain:
        return _verdict(kind, verb, "")
    name = chain.encode() + b"\0"  # most chains are named once (a map's 10,000 services)
    return _verdict_head(kind, verb, len(name)) + name + bytes(-len(name) % 4)


@functools.lru_cache(maxsize=256)
def _verdict(kind: int, verb: str, chain: str) -> bytes:
    code = struct.pack("!i", VERDICTS[verb])
    body = nla(NFTA_VERDICT_CODE, code) + (string(NFTA_VERDICT_CHAIN, chain) if chain else b"")
    return nested(kind, nested(NFTA_DATA_VERDICT, body))


@functools.lru_cache(maxsize=256)
def _verdict_head(kind: int, verb: str, length: int) -> bytes:
    """What `verdict` puts before a chain's name of `length` bytes (with its NUL)."""
    return _verdict(kind, verb, "x" * (length - 1))[:-(length + -length % 4)]


def _expr(name: str, attrs: bytes) -> bytes:
    return nested(NFTA_LIST_ELEM, string(NFTA_EXPR_NAME, name) + nested(NFTA_EXPR_DATA, attrs))


def register(slot: int) -> int:
    """nft's register for the 32-bit slot `slot` of a concatenation: a whole 128-bit
    register where one starts (the old numbering, as nft keeps it), else a 32-bit one."""
    return NFT_REG_1 + slot // 4 if slot % 4 == 0 else NFT_REG32_00 + slot


# --- expressions (cached: the same few appear in every rule) ---------------------------------


@functools.cache
def payload(base: int, offset: int, length: int, reg: int = NFT_REG_1) -> bytes:
    return _expr("payload", nla(NFTA_PAYLOAD_DREG, u32(reg))
                 + nla(NFTA_PAYLOAD_BASE, u32(base)) + nla(NFTA_PAYLOAD_OFFSET, u32(offset))
                 + nla(NFTA_PAYLOAD_LEN, u32(length)))


@functools.lru_cache(maxsize=256)
def cmp(op: int, data: bytes) -> bytes:
    return _expr("cmp", nla(NFTA_CMP_SREG, u32(NFT_REG_1)) + nla(NFTA_CMP_OP, u32(op))
                 + value(NFTA_CMP_DATA, data))


@functools.cache
def meta_load(key: int, reg: int = NFT_REG_1) -> bytes:
    return _expr("meta", nla(NFTA_META_KEY, u32(key)) + nla(NFTA_META_DREG, u32(reg)))


@functools.cache
def _ct_load(key: int) -> bytes:
    return _expr("ct", nla(NFTA_CT_KEY, u32(key)) + nla(NFTA_CT_DREG, u32(NFT_REG_1)))


@functools.cache
def _bitwise(width: int, mask: bytes, xor: bytes) -> bytes:
    return _expr("bitwise", nla(NFTA_BITWISE_SREG, u32(NFT_REG_1))
                 + nla(NFTA_BITWISE_DREG, u32(NFT_REG_1)) + nla(NFTA_BITWISE_LEN, u32(width))
                 + value(NFTA_BITWISE_MASK, mask) + value(NFTA_BITWISE_XOR, xor))


@functools.lru_cache(maxsize=256)
def _immediate_verdict(verb: str, chain: str = "") -> bytes:
    return _expr("immediate", nla(NFTA_IMMEDIATE_DREG, u32(NFT_REG_VERDICT))
                 + verdict(NFTA_IMMEDIATE_DATA, verb, chain))


def _immediate_data(reg: int, data: bytes) -> bytes:
    return _expr("immediate", nla(NFTA_IMMEDIATE_DREG, u32(reg)) + value(NFTA_IMMEDIATE_DATA, data))


@functools.lru_cache(maxsize=256)
def _lookup(set_name: str, dreg: int | None = None) -> bytes:
    attrs = nla(NFTA_LOOKUP_SREG, u32(NFT_REG_1)) + string(NFTA_LOOKUP_SET, set_name)
    if dreg is not None:
        attrs += nla(NFTA_LOOKUP_DREG, u32(dreg))
    return _expr("lookup", attrs)


@functools.cache
def _protocol_match(proto: int) -> bytes:
    return meta_load(NFT_META_L4PROTO) + cmp(NFT_CMP_EQ, bytes([proto]))


def _numgen_random(modulus: int, reg: int = NFT_REG_1) -> bytes:
    """numgen's attributes: `numgen random mod <modulus>` (offset 0) into `reg`."""
    return (nla(NFTA_NG_DREG, u32(reg)) + nla(NFTA_NG_MODULUS, u32(modulus))
            + nla(NFTA_NG_TYPE, u32(NFT_NG_RANDOM)) + nla(NFTA_NG_OFFSET, u32(0)))


@functools.cache
def _numgen(modulus: int) -> bytes:
    return _expr("numgen", _numgen_random(modulus)) + cmp(NFT_CMP_EQ, _HOST_U32.pack(0))


@functools.cache
def _numgen_below(modulus: int, bound: int) -> bytes:
    """`numgen random mod <modulus> < <bound>`: as nft sends it, the host-order pick
    turned to network order, so that the kernel's bytewise `lt` compares numbers."""
    hton = (nla(NFTA_BYTEORDER_SREG, u32(NFT_REG_1)) + nla(NFTA_BYTEORDER_DREG, u32(NFT_REG_1))
            + nla(NFTA_BYTEORDER_OP, u32(NFT_BYTEORDER_HTON)) + nla(NFTA_BYTEORDER_LEN, u32(4))
            + nla(NFTA_BYTEORDER_SIZE, u32(4)))
    return (_expr("numgen", _numgen_random(modulus)) + _expr("byteorder", hton)
            + cmp(NFT_CMP_LT, u32(bound)))


@functools.cache
def _fib_local(flag: int) -> bytes:
    fib = (nla(NFTA_FIB_FLAGS, u32(flag)) + nla(NFTA_FIB_RESULT, u32(NFT_FIB_RESULT_ADDRTYPE))
           + nla(NFTA_FIB_DREG, u32(NFT_REG_1)))
    return _expr("fib", fib) + cmp(NFT_CMP_EQ, _HOST_U32.pack(RTN_LOCAL))


@functools.cache
def _nat(family: Family, port_reg: int = NFT_REG_2) -> bytes:
    return _expr("nat", nla(NFTA_NAT_TYPE, u32(NFT_NAT_DNAT))
                 + nla(NFTA_NAT_FAMILY, u32(NFPROTO[family]))
                 + nla(NFTA_NAT_REG_ADDR_MIN, u32(NFT_REG_1))
                 + nla(NFTA_NAT_REG_PROTO_MIN, u32(port_reg))
                 + nla(NFTA_NAT_FLAGS, u32(NF_NAT_RANGE_PROTO_SPECIFIED)))


@functools.lru_cache(maxsize=256)
def _dnat_slot_map(family: Family, modulus: int, set_name: str) -> bytes:
    """`dnat ip to numgen random mod <n> map @<slots>`: a slot into register 1, looked
    up into the address (from register 1) and the port (the register slot after it)."""
    return (_expr("numgen", _numgen_random(modulus)) + _lookup(set_name, NFT_REG_1)
            + _nat(family, register(ADDRESS_WIDTH[family] // 4)))


@functools.lru_cache(maxsize=256)
def _dnat_hashed(family: Family, fields: tuple[str, ...], modulus: int, seed: int,
                 set_name: str) -> bytes:
    """`dnat ip to jhash <fields> mod <n> seed <seed> map @<slots>` as nft sends it: the
    slot (`_jhash`) looked up into the address and the port."""
    return (_jhash(family, fields, modulus, seed) + _lookup(set_name, NFT_REG_1)
            + _nat(family, register(ADDRESS_WIDTH[family] // 4)))


@functools.lru_cache(maxsize=256)
def _jhash_vmap(family: Family, fields: tuple[str, ...], modulus: int, seed: int,
                set_name: str) -> bytes:
    """`jhash <fields> mod <n> seed <seed> vmap @<slots>`: the slot looked up into the
    verdict register."""
    return _jhash(family, fields, modulus, seed) + _lookup(set_name, NFT_REG_VERDICT)


def _jhash(family: Family, fields: tuple[str, ...], modulus: int, seed: int) -> bytes:
    """The fields loaded from register 2 on, hashed into register 1, as nft sends it."""
    loads, width = b"", 0
    for field in fields:
        if field == "saddr":
            size = ADDRESS_WIDTH[family]
            loads += payload(NFT_PAYLOAD_NETWORK_HEADER, ADDRESS_OFFSETS[family]["saddr"], size,
                             register(4 + width // 4))
        else:  # the source port
            size = 2
            loads += payload(NFT_PAYLOAD_TRANSPORT_HEADER, 0, size, register(4 + width // 4))
        width += (size + 3) // 4 * 4
    hashed = (nla(NFTA_HASH_SREG, u32(NFT_REG_2)) + nla(NFTA_HASH_DREG, u32(NFT_REG_1))
              + nla(NFTA_HASH_LEN, u32(width)) + nla(NFTA_HASH_MODULUS, u32(modulus))
              + nla(NFTA_HASH_SEED, u32(seed)) + nla(NFTA_HASH_OFFSET, u32(0))
              + nla(NFTA_HASH_TYPE, u32(NFT_HASH_JENKINS)))
    return loads + _expr("hash", hashed)


def _hashed_fields(family: Family, words: list[str]) -> tuple[str, ...]:
    """`ip saddr [. tcp sport]` -> ("saddr"[, "sport"])."""
    if words[:2] == [_ip(family), "saddr"] and len(words) == 2:
        return ("saddr",)
    if words[:3] == [_ip(family), "saddr", "."] and len(words) == 5 \
            and words[3] in PROTOCOLS and words[4] == "sport":
        return ("saddr", "sport")
    raise Unencodable(f"jhash {' '.join(words)}")


def _dnat_hash_statement(family: Family, cur: _Cursor) -> list[bytes]:
    """`dnat ip to jhash <fields> mod <n> seed <seed> map @<slots>` at the cursor."""
    cur.take(3)  # dnat ip to
    return [_dnat_hashed(family, *_hash_lookup(family, cur, "map"))]


def _hash_vmap_statement(family: Family, cur: _Cursor) -> list[bytes]:
    """`jhash <fields> mod <n> seed <seed> vmap @<slots>` at the cursor."""
    return [_jhash_vmap(family, *_hash_lookup(family, cur, "vmap"))]


def _hash_lookup(family: Family, cur: _Cursor, how: str
                 ) -> tuple[tuple[str, ...], int, int, str]:
    """`jhash <fields> mod <n> seed <seed> <how> @<slots>` at the cursor: the fields,
    n, the seed and the map's name."""
    cur.take(1)  # jhash
    fields: list[str] = []
    while cur.more() and cur.at(0) != "mod":
        fields += cur.take(1)
    _, modulus, seed_kw, seed, map_, set_ref = cur.take(6)
    if (seed_kw, map_) != ("seed", how) or not modulus.isdigit() \
            or not 0 < int(modulus) <= 0xFFFFFFFF or not set_ref.startswith("@"):
        raise Unencodable(f"jhash ... mod {modulus} {seed_kw} {seed} {map_} {set_ref}")
    return _hashed_fields(family, fields), int(modulus), _number(seed), set_ref[1:]


def _dnat_tail(family: Family, port_text: str) -> bytes:
    """What follows the address in `dnat to <addr>:<port>`: the port's immediate, then
    the nat expression (the same length for every port)."""
    return _immediate_data(NFT_REG_2, port(port_text)) + _nat(family)


def protocol(name: str) -> int:
    try:
        return PROTOCOLS[name]
    except KeyError:
        raise Unencodable(f"protocol {name!r}") from None


def address(text: str, family: Family) -> bytes:
    try:
        return socket.inet_pton(INET[family], text)
    except OSError:
        raise Unencodable(f"address {text!r} in the {family.label} table") from None


def port(text: str) -> bytes:
    if not text.isdigit() or not 0 <= int(text) <= 0xFFFF:
        raise Unencodable(f"port {text!r}")
    return struct.pack("!H", int(text))


def _number(text: str) -> int:
    try:
        number = int(text, 0)
    except ValueError:
        raise Unencodable(f"number {text!r}") from None
    if not 0 <= number <= 0xFFFFFFFF:
        raise Unencodable(f"number {text!r}")
    return number


def _network(operand: str, family: Family) -> tuple[bytes, int]:
    """(address bytes, prefix length) of `a.b.c.d/n`, which must be a network address."""
    addr, _, bits = operand.partition("/")
    raw = address(addr, family)
    width = len(raw) * 8
    if not bits.isdigit() or int(bits) > width:
        raise Unencodable(f"network {operand!r}")
    prefix = int(bits)
    if int.from_bytes(raw, "big") & ((1 << (width - prefix)) - 1):
        raise Unencodable(f"network {operand!r} has host bits")
    return raw, prefix


def _address_match(family: Family, field: str, op: int, operand: str) -> bytes:
    """`ip saddr 198.18.0.0/17` and its kin, as nft encodes them: a prefix on a byte
    boundary loads only its bytes; any other is masked."""
    offset = ADDRESS_OFFSETS[family][field]
    width = ADDRESS_WIDTH[family]
    if operand.startswith("@"):
        if op != NFT_CMP_EQ:
            raise Unencodable("a negated set lookup")
        return payload(NFT_PAYLOAD_NETWORK_HEADER, offset, width) + _lookup(operand[1:])
    if "/" not in operand:
        return (payload(NFT_PAYLOAD_NETWORK_HEADER, offset, width)
                + cmp(op, address(operand, family)))
    raw, bits = _network(operand, family)
    if bits and bits % 8 == 0:
        size = bits // 8
        return payload(NFT_PAYLOAD_NETWORK_HEADER, offset, size) + cmp(op, raw[:size])
    mask = ((((1 << bits) - 1) << (width * 8 - bits)) if bits else 0).to_bytes(width, "big")
    return (payload(NFT_PAYLOAD_NETWORK_HEADER, offset, width)
            + _bitwise(width, mask, bytes(width)) + cmp(op, raw))


@functools.cache
def _immediate_address_head(family: Family) -> bytes:
    """An immediate of an address into register 1, but the address's bytes, which end
    it (4 or 16 bytes: no padding follows)."""
    width = ADDRESS_WIDTH[family]
    return _immediate_data(NFT_REG_1, bytes(width))[:-width]


def _dnat_address(family: Family, host: str) -> bytes:
    """The address of a dnat target: `<addr>`, or in ip6 `[<addr6>]`."""
    if family is Family.V6:
        if not (host.startswith("[") and host.endswith("]")):
            raise Unencodable(f"dnat target address {host!r}")
        host = host[1:-1]
    return address(host, family)


def _dnat(family: Family, target: str) -> bytes:
    host, sep, port_text = target.rpartition(":")
    if not sep:
        raise Unencodable(f"dnat target {target!r} without a port")
    return (_immediate_address_head(family) + _dnat_address(family, host)
            + _dnat_tail(family, port_text))


# --- concatenations ----------------------------------------------------------------------------


def _selector(family: Family, tokens: list[str], i: int, protocol_ports: bool = False
              ) -> tuple[int, int] | None:
    """(how many tokens, width in bytes) of the concatenable selector at tokens[i];
    `tcp|udp|sctp dport` only with `protocol_ports` (a pick map's key, after a match of
    that protocol: elsewhere nft would add the match, and the bytes would differ)."""
    ip = "ip" if family is Family.V4 else "ip6"
    pair = tuple(tokens[i:i + 2])
    if pair in ((ip, "saddr"), (ip, "daddr")):
        return 2, ADDRESS_WIDTH[family]
    if pair == ("meta", "l4proto"):
        return 2, 1
    if pair == ("th", "dport") or (protocol_ports and pair[0] in PROTOCOLS
                                   and pair[1] == "dport"):
        return 2, 2
    if pair == ("numgen", "random") and tokens[i + 2:i + 3] == ["mod"] \
            and tokens[i + 3:i + 4] and tokens[i + 3].isdigit() \
            and 0 < int(tokens[i + 3]) <= 0xFFFFFFFF:
        return 4, 4  # a pick: numgen's host-order u32
    return None


def _load(family: Family, words: list[str], reg: int) -> bytes:
    if words[0] in ("ip", "ip6"):
        return payload(NFT_PAYLOAD_NETWORK_HEADER, ADDRESS_OFFSETS[family][words[1]],
                       ADDRESS_WIDTH[family], reg)
    if words[0] == "meta":
        return meta_load(NFT_META_L4PROTO, reg)
    if words[0] == "numgen":
        return _expr("numgen", _numgen_random(int(words[3]), reg))
    return payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2, reg)  # th dport


def _concatenation(family: Family, tokens: list[str], i: int, protocol_ports: bool = False
                   ) -> tuple[int, bytes] | None:
    """(index after it, the loads into consecutive registers) of `a . b [. c]` at
    tokens[i]; None when tokens[i] starts no concatenation. (`protocol_ports`: _selector.)"""
    loads = b""
    slot = 0
    j = i
    while True:
        found = _selector(family, tokens, j, protocol_ports)
        if found is None:
            if j == i:
                return None
            raise Unencodable(f"{' '.join(tokens[i:j + 2])!r}: not a concatenation we speak")
        count, width = found
        loads += _load(family, tokens[j:j + count], register(slot))
        slot += (width + 3) // 4
        j += count
        if j < len(tokens) and tokens[j] == ".":
            j += 1
            continue
        break
    if j == i + count:  # a single selector: not a concatenation
        return None
    return j, loads


# --- one rule ----------------------------------------------------------------------------------


class _Cursor:
    """One rule's tokens, read front to back."""

    def __init__(self, tokens: list[str]) -> None:
        self.tokens, self.i = tokens, 0

    def more(self) -> bool:
        return self.i < len(self.tokens)

    def at(self, offset: int) -> str | None:
        """The token `offset` places ahead, if there is one."""
        k = self.i + offset
        return self.tokens[k] if k < len(self.tokens) else None

    def rest(self) -> str:
        return " ".join(self.tokens[self.i:])

    def take(self, count: int) -> list[str]:
        if self.i + count > len(self.tokens):
            raise Unencodable(f"{self.rest()!r} ends too soon")
        got = self.tokens[self.i:self.i + count]
        self.i += count
        return got


def rule_expressions(family: Family, tokens: list[str]) -> bytes:
    """NFTA_RULE_EXPRESSIONS for one rule's tokens (without a comment): matches, then at
    most one verdict or statement that ends the rule."""
    exprs, _ = _expressions(family, tokens)
    if not exprs:
        raise Unencodable("an empty rule")
    return nested(NFTA_RULE_EXPRESSIONS, exprs)


def rule_body(family: Family, body: str) -> bytes:
    """`rule_expressions` of the rule `body` (text, without a comment), the same bytes.
    A service port's masquerade-mark rule is its cluster IP, then the same words for
    all: what follows the address is encoded once per text."""
    words = body.split(None, 3)
    if len(words) == 4 and words[0] == _ip(family) and words[1] in ("saddr", "daddr") \
            and words[2] not in (".", "!="):
        return nested(NFTA_RULE_EXPRESSIONS, _address_match(family, words[1], NFT_CMP_EQ, words[2])
                      + _after_address(family, words[3]))
    return rule_expressions(family, body.split())


def encode_rules(family: Family, texts: Iterable[str]) -> list[bytes]:
    """Each rule's attributes: `rule_body` of its text (`<rule> [comment "<text>"]`),
    then its comment's. Most rules of a full sync (100,000 at 10,000 services x 10
    endpoints) are an endpoint's `<matches> dnat to <addr>:<port> comment "<port>"`,
    whose matches are the same few texts (`numgen random mod 7 0 meta l4proto tcp`)
    and port and comment those of the rules around it: those are encoded once per
    text (`_dnat_rule_head`, `_dnat_tail`, `_rule_comment`), only the address each
    time. What this shortcut does not take (or refuses) goes to `rule_body`, which
    encodes it or says why not."""
    heads, tails, dnat_address = _DNAT_HEADS[family], _DNAT_TAILS[family], _DNAT_ADDRESS[family]
    note_of, comment_of = None, b""  # the last comment: most rules share their neighbours'
    out = []
    for text in texts:
        body, mark, note = text.partition(' comment "')
        head, sep, target = body.rpartition(" dnat to ")
        host, colon, port_text = target.rpartition(":")
        if sep and colon:  # (an address and a port hold no blank: the parse reads them alike)
            try:
                exprs = heads[head] + dnat_address(host) + tails[port_text]
            except (Unencodable, OSError):
                exprs = rule_body(family, body)
        else:
            exprs = rule_body(family, body)
        if mark:
            if note != note_of:
                comment_of, note_of = _rule_comment(note), note
            exprs += comment_of
        out.append(exprs)
    return out


def _dnat_rule_head(family: Family, matches: str) -> bytes:
    """NFTA_RULE_EXPRESSIONS of `<matches> dnat to <addr>:<port>` up to the address:
    the attribute's header (every target is as long as another), the matches, which a
    statement follows (no verdict may end them), and the address's immediate."""
    exprs, final = _expressions(family, matches.split())
    if final:
        raise Unencodable(f"{matches!r}: a statement after the verdict")
    exprs += _immediate_address_head(family)
    rest = ADDRESS_WIDTH[family] + len(_dnat_tail(family, "0"))
    return nested(NFTA_RULE_EXPRESSIONS, exprs + bytes(rest))[:-rest]


def _rule_comment(note: str) -> bytes:
    """The user data of `comment "<note>`: its text, then the closing quote, and no
    other quote."""
    if not note.endswith('"') or '"' in note[:-1]:
        raise Unencodable(f"comment {note!r}")
    return comment(note[:-1])


class _Memo(dict[str, bytes]):
    """`make(text)` by text, looked up as `memo[text]`: a dict's own speed, where a call
    of an lru_cache costs several times that (a full sync's rules look up 300,000
    times). Emptied when full; what `make` refuses (Unencodable) is not kept."""

    def __init__(self, make: Callable[[str], bytes], size: int = 1024) -> None:
        super().__init__()
        self._make, self._size = make, size

    def __missing__(self, text: str) -> bytes:
        if len(self) >= self._size:
            self.clear()
        made = self[text] = self._make(text)
        return made


_DNAT_HEADS = {family: _Memo(functools.partial(_dnat_rule_head, family)) for family in Family}
_DNAT_TAILS = {family: _Memo(functools.partial(_dnat_tail, family)) for family in Family}
# In an ip table the address is the host itself: inet_pton's OSError refuses the rest.
_DNAT_ADDRESS = {Family.V4: functools.partial(socket.inet_pton, socket.AF_INET),
                 Family.V6: functools.partial(_dnat_address, Family.V6)}


@functools.lru_cache(maxsize=1024)
def _after_address(family: Family, text: str) -> bytes:
    """The expressions of `text`, which an address match precedes."""
    return _expressions(family, text.split())[0]


def _expressions(family: Family, tokens: list[str]) -> tuple[bytes, bool]:
    """The expressions of `tokens`, and whether the last of them ends a rule."""
    cur = _Cursor(tokens)
    out: list[bytes] = []
    final = False
    while cur.more():
        if final:
            raise Unencodable(f"{cur.rest()!r} after the verdict")
        found = _concatenation_lookup(family, cur)
        if found is None:
            matched = _match(family, cur)
            found = (matched, False) if matched is not None else _statement(family, cur)
        exprs, final = found
        out += exprs
    return b"".join(out), final


def _concatenation_lookup(family: Family, cur: _Cursor) -> tuple[list[bytes], bool] | None:
    """`a . b [. c] @set` (a match) or `a . b [. c] vmap @map` (the verdict, last) at the
    cursor: the loads into consecutive registers, then the lookup; None if no
    concatenation starts there."""
    found = _concatenation(family, cur.tokens, cur.i) if cur.at(2) == "." else None
    if found is None:
        return None
    cur.i, loads = found
    target = cur.take(1)[0]
    if target == "vmap":
        set_ref = cur.take(1)[0]
        if not set_ref.startswith("@"):
            raise Unencodable(f"vmap {set_ref}")
        return [loads, _lookup(set_ref[1:], NFT_REG_VERDICT)], True
    if target.startswith("@"):
        return [loads, _lookup(target[1:])], False
    raise Unencodable(f"a concatenation compared with {target!r}")


def _match(family: Family, cur: _Cursor) -> list[bytes] | None:
    """The expressions of the match at the cursor; None if a statement is there."""
    ip, word = _ip(family), cur.at(0)
    if word == ip and cur.at(1) in ("saddr", "daddr"):
        _, field, operand = cur.take(3)
        op = NFT_CMP_EQ
        if operand == "!=":
            op, operand = NFT_CMP_NEQ, cur.take(1)[0]
        return [_address_match(family, field, op, operand)]
    if word in PROTOCOLS and cur.at(1) == "dport":
        proto, _, port_text = cur.take(3)
        return [_protocol_match(protocol(proto)), payload(NFT_PAYLOAD_TRANSPORT_HEADER, 2, 2),
                cmp(NFT_CMP_EQ, port(port_text))]
    if word == "meta" and cur.at(1) == "mark":
        return [_mark(cur.take(6 if cur.at(2) == "&" else 7))]
    if word == "meta":
        _, key, proto = cur.take(3)
        if key != "l4proto":
            raise Unencodable(f"meta {key}")
        return [_protocol_match(protocol(proto))]
    if word == "ct":
        return _ct_match(cur.take(3))
    if word == "fib":
        _, field, kw, what = cur.take(4)
        if field not in ("saddr", "daddr") or kw != "type" or what != "local":
            raise Unencodable(f"fib {field} {kw} {what}")
        return [_fib_local(NFTA_FIB_F_SADDR if field == "saddr" else NFTA_FIB_F_DADDR)]
    if word == "numgen":
        _, kind, mod, modulus, start = cur.take(5)
        if kind != "random" or mod != "mod" or not modulus.isdigit():
            raise Unencodable(f"numgen {kind} {mod} {modulus}")
        if start == "<":
            bound = cur.take(1)[0]
            if not bound.isdigit() or not 0 < int(bound) < int(modulus):
                raise Unencodable(f"numgen random mod {modulus} < {bound}")
            return [_numgen_below(int(modulus), int(bound))]
        if start != "0":
            raise Unencodable(f"numgen {kind} {mod} {modulus} {start}")
        return [_numgen(int(modulus))]
    return None


def _ct_match(words: list[str]) -> list[bytes]:
    _, key, what = words
    if (key, what) == ("state", "new"):
        load, bits = _ct_load(NFT_CT_STATE), NF_CT_STATE_NEW
    elif (key, what) == ("status", "dnat"):
        load, bits = _ct_load(NFT_CT_STATUS), IPS_DST_NAT
    else:
        raise Unencodable(f"ct {key} {what}")
    return [load, _bitwise(4, _HOST_U32.pack(bits), bytes(4)), cmp(NFT_CMP_NEQ, bytes(4))]


def _ip(family: Family) -> str:
    return "ip" if family is Family.V4 else "ip6"


def _statement(family: Family, cur: _Cursor) -> tuple[list[bytes], bool]:
    """The statement at the cursor, and whether it ends the rule (a verdict or NAT)."""
    ip, word = _ip(family), cur.at(0)
    if word in ("jump", "goto"):
        verb, chain = cur.take(2)
        return [_immediate_verdict(verb, chain)], True
    if word in ("drop", "accept", "return"):
        return [_immediate_verdict(cur.take(1)[0])], True
    if word == "reject":
        cur.take(1)
        return [_reject(family)], True
    if word == "masquerade":
        _, how = cur.take(2)
        if how != "fully-random":
            raise Unencodable(f"masquerade {how}")
        return [_MASQUERADE_FULLY_RANDOM], True
    if word == "dnat" and cur.at(1) == ip and cur.at(3) == ip:
        return _dnat_pick(family, cur), True
    if word == "dnat" and cur.at(1) == ip and cur.at(3) == "jhash":
        return _dnat_hash_statement(family, cur), True
    if word == "jhash":
        return _hash_vmap_statement(family, cur), True
    if word == "dnat" and cur.at(1) == ip:
        _, _, to, ng, kind, mod, modulus, map_, set_ref = cur.take(9)
        if (to, ng, kind, mod, map_) != ("to", "numgen", "random", "mod", "map") \
                or not modulus.isdigit() or not 0 < int(modulus) <= 0xFFFFFFFF \
                or not set_ref.startswith("@"):
            raise Unencodable(f"dnat {ip} {to} {ng} {kind} {mod} {modulus} {map_} "
                              f"{set_ref}")
        return [_dnat_slot_map(family, int(modulus), set_ref[1:])], True
    if word == "dnat":
        _, to, target = cur.take(3)
        if to != "to":
            raise Unencodable(f"dnat {to}")
        return [_dnat(family, target)], True
    if word == "counter" and cur.at(1) == "name" and cur.at(2) == ip:
        cur.take(2)
        loads, set_name = _concatenation_map(family, cur)
        return [loads, _expr("objref", nla(NFTA_OBJREF_SET_SREG, u32(NFT_REG_1))
                             + string(NFTA_OBJREF_SET_NAME, set_name))], False
    if word == "counter" and cur.at(1) == "name":
        _, _, quoted = cur.take(3)
        if len(quoted) < 3 or quoted[0] != '"' or quoted[-1] != '"' or '"' in quoted[1:-1]:
            raise Unencodable(f"counter name {quoted}")
        return [_counter_ref(quoted[1:-1])], False
    if word == "update":
        _, set_ref, open_, proto, field, close = cur.take(6)
        if (not set_ref.startswith("@") or (open_, close) != ("{", "}") or proto != ip
                or field != "saddr"):
            raise Unencodable(f"update {set_ref} {open_} {proto} {field} {close}")
        dynset = (nla(NFTA_DYNSET_SREG_KEY, u32(NFT_REG_1))
                  + nla(NFTA_DYNSET_OP, u32(NFT_DYNSET_OP_UPDATE))
                  + string(NFTA_DYNSET_SET_NAME, set_ref[1:]))
        return [payload(NFT_PAYLOAD_NETWORK_HEADER, ADDRESS_OFFSETS[family]["saddr"],
                        ADDRESS_WIDTH[family]), _expr("dynset", dynset)], False
    raise Unencodable(f"{word!r}")


def _concatenation_map(family: Family, cur: _Cursor, protocol_ports: bool = False
                       ) -> tuple[bytes, str]:
    """`<concatenation> map @<map>` at the cursor: the loads into consecutive registers
    from register 1, and the map's name."""
    found = _concatenation(family, cur.tokens, cur.i, protocol_ports)
    if found is None:
        raise Unencodable(f"{cur.rest()!r}: no concatenation")
    cur.i, loads = found
    map_, set_ref = cur.take(2)
    if map_ != "map" or not set_ref.startswith("@"):
        raise Unencodable(f"{map_} {set_ref}")
    return loads, set_ref[1:]


def _dnat_pick(family: Family, cur: _Cursor) -> list[bytes]:
    """`dnat ip to ip daddr . <proto> dport . numgen random mod <n> map @<pick map>`
    (after `meta l4proto <proto>`): the key loaded from register 1 on, looked up into
    the address (register 1) and the port (the register slot after it)."""
    _, _, to = cur.take(3)
    if to != "to":
        raise Unencodable(f"dnat {to}")
    loads, set_name = _concatenation_map(family, cur, protocol_ports=True)
    return [loads, _lookup(set_name, NFT_REG_1), _nat(family, register(ADDRESS_WIDTH[family] // 4))]


def _counter_ref(name: str) -> bytes:
    """`counter name "<name>"`: a reference to the named counter, which counts the packet."""
    return _expr("objref", nla(NFTA_OBJREF_IMM_TYPE, u32(NFT_OBJECT_COUNTER))
                 + string(NFTA_OBJREF_IMM_NAME, name))


_SET_MARK = _expr("meta", nla(NFTA_META_KEY, u32(NFT_META_MARK))
                  + nla(NFTA_META_SREG, u32(NFT_REG_1)))


def _mark(words: list[str]) -> bytes:
    """`meta mark & <mask> == <value>` (a match) or `meta mark set meta mark ^ <bits>` (or `|`)
    (a statement): the mark is in host byte order, as nft writes it."""
    if words[2] == "&" and len(words) == 6 and words[4] == "==":
        return (meta_load(NFT_META_MARK) + _bitwise(4, _HOST_U32.pack(_number(words[3])), bytes(4))
                + cmp(NFT_CMP_EQ, _HOST_U32.pack(_number(words[5]))))
    if words[2] == "set" and len(words) == 7 and words[3:5] == ["meta", "mark"] \
            and words[5] in ("^", "|"):
        bits = _number(words[6])
        keep = 0xFFFFFFFF if words[5] == "^" else 0xFFFFFFFF & ~bits
        return (meta_load(NFT_META_MARK) + _bitwise(4, _HOST_U32.pack(keep), _HOST_U32.pack(bits))
                + _SET_MARK)
    raise Unencodable(f"{' '.join(words)!r}")


@functools.cache
def _reject(family: Family) -> bytes:
    """nft's plain `reject` in an ip or ip6 table: ICMP port unreachable."""
    return _expr("reject", nla(NFTA_REJECT_TYPE, u32(NFT_REJECT_ICMP_UNREACH))
                 + nla(NFTA_REJECT_ICMP_CODE, bytes([PORT_UNREACHABLE[family]])))


_MASQUERADE_FULLY_RANDOM = _expr("masq", nla(NFTA_MASQ_FLAGS,
                                              u32(NF_NAT_RANGE_PROTO_RANDOM_FULLY)))


def comment(text: str) -> bytes:
    data = text.encode() + b"\0"
    if len(data) > 255:
        raise Unencodable("a comment over 254 bytes")
    return nla(NFTA_RULE_USERDATA, bytes([0, len(data)]) + data)
