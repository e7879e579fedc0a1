"""A restart over our own tables on the fake kernel (restart.py): the new agent writes
what differs from what the tables hold, and ends where a full sync from scratch ends,
whatever the cluster did while it was down. The real kernel's side (the read-back of
elements over netlink, traffic across a restart) is tests/e2e/test_nftables_restart_kernel.py."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterable
from dataclasses import fields, replace
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.dataplane.base import ApplyError
from proxy.dataplane.nftables import apply as nft_apply
from proxy.dataplane.nftables import mark_steps, render, restart_steps
from proxy.dataplane.nftables import marks as marks_module
from proxy.dataplane.nftables.marks import marks_for
from proxy.dataplane.nftables.objects import Verdict
from proxy.dataplane.nftables.readback import Held
from proxy.dataplane.nftables.render import FINGERPRINTS, TABLE, port_chain
from proxy.dataplane.nftables.restart import KernelTables, picks_to_probe
from proxy.dataplane.nftables.runner import NftError
from proxy.dataplane.nftables.transaction import KeptPort
from proxy.model.types import Family, ServicePortKey
from tests.fakekernel.nftables import Chain, NftFakeError
from tests.fakekernel.planes import FakePlane
from tests.unit.builders import ep, eps_slice, service
from tests.unit.test_iptables_sync import clusters
from tests.unit.test_nftables_fake_sync import assert_same_answers, comparable


def cluster(indices: Iterable[int], changed: int | None = None,
            counted: bool = False) -> list[dict[str, Any]]:
    """Service s<i> (cluster IP 198.18.128.<i + 10>, port 80) with two endpoints, three
    for s<changed>; `counted`: each endpoint's connections counted (its own counter)."""
    out = []
    annotations = {"sliceproxy.io/traffic-per-endpoint": "true"} if counted else None
    for i in indices:
        out.append(service(f"s{i}", ips=(f"198.18.128.{10 + i}",),
                           ports=({"name": "http", "port": 80},), annotations=annotations))
        eps = [ep(f"198.18.1.{10 * i + k}") for k in range(3 if i == changed else 2)]
        out.append(eps_slice(f"s{i}-a", eps, service_name=f"s{i}",
                             ports=({"name": "http", "port": 8080},)))
    return out


def port_key(i: int) -> ServicePortKey:
    return ServicePortKey("ns", f"s{i}", "http", Family.V4)


def _key(fingerprint: tuple[Any, ...]) -> tuple[str, ...]:
    """The fake kernel's key for an element (every part as text)."""
    return tuple(str(p) for p in fingerprint)


def restart_details(report: Any) -> dict[str, int]:
    """The restart's counts summed over the families (SyncReport details)."""
    out: dict[str, int] = {}
    for family in report.details.values():
        for k, v in family.get("restart", {}).items():
            out[k] = out.get(k, 0) + v
    return out


def port_rule_lines(script: str) -> list[str]:
    """The lines of a script that write a service port's rules (not the bases')."""
    return [line for line in script.splitlines() if line.startswith("add rule")
            and any(f" {kind}-" in line.split(" rule ", 1)[1][:40]
                    for kind in ("svc", "svl", "ext", "fw", "ep"))]


