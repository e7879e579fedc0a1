"""A port's change rendered from its endpoint delta (nftables/port_edit.py) changes exactly
what rendering the port whole would: the same script, the same kept state, through
random sequences of endpoints added, removed, flipped and moved across the slot-map
threshold both ways; and the kernel then holds what a fresh full sync writes, but for
which slot holds which endpoint."""

from __future__ import annotations

import random
from dataclasses import dataclass, replace
from typing import Any

import pytest

from proxy.dataplane.nftables import port_edit as port_edit_module
from proxy.dataplane.nftables import slot_tail
from proxy.dataplane.nftables.port_edit import render_edit
from proxy.dataplane.nftables.render import (
    FINGERPRINTS,
    HASHED,
    SLOT_MAP_MIN,
    SLOTS,
    render_base,
    render_port,
    render_shard,
)
from proxy.dataplane.nftables.slot_tail import TAIL_PREFIX
from proxy.dataplane.nftables.transaction import (
    TableState,
    full_script,
    kept_slots,
    partial_script,
)
from proxy.dataplane.nftables.wire import encode
from proxy.model.snapshot import EndpointDelta, ResolvedServicePort
from proxy.model.types import Family
from tests.unit.builders import NODE, ep, eps_slice, node, resolve_one, service
from tests.unit.test_nftables_render import CIDR4, S0

POOL = [f"198.18.{2 + i // 200}.{1 + i % 200}" for i in range(400)]


@dataclass
class Pod:
    ready: bool = True
    local: bool = True


def resolve(pods: dict[str, Pod], spec: dict[str, Any]) -> ResolvedServicePort:
    eps = [ep(a, node=NODE if p.local else "node-b", ready=p.ready) for a, p in pods.items()]
    return resolve_one(node(), service(**spec), eps_slice("s1", eps), port="http")


def with_delta(old: ResolvedServicePort, new: ResolvedServicePort) -> ResolvedServicePort:
    """`new` carrying its endpoint delta from `old`, as the model sends it."""
    before, after = set(old.endpoints), set(new.endpoints)

    def order(s: Any) -> tuple[int, int]:
        return int(s.endpoint.address), s.endpoint.port

    return replace(new, delta=EndpointDelta(old.token, tuple(sorted(before - after, key=order)),
                                            tuple(sorted(after - before, key=order))))


def start(rsp: ResolvedServicePort) -> TableState:
    return full_script([render_base(CIDR4), render_shard(CIDR4, S0)],
                       {rsp.key: render_port(rsp, CIDR4)})[1]


def kept(state: TableState) -> dict[Any, Any]:
    """Everything a TableState says the kernel holds, comparable, fingerprints aside (an
    edit drops the port's, a whole render writes a new one)."""
    return {
        "ports": {k: (p.table, p.chains, unmarked(p.elements()), p.sets,
                      {n: list(m.values) for n, m in p.slots})
                  for k, p in state.ports.items()},
        "owners": sorted(unmarked(dict(state.owners.elements())).items()),
    }


def unmarked(elements: Any) -> dict[Any, Any]:
    return {k: v for k, v in elements.items() if k[1] != FINGERPRINTS}


def unmarked_script(script: str) -> str:
    return "".join(line for line in script.splitlines(keepends=True)
                   if f" {FINGERPRINTS} " not in line)


def step(pods: dict[str, Pod], rng: random.Random, shrink: bool) -> None:
    """One random change of one to four endpoints, biased to shrink or grow."""
    k = rng.randint(1, 4)
    present = sorted(pods)
    op = rng.choices(["remove", "add", "flip", "move"],
                     [6, 1, 2, 1] if shrink else [1, 6, 2, 1])[0]
    if op == "add":
        for a in rng.sample([a for a in POOL if a not in pods], k):
            pods[a] = Pod(local=rng.random() < 0.95)
    for a in rng.sample(present, min(k, len(present))) if op != "add" else ():
        if op == "remove":
            del pods[a]
        elif op == "flip":
            pods[a].ready = not pods[a].ready
        else:
            pods[a].local = not pods[a].local


def split_at(state: TableState) -> dict[str, int]:
    """Each split path's main map's size (slot_tail.py)."""
    slots = {n: len(m.values) for p in state.ports.values() for n, m in p.slots}
    return {n: size for n, size in slots.items()
            if TAIL_PREFIX + n.removeprefix(SLOTS) in slots}


def slot_maps(state: TableState) -> set[str]:
    return {n for p in state.ports.values() for n, _ in p.slots}


SPECS: dict[str, dict[str, Any]] = {
    "cluster": {},
    # A NodePort with policy Local: the cluster path for the cluster IP, the local path
    # (95% of the endpoints are on this node) for the NodePort; both cross the threshold.
    "local": {"type": "NodePort", "externalTrafficPolicy": "Local",
              "ports": ({"name": "http", "port": 80, "nodePort": 30080},)},
}


