"""The periodic resync a table at a time (nftables/resync_steps.py), on the fake kernel:
each housekeeping part writes one table whole again, repairs what was changed behind
the agent's back there, and changes go between the parts; the tables end as a full
sync from scratch leaves them."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.dataplane.base import ApplyError
from proxy.dataplane.nftables import render
from proxy.dataplane.nftables.render import FINGERPRINTS, TABLE, port_chain, shard_of
from proxy.dataplane.nftables.transaction import KeptPort
from proxy.model.types import Family
from tests.fakekernel.nftables import Chain, NftSet
from tests.fakekernel.planes import FakePlane
from tests.unit.test_iptables_sync import clusters
from tests.unit.test_nftables_fake_sync import assert_same_answers, comparable
from tests.unit.test_nftables_restart import cluster, marks, port_key, without_marks

SHARDS = 2


def resync_parts(plane: FakePlane, repair: bool = False) -> list[int]:
    """Begin a resync (`repair`: after drift) and run it to its end, a housekeeping
    call at a time: the transactions each call committed."""
    assert plane.dp.begin_resync(repair)
    sent = []
    while plane.dp.housekeeping_pending():
        before = len(plane.nft.scripts)
        plane.dp.housekeeping()
        sent.append(len(plane.nft.scripts) - before)
    return sent


def tables_left(plane: FakePlane) -> list[int]:
    """Each family's tables its resync has still to write."""
    return [len(fam.resync.tables) if fam.resync is not None else 0
            for fam in plane.dp._families.values()]


def fresh_plane(objects: list[dict[str, Any]], shards: int = SHARDS) -> FakePlane:
    fresh = FakePlane("nftables", shards=shards)
    fresh.become(*objects, full=True)
    return fresh.settle()


def drifted(objects: list[dict[str, Any]]) -> FakePlane:
    """`objects` synced, then behind the agent's back: a port's chain emptied in its
    shard, the cluster IP of another gone from the main table and one added there, a
    chain and a map of someone else's added to a shard."""
    plane = FakePlane("nftables", shards=SHARDS)
    plane.become(*objects, full=True)
    plane.settle()
    first, second = port_key(1), port_key(2)
    shard = plane.nft.tables["ip", shard_of(first, SHARDS)]
    shard.chains[port_chain("svc", first, "tcp")].rules.clear()
    main = plane.nft.tables["ip", TABLE]
    ips = main.sets[render.CLUSTER_IPS].elements
    del ips["198.18.128.12",]
    ips["198.18.128.99",] = ""  # (heard by the drift watch: a repair follows)
    other = plane.nft.tables["ip", shard_of(second, SHARDS)]
    other.chains["theirs"] = Chain(["counter"])
    other.sets["theirs"] = NftSet(True, "type ipv4_addr : verdict")
    return plane


def test_a_repair_writes_a_table_a_part_and_repairs_what_was_changed_behind_its_back(
        ) -> None:
    objects = cluster(range(8), counted=True)  # a chain per port and per endpoint
    plane = drifted(objects)
    # One table a part, in each family (shards first, the main table last).
    assert resync_parts(plane, repair=True) == [2] * (SHARDS + 1)
    assert comparable(plane.written()) == comparable(fresh_plane(objects).written())
    # Nothing was made anew: a change after it is a partial sync of that port alone.
    report = plane.become(*cluster(range(8), changed=3, counted=True))
    assert not report.full and report.written == (port_key(3),)


def test_the_periodic_resync_adds_to_the_main_table_s_sets_without_flushing_them() -> None:
    """Flushed, each of their elements (a million at 100,000 services x 10) is
    announced twice to anyone listening to nf_tables: the periodic resync only adds
    what they lack; an element someone added stays (the drift watch hears that, and
    its repair flushes them)."""
    objects = cluster(range(8), counted=True)
    plane = drifted(objects)
    sent = len(plane.nft.scripts)
    resync_parts(plane)
    main = [line for script in plane.nft.scripts[sent:] for line in script.splitlines()
            if f" {TABLE} " in line]
    assert main and not any(line.startswith("flush set") for line in main)
    fresh = comparable(fresh_plane(objects).written())
    assert comparable(plane.written()) != fresh
    ips = plane.nft.tables["ip", TABLE].sets[render.CLUSTER_IPS].elements
    assert ("198.18.128.12",) in ips  # what it lacked, added
    del ips["198.18.128.99",]  # the one added by someone else, left
    assert comparable(plane.written()) == fresh


def test_the_main_table_s_sets_are_refilled_by_the_shards_parts() -> None:
    """Every element of the main table's sets gone behind the agent's back, every one
    back after a periodic resync: each shard's part adds its ports' (their cluster IPs,
    their endpoints' hairpin pairs), so the main table's part, which added all of them
    (1.1 million at 100,000 x 10: 2 s), adds the bases' alone."""
    objects = cluster(range(8), counted=True)
    plane = fresh_plane(objects)
    main = plane.nft.tables["ip", TABLE]
    emptied = {name: dict(s.elements) for name, s in main.sets.items()
               if not s.is_map and s.elements}
    assert {render.CLUSTER_IPS, render.HAIRPIN} <= emptied.keys()
    for name in emptied:
        main.sets[name].elements.clear()
    resync_parts(plane)
    main = plane.nft.tables["ip", TABLE]  # (the fake kernel commits a copy)
    assert {name: main.sets[name].elements for name in emptied} == emptied
    for part in plane.nft.scripts[-2:]:  # each family's main table, written last
        added = [line for line in part.splitlines() if line.startswith("add element")]
        assert f"table ip{'6' if part is plane.nft.scripts[-1] else ''} {TABLE}" in part
        assert not any(f" {render.HAIRPIN} " in line or f" {render.CLUSTER_IPS} " in line
                       for line in added)
    assert comparable(plane.written()) == comparable(fresh_plane(objects).written())