@settings(max_examples=30, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(before=clusters(), after=clusters())
def test_a_restart_ends_where_a_full_sync_from_scratch_does(
        monkeypatch: pytest.MonkeyPatch, before: list[dict[str, Any]],
        after: list[dict[str, Any]]) -> None:
    monkeypatch.setattr(render, "SLOT_MAP_MIN", 2)  # slot maps in these small clusters
    plane = FakePlane("nftables", shards=2)
    plane.become(*before, full=True)
    plane.settle()  # its ports' input marks, as the agent adds them when idle
    restarted = plane.restarted()
    report = restarted.become(*after)
    assert report.full and restart_details(report)
    fresh = FakePlane("nftables", shards=2)
    fresh.become(*after, full=True)
    assert_same_answers(restarted, fresh, after)
    assert comparable(restarted.settle().written()) == comparable(fresh.settle().written())
    # And the agent goes on from there as from any full sync (a port rendered with its
    # earlier slots has no input mark: marks.py).
    assert not restarted.become(*before).full
    again = FakePlane("nftables", shards=2)
    again.become(*before, full=True)
    restarted.settle()
    again.settle()
    assert without_marks(restarted.written()) == without_marks(again.written())
    assert marks(restarted.written()) <= marks(again.written())


def without_marks(tables: object) -> object:
    """`comparable`, without @fingerprints."""
    out = comparable(tables)
    assert isinstance(out, dict)
    for _chains, sets, _counters in out.values():
        sets.pop(FINGERPRINTS, None)
    return out


def marks(tables: object, ip: str = "ip") -> set[tuple[str, ...]]:
    """Every table's @fingerprints of family `ip`, as one (render.mark_element)."""
    assert isinstance(tables, dict)
    return {k for (f, _name), t in tables.items() if f == ip
            for k in t.sets[FINGERPRINTS].elements}


@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(cluster=clusters())
def test_a_restart_over_the_same_cluster_writes_no_port(
        monkeypatch: pytest.MonkeyPatch, cluster: list[dict[str, Any]]) -> None:
    monkeypatch.setattr(render, "SLOT_MAP_MIN", 2)
    plane = FakePlane("nftables", shards=2)
    first = plane.become(*cluster, full=True)
    before, sent = plane.settle().written(), len(plane.nft.scripts)
    # Idle after its sync, the agent added every port's input mark (marks.py).
    for fam in plane.dp._families.values():
        assert fam.context is not None and fam.last is not None
        of = marks_for(fam.context, fam.shards).of
        held = marks(plane.nft.tables, render.table_family(fam.family))
        assert all(_key(of(rsp)) in held
                   for key, rsp in fam.last.ports.items() if key.family is fam.family)
    restarted = plane.restarted()
    report = restarted.become(*cluster)
    counts = restart_details(report)
    assert counts == {"ports_kept": len(first.written), "ports_written": 0,
                      "elements_deleted": 0, "elements_added": 0}
    # Every port's input mark is there, and nothing nobody claims: nothing is sent, and
    # of the sets only @fingerprints is read back (marks.py, restart.unrendered).
    assert plane.nft.scripts[sent:] == []
    assert plane.written() == before
    assert {name for _table, name in plane.nft.dumped} == {FINGERPRINTS}
    # The kept state, made after the sync, is a full sync's: a change is partial and
    # ends where a plane that never restarted ends.
    changed = [_with_endpoint(obj) for obj in cluster]
    assert not restarted.become(*changed).full
    never = FakePlane("nftables", shards=2)
    never.become(*cluster, full=True)
    never.settle().become(*changed)
    assert comparable(restarted.settle().written()) == comparable(never.settle().written())


def _with_endpoint(obj: dict[str, Any]) -> dict[str, Any]:
    """An EndpointSlice object with one more ready endpoint (any other object as it is)."""
    if obj["kind"] != "EndpointSlice":
        return obj
    address = "fd00:18:1::99" if obj["addressType"] == "IPv6" else "198.18.1.99"
    return {**obj, "endpoints": [*obj["endpoints"], ep(address)]}


def test_another_builds_restart_writes_a_port_whose_endpoints_port_changed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Another build (no input mark of its own in the kernel) renders every port and
    keeps those whose fingerprint the kernel holds. One port's target port changed while
    no agent ran, its endpoints' addresses not (its @hairpin pairs and dispatch the
    same, its pick values not): its fingerprint differs, so it is written, and its
    connections reach the new port; the others are kept."""
    plane = FakePlane("nftables")
    plane.become(*cluster(range(3)), full=True)
    plane.settle()
    after = [{**o, "ports": [{**o["ports"][0], "port": 9090}]}
             if o["kind"] == "EndpointSlice" and o["metadata"]["name"] == "s1-a" else o
             for o in cluster(range(3))]
    monkeypatch.setattr(marks_module, "source_digest", lambda: b"another build")
    marks_for.cache_clear()
    try:
        restarted = plane.restarted()
        report = restarted.become(*after)
    finally:
        marks_for.cache_clear()
    counts = restart_details(report)
    assert (counts["ports_kept"], counts["ports_written"]) == (2, 1)
    fresh = FakePlane("nftables")
    fresh.become(*after, full=True)
    assert_same_answers(restarted, fresh, after)


def test_a_port_edited_since_its_fingerprint_is_read_back_and_written_whole(
        caplog: pytest.LogCaptureFixture) -> None:
    """A port whose marks an endpoint delta dropped is written whole, the others kept by
    theirs; what it held and no longer has (an endpoint, here, in its pick map and
    @hairpin) is deleted right after, by the sweep. Its pick elements and that hairpin
    pair are asked for by key, not dumped (a dump walks the set from its start for
    every message: 70 s for @hairpin at 100,000 x 10)."""
    plane = FakePlane("nftables")
    plane.become(*cluster(range(3)), full=True)
    plane.settle()
    state = plane.dp._families[Family.V4].kept
    main = plane.nft.tables["ip", TABLE]
    shard = plane.nft.tables["ip", state.ports[port_key(1)].table]
    for mark in (state.ports[port_key(1)].fingerprint, state.ports[port_key(1)].input_mark):
        del shard.sets[FINGERPRINTS].elements[_key(mark)]
    # Its second endpoint was 198.18.1.19 before the restart.
    shard.sets[render.pick_map("tcp", 2)].elements["198.18.128.11", "80", "1"] = \
        "198.18.1.19 . 8080"
    main.sets[render.HAIRPIN].elements["198.18.1.19", "198.18.1.19"] = ""
    restarted = plane.restarted()
    report = restarted.become(*cluster(range(3)))
    # Deleted: its pick element's old value (by its key, added again); added: that, its
    # marks, and (the sets not read) its cluster IP and two hairpin pairs, which the
    # kernel holds already but for 198.18.1.11's.
    assert restart_details(report) == {"ports_kept": 2, "ports_written": 1,
                                       "elements_deleted": 1, "elements_added": 6}
    assert ("198.18.1.19", "198.18.1.19") in main.sets[render.HAIRPIN].elements
    with caplog.at_level(logging.INFO, logger="proxy.dataplane.nftables.apply"):
        restarted.settle()  # the sync loop's, right after the first sync: the sweep
    assert ("198.18.1.19", "198.18.1.19") not in hairpins(plane)
    assert ("sliceproxy", render.HAIRPIN) not in plane.nft.dumped
    # Before the first sync, of the pick maps only that port's two slots, by key: its
    # dispatch element says where (a million elements dumped at 100,000 x 10).
    assert plane.nft.probed == [(state.ports[port_key(1)].table, render.pick_map("tcp", 2), 2),
                                ("sliceproxy", render.HAIRPIN, 1)]
    assert not [name for _table, name in plane.nft.dumped if name.startswith(render.PICKS)]
    # What it did not ask for it does not take for missing: nothing added.
    swept = [r for r in caplog.records if r.getMessage().startswith("restart: what nobody")]
    assert [(r.__dict__["elements_deleted"], r.__dict__["elements_added"],
             r.__dict__["hairpins_probed"]) for r in swept] == [(1, 0, 1)]
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(3)), full=True)
    assert comparable(restarted.written()) == comparable(fresh.settle().written())


def hairpins(plane: FakePlane) -> set[tuple[str, ...]]:
    """The IPv4 @hairpin pairs the fake kernel holds now."""
    return set(plane.nft.tables["ip", TABLE].sets[render.HAIRPIN].elements)


def test_a_port_not_picked_gone_while_no_agent_ran_has_its_hairpins_asked_for() -> None:
    """A port gone while no agent ran whose endpoints were in no pick map (a chain per
    endpoint: its connections counted one by one) leaves @hairpin pairs the sweep finds
    in the rules of its chains, which it deletes: it asks for those pairs alone, by key,
    and never dumps @hairpin (70 s at 100,000 x 10)."""
    plane = FakePlane("nftables")
    plane.become(*cluster(range(3), counted=True), full=True)
    plane.settle()
    assert ("198.18.1.20", "198.18.1.20") in hairpins(plane)
    restarted = plane.restarted()
    restarted.become(*cluster(range(2), counted=True))
    restarted.settle()
    assert ("sliceproxy", render.HAIRPIN) not in plane.nft.dumped
    assert plane.nft.probed == [("sliceproxy", render.HAIRPIN, 2)]  # its two endpoints'
    assert ("198.18.1.20", "198.18.1.20") not in hairpins(plane)
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(2), counted=True), full=True)
    assert comparable(restarted.written()) == comparable(fresh.settle().written())


@pytest.mark.parametrize("upgrade", [False, True], ids=["by-marks", "upgrade"])
@pytest.mark.parametrize(("pairs_squared_per_chain", "read_whole"), [(1, False), (10**9, True)])
def test_many_chains_are_read_one_by_one_where_hairpin_read_whole_would_cost_more(
        monkeypatch: pytest.MonkeyPatch, pairs_squared_per_chain: int, read_whole: bool,
        upgrade: bool) -> None:
    """Past an eighth of the kernel's chains, reading their rules one by one costs more
    than a dump of every counter, but where the whole read of @hairpin that then comes
    with it costs more still (its pairs squared: 33 s at 1,000,000), they are read, and
    the gone ports' pairs asked for by key; where it costs less, it is read whole. So
    in the sweep after a restart that kept ports by their marks, and in an upgrade's
    restart (another build's marks: every port rendered). Both leave what a fresh start
    writes."""
    monkeypatch.setattr(restart_steps, "NAMED_DUMPS_MIN", 0)
    monkeypatch.setattr(restart_steps, "PAIRS_SQUARED_PER_CHAIN", pairs_squared_per_chain)
    marks_for.cache_clear()
    plane = FakePlane("nftables")
    plane.become(*cluster(range(12), counted=True), full=True)
    plane.settle()
    before = hairpins(plane)
    # Eight ports go, a chain each: more than an eighth of the family's chains.
    assert sum(len(t.chains) for (f, _n), t in plane.nft.tables.items() if f == "ip") // 8 < 8
    if upgrade:
        monkeypatch.setattr(marks_module, "source_digest", lambda: b"another build")
        marks_for.cache_clear()
    restarted = plane.restarted()
    restarted.become(*cluster(range(4), counted=True))
    restarted.settle()
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(4), counted=True), full=True)
    fresh.settle()
    monkeypatch.undo()
    marks_for.cache_clear()
    assert (("sliceproxy", render.HAIRPIN) in plane.nft.dumped) is read_whole
    assert [p for p in plane.nft.probed if p[1] == render.HAIRPIN] == (
        [] if read_whole else [("sliceproxy", render.HAIRPIN, 16)])
    assert len(before - hairpins(plane)) == 16
    assert comparable(restarted.written()) == comparable(fresh.written())


def test_a_port_not_picked_that_lost_an_endpoint_while_no_agent_ran_has_its_hairpins_asked_for(
        ) -> None:
    """A port with chains of its own (counted one by one) that lost an endpoint while no
    agent ran keeps its dispatch element; when a picked port went too (a sweep is due),
    the rules of its chains as they were before its restart wrote them anew tell its
    earlier endpoints, and that endpoint's pair goes with the gone port's, each asked
    for by key."""
    plane = FakePlane("nftables")
    plane.become(*cluster([0, 1], changed=0, counted=True), *cluster([2, 3]), full=True)
    plane.settle()
    assert {("198.18.1.2", "198.18.1.2"), ("198.18.1.30", "198.18.1.30")} <= hairpins(plane)
    restarted = plane.restarted()
    after = [*cluster([0, 1], counted=True), *cluster([2])]
    restarted.become(*after)
    restarted.settle()
    assert not {("198.18.1.2", "198.18.1.2"), ("198.18.1.30", "198.18.1.30")} & hairpins(plane)
    assert ("sliceproxy", render.HAIRPIN) not in plane.nft.dumped
    fresh = FakePlane("nftables")
    fresh.become(*after, full=True)
    assert comparable(restarted.written()) == comparable(fresh.settle().written())


def test_a_port_gone_whose_endpoints_were_in_a_slot_map_has_hairpin_read_whole() -> None:
    """A port of SLOT_MAP_MIN endpoints or more balances through a slot map of its own:
    its rule DNATs to the map's value, and no rule names its endpoints. Gone while no
    agent ran, its pairs are found by reading @hairpin whole."""
    many = [ep(f"198.18.2.{k}") for k in range(1, render.SLOT_MAP_MIN + 1)]
    big = [service("big", ips=("198.18.128.99",), ports=({"name": "http", "port": 80},)),
           eps_slice("big-a", many, service_name="big", ports=({"name": "http", "port": 8080},))]
    plane = FakePlane("nftables")
    plane.become(*cluster(range(2)), *big, full=True)
    plane.settle()
    assert ("198.18.2.7", "198.18.2.7") in hairpins(plane)
    restarted = plane.restarted()
    restarted.become(*cluster(range(2)))
    restarted.settle()
    assert ("sliceproxy", render.HAIRPIN) in plane.nft.dumped
    assert ("198.18.2.7", "198.18.2.7") not in hairpins(plane)
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(2)), full=True)
    assert comparable(restarted.written()) == comparable(fresh.settle().written())


def test_the_pick_elements_a_restart_asks_for_are_the_slots_a_dispatch_names() -> None:
    """Of the pick maps, the slots 0..n-1 of each picked destination's map (its dispatch
    element's `goto pick-<n>`, its protocol), in the dispatch's table; not a kept
    port's, a chain of its own, a `pick-` chain we never name, nor a map not there."""
    shard = "sliceproxy-0"
    dispatch = {("198.18.128.1", "tcp", 80): Verdict("goto", "pick-2"),
                ("198.18.128.2", "udp", 53): Verdict("goto", "pick-1"),
                ("198.18.128.3", "tcp", 80): Verdict("goto", "pick-3"),  # kept
                ("198.18.128.4", "tcp", 80): Verdict("goto", "svc-ABC"),
                ("198.18.128.5", "tcp", 80): Verdict("goto", "pick-x"),
                ("198.18.128.6", "sctp", 9): Verdict("goto", "pick-1")}  # no such map
    maps = {(shard, render.pick_map(p, n)): "map" for p, n in (("tcp", 2), ("udp", 1),
                                                              ("tcp", 3), ("tcp", 4))}
    kernel = KernelTables({shard}, set(), {**maps, (shard, render.SERVICE_IPS): "map"},
                          set(), {(shard, render.SERVICE_IPS): Held(decoded=dict(dispatch))})
    assert picks_to_probe(kernel, {("198.18.128.3", "tcp", 80)}) == {
        (shard, "eps-tcp-2"): [("198.18.128.1", 80, 0), ("198.18.128.1", 80, 1)],
        (shard, "eps-udp-1"): [("198.18.128.2", 53, 0)],
        (shard, "eps-tcp-3"): [], (shard, "eps-tcp-4"): []}


def test_what_the_restart_writes_is_the_change_alone() -> None:
    """Services changed, removed and added while the agent was down: those ports are
    written, the others kept; one edited by an endpoint delta since its last whole
    write (no fingerprint) is written whole, and one whose chain someone deleted too."""
    plane = FakePlane("nftables")
    plane.become(*cluster(range(10), counted=True), full=True)
    assert len(marks(plane.nft.tables)) == 10 + 2  # a sync writes no input mark (marks.py)
    plane.settle()
    # Two per port (IPv4 only: its fingerprint and input mark), and the main table's and
    # shard's fingerprints.
    assert len(marks(plane.nft.tables)) == 2 * 10 + 2
    # As an endpoint delta's transaction leaves it (transaction._apply_edit).
    state = plane.dp._families[Family.V4].kept
    held = plane.nft.tables["ip", state.ports[port_key(9)].table].sets[FINGERPRINTS].elements
    del held[_key(state.ports[port_key(9)].fingerprint)]
    del held[_key(state.ports[port_key(9)].input_mark)]
    # Port 0's chain deleted by hand (after its dispatch entry, which the kernel asks
    # for first): its marks stay, the chain does not.
    delete_by_hand(plane, 0)
    restarted = plane.restarted()
    sent = len(plane.nft.scripts)
    report = restarted.become(*cluster([0, 1, 2, 3, 4, 5, 6, 8, 9, 10], changed=3, counted=True))
    # First: written 3 (changed), 9 (edited), 10 (new); kept by their marks 0, 1, 2, 4,
    # 5, 6, 8; nothing deleted; added: 3's new marks, cluster IP and three hairpin pairs
    # (the sets are not read), 9's marks, cluster IP and two pairs, 10's the same and its
    # dispatch entry.
    assert restart_details(report) == {"ports_kept": 7, "ports_written": 3,
                                       "elements_deleted": 0, "elements_added": 6 + 5 + 6}
    first = plane.nft.scripts[sent:]
    assert len(first) == 1
    assert {line.split()[4] for line in port_rule_lines(first[0])} == {
        port_chain("svc", port_key(i), "tcp") for i in (3, 9, 10)}
    assert " delete " not in first[0]
    # Right after: the sweep writes 0 again and deletes 7's objects.
    restarted.settle()
    sweep = plane.nft.scripts[sent + 1:]
    assert len(sweep) == 1
    assert f"delete chain ip sliceproxy-0 {port_chain('svc', port_key(7), 'tcp')}" in sweep[0]
    assert {line.split()[4] for line in port_rule_lines(sweep[0])} == {
        port_chain("svc", port_key(0), "tcp")}
    fresh = FakePlane("nftables")
    fresh.become(*cluster([0, 1, 2, 3, 4, 5, 6, 8, 9, 10], changed=3, counted=True), full=True)
    assert comparable(restarted.written()) == comparable(fresh.settle().written())


def test_an_upgrade_from_every_fingerprint_in_the_main_table_keeps_every_port() -> None:
    """A version that kept every port's fingerprint in the main table's @fingerprints
    (and so wrote its shard tables otherwise), built from other code (no input mark of
    ours): the restart renders every port and finds their fingerprints where they are,
    so it writes no port; the fingerprints move to their own tables in the one
    transaction."""
    plane = FakePlane("nftables", shards=2)
    plane.become(*cluster(range(6)), full=True)
    plane.settle()
    state = plane.dp._families[Family.V4].kept
    for (ip, name), table in plane.nft.tables.items():
        if ip == "ip" and name != TABLE:
            del table.sets[FINGERPRINTS]
    plane.nft.tables["ip", TABLE].sets[FINGERPRINTS].elements = {
        **{_key(p.fingerprint): "" for p in state.ports.values()},
        _key(state.bases[0].fingerprint): "",
        ("198.18.0.1",) * 4: "", ("198.18.0.2",) * 4: ""}  # its shard tables'
    restarted = plane.restarted()
    report = restarted.become(*cluster(range(6)))
    assert restart_details(report)["ports_written"] == 0
    assert restart_details(report)["ports_kept"] == 6
    assert port_rule_lines(plane.nft.scripts[-1]) == []
    fresh = FakePlane("nftables", shards=2)
    fresh.become(*cluster(range(6)), full=True)
    assert comparable(restarted.settle().written()) == comparable(fresh.settle().written())


@pytest.mark.parametrize("counted", [False, True], ids=["picked", "chains"])
@pytest.mark.parametrize("gone", [False, True], ids=["same-cluster", "one-went"])
def test_an_upgrade_reads_the_shared_sets_only_if_a_port_went(
        monkeypatch: pytest.MonkeyPatch, gone: bool, counted: bool) -> None:
    """Another build (other input marks; the kernel keeps the old build's) over the same
    rules renders every port and keeps each by its fingerprint. The old marks alone do
    not make it read @cluster-ips and @hairpin (a million pairs dumped at 100,000 x 10:
    70 s): only a port that went does, and its elements go (of @hairpin, the pairs of
    its endpoints, asked for by key: from its pick elements, or from the DNAT rules of
    its chains when it had chains of its own, `counted`)."""
    marks_for.cache_clear()
    plane = FakePlane("nftables")
    plane.become(*cluster(range(4), counted=counted), full=True)
    plane.settle()  # every port's input mark written
    monkeypatch.setattr(marks_module, "source_digest", lambda: b"another build")
    marks_for.cache_clear()
    after = cluster(range(3) if gone else range(4), counted=counted)
    restarted = plane.restarted()
    report = restarted.become(*after)
    restarted.settle()
    fresh = FakePlane("nftables")
    fresh.become(*after, full=True)
    fresh.settle()  # input marks of that build
    monkeypatch.undo()
    marks_for.cache_clear()  # none of another build's left for the tests after
    assert restart_details(report)["ports_written"] == 0
    assert ((TABLE, render.CLUSTER_IPS) in plane.nft.dumped) is gone
    assert (TABLE, render.HAIRPIN) not in plane.nft.dumped
    picks = [] if counted else [(render.pick_map("tcp", 2), 2)]
    assert [(name, n) for _table, name, n in plane.nft.probed] == (
        [*picks, (render.HAIRPIN, 2)] if gone else [])
    assert comparable(restarted.written()) == comparable(fresh.written())


def test_a_restart_that_renders_every_port_holds_only_those_it_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After an upgrade (other input marks) every port is rendered, and kept as the
    kernel holds it where its fingerprint is there: while the restart's transaction is
    sent, only the rendered objects of the one port that changed are held, not every
    port's (at 100,000 services x 10, 700 MiB more than a first start's peak). It still
    ends where a fresh start does."""
    marks_for.cache_clear()
    plane = FakePlane("nftables")
    plane.become(*cluster(range(30)), full=True)
    plane.settle()
    monkeypatch.setattr(marks_module, "source_digest", lambda: b"another build")
    marks_for.cache_clear()
    after = cluster(range(30), changed=7)
    restarted = plane.restarted()
    held_at_send: list[int] = []
    send = plane.nft.send

    def counting(script: Any, family: Family, tables: Any) -> None:
        gc.collect()
        held_at_send.append(sum(type(o) is render.PortObjects for o in gc.get_objects()))
        send(script, family, tables)

    monkeypatch.setattr(plane.nft, "send", counting)
    report = restarted.become(*after)
    restarted.settle()
    fresh = FakePlane("nftables")
    fresh.become(*after, full=True)
    fresh.settle()
    monkeypatch.undo()
    marks_for.cache_clear()
    assert restart_details(report)["ports_written"] == 1
    assert restart_details(report)["ports_kept"] == 29
    assert held_at_send[0] == 1
    assert comparable(restarted.written()) == comparable(fresh.written())


@pytest.mark.parametrize("by_hand", [None, "deleted", "changed", "map-deleted"])
def test_an_unchanged_upgrade_holds_none_of_the_maps_it_reads(
        monkeypatch: pytest.MonkeyPatch, by_hand: str | None) -> None:
    """After an upgrade over an unchanged cluster every port is intact, and the dispatch
    and counter maps are checked as they are read: none of their elements is held (at
    100,000 services x 10 those held put the peak 117 MiB higher). One deleted or
    changed by hand, its port's fingerprint still there, is found so, and the maps are
    read whole for the diff: the restart puts it back as a fresh start writes it, as it
    does a whole map deleted by hand (not checked, nor dumped: it is not there)."""
    marks_for.cache_clear()
    plane = FakePlane("nftables")
    plane.become(*cluster(range(5)), full=True)
    plane.settle()
    shard = plane.nft.tables["ip", plane.dp._families[Family.V4].kept.ports[port_key(2)].table]
    dispatch = shard.sets[render.SERVICE_IPS].elements
    one = sorted(dispatch)[0]
    if by_hand == "map-deleted":
        del shard.sets[render.PORT_COUNTERS]
    elif by_hand == "deleted":
        del dispatch[one]
    elif by_hand == "changed":
        dispatch[one] = "goto pick-tcp-7"
    monkeypatch.setattr(marks_module, "source_digest", lambda: b"another build")
    marks_for.cache_clear()
    reads: list[tuple[str, bool, int]] = []
    elements = plane.nft.elements

    def counting(family: Family, table: str, name: str, types: Any, is_map: bool,
                 keep: Any = None) -> Held:
        held = elements(family, table, name, types, is_map, keep)
        if is_map:
            reads.append((name, keep is not None, len(held)))
        return held

    monkeypatch.setattr(plane.nft, "elements", counting)
    restarted = plane.restarted()
    report = restarted.become(*cluster(range(5)))
    restarted.settle()
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(5)), full=True)
    fresh.settle()
    monkeypatch.undo()
    marks_for.cache_clear()
    assert restart_details(report)["ports_written"] == 0
    checked = {name for name, filtered, _n in reads if filtered}
    held_whole = [(name, n) for name, filtered, n in reads if not filtered]
    if by_hand is None:
        assert {render.SERVICE_IPS, render.PORT_COUNTERS} <= checked
        assert held_whole == []
        assert all(n == 0 for _name, filtered, n in reads if filtered)
    elif by_hand == "map-deleted":
        assert render.PORT_COUNTERS not in checked
        assert (render.SERVICE_IPS, 5) in held_whole
    else:
        assert render.SERVICE_IPS in checked
        assert (render.SERVICE_IPS, 5 - (by_hand == "deleted")) in held_whole
    assert comparable(restarted.written()) == comparable(fresh.written())


def _fingerprints(plane: FakePlane) -> set[tuple[str, tuple[str, ...]]]:
    """Every (table, element) of the fake kernel's @fingerprints."""
    return {(t, k) for (_ip, t), table in plane.nft.tables.items()
            if FINGERPRINTS in table.sets for k in table.sets[FINGERPRINTS].elements}


