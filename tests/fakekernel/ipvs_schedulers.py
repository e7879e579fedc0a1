"""The kernel's `mh` (Maglev) and `sh` (source hashing) IPVS schedulers, in Python, as
Linux 6.1 builds and reads their tables (net/netfilter/ipvs/ip_vs_mh.c, ip_vs_sh.c;
lib/siphash.c for hsiphash on 64-bit): what a list of real servers, in the kernel's list
order, makes of a flow. For unit tests of the order the IPVS plane keeps
(docs/dataplanes.md#balancing), and to predict what the kernel lab's kernel chooses.

Both walk the virtual server's list of real servers in list order (new ones are added
at its head), so the same set in another order can build another table.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv6Address

from proxy.dataplane.ipvs.render import RsKey

MASK64 = (1 << 64) - 1
MH_TABLE_SIZE = 4093  # primes[CONFIG_IP_VS_MH_TAB_INDEX - 8]; Debian keeps the default 12
SH_TABLE_SIZE = 256  # 1 << CONFIG_IP_VS_SH_TAB_BITS (8)
MH_KEY1 = (2654435761, 2654435761)  # generate_hash_secret: fixed, the same on every node
MH_KEY2 = (2654446892, 2654446892)


def _rotl(x: int, b: int) -> int:
    return ((x << b) | (x >> (64 - b))) & MASK64


def _round(v0: int, v1: int, v2: int, v3: int) -> tuple[int, int, int, int]:
    v0 = (v0 + v1) & MASK64
    v1 = _rotl(v1, 13) ^ v0
    v0 = _rotl(v0, 32)
    v2 = (v2 + v3) & MASK64
    v3 = _rotl(v3, 16) ^ v2
    v0 = (v0 + v3) & MASK64
    v3 = _rotl(v3, 21) ^ v0
    v2 = (v2 + v1) & MASK64
    v1 = _rotl(v1, 17) ^ v2
    v2 = _rotl(v2, 32)
    return v0, v1, v2, v3


def hsiphash_u32(value: int, key: tuple[int, int]) -> int:
    """hsiphash(&value, 4, key) on a 64-bit little-endian kernel: SipHash-1-3."""
    k0, k1 = key
    v0 = 0x736F6D6570736575 ^ k0
    v1 = 0x646F72616E646F6D ^ k1
    v2 = 0x6C7967656E657261 ^ k0
    v3 = 0x7465646279746573 ^ k1
    b = (4 << 56) | struct.unpack("<I", struct.pack("<I", value & 0xFFFFFFFF))[0]
    v3 ^= b
    v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    v0 ^= b
    v2 ^= 0xFF
    for _ in range(3):
        v0, v1, v2, v3 = _round(v0, v1, v2, v3)
    return (v0 ^ v1 ^ v2 ^ v3) & 0xFFFFFFFF


def _fold(address: IPv4Address | IPv6Address) -> int:
    """The address as the kernel folds it into 32 bits (IPv6: the xor of its words)."""
    if address.version == 4:
        return int(address)
    words: tuple[int, ...] = struct.unpack(">4I", address.packed)
    return words[0] ^ words[1] ^ words[2] ^ words[3]


def mh_hash(address: IPv4Address | IPv6Address, port: int, key: tuple[int, int],
            offset: int = 0) -> int:
    """ip_vs_mh_hashkey: note the sum, so address+1 with port-1 is the same key."""
    return hsiphash_u32(offset + port + _fold(address), key)


def mh_table(dests: Sequence[RsKey], weights: Sequence[int] | None = None,
             size: int = MH_TABLE_SIZE) -> list[RsKey | None]:
    """ip_vs_mh_permutate + ip_vs_mh_populate for `dests` in the kernel's list order."""
    weights = list(weights) if weights is not None else [1] * len(dests)
    live = [w for w in weights if w > 0]
    if not live:
        return [None] * size
    g = 0
    for w in live:
        g = _gcd(w, g) if g else w
    shift = max((max(live) // g).bit_length() - 6, 0)  # IP_VS_MH_TAB_BITS = 12 / 2
    setup = []
    for rs, w in zip(dests, weights, strict=True):
        offset = mh_hash(rs.address, rs.port, MH_KEY1) % size
        skip = mh_hash(rs.address, rs.port, MH_KEY2) % (size - 1) + 1
        turns = ((w // g) >> shift) or (1 if w else 0)
        setup.append([offset, skip, turns])
    table: list[RsKey | None] = [None] * size
    n = 0
    while True:
        for rs, ds in zip(dests, setup, strict=True):
            offset, skip, turns = ds
            for _ in range(turns):
                while table[ds[0]] is not None:
                    ds[0] = (ds[0] + skip) % size
                table[ds[0]] = rs
                n += 1
                if n == size:
                    return table


def _gcd(a: int, b: int) -> int:
    while b:
        a, b = b, a % b
    return a


def mh_choice(table: Sequence[RsKey | None], address: IPv4Address | IPv6Address,
              port: int) -> RsKey | None:
    """ip_vs_mh_get with the port flag on: the source address and port."""
    return table[mh_hash(address, port, MH_KEY1) % len(table)]


def sh_table(dests: Sequence[RsKey], weights: Sequence[int] | None = None
             ) -> list[RsKey | None]:
    """ip_vs_sh_reassign: buckets dealt round robin in list order (a weight-0 real
    server still takes one bucket a round, which then answers no destination)."""
    weights = list(weights) if weights is not None else [1] * len(dests)
    if not dests:
        return [None] * SH_TABLE_SIZE
    table: list[RsKey | None] = []
    i = count = 0
    while len(table) < SH_TABLE_SIZE:
        table.append(dests[i] if weights[i] > 0 else None)
        count += 1
        if count >= weights[i]:
            i, count = (i + 1) % len(dests), 0
    return table


def sh_choice(table: Sequence[RsKey | None], address: IPv4Address | IPv6Address
              ) -> RsKey | None:
    """ip_vs_sh_get without the port flag: the source address alone."""
    return table[(_fold(address) * 2654435761 & 0xFFFFFFFF) % SH_TABLE_SIZE]
