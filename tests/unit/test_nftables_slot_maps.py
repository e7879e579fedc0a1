"""Large service ports balance through a slot map (nftables/render.py): endpoints keep
their slots, so a change to one endpoint is a few elements and at most one rule, not a
rewrite of the port's chain. Every script here is also encoded for netlink (wire.py),
as the agent sends it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from proxy.dataplane.nftables import render
from proxy.dataplane.nftables.objects import parts_text
from proxy.dataplane.nftables.render import (
    FINGERPRINTS,
    SLOT_MAP_MIN,
    SLOTS,
    assign_slots,
    port_chain,
    render_base,
    render_port,
    render_shard,
)
from proxy.dataplane.nftables.slot_tail import (
    SPLIT_MIN,
    TAIL,
    TAIL_MAX,
    TAIL_PREFIX,
    main_size,
)
from proxy.dataplane.nftables.transaction import (
    TableState,
    full_script,
    kept_slots,
    partial_script,
)
from proxy.dataplane.nftables.wire import encode
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family
from tests.unit.builders import ep, eps_slice, node, resolve_one, service
from tests.unit.test_nftables_render import CIDR4, S0

# --- slot assignment ---------------------------------------------------------------------


@given(st.lists(st.integers(0, 40), unique=True), st.lists(st.integers(0, 40), unique=True))
def test_slots_are_dense_and_nothing_moves_that_need_not(before: list[int],
                                                        after: list[int]) -> None:
    old = assign_slots([str(v) for v in before], ())
    previous = {v: i for i, v in enumerate(old)}
    new = assign_slots([str(v) for v in after], old)
    # Every value once, in slots 0..n-1 (numgen picks any of them).
    assert sorted(new) == sorted(str(v) for v in after)
    # A value keeps its slot while that slot still exists ...
    n = len(new)
    kept = {v for v, i in previous.items() if v in new and i < n}
    assert all(new[previous[v]] == v for v in kept)
    # ... so what moves is what is new, or was beyond the end.
    moved = sum(1 for i, v in enumerate(new) if previous.get(v) != i)
    assert moved == n - len(kept)


def test_an_endpoint_gone_moves_the_last_one_into_its_slot() -> None:
    assert assign_slots(["a", "b", "d"], "abcd") == ["a", "b", "d"]
    assert assign_slots(["a", "c", "d"], "abcd") == ["a", "d", "c"]


# --- rendering and transactions ------------------------------------------------------------


def addresses(n: int, start: int = 0) -> list[str]:
    return [f"198.18.{2 + i // 250}.{1 + i % 250}" for i in range(start, start + n)]


def resolve(addrs: list[str]) -> ResolvedServicePort:
    """The service with `addrs`, in slices of at most 1,000 (the API's limit)."""
    slices = [eps_slice(f"s{i // 1000 + 1}", [ep(a) for a in addrs[i:i + 1000]])
              for i in range(0, max(len(addrs), 1), 1000)]
    return resolve_one(node(), service(), *slices, port="http")


def start(rsp: ResolvedServicePort) -> tuple[str, TableState]:
    bases = [render_base(CIDR4), render_shard(CIDR4, S0)]
    return full_script(bases, {rsp.key: render_port(rsp, CIDR4)})


def change(state: TableState, rsp: ResolvedServicePort) -> list[str]:
    """The partial script from `state` to `rsp`, checked to encode, as lines."""
    old = state.ports.get(rsp.key)
    new = render_port(rsp, CIDR4, 1, kept_slots(old))
    text = partial_script(state, {rsp.key: new})
    encode(text, Family.V4, ("sliceproxy", S0), 1)  # raises Unencodable outside the dialect
    # The port's fingerprint follows what it writes: the old one out, the new one in.
    marks = [line for line in text.splitlines() if f" {FINGERPRINTS} " in line]
    if old is not None and text:
        assert marks == [
            f"delete element ip {S0} {FINGERPRINTS} {{ {parts_text(old.fingerprint)} }}",
            f"add element ip {S0} {FINGERPRINTS} {{ {parts_text(new.fingerprint)} }}"]
    return [line for line in text.splitlines() if line not in marks]


def slots_of(state: TableState) -> dict[Any, Any]:
    (port,) = state.ports.values()
    return {k[2][0]: v for k, v in port.elements().items() if k[1].startswith(SLOTS)}


def test_a_large_port_balances_with_one_rule_over_its_slot_map() -> None:
    rsp = resolve(addresses(SLOT_MAP_MIN))
    svc = port_chain("svc", rsp.key, "tcp")
    objects = render_port(rsp, CIDR4)
    (chain,) = objects.chains
    chain_name, rules = chain.name, chain.rules
    assert chain_name == svc
    assert rules[-1] == (f"meta l4proto tcp dnat ip to numgen random mod {SLOT_MAP_MIN} "
                         f"map @{SLOTS}{svc} comment \"ns/svc:http\"")
    assert [(s.name, s.declaration()) for s in objects.sets] == [
        (f"{SLOTS}{svc}", "typeof numgen random mod 1 : ip daddr . tcp dport;")]
    slots = sorted((e.key, e.value) for e in objects.elements if e.set == SLOTS + svc)
    assert slots == [((i,), (a, 8080)) for i, a in enumerate(addresses(SLOT_MAP_MIN))]
    assert {e.table for e in objects.elements if e.set == SLOTS + svc} == {S0}
    text, _ = start(rsp)
    assert f"flush map ip {S0} {SLOTS}{svc}" in text.splitlines()
    encode(text, Family.V4, ("sliceproxy", S0), 1)
    # One endpoint fewer: the cascade, one rule per endpoint.
    small = render_port(resolve(addresses(SLOT_MAP_MIN - 1)), CIDR4)
    # + the port's counter and the masquerade mark
    assert not small.sets and len(small.chains[0].rules) == SLOT_MAP_MIN - 1 + 2


def test_where_a_path_splits_its_slots_moves_only_past_the_tail_s_bounds() -> None:
    assert main_size(SPLIT_MIN - 1, None) == SPLIT_MIN - 1  # no tail below SPLIT_MIN
    assert main_size(SPLIT_MIN, None) == SPLIT_MIN - TAIL  # fresh: a tail of TAIL
    m = 5000 - TAIL
    assert main_size(5000, m) == m
    assert main_size(m + 1, m) == m and main_size(m + TAIL_MAX, m) == m  # 1..TAIL_MAX
    assert main_size(m, m) == m - TAIL  # the tail would be empty
    assert main_size(m + TAIL_MAX + 1, m) == m + TAIL_MAX + 1 - TAIL  # it would overflow
    assert main_size(SPLIT_MIN, SPLIT_MIN - 1) == SPLIT_MIN - 1  # a path growing into it


def test_a_path_of_split_min_endpoints_keeps_its_last_slots_in_a_tail() -> None:
    addrs = addresses(SPLIT_MIN)
    rsp = resolve(addrs)
    svc = port_chain("svc", rsp.key, "tcp")
    objects = render_port(rsp, CIDR4)
    m = SPLIT_MIN - TAIL
    tail_chain, policy = objects.chains
    assert tail_chain.name == TAIL_PREFIX + svc and policy.name == svc
    label = 'comment "ns/svc:http"'
    assert tail_chain.rules == (
        f"meta l4proto tcp numgen random mod {SPLIT_MIN} < {TAIL} "
        f"dnat ip to numgen random mod {TAIL} map @{TAIL_PREFIX}{svc} {label}",)
    assert policy.rules[-2:] == (
        f"jump {TAIL_PREFIX}{svc}",
        f"meta l4proto tcp dnat ip to numgen random mod {m} map @{SLOTS}{svc} {label}")
    assert [x.name for x in objects.sets] == [SLOTS + svc, TAIL_PREFIX + svc]
    main = sorted((e.key, e.value) for e in objects.elements if e.set == SLOTS + svc)
    tail = sorted((e.key, e.value) for e in objects.elements if e.set == TAIL_PREFIX + svc)
    assert main == [((i,), (a, 8080)) for i, a in enumerate(addrs[:m])]
    assert tail == [((i,), (a, 8080)) for i, a in enumerate(addrs[m:])]
    encode(start(rsp)[0], Family.V4, ("sliceproxy", S0), 1)


def test_one_endpoint_changed_is_a_few_elements_not_the_chain() -> None:
    n = 300
    addrs = addresses(n)
    _, state = start(resolve(addrs))
    svc = port_chain("svc", resolve(addrs).key, "tcp")
    slot_map = f"ip {S0} {SLOTS}{svc}"
    # Gone: the last slot's endpoint moves into the free slot; the rule says n - 1.
    gone = addrs[10]
    lines = change(state, resolve([a for a in addrs if a != gone]))
    assert lines == [
        f"flush chain ip {S0} {svc}",
        f'add rule ip {S0} {svc} counter name "{port_chain("cnt", resolve(addrs).key, "tcp")}"',
        f"add rule ip {S0} {svc} ip daddr 198.18.128.1 tcp dport 80 ip saddr != "
        "198.18.1.0/24 jump mark-for-masquerade",
        f"add rule ip {S0} {svc} meta l4proto tcp dnat ip to numgen random mod {n - 1} "
        f"map @{SLOTS}{svc} comment \"ns/svc:http\"",
        f"delete element ip sliceproxy hairpin {{ {gone} . {gone} }}",
        f"delete element {slot_map} {{ 10, {n - 1} }}",
        f"add element {slot_map} {{ 10 : {addrs[-1]} . 8080 }}",
    ]
    assert slots_of(state)[10] == (addrs[-1], 8080) and len(slots_of(state)) == n - 1
    # Replaced by a new pod (one write of a rolling update): one slot, no rule.
    now = [a for a in addrs if a != gone]
    fresh = addresses(1, start=n)[0]
    lines = change(state, resolve([*now[:5], fresh, *now[6:]]))
    replaced = slots_of(state)
    assert replaced[5] == (fresh, 8080)
    assert not any(" chain " in line or " rule " in line for line in lines), lines
    assert len(lines) == 4  # hairpin out and in, the slot out and in
    # Added: the new last slot.
    more = addresses(1, start=n + 1)[0]
    lines = change(state, resolve([*now[:5], fresh, *now[6:], more]))
    assert f"add element {slot_map} {{ {n - 1} : {more} . 8080 }}" in lines
    assert slots_of(state) == {**replaced, n - 1: (more, 8080)}


def test_crossing_the_threshold_swaps_cascade_and_map_in_one_transaction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(render, "SLOT_MAP_MIN", 4)
    monkeypatch.setattr(render, "PICK_MAX", 0)  # the cascade: a port with a chain of its own
    _, state = start(resolve(addresses(3)))
    svc = port_chain("svc", resolve(addresses(3)).key, "tcp")
    up = change(state, resolve(addresses(4)))
    assert up[0] == (f"add map ip {S0} {SLOTS}{svc} "
                     "{ typeof numgen random mod 1 : ip daddr . tcp dport; }")
    assert sum(" rule " in line and "numgen" in line for line in up) == 1
    down = change(state, resolve(addresses(3)))
    assert down[-1] == f"delete map ip {S0} {SLOTS}{svc}"
    assert sum("numgen random mod" in line for line in down) == 2  # 1/3, 1/2, the last
    assert not state.set_names() - {(b.table, s.name) for b in state.bases for s in b.sets}


def test_affinity_keeps_the_cascade_whatever_the_size() -> None:
    objs: list[dict[str, Any]] = [service(sessionAffinity="ClientIP"),
                                  eps_slice("s1", [ep(a) for a in addresses(SLOT_MAP_MIN)])]
    objects = render_port(resolve_one(node(), *objs, port="http"), CIDR4)
    assert not any(s.name.startswith(SLOTS) for s in objects.sets)