@pytest.mark.parametrize("between", [None, "change", "deleted by hand"])
def test_an_unchanged_upgrade_writes_nothing_and_deletes_the_old_marks_after(
        monkeypatch: pytest.MonkeyPatch, between: str | None) -> None:
    """After an upgrade over an unchanged cluster the restart writes nothing: the other
    build's input marks, true of what the kernel holds while nothing is written, are
    deleted after it, a part at a time, and this build's are added when idle (200,000
    of both in its transaction were ~50 MiB of its peak at 100,000 services). A change
    before they are all deleted deletes the rest first: none outlives a write (one
    made untrue would have a rollback keep a port as it no longer is). One deleted by
    hand meanwhile makes the part refused, and the next sync full. Every way, the node
    ends as a fresh start of the new build leaves it."""
    marks_for.cache_clear()
    plane = FakePlane("nftables")
    plane.become(*cluster(range(30)), full=True)
    plane.settle()
    before = _fingerprints(plane)
    monkeypatch.setattr(marks_module, "source_digest", lambda: b"another build")
    monkeypatch.setattr(mark_steps, "MARKS_ASIDE_PER_PART", 4)
    marks_for.cache_clear()
    after = cluster(range(30), changed=3 if between == "change" else None)
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(30)), full=True)
    fresh.settle()
    old = before - _fingerprints(fresh)
    fresh.become(*after)
    fresh.settle()
    restarted = plane.restarted()
    applied = len(plane.nft.scripts)
    report = restarted.become(*cluster(range(30)))
    assert restart_details(report) == {"ports_kept": 30, "ports_written": 0,
                                       "elements_deleted": 0, "elements_added": 0}
    assert len(plane.nft.scripts) == applied  # no transaction at all
    assert _fingerprints(restarted) == before
    assert len(old) == 30
    if between == "change":
        restarted.become(*after)
        assert not old & _fingerprints(restarted)
    elif between == "deleted by hand":
        table, key = sorted(old)[-1]
        del plane.nft.tables["ip", table].sets[FINGERPRINTS].elements[key]
        send = plane.nft.send

        def refusing(script: Any, family: Family, tables: Any) -> None:
            try:
                send(script, family, tables)
            except NftFakeError as exc:  # as the kernel's ENOENT reaches the plane
                raise NftError(str(exc)) from exc

        monkeypatch.setattr(plane.nft, "send", refusing)
        with pytest.raises(ApplyError):  # the part that holds it, whichever
            for _part in range(len(old)):
                restarted.dp.housekeeping()
        restarted.become(*after)  # full: the kernel no longer trusted
    else:
        restarted.dp.housekeeping()
        left = old & _fingerprints(restarted)
        assert len(left) == 26  # one part of 4
    restarted.settle()
    monkeypatch.undo()
    marks_for.cache_clear()
    assert comparable(restarted.written()) == comparable(fresh.written())


