"""How a service port picks an endpoint: the choice, and Maglev's lookup table.

The choice is the service's `sliceproxy.io/balancing` annotation, else the node's
`--default-balancing` (`choose`). `random` is kube-proxy's. `maglev` and `source-hash`
hash the connection into a table of endpoints, so that every node picks the same endpoint
for the same flow (and again after its conntrack entry is lost); the data planes look the
hash up (nftables: a `jhash` into a map of slots; IPVS: its `mh` and `sh` schedulers).

Maglev's table (Eisenbud et al., "Maglev: A Fast and Reliable Software Network Load
Balancer", NSDI 2016, section 3.4): each endpoint has a permutation of the M slots,
`(offset + j * skip) mod M`, from two hashes of its name; endpoints take turns claiming
their next free slot until all M are taken. Every endpoint then holds floor(M/N) or
ceil(M/N) slots, and removing one endpoint hands its slots to the others while moving
few of theirs. The table depends only on the set of endpoints: their names are hashed
with a fixed hash (never Python's salted `hash()`), and they take turns in a fixed
order, so every node builds the same one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from proxy.model.types import Balancing, IPAddress, Service, format_endpoint

# Slots per endpoint, at least. Balance is within one slot whatever M, but the fewer
# slots per endpoint, the more of the others' slots a removal moves as the fill order
# shifts (measured for 1 of 10 removed: 2.7% of the others' slots at M/N = 100, 1.8% at
# 200, 1.3% at 400; tests/unit/test_balancing.py). 256 is a power of two, so with the
# ladder below the rungs fall where N reaches a power of two (8, 16, 32, 64, 128):
# N = 10 +- 1 or 20 +- 1 keep their M, and M/N stays within 256-512 up to the largest.
SLOTS_PER_ENDPOINT = 256
# The sizes a table may take: the largest prime below each power of two, the ladder of
# IPVS's own `mh` scheduler from 509 up (net/netfilter/ipvs/ip_vs_mh.c, `primes`). M must
# be a function of N alone (every node the same), and a change of M rehashes every flow:
# on a ladder, M stays put while N moves within a factor of two, so adding or removing an
# endpoint moves its own share and little more. The largest is about the paper's 65537:
# each slot is a map element in the kernel, so past 255 endpoints a port keeps that size
# (M/N falls below 256; balance stays within one slot).
TABLE_SIZES = (509, 1021, 2039, 4093, 8191, 16381, 32749, 65521)
MAX_TABLE_SIZE = TABLE_SIZES[-1]

Backend = tuple[IPAddress, int]


def choose(service: Service, default: Balancing) -> Balancing:
    """The service's own choice (its annotation, when valid), else the node's default."""
    return service.balancing if service.balancing is not None else default


def table_size(endpoints: int) -> int:
    """M for N endpoints: the smallest size of TABLE_SIZES holding 256 slots for each (a
    prime, so that every skip in 1..M-1 walks a full permutation). 0 endpoints: 0."""
    if endpoints <= 0:
        return 0
    want = SLOTS_PER_ENDPOINT * endpoints
    return next((m for m in TABLE_SIZES if m >= want), MAX_TABLE_SIZE)


def _offset_skip(backend: Backend, size: int) -> tuple[int, int]:
    """The paper's two hashes of the endpoint's name ("address:port", IPv6 in brackets):
    the two halves of one BLAKE2b digest, the same on every node and every run."""
    digest = hashlib.blake2b(format_endpoint(*backend).encode(), digest_size=16,
                             person=b"sliceproxy-mglv").digest()
    h1 = int.from_bytes(digest[:8], "big")
    h2 = int.from_bytes(digest[8:], "big")
    skip = h2 % (size - 1) + 1 if size > 1 else 1
    return h1 % size, skip


def maglev_table(endpoints: Iterable[Backend], size: int | None = None) -> tuple[Backend, ...]:
    """Slot -> endpoint for the set `endpoints` (order and repeats do not matter), of
    `size` slots (default `table_size`). Empty when there is no endpoint."""
    backends = ordered(endpoints)
    return tuple(backends[i] for i in maglev_slots(backends, size))


def ordered(endpoints: Iterable[Backend]) -> list[Backend]:
    """The distinct `endpoints` in the order they take turns (the same on every node)."""
    return sorted(set(endpoints), key=_order)


def maglev_slots(backends: Sequence[Backend], size: int | None = None) -> list[int]:
    """Maglev's table as indexes into `backends` (distinct, in `ordered` order)."""
    m = table_size(len(backends)) if size is None else size
    if not backends or m <= 0:
        return []
    # Each endpoint's position in its permutation: offset, then + skip (mod m) per step.
    at, skips = map(list, zip(*(_offset_skip(b, m) for b in backends), strict=True))
    entry: list[int] = [-1] * m
    filled = 0
    while True:
        for i, skip in enumerate(skips):
            c = at[i]
            while entry[c] >= 0:
                c += skip
                if c >= m:
                    c -= m
            entry[c] = i
            c += skip
            at[i] = c - m if c >= m else c
            filled += 1
            if filled == m:
                return entry


def _order(backend: Backend) -> tuple[int, int, int]:
    """A total order on endpoints that is the same everywhere (families apart)."""
    address, port = backend
    return (address.version, int(address), port)
