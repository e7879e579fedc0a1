"""A first full script (transaction.first_lines, for a family holding none of our
tables) comes in parts the kernel may commit one by one: nothing a packet enters by
before the last part, every port and element the one-transaction script writes, each
map element once with the value the kernel is to hold, and the state that script
leaves."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import pytest

from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.nftables import transaction, wire
from proxy.dataplane.nftables.objects import Value
from proxy.dataplane.nftables.render import (
    FINGERPRINTS,
    PortObjects,
    our_tables,
    render_base,
    render_port,
    render_shard,
    shard_table,
    shards_for,
)
from proxy.dataplane.nftables.transaction import (
    ElementKey,
    Script,
    TableState,
    first_lines,
    full_lines,
)
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family, ServicePortKey
from tests.unit.builders import ep, eps_slice, service
from tests.unit.test_nftables_full_encoding import CONTEXTS, Cluster, varied_state

FAMILIES = pytest.mark.parametrize("family", [Family.V4, Family.V6], ids=["ipv4", "ipv6"])


@pytest.fixture(scope="module")
def state() -> DesiredState:
    return varied_state()


def scripts(state: DesiredState, family: Family, stage_lines: int = 200
            ) -> tuple[Script, TableState, Script, TableState, list[str]]:
    """first_lines and full_lines of one family's ports; the keys in render order."""
    ctx = CONTEXTS[family]
    ports = {k: v for k, v in state.ports.items() if k.family is family}
    shards = shards_for(len(ports))
    bases = [render_base(ctx), *(render_shard(ctx, shard_table(i)) for i in range(shards))]
    objects = {k: render_port(v, ctx, shards) for k, v in ports.items()}
    rendered: list[str] = []

    def later(key: ServicePortKey) -> Callable[[], PortObjects]:
        def render() -> PortObjects:
            rendered.append(key.name)
            return objects[key]
        return render

    first, first_state = first_lines(bases, {k: later(k) for k in objects}, stage_lines)
    full, full_state = full_lines(bases, objects)
    return first, first_state, full, full_state, rendered


def parts(script: Script) -> list[list[wire.Statement]]:
    return list(wire.stages(script.statements()))


def elements(statements: Iterator[wire.Statement]) -> dict[ElementKey, Value]:
    """What the kernel's sets and maps hold after `statements`, applied in order; a
    map's key written again with another value fails (the kernel refuses it)."""
    held: dict[ElementKey, Value] = {}
    for st in statements:
        if not isinstance(st, wire.Elements):
            continue
        for key, value in st.items:
            element = (st.table, st.set, key)
            if st.verb == "delete":
                held.pop(element)
            else:
                assert held.get(element, value) == value, f"{element}: two values"
                held[element] = value
    return held


def assert_same_state(mine: TableState, theirs: TableState) -> None:
    """The same ports kept, each with the same objects, and the same elements held."""
    assert dict(mine.owners.elements()) == dict(theirs.owners.elements())
    assert mine.ports.keys() == theirs.ports.keys()
    for key, kept in theirs.ports.items():
        port = mine.ports[key]
        assert (port.table, port.chains, port.sets, dict(port.elements())) \
            == (kept.table, kept.chains, kept.sets, dict(kept.elements()))
        assert [(n, m.values) for n, m in port.slots] == [(n, m.values) for n, m in kept.slots]


@FAMILIES
def test_nothing_a_packet_enters_by_comes_before_the_last_part(
        state: DesiredState, family: Family) -> None:
    first, _, full, _, _ = scripts(state, family)
    cut = parts(first)
    assert len(cut) > 5
    hooked = [[line for st in part for line in wire.statement_lines(st, first.ip)
               if " hook " in line] for part in cut]
    assert not any(hooked[:-1])
    assert sorted(hooked[-1]) == sorted(line for line in full.lines() if " hook " in line)
    # The bases' rules come with the hooked chains, after every port's, and then what
    # says they are written (their fingerprints: restart.py).
    at = max(n for n, st in enumerate(cut[-1]) if isinstance(st, wire.Rules))
    last, marks = cut[-1][at], cut[-1][at + 1:]
    assert isinstance(last, wire.Rules)
    assert all(isinstance(m, wire.Elements) and m.set == FINGERPRINTS for m in marks)
    assert sum(len(m.items) for m in marks if isinstance(m, wire.Elements)) \
        == len(last.tables)
    assert {table for table, _chains in last.tables} == {
        line.split()[3] for line in full.lines() if line.startswith("add table")}
    assert all(not isinstance(st, wire.Rules) for st in cut[0])