def test_the_sweep_reads_the_rules_of_what_may_be_nobodys_not_every_counter() -> None:
    """Endpoints counted one by one: a service that lost an endpoint and one that went
    while no agent ran leave counters nobody claims. The sweep finds them in the rules
    of the chains the restart rewrote (read before it rewrote them) and of the chains
    nobody claims, and deletes them, without a dump of every counter (which grows
    faster than the tables); it ends with the counters a fresh start writes."""
    plane = FakePlane("nftables")
    plane.become(*cluster(range(6), changed=3, counted=True), full=True)
    plane.settle()
    state = plane.dp._families[Family.V4].kept
    held = {(state.ports[port_key(i)].table, name)
            for i in (3, 5) for name, _digest in state.ports[port_key(i)].chains}
    dumps = plane.nft.counter_dumps
    restarted = plane.restarted()
    after = cluster(range(5), counted=True)  # s3 lost an endpoint, s5 went
    report = restarted.become(*after)
    assert restart_details(report)["ports_written"] == 1
    restarted.settle()  # the sweep
    assert plane.nft.counter_dumps == dumps
    assert set(plane.nft.rules_read) == held
    fresh = FakePlane("nftables")
    fresh.become(*after, full=True)
    ours = comparable(restarted.written())
    assert ours == comparable(fresh.settle().written())
    assert isinstance(ours, dict)
    assert len(ours["ip", render.shard_of(port_key(0), 1)][2]) == 5 * (1 + 2)


