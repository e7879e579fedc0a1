"""`Owners` (nftables/transaction.py) keeps an element's owners in three shapes (the port
alone, a (port, value) pair, a dict once shared) to save memory; it must answer exactly
as a plain element -> {port: value} map would, whatever the order of additions and
removals: the kernel holds the smallest owner's value, and an element leaves with its
last owner."""

from __future__ import annotations

import copy
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.dataplane.nftables import transaction
from proxy.dataplane.nftables.objects import Element, Value, Verdict
from proxy.dataplane.nftables.render import pick_map
from proxy.dataplane.nftables.transaction import ElementKey, Owners, element_statements
from proxy.model.types import Family, ServicePortKey

PORTS = [ServicePortKey("ns", f"s{i}", "", Family.V4) for i in range(3)]
# A pick map's elements are kept per (cluster IP, port) (`_Picks`), whatever their owners.
PICKED = pick_map("tcp", 2)
# @hairpin's are kept by address (`_Pairs`), a key of another shape whole.
ELEMENTS: list[ElementKey] = [("t", "hairpin", ("198.18.0.1", "198.18.0.1")),
                              ("t", "hairpin", ("198.18.0.1", "198.18.0.2")),
                              ("t", "cluster-ips", ("198.18.128.1",)),
                              ("t", "services", ("198.18.128.1",)),
                              ("t", PICKED, ("198.18.128.1", 80, 0)),
                              ("t", PICKED, ("198.18.128.1", 80, 1)),
                              ("t", PICKED, ("198.18.128.1", 80, 2)),
                              ("t", PICKED, ("198.18.128.2", 80, 1)),
                              ("t", "hairpin", ("198.18.0.2", "198.18.0.2")),
                              ("t", "hairpin", ("198.18.0.3", "198.18.0.3"))]
VALUES: list[Value] = [(), Verdict("goto", "svc-a"), Verdict("goto", "svc-b"),
                       ("198.18.0.7", 8080), ("198.18.0.8", 8080)]

ops = st.lists(st.tuples(st.booleans(), st.sampled_from(ELEMENTS), st.sampled_from(PORTS),
                         st.sampled_from(VALUES)), max_size=60)


@settings(max_examples=500, deadline=None)
@given(ops)
def test_owners_answer_as_a_plain_map_would(
        operations: list[tuple[bool, ElementKey, ServicePortKey, Value]]) -> None:
    owners = Owners()
    plain: dict[ElementKey, dict[ServicePortKey, Value]] = {}
    for add, element, port, value in operations:
        if add:
            owners.add(element, port, value)
            plain.setdefault(element, {})[port] = value
        else:
            owners.remove(element, port)
            plain.get(element, {}).pop(port, None)
            if not plain.get(element, True):
                del plain[element]
        for e in ELEMENTS:
            wanted = plain.get(e)
            assert owners.held(e) == (wanted[min(wanted)] if wanted else None)
        # The addresses whose pair nobody owns (a restart's sweep asks the kernel for those).
        asked = {"198.18.0.1", "198.18.0.2", "198.18.0.9"}
        for set_name in ("hairpin", "cluster-ips"):
            assert owners.unowned_pairs("t", set_name, asked) == {
                a for a in asked if ("t", set_name, (a, a)) not in plain}
    assert dict(owners.elements()) == {e: m[min(m)] for e, m in plain.items()}
    assert {(t, s, k): v for t, s, pairs in owners.sets() for k, v in pairs} \
        == dict(owners.elements())
    assert len(owners) == len(plain)
    # As a full script writes them: each element once, in statements of at most
    # ELEMENTS_PER_LINE, read as pairs or one by one (@hairpin's made when read).
    with mock.patch.object(transaction, "ELEMENTS_PER_LINE", 2):
        statements = [s for t, name, pairs in owners.sets()
                      for s in element_statements("add", t, name, pairs)]
    written = [((s.table, s.set, k), v) for s in statements for k, v in s.items]
    assert dict(written) == dict(owners.elements()) and len(written) == len(plain)
    assert all(0 < len(s.items) <= 2 for s in statements)
    assert all(list(s.items) == [s.items[i] for i in range(len(s.items))] == list(s.items[:])
               for s in statements)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.sampled_from(ELEMENTS), max_size=5),
                          st.sampled_from(PORTS), st.sampled_from(VALUES)), max_size=30))
