"""A full script over exactly the tables this process wrote (transaction.resync_lines:
the periodic resync) rewrites one table per part, each committed on its own, each
port rendered as its table's part is read: what one transaction (full_lines) writes,
and the same state. Through the data plane over a fake kernel, the resync commits one
transaction per table and leaves what it found."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from proxy.dataplane.nftables import wire
from proxy.dataplane.nftables.objects import Key, Value
from proxy.dataplane.nftables.render import (
    BaseObjects,
    PortObjects,
    render_base,
    render_port,
    render_shard,
    shard_table,
)
from proxy.dataplane.nftables.transaction import Script, full_lines, resync_lines
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family, ServicePortKey
from tests.fakekernel.packet import Packet
from tests.fakekernel.planes import FakePlane
from tests.unit.builders import ep, eps_slice, service
from tests.unit.test_nftables_first_parts import assert_same_state
from tests.unit.test_nftables_full_encoding import CONTEXTS, varied_state

FAMILIES = pytest.mark.parametrize("family", [Family.V4, Family.V6], ids=["ipv4", "ipv6"])
SHARDS = 4


@pytest.fixture(scope="module")
def state() -> DesiredState:
    return varied_state()


def rendered(state: DesiredState, family: Family
             ) -> tuple[list[BaseObjects], dict[ServicePortKey, PortObjects]]:
    ctx = CONTEXTS[family]
    bases = [render_base(ctx), *(render_shard(ctx, shard_table(i)) for i in range(SHARDS))]
    return bases, {k: render_port(v, ctx, SHARDS) for k, v in state.ports.items()
                   if k.family is family}


def tables_named(script: Script) -> list[set[str]]:
    """The tables each part's lines name (every line names its table fourth)."""
    return [{line.split()[3] for st in part for line in wire.statement_lines(st, script.ip)}
            for part in wire.stages(script.statements())]


def other_lines(script: Script) -> list[str]:
    return [line for line in script.lines() if not line.startswith("add element")]


def written(script: Script) -> set[tuple[str, str, Key, Value]]:
    """Every element the script adds."""
    return {(st.table, st.set, key, value) for st in script.statements()
            if isinstance(st, wire.Elements) and st.verb == "add" for key, value in st.items}


@FAMILIES
def test_over_exactly_our_tables_each_table_is_rewritten_in_a_part_of_its_own(
        state: DesiredState, family: Family) -> None:
    bases, ports = rendered(state, family)
    tables = {b.table for b in bases}
    shard = shard_table(1)
    chains, sets, counters = ([(shard, "svc-gone")], {(shard, "slots-gone"): "map"},
                              [(shard, "cnt-gone")])
    renders: list[ServicePortKey] = []

    def later(key: ServicePortKey) -> Callable[[], PortObjects]:
        return lambda: renders.append(key) or ports[key]

    parted, parted_state = resync_lines(bases, {k: later(k) for k in ports}, chains, sets,
                                        counters)
    one, one_state = full_lines(bases, ports, chains, sets, tables, counters)
    assert parted.parts and renders == []  # nothing rendered before it is read
    named = tables_named(parted)
    assert renders != [] and sorted(renders) == sorted(ports)  # each port once, as read
    # The shards first, each on its own, then the main table with every port's elements.
    assert named == [{b.table} for b in (*bases[1:], bases[0])]
    # What the one transaction writes (its elements grouped by table, not port), what
    # nobody wants deleted in its table's part.
    assert sorted(other_lines(parted)) == sorted(other_lines(one))
    assert written(parted) == written(one)
    assert f"delete chain {parted.ip} {shard} svc-gone" in set(parted.lines())
    assert_same_state(parted_state, one_state)


def _web(name: str, ip: str, pods: list[str]) -> list[dict[str, Any]]:
    return [service(name, ips=(ip,)),
            eps_slice(f"{name}-1", [ep(p) for p in pods], service_name=name)]


def test_a_resync_commits_a_transaction_per_table_and_leaves_what_it_found() -> None:
    plane = FakePlane("nftables", shards=SHARDS)
    objects = [o for i in range(12) for o in _web(f"web-{i}", f"198.18.128.{i + 1}",
                                                  [f"198.18.1.{10 + i}", f"198.18.1.{40 + i}"])]
    plane.become(*objects)
    plane.settle()
    before = plane.written()
    scripts = len(plane.nft.scripts)
    plane.become(*objects, full=True)
    # Each family's main table and shards (the IPv6 ones hold no port).
    assert len(plane.nft.scripts) - scripts == 2 * (1 + SHARDS)
    assert plane.settle().written() == before  # (its input marks added again, idle)
    trace = plane.trace(Packet.of("198.18.1.200", "198.18.128.3", 80))
    assert trace.endpoints() == pytest.approx({"198.18.1.12:8080": 0.5, "198.18.1.42:8080": 0.5})