@pytest.mark.parametrize(("before", "after"), [(2, 7), (7, 2)])
def test_a_restart_across_a_change_of_shard_count(monkeypatch: pytest.MonkeyPatch,
                                                  before: int, after: int) -> None:
    """Services added or removed while no agent ran change how many shard tables the
    ports need: ports move between tables (their fingerprints name the table), and
    shard tables no longer used go, in the one transaction."""
    monkeypatch.setattr(render, "SHARD_PORTS", 2)  # 1 shard up to 2 ports, 4 up to 8
    plane = FakePlane("nftables")
    plane.become(*cluster(range(before)), full=True)
    restarted = plane.settle().restarted()
    report = restarted.become(*cluster(range(after)))
    assert report.full and restart_details(report)["ports_written"] > 0
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(after)), full=True)
    assert comparable(restarted.settle().written()) == comparable(fresh.settle().written())
    assert_same_answers(restarted, fresh, cluster(range(after)))


def test_a_chain_deleted_under_kept_marks_is_found_after_the_restart_and_written() -> None:
    """Marks promise what they stand for; a chain deleted by hand while no agent ran
    breaks the promise: the restart keeps the port unrendered, the kept state made after
    it finds the chain missing, and the sweep then writes that port whole (its dispatch
    entry too), without waiting for a change."""
    plane = FakePlane("nftables")
    plane.become(*cluster(range(3), counted=True), full=True)
    plane.settle()
    delete_by_hand(plane, 1)
    restarted = plane.restarted()
    report = restarted.become(*cluster(range(3), counted=True))
    assert restart_details(report)["ports_written"] == 0
    restarted.settle()  # the sync loop's, right after the first sync
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(3), counted=True), full=True)
    assert comparable(restarted.written()) == comparable(fresh.settle().written())
    assert_same_answers(restarted, fresh, cluster(range(3), counted=True))
    assert not restarted.become(*cluster(range(3), changed=1, counted=True)).full