def test_elements_added_as_rendered_are_owned_as_added_one_by_one(
        operations: list[tuple[bool, list[ElementKey], ServicePortKey, Value]]) -> None:
    """`add_rendered` (a port's elements in runs of a set: its shortcuts for the common
    cases) keeps what `add` of each would."""
    rendered, one_by_one = Owners(), Owners()
    for add, elements, port, value in operations:
        if add:
            rendered.add_rendered(port, [Element(t, s, k, value) for t, s, k in elements])
            for e in elements:
                one_by_one.add(e, port, value)
        else:
            for e in elements:
                rendered.remove(e, port)
                one_by_one.remove(e, port)
        assert dict(rendered.elements()) == dict(one_by_one.elements())
        for e in ELEMENTS:
            assert rendered.held(e) == one_by_one.held(e)
        for e in elements:
            for p in PORTS:  # each owner left leaves the element to the others
                probe_r, probe_o = copy.deepcopy(rendered), copy.deepcopy(one_by_one)
                probe_r.remove(e, p)
                probe_o.remove(e, p)
                assert probe_r.held(e) == probe_o.held(e)


ENDPOINTS = [("198.18.0.7", 8080), ("198.18.0.8", 8080), ("198.18.0.9", 53)]
PREFIXES = [("198.18.128.1", 80), ("198.18.128.2", 80)]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["group", "one", "remove"]), st.sampled_from(PORTS),
                          st.sampled_from(PREFIXES),
                          st.lists(st.sampled_from(ENDPOINTS), min_size=1, max_size=3)),
                max_size=30))
def test_pick_elements_added_a_group_at_a_time_are_owned_as_added_one_by_one(
        operations: list[tuple[str, ServicePortKey, tuple[str, int], list[Value]]]) -> None:
    """`add_rendered` given a port's pick elements grouped (PortObjects.picked, as
    render._pick makes them) keeps what `add` of each would, whoever else holds the
    (cluster IP, port) or one of its slots."""
    grouped, one_by_one = Owners(), Owners()
    for op, port, prefix, values in operations:
        elements = [Element("t", PICKED, (*prefix, slot), v) for slot, v in enumerate(values)]
        if op == "group":
            flat = tuple(x for v in values for x in v)
            grouped.add_rendered(port, elements, ((PICKED, prefix, flat),))
        elif op == "one":  # another claimant of a slot alone (a destination moving)
            elements = elements[-1:]
            grouped.add(elements[0][:3], port, elements[0].value)
        for e in elements:
            if op == "remove":
                grouped.remove(e[:3], port)
                one_by_one.remove(e[:3], port)
            else:
                one_by_one.add(e[:3], port, e.value)
        assert dict(grouped.elements()) == dict(one_by_one.elements())
        assert len(grouped) == len(one_by_one)
        for prefix_ in PREFIXES:
            for slot in range(3):
                key = ("t", PICKED, (*prefix_, slot))
                assert grouped.held(key) == one_by_one.held(key)


def test_a_set_element_owned_once_is_the_port_alone_and_a_map_element_a_pair() -> None:
    owners = Owners()
    owners.add(ELEMENTS[2], PORTS[0], ())
    owners.add(ELEMENTS[3], PORTS[0], VALUES[1])
    owners.add(ELEMENTS[3], PORTS[1], VALUES[2])
    owners.remove(ELEMENTS[3], PORTS[0])
    assert owners._sets == {("t", "cluster-ips"): {ELEMENTS[2][2]: PORTS[0]},
                            ("t", "services"): {ELEMENTS[3][2]: (PORTS[1], VALUES[2])}}


def test_a_hairpin_element_is_kept_by_its_address() -> None:
    owners = Owners()
    owners.add(ELEMENTS[0], PORTS[0], ())
    assert owners._sets["t", "hairpin"].by_address == {  # type: ignore[union-attr]
        "198.18.0.1": PORTS[0]}


def test_a_ports_pick_elements_are_one_flat_entry_of_its_values_in_slot_order() -> None:
    owners = Owners()
    for slot, value in enumerate([("198.18.0.7", 8080), ("198.18.0.8", 8080)]):
        owners.add(("t", PICKED, ("198.18.128.1", 80, slot)), PORTS[0], value)
    picks = owners._sets["t", PICKED]
    assert picks.by_port == {  # type: ignore[union-attr]
        ("198.18.128.1", 80): [PORTS[0], "198.18.0.7", 8080, "198.18.0.8", 8080]}
    owners.remove(("t", PICKED, ("198.18.128.1", 80, 1)), PORTS[0])
    owners.remove(("t", PICKED, ("198.18.128.1", 80, 0)), PORTS[0])
    assert len(owners) == 0 and not picks.by_port  # type: ignore[union-attr]
