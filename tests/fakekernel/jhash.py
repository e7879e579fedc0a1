"""The kernel's `jhash` as nf_tables' `jhash` expression computes it
(net/netfilter/nft_hash.c, `nft_jhash_eval`), so the tracer and the tests can say which
slot, hence which endpoint, a flow reaches.

`jhash` is Bob Jenkins' lookup3 as include/linux/jhash.h has it: the key is read as
32-bit words in the CPU's byte order (little-endian here: x86 and arm64 as Linux runs
them), the tail bytes added one by one. nf_tables hashes the registers its operands were
loaded into: each field of a concatenation takes whole 32-bit registers, zero-padded (a
2-byte port is its 2 bytes in network order, then 2 zero bytes), and the length is the
padded one. The result is scaled into `mod` by `reciprocal_scale`, not by `%`.
"""

from __future__ import annotations

from collections.abc import Iterable

JHASH_INITVAL = 0xDEADBEEF
_MASK = 0xFFFFFFFF


def _rol(x: int, k: int) -> int:
    return ((x << k) | (x >> (32 - k))) & _MASK


def _mix(a: int, b: int, c: int) -> tuple[int, int, int]:
    """__jhash_mix: six steps of `x -= z; x ^= rol32(z, r); z += y`, the roles of
    (a, b, c) turning by one each step (back in place after six)."""
    x, y, z = a, b, c
    for r in (4, 6, 8, 16, 19, 4):
        x = ((x - z) & _MASK) ^ _rol(z, r)
        z = (z + y) & _MASK
        x, y, z = y, z, x
    return x, y, z


def _final(a: int, b: int, c: int) -> int:
    """__jhash_final: seven steps of `x ^= y; x -= rol32(y, r)`, from (x, y) = (c, b),
    then (a, c), (b, a), ...; c is `y` after the seventh."""
    x, y, w = c, b, a
    for r in (14, 11, 25, 16, 4, 14, 24):
        x = ((x ^ y) - _rol(y, r)) & _MASK
        x, y, w = w, x, y
    return y


def jhash(key: bytes, initval: int) -> int:
    """include/linux/jhash.h `jhash(key, length, initval)`."""
    length = len(key)
    a = b = c = (JHASH_INITVAL + length + initval) & _MASK
    k = 0
    while length > 12:
        a = (a + int.from_bytes(key[k:k + 4], "little")) & _MASK
        b = (b + int.from_bytes(key[k + 4:k + 8], "little")) & _MASK
        c = (c + int.from_bytes(key[k + 8:k + 12], "little")) & _MASK
        a, b, c = _mix(a, b, c)
        length -= 12
        k += 12
    if length == 0:
        return c
    tail = key[k:] + bytes(12 - length)  # the switch's fall-through adds the bytes present
    a = (a + int.from_bytes(tail[0:4], "little")) & _MASK
    b = (b + int.from_bytes(tail[4:8], "little")) & _MASK
    c = (c + int.from_bytes(tail[8:12], "little")) & _MASK
    return _final(a, b, c)


def registers(fields: Iterable[bytes]) -> bytes:
    """A concatenation as nf_tables holds it: each field (network byte order) padded
    with zeros to whole 32-bit registers."""
    return b"".join(f + bytes(-len(f) % 4) for f in fields)


def nft_jhash(fields: Iterable[bytes], modulus: int, seed: int, offset: int = 0) -> int:
    """`jhash <fields> mod <modulus> seed <seed> offset <offset>`, as the kernel evaluates it."""
    h = jhash(registers(fields), seed)
    return ((h * modulus) >> 32) + offset