def delete_by_hand(plane: FakePlane, i: int) -> None:
    """Port i's service chain deleted with `nft`, its dispatch entry first (the kernel
    refuses to delete a chain a map element jumps to); its marks left. (A port with a
    chain of its own: `cluster(counted=True)`; a picked port has none.)"""
    key = port_key(i)
    table = plane.nft.tables["ip", render.shard_of(key, 1)]
    victim = port_chain("svc", key, "tcp")
    dispatch = table.sets[render.SERVICE_IPS].elements
    for k in [k for k, v in dispatch.items() if victim in v]:
        del dispatch[k]
    del table.chains[victim]


def test_input_marks_are_added_a_part_at_a_time_and_a_change_goes_between(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A change never waits for every port's mark (4 s at 100,000 services): one
    housekeeping adds MARKS_PER_PART and says more is left; a change between parts is
    applied and its port marked in a later part; a restart then keeps every port."""
    monkeypatch.setattr(mark_steps, "MARKS_PER_PART", 2)
    plane = FakePlane("nftables", shards=2)
    plane.become(*cluster(range(5)), full=True)
    fam = plane.dp._families[Family.V4]
    assert fam.context is not None
    held = lambda: len(marks(plane.nft.tables))  # noqa: E731
    base = held()  # the bases' fingerprints
    sent = len(plane.nft.scripts)
    plane.dp.housekeeping()
    assert plane.dp.housekeeping_pending() and held() == base + 2
    assert len(plane.nft.scripts) == sent + 1
    plane.become(*cluster(range(5), changed=4))  # s4 gains an endpoint
    while plane.dp.housekeeping_pending():
        plane.dp.housekeeping()
    plane.dp.housekeeping()  # lists again: what the change left unmarked
    assert not plane.dp.housekeeping_pending()
    assert fam.last is not None
    of = marks_for(fam.context, fam.shards).of
    assert {_key(of(fam.last.ports[port_key(i)])) for i in range(5)} <= marks(plane.nft.tables)
    report = plane.restarted().become(*cluster(range(5), changed=4))
    assert restart_details(report)["ports_kept"] == 5


def test_a_kept_port_with_its_mark_is_the_port_with_that_mark_field() -> None:
    """KeptPort.with_mark builds the port positionally (fast): the same as replacing
    the mark field and adding its element."""
    plane = FakePlane("nftables", shards=2)
    plane.become(*cluster(range(2)), full=True)
    state = plane.dp._families[Family.V4].state
    assert state is not None
    mark = ("198.18.0.1", "198.18.0.2", "198.18.0.3", "198.18.0.4")
    for kept in state.ports.values():
        marked = kept.with_mark(mark)
        element = render.mark_element(kept.table, mark)
        assert marked == replace(kept, input_mark=mark, rendered=(*kept.rendered, *element))
        assert [f.name for f in fields(KeptPort)][-3:] == ["input_mark", "from_input", "picked"]
        assert marked.elements()[kept.table, FINGERPRINTS, mark] == ()


def test_a_refused_part_of_marks_leaves_the_rest_for_the_next_interval(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """One warning per interval while the kernel refuses marks, not one per part."""
    monkeypatch.setattr(mark_steps, "MARKS_PER_PART", 2)
    plane = FakePlane("nftables", shards=2)
    plane.become(*cluster(range(5)), full=True)
    base = len(marks(plane.nft.tables))
    send = plane.nft.send

    def refuse(*args: Any) -> None:
        raise NftError("refused by the test")

    monkeypatch.setattr(plane.nft, "send", refuse)
    plane.dp.housekeeping()
    assert not plane.dp.housekeeping_pending()
    assert len([r for r in caplog.records if "could not add input marks" in r.message]) == 1
    monkeypatch.setattr(plane.nft, "send", send)
    plane.settle()  # the next interval: every part
    assert len(marks(plane.nft.tables)) == base + 5


@pytest.mark.parametrize("marked", [True, False], ids=["kept-by-marks", "every-port-rendered"])
def test_a_picked_port_gone_or_changed_while_no_agent_ran_is_swept_or_written(
        marked: bool) -> None:
    """Picked ports (no chain of their own: their elements and counter) across a
    restart: one removed leaves no element, counter or mark; one whose endpoint count
    changed moves to the other pick map; the kernel ends as a fresh full sync leaves it.
    Whether the restart keeps the others by their input marks or (none written yet, or
    another build's) renders every port, it asks only for the pick elements of those
    two and the hairpin pairs of the endpoints nobody wants now, and dumps neither (a
    million pick elements at 100,000 x 10)."""
    plane = FakePlane("nftables")
    plane.become(*cluster(range(4)), full=True)
    if marked:
        plane.settle()  # input marks written
    assert not any(c.startswith("svc-") for t in plane.nft.tables.values() for c in t.chains)
    restarted = plane.restarted()
    restarted.become(*cluster([0, 2, 3], changed=2))
    restarted.settle()
    fresh = FakePlane("nftables")
    fresh.become(*cluster([0, 2, 3], changed=2), full=True)
    assert comparable(restarted.written()) == comparable(fresh.settle().written())
    gone = port_chain("cnt", port_key(1), "tcp")
    assert not any(gone in t.counters for t in plane.nft.tables.values())
    assert not [name for _table, name in plane.nft.dumped
                if name.startswith(render.PICKS) or name == render.HAIRPIN]
    # Ports 1 (gone) and 2 (now three endpoints): their two slots each, before; and
    # the hairpin pairs of port 1's two endpoints.
    assert [(name, n) for _table, name, n in plane.nft.probed] == [
        (render.pick_map("tcp", 2), 4), (render.HAIRPIN, 2)]


def test_an_upgrade_from_a_chain_per_port_picks_every_port_in_one_transaction(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The version before picked ports gave each port a chain of its own (as PICK_MAX 0
    does): the first sync of this one over its tables writes every port picked, deletes
    the chains in the same transaction, and ends as a start on a clean node."""
    monkeypatch.setattr(render, "PICK_MAX", 0)
    plane = FakePlane("nftables")
    plane.become(*cluster(range(4), changed=1), full=True)
    plane.settle()
    assert any(c.startswith("svc-") for t in plane.nft.tables.values() for c in t.chains)
    monkeypatch.setattr(render, "PICK_MAX", 32)
    restarted = plane.restarted()
    sent = len(plane.nft.scripts)
    report = restarted.become(*cluster(range(4), changed=1))
    assert restart_details(report)["ports_written"] == 4
    assert len(plane.nft.scripts) == sent + 2  # one transaction a family (its bases too)
    assert not any(c.startswith("svc-") for t in plane.nft.tables.values() for c in t.chains)
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(4), changed=1), full=True)
    assert comparable(restarted.settle().written()) == comparable(fresh.settle().written())


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(before=clusters(), gone=st.booleans(), picked=st.booleans(),
       during=st.lists(clusters(), min_size=1, max_size=3))
