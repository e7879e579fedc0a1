"""The nftables mode's maglev and source-hash balancing, traced on the fake kernel with the
kernel's own jhash (tests/fakekernel/jhash.py): which endpoint a given source address and
port reaches, as predicted from the model's Maglev table; what a change of endpoints
writes (the slots that changed, not the table); ClientIP affinity still first."""

from __future__ import annotations

from collections import Counter
from ipaddress import ip_address
from typing import Any

import pytest

from proxy.dataplane.nftables.render import HASH_SEED, HASHED
from proxy.model.balancing import maglev_table, table_size
from tests.fakekernel.jhash import nft_jhash
from tests.fakekernel.packet import Packet
from tests.fakekernel.planes import FakePlane
from tests.unit.builders import ep, eps_slice, service

VIP, VIP6 = "198.18.128.1", "fd00:18:128::1"
POD, POD6 = "198.18.1.99", "fd00:18:1::99"
NODE_IP = "198.18.0.1"


def cluster(balancing: str, endpoints: list[str], family: str = "IPv4",
            **spec: Any) -> list[dict[str, Any]]:
    ips = (VIP,) if family == "IPv4" else (VIP6,)
    return [service(ips=ips, annotations={"sliceproxy.io/balancing": balancing},
                    **spec),
            eps_slice("s1", [ep(a) for a in endpoints], address_type=family)]


def predicted(endpoints: list[str], source: str, sport: int | None) -> str:
    table = maglev_table((ip_address(a), 8080) for a in endpoints)
    fields = [ip_address(source).packed] + ([sport.to_bytes(2, "big")] if sport else [])
    address, port = table[nft_jhash(fields, len(table), HASH_SEED)]
    return f"[{address}]:{port}" if address.version == 6 else f"{address}:{port}"


ENDPOINTS = [f"198.18.1.{i}" for i in range(10, 20)]


@pytest.mark.parametrize(("family", "vip", "pod", "endpoints"), [
    ("IPv4", VIP, POD, ENDPOINTS),
    ("IPv6", VIP6, POD6, [f"fd00:18:1::{i:x}" for i in range(10, 15)]),
])
def test_maglev_sends_each_source_port_where_the_table_says(
        family: str, vip: str, pod: str, endpoints: list[str]) -> None:
    plane = FakePlane("nftables")
    plane.become(*cluster("maglev", endpoints, family))
    reached: Counter[str] = Counter()
    for sport in range(30000, 30200):
        trace = plane.trace(Packet.of(pod, vip, 80, sport=sport))
        want = predicted(endpoints, pod, sport)
        assert trace.endpoints() == {want: 1.0}
        reached[want] += 1
    assert len(reached) == len(endpoints)  # 200 flows over every endpoint


def test_maglev_from_outside_through_a_node_port_hashes_the_same_source() -> None:
    """The destination (the node's address) is not hashed: another node, with another
    address, sends the same flow to the same endpoint."""
    plane = FakePlane("nftables")
    plane.become(*cluster("maglev", ENDPOINTS, type="NodePort",
                          ports=({"name": "http", "port": 80, "nodePort": 30080},)))
    for sport in (1024, 40000, 65000):
        want = {predicted(ENDPOINTS, "203.0.113.7", sport): 1.0}
        assert plane.trace(Packet.of("203.0.113.7", NODE_IP, 30080, sport=sport)
                           ).endpoints() == want
        assert plane.trace(Packet.of("203.0.113.7", VIP, 80, sport=sport)).endpoints() == want


def test_source_hash_sends_every_port_of_a_client_to_one_endpoint() -> None:
    plane = FakePlane("nftables")
    plane.become(*cluster("source-hash", ENDPOINTS))
    for client in ("198.18.1.99", "198.18.1.98"):
        want = {predicted(ENDPOINTS, client, None): 1.0}
        for sport in (1024, 30000, 65000):
            assert plane.trace(Packet.of(client, VIP, 80, sport=sport)).endpoints() == want


def _element_lines(plane: FakePlane) -> list[str]:
    return [line for line in plane.nft.scripts[-1].splitlines()
            if " element " in line and HASHED in line]


def test_an_endpoint_removed_rewrites_its_slots_and_few_others() -> None:
    plane = FakePlane("nftables")
    plane.become(*cluster("maglev", ENDPOINTS))
    before = maglev_table((ip_address(a), 8080) for a in ENDPOINTS)
    rest = ENDPOINTS[1:]
    report = plane.become(*cluster("maglev", rest))
    assert not report.full
    after = maglev_table((ip_address(a), 8080) for a in rest)
    changed = sum(a != b for a, b in zip(before, after, strict=True))
    owned = before.count((ip_address(ENDPOINTS[0]), 8080))
    assert owned <= changed <= owned + len(before) // 50
    script = plane.nft.scripts[-1]
    assert "flush" not in script and " rule " not in script  # M kept: the rule stays
    # Each changed slot: its old element deleted, its new one added; no other slot.
    deleted = [line for line in _element_lines(plane) if line.startswith("delete")]
    added = [line for line in _element_lines(plane) if line.startswith("add")]
    assert sum(line.count(",") + 1 for line in deleted) == changed
    assert sum(line.count(" : ") for line in added) == changed
    for sport in range(30000, 30050):
        assert plane.trace(Packet.of(POD, VIP, 80, sport=sport)).endpoints() == {
            predicted(rest, POD, sport): 1.0}