def test_a_resync_asked_again_before_it_ends_goes_on_but_a_repair_starts_over() -> None:
    """At 100,000 services a resync with someone listening to nf_tables took longer
    than a short --sync-period: asked again, it does not start over."""
    plane = FakePlane("nftables", shards=SHARDS)
    plane.become(*cluster(range(4)), full=True)
    plane.settle()
    assert plane.dp.begin_resync(False)
    plane.dp.housekeeping()
    left = tables_left(plane)
    assert left == [SHARDS, SHARDS]
    assert plane.dp.begin_resync(False)
    assert tables_left(plane) == left
    # A repair asked meanwhile starts over, flushing the main table's sets too.
    assert plane.dp.begin_resync(True)
    assert tables_left(plane) == [SHARDS + 1] * 2
    assert all(fam.resync is not None and fam.resync.repair
               for fam in plane.dp._families.values())


def test_a_part_refused_drops_the_resync_and_makes_the_next_sync_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    objects = cluster(range(4))
    plane = FakePlane("nftables", shards=SHARDS)
    plane.become(*objects, full=True)
    plane.settle()
    assert plane.dp.begin_resync(False)
    plane.dp.housekeeping()

    def refuse(*args: Any) -> None:
        from proxy.dataplane.nftables.runner import NftError
        raise NftError("refused")

    monkeypatch.setattr(plane.nft, "send", refuse)
    with pytest.raises(ApplyError):
        plane.dp.housekeeping()
    # Both families' parts were tried; each dropped its state and resync.
    assert all(fam.state is None and fam.resync is None
               for fam in plane.dp._families.values())
    assert not plane.dp.housekeeping_pending()
    monkeypatch.undo()
    assert plane.become(*objects).full


def test_a_port_not_rendering_to_what_the_state_keeps_makes_the_next_sync_full() -> None:
    objects = cluster(range(4), counted=True)
    plane = FakePlane("nftables", shards=1)
    plane.become(*objects, full=True)
    plane.settle()
    fam = plane.dp._families[Family.V4]
    state = fam.state
    assert state is not None
    kept = state.ports[port_key(2)]
    name, digest = kept.chains[0]
    state.ports[port_key(2)] = KeptPort(kept.table, ((name, digest + 1), *kept.chains[1:]),
                                        kept.rendered, kept.sets, kept.slots,
                                        kept.element_dict, kept.counters, kept.fingerprint,
                                        kept.input_mark, kept.from_input, kept.picked)
    assert plane.dp.begin_resync(False)
    with pytest.raises(ApplyError, match="differs"):
        while plane.dp.housekeeping_pending():
            plane.dp.housekeeping()
    assert fam.state is None and fam.resync is None  # the other family's goes on
    assert plane.become(*objects).full


def test_no_resync_in_parts_before_a_first_sync_or_when_ports_outgrow_the_shards(
        monkeypatch: pytest.MonkeyPatch) -> None:
    plane = FakePlane("nftables", shards=1)
    assert not plane.dp.begin_resync(False)
    plane.become(*cluster(range(6)), full=True)
    monkeypatch.setattr(render, "SHARD_PORTS", 2)  # 6 ports would want 4 shards
    assert not plane.dp.begin_resync(False)


@settings(max_examples=50, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(before=clusters(), picked=st.booleans(), repair=st.booleans(),
       during=st.lists(clusters(), min_size=1, max_size=4))
def test_changes_between_the_parts_of_a_resync_end_where_a_full_sync_does(
        monkeypatch: pytest.MonkeyPatch, before: list[dict[str, Any]], picked: bool,
        repair: bool, during: list[list[dict[str, Any]]]) -> None:
    """A resync begun over one cluster, a part at a time, with the cluster changing
    between the parts (services sharing endpoints and external IPs; ports with slot
    maps, picked ports or a chain per endpoint): every sync answers as a full sync from
    scratch would, and the tables end as it leaves them."""
    monkeypatch.setattr(render, "SLOT_MAP_MIN", 2)
    if not picked:
        monkeypatch.setattr(render, "PICK_MAX", 0)
    plane = FakePlane("nftables", shards=SHARDS)
    plane.become(*before, full=True)
    plane.settle()
    assert plane.dp.begin_resync(repair)
    for cluster_now in during:
        left = tables_left(plane)
        plane.dp.housekeeping()  # one table of each family, if any is left
        assert tables_left(plane) == [max(0, n - 1) for n in left]
        assert not plane.become(*cluster_now).full
        assert_same_answers(plane, fresh_plane(cluster_now), cluster_now)
    plane.settle()
    assert not plane.dp.housekeeping_pending()
    # Input marks aside (a port edited by a delta has none, marks.py), which are exactly
    # what the state claims.
    assert without_marks(plane.written()) == without_marks(fresh_plane(during[-1]).written())
    for family, fam in plane.dp._families.items():
        assert fam.state is not None
        claimed = {tuple(str(part) for part in k) for (_t, name, k), _v
                   in fam.state.owners.elements() if name == FINGERPRINTS}
        assert marks(plane.written(), render.table_family(family)) == claimed