def test_changes_between_the_parts_of_a_restart_end_where_a_full_sync_does(
        monkeypatch: pytest.MonkeyPatch, before: list[dict[str, Any]], gone: bool,
        picked: bool, during: list[list[dict[str, Any]]]) -> None:
    """A restart over the same cluster (or with a service `gone` while no agent ran: a
    sweep is due) keeps every port by its marks; their state is made a port per part
    here, and changes come between the parts (services sharing endpoints and external
    IPs, so an element a change lets go may be a kept port's not made yet). Every sync
    answers as the cluster wants, and the tables end as a full sync from scratch leaves
    them, nothing left behind (but input marks: a port edited by a delta has none,
    marks.py)."""
    monkeypatch.setattr(render, "SLOT_MAP_MIN", 2)
    monkeypatch.setattr(restart_steps, "COMPLETE_PER_PART", 1)
    if not picked:  # a chain per port and per endpoint
        monkeypatch.setattr(render, "PICK_MAX", 0)
    plane = FakePlane("nftables", shards=2)
    plane.become(*before, full=True)
    restarted = plane.settle().restarted()
    services = [o["metadata"]["name"] for o in before if o["kind"] == "Service"]
    left = services[0] if gone and services else None
    restarted.become(*(o for o in before if _service_of(o) != left))
    for cluster_now in during:
        restarted.dp.housekeeping()  # one part
        assert not restarted.become(*cluster_now).full
        fresh = FakePlane("nftables", shards=2)
        fresh.become(*cluster_now, full=True)
        # A service gone while no agent ran keeps its rules until the sweep, also where
        # another takes its name meanwhile: not compared here.
        assert_same_answers(restarted, fresh, [o for o in cluster_now
                                               if _service_of(o) != left])
        assert_holds_what_is_claimed(restarted)
    restarted.settle()
    fresh = FakePlane("nftables", shards=2)
    fresh.become(*during[-1], full=True)
    fresh.settle()
    assert without_marks(restarted.written()) == without_marks(fresh.written())
    for family, fam in restarted.dp._families.items():
        assert fam.kept is not None and fam.kept.unfinished is None
        claimed = {_key(k) for (_t, name, k), _v in fam.kept.owners.elements()
                   if name == FINGERPRINTS}
        assert marks(restarted.written(), render.table_family(family)) == claimed


def _service_of(obj: dict[str, Any]) -> str:
    """The name of the Service an object is (or whose EndpointSlice it is)."""
    labels = obj["metadata"].get("labels", {})
    return str(labels.get("kubernetes.io/service-name", obj["metadata"]["name"]))


def assert_holds_what_is_claimed(plane: FakePlane) -> None:
    """Every element of the bases' sets and maps a port in the kept state claims (and
    so no sync will write again) is in the fake kernel."""
    for family, fam in plane.dp._families.items():
        assert fam.kept is not None
        ip = render.table_family(family)
        shared = {s.name for b in fam.kept.bases for s in b.sets}
        missing = [(t, name, k) for (t, name, k), _v in fam.kept.owners.elements()
                   if name in shared
                   and _key(k) not in plane.nft.tables[ip, t].sets[name].elements]
        assert not missing