@FAMILIES
def test_it_writes_what_one_transaction_writes_and_leaves_the_same_state(
        state: DesiredState, family: Family) -> None:
    first, first_state, full, full_state, rendered = scripts(state, family)
    assert rendered == []  # nothing rendered before the script is read
    first_lines_ = list(first.lines())
    assert len(rendered) == len(full_state.ports)  # each port once, as it was read
    assert sorted(rendered) == sorted(k.name for k in full_state.ports)
    assert elements(first.statements()) == dict(full_state.owners.elements())
    # Every chain, rule, set and flush of the one-transaction script but the flushes of
    # the bases' sets (nothing in them yet), nothing else.
    ip = "ip" if family is Family.V4 else "ip6"
    base_flushes = {f"flush {s.kind} {ip} {b.table} {s.name}" for b in full_state.bases
                    for s in b.sets}
    assert {line for line in first_lines_ if not line.startswith("add element")} \
        == {line for line in full.lines()
            if not line.startswith("add element") and line not in base_flushes}
    assert_same_state(first_state, full_state)


@FAMILIES
def test_read_again_it_is_the_same_statements_and_lines_count_across_parts(
        state: DesiredState, family: Family) -> None:
    first, *_ = scripts(state, family)
    lines = list(first.lines())
    assert list(first.lines()) == lines
    assert first.count == len(lines)
    cut = parts(first)
    at = 1 + sum(wire.statement_size(st) for part in cut[:3] for st in part)
    assert first.line(at) == lines[at - 1]
    # Encoded from where the part starts, a message names the script's own line.
    batch = wire.encode(cut[3], family, our_tables(), 1000, at)
    assert batch.line_of(batch.begin_seq + 1) == at


def test_ports_without_chains_of_their_own_still_come_in_parts() -> None:
    """Picked ports write elements alone: a part is cut by its elements too, or a first
    start of such ports would be one transaction (at 100,000 services, ~400 MB held)."""
    ctx = RenderContext(Family.V4)
    objects = [o for i in range(300) for o in (
        service(f"s{i}", ips=(f"198.18.{128 + i // 250}.{i % 250 + 1}",)),
        eps_slice(f"s{i}-a", [ep(f"198.19.{i // 100}.{i % 100 * 2 + k + 1}") for k in (0, 1)],
                  service_name=f"s{i}"))]
    ports = Cluster().become(objects).ports
    assert all(not render_port(rsp, ctx).chains for rsp in ports.values())
    bases = [render_base(ctx), render_shard(ctx, shard_table(0))]
    first, _ = first_lines(bases, {k: functools.partial(render_port, v, ctx)
                                   for k, v in ports.items()}, 200)
    assert len(parts(first)) > 5


@FAMILIES
def test_parts_grow_with_the_chains_the_tables_hold(
        monkeypatch: pytest.MonkeyPatch, state: DesiredState, family: Family) -> None:
    """Every commit visits every chain of the family, so a part holds at least a line
    per CHAINS_PER_STAGE_LINE chains the tables hold after it: where ports have chains
    of their own, the same statements in fewer parts."""
    first = parts(scripts(state, family, 20)[0])  # (a script is made as it is read)
    monkeypatch.setattr(transaction, "CHAINS_PER_STAGE_LINE", 1)
    grown = parts(scripts(state, family, 20)[0])
    assert 1 < len(grown) < len(first)
    ip = "ip" if family is Family.V4 else "ip6"

    def written(cut: list[list[wire.Statement]]) -> tuple[list[str], dict[ElementKey, Value]]:
        """Its lines but the elements', sorted, and the elements it leaves."""
        statements = [st for part in cut for st in part]
        return (sorted(line for st in statements if not isinstance(st, wire.Elements)
                       for line in wire.statement_lines(st, ip)),
                elements(iter(statements)))

    assert written(grown) == written(first)
