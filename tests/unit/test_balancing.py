"""Balancing per service: the annotation, the node's default, and Maglev's table (the same
on every node, balanced within a slot, and a removal moves little but its own share)."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
from collections import Counter
from ipaddress import IPv4Address, ip_address

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.kube.decode import decode_service
from proxy.kube.ingest import apply_object
from proxy.model.balancing import (
    MAX_TABLE_SIZE,
    TABLE_SIZES,
    Backend,
    maglev_table,
    table_size,
)
from proxy.model.tracker import ClusterModel
from proxy.model.types import Balancing, Family, ServicePortKey
from proxy.model.view import service_port_view
from tests.fakekernel.jhash import nft_jhash
from tests.fakekernel.nftables import FakeNft
from tests.fakekernel.packet import Node, Packet
from tests.unit.builders import ep, eps_slice, service

KEY = ServicePortKey("ns", "svc", "http", Family.V4)
ANNOTATION = "sliceproxy.io/balancing"


def _resolved(default: Balancing, annotations: dict[str, str] | None) -> Balancing:
    model = ClusterModel("node-a", balancing=default)
    apply_object(model, service(annotations=annotations))
    apply_object(model, eps_slice("s1", [ep("10.0.0.1")]))
    rsp = model.resolve().get(KEY)
    assert rsp is not None
    assert service_port_view(rsp)["balancing"] == rsp.balancing.value
    return rsp.balancing


@pytest.mark.parametrize(("default", "annotations", "expected"), [
    (Balancing.RANDOM, None, Balancing.RANDOM),
    (Balancing.MAGLEV, None, Balancing.MAGLEV),
    (Balancing.RANDOM, {ANNOTATION: "maglev"}, Balancing.MAGLEV),
    (Balancing.MAGLEV, {ANNOTATION: "random"}, Balancing.RANDOM),
    (Balancing.RANDOM, {ANNOTATION: " Source-Hash "}, Balancing.SOURCE_HASH),
    (Balancing.SOURCE_HASH, {ANNOTATION: "round-robin"}, Balancing.SOURCE_HASH),
])
def test_the_annotation_wins_over_the_node_default(
        default: Balancing, annotations: dict[str, str] | None, expected: Balancing) -> None:
    assert _resolved(default, annotations) is expected


def test_a_bad_value_is_one_skip_record_naming_the_service_and_keeps_the_default() -> None:
    svc, skips = decode_service(service(annotations={ANNOTATION: "fastest"}))
    assert svc is not None and svc.balancing is None
    assert [(s.name, s.reason, s.part) for s in skips] == [
        ("svc", "invalid-value", f"metadata.annotations[{ANNOTATION}]")]
    assert "'fastest'" in skips[0].detail and "--default-balancing" in skips[0].detail


def test_a_bad_value_is_logged_once_per_service(caplog: pytest.LogCaptureFixture) -> None:
    model = ClusterModel("node-a", balancing=Balancing.MAGLEV)
    bad = service(annotations={ANNOTATION: "fastest"})
    with caplog.at_level(logging.WARNING, logger="proxy.kube.ingest"):
        for _ in range(3):  # a relist brings the same object again
            apply_object(model, bad)
    lines = [r for r in caplog.records if r.getMessage() == "input skipped"]
    assert len(lines) == 1 and lines[0].__dict__["object"] == "ns/svc"
    apply_object(model, eps_slice("s1", [ep("10.0.0.1")]))
    rsp = model.resolve().get(KEY)
    assert rsp is not None and rsp.balancing is Balancing.MAGLEV


def test_changing_the_annotation_marks_the_port_changed() -> None:
    model = ClusterModel("node-a")
    apply_object(model, service())
    apply_object(model, eps_slice("s1", [ep("10.0.0.1")]))
    first = model.resolve()
    apply_object(model, service(annotations={ANNOTATION: "maglev"}))
    second = model.resolve()
    assert KEY in second.changed_since(first)
    rsp = second.get(KEY)
    assert rsp is not None and rsp.balancing is Balancing.MAGLEV


# --- Maglev's table ----------------------------------------------------------------------


def _backends(n: int, seed: int) -> list[Backend]:
    r = random.Random(seed)
    out: set[Backend] = set()
    while len(out) < n:
        out.add((IPv4Address(r.randrange(0x0A000000, 0x0B000000)), r.choice((80, 8080))))
    return sorted(out)


def test_the_table_size_is_a_prime_of_the_ladder_and_keeps_while_n_changes_a_little() -> None:
    assert table_size(0) == 0
    for n in range(1, 400):
        m = table_size(n)
        assert m in TABLE_SIZES and all(m % d for d in range(2, int(m ** 0.5) + 1))
        assert m >= 256 * n or m == MAX_TABLE_SIZE
        assert m < 512 * n or m == TABLE_SIZES[0]
    # 1 of 10 removed, or one added: the same M, so the hash of a flow keeps its slot.
    assert table_size(9) == table_size(10) == table_size(11) == 4093
    assert table_size(19) == table_size(20) == table_size(21) == 8191


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**32), st.randoms(use_true_random=False))
def test_every_node_builds_the_same_table_whatever_the_order(
        n: int, seed: int, shuffler: random.Random) -> None:
    backends = _backends(n, seed)
    table = maglev_table(backends)
    shuffled = backends + backends[: n // 2]  # and repeats
    shuffler.shuffle(shuffled)
    assert maglev_table(shuffled) == table
    assert len(table) == table_size(n) and set(table) == set(backends)


def test_another_process_with_another_hash_seed_builds_the_same_table() -> None:
    """Nodes are other processes: Python's salted hash() must play no part."""
    program = ("from ipaddress import ip_address as a\n"
               "from proxy.model.balancing import maglev_table as t\n"
               "import hashlib\n"
               "e = [(a('10.1.0.%d' % i), 8080) for i in range(1, 11)] + [(a('fd00::5'), 80)]\n"
               "print(hashlib.sha256(repr(t(e)).encode()).hexdigest())\n")
    digests = set()
    for hash_seed in ("1", "2", "random"):
        env = dict(os.environ, PYTHONHASHSEED=hash_seed)
        digests.add(subprocess.run([sys.executable, "-c", program], env=env, check=True,
                                   capture_output=True, text=True).stdout)
    assert len(digests) == 1


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 60), st.integers(0, 2**32))
def test_shares_are_within_one_slot(n: int, seed: int) -> None:
    """Maglev's bound with equal weights: every endpoint holds floor(M/N) or ceil(M/N)."""
    table = maglev_table(_backends(n, seed))
    counts = Counter(table)
    assert len(counts) == n and max(counts.values()) - min(counts.values()) <= 1