def test_an_element_a_change_lets_go_stays_while_a_kept_port_not_made_yet_owns_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """s0 and s1 share an endpoint (its @hairpin pair). After a restart, one's state is
    made first; a change then takes its endpoints from that one. The other, kept but
    not made yet, still has the shared one: its pair stays in the kernel, and goes
    only when nobody has it; the pair of the endpoint nobody else had goes once every
    kept port is made."""
    monkeypatch.setattr(restart_steps, "COMPLETE_PER_PART", 1)

    def two(without: Iterable[int] = (), gone: int | None = None) -> list[dict[str, Any]]:
        out = []
        for i in (0, 1):
            if i == gone:
                continue
            out.append(service(f"s{i}", ips=(f"198.18.128.{10 + i}",),
                               ports=({"name": "http", "port": 80},)))
            eps = [] if i in without else [ep(f"198.18.1.{20 + i}"), ep("198.18.1.99")]
            out.append(eps_slice(f"s{i}-a", eps, service_name=f"s{i}",
                                 ports=({"name": "http", "port": 8080},)))
        return out

    plane = FakePlane("nftables")
    plane.become(*two(), full=True)
    restarted = plane.settle().restarted()
    restarted.become(*two())
    restarted.dp.housekeeping()  # one's state made, the other's not
    fam = restarted.dp._families[Family.V4]
    (waiting,) = fam.pending
    made = 1 - int(waiting.name[1:])
    pair = _key(render.hairpin_element("198.18.1.99"))
    hairpin = lambda: plane.nft.tables["ip", TABLE].sets[render.HAIRPIN].elements  # noqa: E731
    own = _key(render.hairpin_element(f"198.18.1.{20 + made}"))
    restarted.become(*two(without=[made]))
    assert pair in hairpin() and own in hairpin()
    restarted.settle()
    assert pair in hairpin() and own not in hairpin()
    restarted.become(*two(without=[made], gone=1 - made))
    assert pair not in hairpin()


def test_a_service_back_under_a_gone_ones_name_before_the_sweep_replaces_its_rules(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """s2 went while no agent ran; its chains stay until the sweep. Before that, s2 is
    created again, with other endpoints: its chains are flushed and written anew, not
    added to, and the tables end as a start on a clean node."""
    monkeypatch.setattr(restart_steps, "COMPLETE_PER_PART", 1)
    monkeypatch.setattr(render, "PICK_MAX", 0)  # a chain per port
    plane = FakePlane("nftables")
    plane.become(*cluster(range(3)), full=True)
    restarted = plane.settle().restarted()
    restarted.become(*cluster(range(2)))
    assert restarted.dp._families[Family.V4].sweep_due
    restarted.become(*cluster(range(3), changed=2))
    fresh = FakePlane("nftables")
    fresh.become(*cluster(range(3), changed=2), full=True)
    assert_same_answers(restarted, fresh, cluster(range(3), changed=2))
    restarted.settle()
    assert comparable(restarted.written()) == comparable(fresh.settle().written())


def restarted_with_six_pending(monkeypatch: pytest.MonkeyPatch
                               ) -> tuple[FakePlane, FakePlane]:
    """Six ports synced, then an agent restarted over them that keeps all six by their
    marks, none of their state made yet (a port a part): (the first, the restarted)."""
    monkeypatch.setattr(restart_steps, "COMPLETE_PER_PART", 1)
    plane = FakePlane("nftables")
    plane.become(*cluster(range(6)), full=True)
    restarted = plane.settle().restarted()
    restarted.become(*cluster(range(6)))
    assert len(restarted.dp._families[Family.V4].pending) == 6
    return plane, restarted


def test_the_rules_of_one_port_asked_while_a_restart_completes_make_that_port_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The debug dump of one service during a restart's completion: its kept state is
    made (its rules rendered as applied), the other kept ports' wait for their parts."""
    plane, restarted = restarted_with_six_pending(monkeypatch)
    fam = restarted.dp._families[Family.V4]
    assert port_key(3) in fam.pending
    lines = restarted.dp.applied_rules(port_key(3))
    assert lines == plane.dp.applied_rules(port_key(3)) and lines
    assert port_key(3) not in fam.pending and len(fam.pending) == 5


def test_a_traffic_reading_during_a_restart_s_completion_makes_a_part_and_leaves_the_rest(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A scrape right after a restart: it made every kept port's state at once (12 s at
    100,000); it now makes a part, and the ports not made yet are not in its reading."""
    monkeypatch.setattr(nft_apply, "READ_COMPLETES", 2)
    plane, restarted = restarted_with_six_pending(monkeypatch)
    fam = restarted.dp._families[Family.V4]
    assert len(restarted.dp.traffic()) == 2 and len(fam.pending) == 4
    restarted.settle()
    assert restarted.dp.traffic().keys() == plane.dp.traffic().keys()



class _Listener:
    """Stands for the nf_tables listener: these tests report foreign changes by hand."""

    def __init__(self, *_: Any) -> None:
        pass

    def start(self) -> None:
        pass


def test_a_drift_check_during_a_restart_s_completion_waits_for_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A foreign change right after a restart: the check made every kept port's state
    at once (12 s at 100,000); it now waits for the completion's parts, whose end asks
    for the check again, which then finds what was changed."""
    monkeypatch.setattr(nft_apply, "NftablesListener", _Listener)
    _plane, restarted = restarted_with_six_pending(monkeypatch)
    asked: list[str] = []
    restarted.dp.watch_drift(asked.append)
    fam = restarted.dp._families[Family.V4]
    restarted.nft.tables["ip", TABLE].chains["theirs"] = Chain(["counter"])

    assert restarted.dp.check_drift() == []
    assert len(fam.pending) == 6 and restarted.dp.housekeeping_pending()
    assert asked == []
    restarted.settle()
    assert asked == ["a drift check held back by the restart's completion"]
    found = restarted.dp.check_drift()
    assert any("theirs" in f for f in found), found


@pytest.mark.parametrize("counted", [False, True], ids=["picked", "chains"])
def test_a_kept_port_deleted_before_the_sweep_has_its_hairpins_deleted_by_it(
        monkeypatch: pytest.MonkeyPatch, counted: bool) -> None:
    """A restart with a sweep due (a port gone while no agent ran) keeps the others by
    their marks; one of those is deleted by a change before its state is made (made
    first, then deleted): its @hairpin pairs, whose deletion waits for every port to be
    in, are asked for by the sweep and deleted by it, for picked ports and ports with
    chains of their own alike."""
    monkeypatch.setattr(restart_steps, "COMPLETE_PER_PART", 1)
    plane = FakePlane("nftables")
    plane.become(*cluster(range(4), counted=counted), full=True)
    plane.settle()
    restarted = plane.restarted()
    restarted.become(*cluster(range(3), counted=counted))  # s3 gone: a sweep is due
    assert not restarted.become(*cluster([0, 1], counted=counted)).full  # s2 goes
    assert ("198.18.1.20", "198.18.1.20") in hairpins(plane)  # held back
    restarted.settle()
    assert not {("198.18.1.20", "198.18.1.20"), ("198.18.1.30", "198.18.1.30")} \
        & hairpins(plane)
    assert ("sliceproxy", render.HAIRPIN) not in plane.nft.dumped
    fresh = FakePlane("nftables")
    fresh.become(*cluster([0, 1], counted=counted), full=True)
    assert comparable(restarted.written()) == comparable(fresh.settle().written())