def small_tails(monkeypatch: pytest.MonkeyPatch) -> None:
    """Slots split into a main map and a tail (slot_tail.py) from a little above the
    slot-map threshold, with tails of 3 to 6, so that these paths cross into and out of
    the split and move it often."""
    monkeypatch.setattr(slot_tail, "SPLIT_MIN", SLOT_MAP_MIN + 10)
    monkeypatch.setattr(slot_tail, "TAIL", 3)
    monkeypatch.setattr(slot_tail, "TAIL_MAX", 6)


@pytest.mark.parametrize("tails", [False, True])
@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_random_deltas_change_what_a_whole_render_changes(seed: int, spec: str, tails: bool,
                                                          monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    if tails:
        small_tails(monkeypatch)
    rng = random.Random(seed)
    pods = {a: Pod(local=rng.random() < 0.95) for a in POOL[:SLOT_MAP_MIN + 30]}
    rsp = resolve(pods, SPECS[spec])
    by_edit, whole = start(rsp), start(rsp)
    edits, moves, maps_seen = 0, 0, [slot_maps(by_edit)]
    for n in range(100):
        # Above the threshold, below it, above again.
        target = SLOT_MAP_MIN - 25 if 20 <= n < 60 else SLOT_MAP_MIN + 30
        step(pods, rng, shrink=len(pods) > target)
        new = with_delta(rsp, resolve(pods, SPECS[spec]))
        key = new.key
        delta = new.endpoint_delta(rsp)
        assert delta is not None
        edit = render_edit(rsp, new, delta, CIDR4, by_edit.ports[key])
        edits += edit is not None
        was_split = split_at(by_edit)
        objects = render_port(new, CIDR4, 1, kept_slots(by_edit.ports[key]))
        script = partial_script(by_edit, {key: edit or objects})
        expected = partial_script(whole, {key: render_port(new, CIDR4, 1,
                                                           kept_slots(whole.ports[key]))})
        assert unmarked_script(script) == unmarked_script(expected), f"step {n}"
        assert kept(by_edit) == kept(whole), f"step {n}"
        if edit is not None and script:  # the kernel no longer holds what it stood for
            assert by_edit.ports[key].fingerprint == ()
            # The bases' fingerprints alone (the main table's and the shard's).
            assert sum(k[1] == FINGERPRINTS for k, _ in by_edit.owners.elements()) == 2
        encode(script, Family.V4, ("sliceproxy", S0), 1)
        assert_like_a_fresh_full_sync(by_edit, new)
        maps_seen.append(slot_maps(by_edit))
        is_split = split_at(by_edit)
        moves += edit is not None and any(is_split.get(p, at) != at
                                          for p, at in was_split.items())
        rsp = new
    # Not vacuous: most changes went by the delta, and the port crossed the threshold
    # both ways (a slot map went and came back).
    assert edits > (15 if tails else 20)
    went = [i for i in range(1, len(maps_seen)) if maps_seen[i - 1] - maps_seen[i]]
    came = [i for i in range(1, len(maps_seen)) if maps_seen[i] - maps_seen[i - 1]]
    assert went and came, (went, came)
    if tails:  # and the split came, went and moved
        assert any(n.startswith(TAIL_PREFIX) for m in maps_seen for n in m)
        assert any(not any(n.startswith(TAIL_PREFIX) for n in m) for m in maps_seen[30:])
        assert moves, "no edit moved a split"


def assert_like_a_fresh_full_sync(state: TableState, rsp: ResolvedServicePort) -> None:
    """The same chains, rules, sets and elements as a full sync of `rsp` alone; each
    slot map the same endpoints in slots 0..n-1, maybe in other slots (a fresh sync
    places them in the model's order; ours kept each where it was)."""
    fresh = start(rsp)
    (mine,), (theirs,) = state.ports.values(), fresh.ports.values()
    # Where a path's slots split between its main map and its tail depends on where
    # they split before (slot_tail.py): its chains' rules say so, its maps together
    # hold the same endpoints.
    tailed = {name.removeprefix(TAIL_PREFIX) for p in (mine, theirs) for name, _ in p.chains
              if name.startswith(TAIL_PREFIX)}

    def shape(p: Any) -> tuple[Any, ...]:
        chains = [(n, None if n.removeprefix(TAIL_PREFIX) in tailed else d)
                  for n, d in p.chains]
        return p.table, chains, p.sets

    assert shape(mine) == shape(theirs)

    def split(elements: Any) -> tuple[dict[Any, Any], dict[str, list[Any]]]:
        plain: dict[Any, Any] = {}
        slots: dict[str, list[tuple[int, Any]]] = {}
        for (table, name, key), value in elements.items():
            if name.startswith((SLOTS, TAIL_PREFIX)):
                (slot,) = key
                path = name.removeprefix(SLOTS).removeprefix(TAIL_PREFIX)
                slots.setdefault(path, []).append((slot, value))
            else:
                plain[(table, name, key)] = value
        return plain, {n: sorted(v for _, v in sorted(s)) for n, s in slots.items()}

    assert split(unmarked(mine.elements())) == split(unmarked(theirs.elements()))
    for _name, m in mine.slots:
        assert sorted(m.slot_of.values()) == list(range(len(m.values)))
        assert all(m.values[i] == v for v, i in m.slot_of.items())
    assert split(unmarked(dict(state.owners.elements()))) \
        == split(unmarked(dict(fresh.owners.elements())))


def test_one_endpoint_flip_in_a_large_port_is_a_few_elements_and_one_rule() -> None:
    pods = {a: Pod() for a in POOL[:300]}
    rsp = resolve(pods, {})
    state = start(rsp)
    pods[POOL[10]].ready = False
    new = with_delta(rsp, resolve(pods, {}))
    delta = new.endpoint_delta(rsp)
    assert delta is not None
    edit = render_edit(rsp, new, delta, CIDR4, state.ports[new.key])
    assert edit is not None
    lines = partial_script(state, {new.key: edit}).splitlines()
    # The rule that says 299 slots, the port's fingerprint (no longer true) and the
    # hairpin pair out, slot 10 refilled by the last.
    assert [line.split(" ", 2)[:2] for line in lines] == [
        ["flush", "chain"], ["add", "rule"], ["add", "rule"], ["add", "rule"],
        ["delete", "element"], ["delete", "element"], ["delete", "element"],
        ["add", "element"]]
    assert "mod 299 map" in lines[3]
    table = state.ports[new.key].table
    assert sum(f" {table} {FINGERPRINTS} " in line for line in lines[4:7]) == 1


def test_a_delta_not_against_the_kept_port_renders_the_port_whole() -> None:
    pods = {a: Pod() for a in POOL[:200]}
    rsp = resolve(pods, {})
    state = start(rsp)
    del pods[POOL[0]]
    new = with_delta(rsp, resolve(pods, {}))
    delta = new.endpoint_delta(rsp)
    assert delta is not None
    port = state.ports[new.key]
    # The kept port lacks what the delta removes: not ours to edit.
    (_name, slots), = port.slots
    value = slots.values[0]
    assert value == (POOL[0], 8080)
    del slots.slot_of[value]
    assert render_edit(rsp, new, delta, CIDR4, port) is None
    # A service change besides the endpoints (the delta's contract says it has none):
    # endpoint_delta, which the plane asks for the delta, refuses it.
    other = replace(new, uses_local=True)
    assert other.delta is new.delta and other.endpoint_delta(rsp) is None


def test_the_helper_orders_like_the_model() -> None:
    """Values moved back from beyond the end are placed in the model's order, which is
    by address as a number, not as text."""
    assert port_edit_module._order_of(("198.18.2.9", 80)) < port_edit_module._order_of(
        ("198.18.2.10", 80))


@pytest.mark.parametrize("balancing", ["maglev", "source-hash"])
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_a_hashed_port_s_deltas_write_only_the_slots_that_change(balancing: str,
                                                                  spec: str) -> None:
    """Maglev's table is a function of the endpoint set: an edit writes exactly what a
    whole render would change (the slots whose endpoint changes), the kernel then holds
    what a fresh full sync writes, slot for slot, and the table's size changing (5 to 20
    endpoints cross two rungs) renders the port whole."""
    rng = random.Random(7)
    spec_ = {**SPECS[spec], "annotations": {"sliceproxy.io/balancing": balancing}}
    pods = {a: Pod(local=rng.random() < 0.9) for a in POOL[:12]}
    rsp = resolve(pods, spec_)
    by_edit, whole = start(rsp), start(rsp)
    edits = wholes = 0
    for n in range(40):
        step(pods, rng, shrink=len(pods) > (6 if 10 <= n < 25 else 18))
        new = with_delta(rsp, resolve(pods, spec_))
        key = new.key
        delta = new.endpoint_delta(rsp)
        assert delta is not None
        edit = render_edit(rsp, new, delta, CIDR4, by_edit.ports[key])
        edits += edit is not None
        wholes += edit is None
        script = partial_script(by_edit, {key: edit or render_port(
            new, CIDR4, 1, kept_slots(by_edit.ports[key]))})
        assert unmarked_script(script) == unmarked_script(
            partial_script(whole, {key: render_port(new, CIDR4)})), f"step {n}"
        assert kept(by_edit) == kept(whole) == kept(start(new)), f"step {n}"
        if edit is not None:  # the slots that changed, never the whole table
            slots = [k for (_, name, k), _ in edit.added if name.startswith(HASHED)]
            assert len(slots) < max(len(m.values) for _, m in by_edit.ports[key].slots)
        rsp = new
    assert edits > 20 and wholes > 0, (edits, wholes)