def test_the_table_size_follows_the_ladder_and_rewrites_the_rule_at_a_new_rung() -> None:
    plane = FakePlane("nftables")
    plane.become(*cluster("maglev", ENDPOINTS[:5]))
    assert f"mod {table_size(5)} " in "".join(plane.nft.scripts)
    written = len(plane.nft.scripts)
    plane.become(*cluster("maglev", ENDPOINTS[:7]))  # 5 and 7: one rung (2039)
    assert " rule " not in "".join(plane.nft.scripts[written:])
    plane.become(*cluster("maglev", ENDPOINTS[:8]))  # 8: the next (4093)
    assert table_size(8) != table_size(7)
    assert f"mod {table_size(8)} " in "".join(plane.nft.scripts[written:])


def test_random_back_again_drops_the_table() -> None:
    plane = FakePlane("nftables")
    plane.become(*cluster("maglev", ENDPOINTS[:3]))
    plane.become(*cluster("random", ENDPOINTS[:3]))
    assert not any(HASHED in name for (_, _), t in plane.nft.tables.items() for name in t.sets)
    reached = plane.trace(Packet.of(POD, VIP, 80)).endpoints()
    assert len(reached) == 3 and abs(sum(reached.values()) - 1) < 1e-9


@pytest.mark.parametrize("balancing", ["maglev", "source-hash"])
def test_client_ip_affinity_is_still_checked_first_and_a_new_client_is_hashed(
        balancing: str) -> None:
    """A client without an affinity entry goes where the table says (into its endpoint's
    chain, which remembers it); one with an entry goes back to its endpoint."""
    plane = FakePlane("nftables")
    plane.become(*cluster(balancing, ENDPOINTS[:3], sessionAffinity="ClientIP"))
    sport = 30000 if balancing == "maglev" else None
    for port in (30000, 30001, 30002, 40000):
        assert plane.trace(Packet.of(POD, VIP, 80, sport=port)).endpoints() == {
            predicted(ENDPOINTS[:3], POD, port if sport else None): 1.0}
    first = plane.trace(Packet.of(POD, VIP, 80, sport=30000))
    endpoint = next(iter(first.endpoints()))
    remembered = first.outcome_at(endpoint).remembered
    assert remembered
    for port in (30001, 40000, 50000):
        assert plane.trace(Packet.of(POD, VIP, 80, sport=port), remembered).endpoints() == {
            endpoint: 1.0}


def test_a_hashed_port_counted_per_endpoint_counts_where_the_table_sends() -> None:
    """With sliceproxy.io/traffic-per-endpoint, a hashed port's table holds each
    endpoint's chain, which counts it: the flow is counted into the counter of the
    endpoint it reaches, and the port's own counter."""
    plane = FakePlane("nftables")
    svc, sl = cluster("maglev", ENDPOINTS)
    svc["metadata"]["annotations"]["sliceproxy.io/traffic-per-endpoint"] = "true"
    plane.become(svc, sl)
    for sport in range(30000, 30040):
        trace = plane.trace(Packet.of(POD, VIP, 80, sport=sport))
        want = predicted(ENDPOINTS, POD, sport)
        assert trace.endpoints() == {want: 1.0}
        counted = trace.outcome_at(want).counted
        assert len(counted) == 2 and counted[0].startswith("cnt-") \
            and counted[1].startswith("cep-"), counted
    names = {trace_counter for sport in range(30000, 30040)
             for trace_counter in plane.trace(Packet.of(POD, VIP, 80, sport=sport))
             .outcome_at(predicted(ENDPOINTS, POD, sport)).counted[1:]}
    assert len(names) > 5  # one counter per endpoint, not one for the port


def test_three_nodes_with_different_histories_agree_on_every_flow() -> None:
    """The issue's figure, the same endpoint from 3 nodes for every 5-tuple: the nodes
    differ in address and history (one got the endpoints at once, one one by one in
    another order, one lost and regained some), yet hold the same table and rule, so
    any 5-tuple agrees; 2,000 of them traced on each."""
    nodes = [FakePlane("nftables", node_ips=(ip, "fd00:18::1"))
             for ip in ("198.18.0.1", "198.18.0.2", "198.18.0.3")]
    nodes[0].become(*cluster("maglev", ENDPOINTS))
    for n in range(1, len(ENDPOINTS) + 1):
        nodes[1].become(*cluster("maglev", ENDPOINTS[::-1][:n]))
    nodes[2].become(*cluster("maglev", ENDPOINTS[:4]))
    nodes[2].become(*cluster("maglev", ENDPOINTS[2:]))
    nodes[2].become(*cluster("maglev", ENDPOINTS))
    held = [{(t, name): (s.elements, table.chains[name.removeprefix(HASHED)].rules)
             for (_, t), table in node.nft.tables.items()
             for name, s in table.sets.items() if name.startswith(HASHED)} for node in nodes]
    assert held[0] and held[0] == held[1] == held[2]
    for i in range(2_000):
        packet = Packet.of(f"198.18.{1 + i % 7}.{100 + i % 101}", VIP, 80,
                           sport=1024 + i * 31 % 64_000)
        assert len({tuple(node.trace(packet).endpoints()) for node in nodes}) == 1