def _moved(before: tuple[Backend, ...], gone: Backend) -> float:
    after = maglev_table(b for b in set(before) if b != gone)
    assert len(after) == len(before) and gone not in after
    kept = [i for i, b in enumerate(before) if b != gone]
    return sum(after[i] != before[i] for i in kept) / len(kept)


def test_removing_one_of_ten_moves_few_of_the_others_flows() -> None:
    """The issue's goal: <= 2% of the flows on the other 9 move. Measured over 30 sets
    of 10 endpoints, each removed in turn (M = 4093): mean 1.25%, the worst single
    removal 2.4%. Maglev's disruption is a mean bound, so the mean is what is asserted; the worst
    case is held to twice the goal."""
    moved = []
    for seed in range(30):
        table = maglev_table(_backends(10, seed))
        moved += [_moved(table, gone) for gone in set(table)]
    mean = sum(moved) / len(moved)
    print(f"maglev 1 of 10 removed: mean {mean:.2%}, worst {max(moved):.2%} of the others' "
          f"slots moved (M={table_size(10)}, {len(moved)} removals)")
    assert mean <= 0.02
    assert max(moved) <= 0.04


def test_an_endpoint_added_back_gets_its_own_slots_back() -> None:
    backends = _backends(10, 7)
    table = maglev_table(backends)
    assert maglev_table(backends[1:] + backends[:1]) == table
    without = maglev_table(backends[1:])
    assert maglev_table([*backends[1:], backends[0]]) == table != without


def test_families_apart_and_ipv6_names() -> None:
    v6 = [(ip_address(f"fd00::{i:x}"), 443) for i in range(1, 6)]
    table = maglev_table(v6)
    assert len(table) == table_size(5) and set(table) == set(v6)
    assert maglev_table([]) == ()


# --- the kernel's jhash, as the fake kernel evaluates nf_tables' `jhash` ------------------


@pytest.mark.parametrize(("source", "modulus", "marks"), [
    ("127.0.0.1", 4093, (42, 1510, 3658, 1484, 1355)),
    ("::1", 509, (39, 60, 455, 447, 235)),
])
def test_jhash_gives_the_kernel_s_slots(source: str, modulus: int,
                                        marks: tuple[int, ...]) -> None:
    """`ct mark set jhash ip saddr . udp sport mod <modulus> seed 0x5a17` read back from
    conntrack (Debian 12's kernel 6.1, nft 1.0.6) for UDP from source ports 1000, 2000,
    33333, 40000 and 65000: a 4-byte port register and a 20-byte IPv6 key both covered."""
    address = ip_address(source).packed
    assert tuple(nft_jhash([address, port.to_bytes(2, "big")], modulus, 0x5A17)
                 for port in (1000, 2000, 33333, 40000, 65000)) == marks


def test_the_fake_kernel_traces_a_hashed_dnat_to_the_slot_s_endpoint() -> None:
    backends = [(ip_address(f"198.18.1.{i}"), 8080) for i in (11, 12, 13)]
    table = maglev_table(backends)
    elements = ", ".join(f"{i} : {a} . {p}" for i, (a, p) in enumerate(table))
    nft = FakeNft()
    nft.run("add table ip t\n"
            "add chain ip t pre { type nat hook prerouting priority dstnat; policy accept; }\n"
            "add map ip t m { typeof numgen random mod 1 : ip daddr . tcp dport; }\n"
            f"add element ip t m {{ {elements} }}\n"
            f"add rule ip t pre meta l4proto tcp dnat ip to jhash ip saddr . tcp sport "
            f"mod {len(table)} seed 0x5a17 map @m\n")
    reached = Counter()
    for sport in range(20000, 20300):
        packet = Packet.of("198.18.2.7", "198.18.128.1", 80, sport=sport)
        slot = nft_jhash([packet.source.packed, sport.to_bytes(2, "big")], len(table), 0x5A17)
        address, port = table[slot]
        trace = nft.trace(packet, Node.of("198.18.0.1"))
        assert trace.endpoints() == {f"{address}:{port}": 1.0}
        reached[address] += 1
    assert len(reached) == 3  # 300 source ports spread over every endpoint
