"""Endpoint deltas against the real kernel: after a run of partial syncs that each
rendered a large port from its endpoint delta (nftables/port_edit.py), our tables read back
as a fresh full sync's do (slot order aside), and the plane's own drift check finds
nothing."""

from __future__ import annotations

import random
from typing import Any

import pytest

from proxy.dataplane.nftables import apply as nft_apply
from proxy.dataplane.nftables.port_edit import render_edit
from proxy.dataplane.nftables.render import FINGERPRINTS, SLOT_MAP_MIN, SLOTS, shard_of
from proxy.dataplane.nftables.slot_tail import TAIL_PREFIX
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family, ServicePortKey
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from tests.e2e.conftest import Cluster, NodePlane
from tests.e2e.test_nftables_kernel import ADDRESSES, dump_rules, listing, nft, wipe
from tests.unit.builders import NODE, ep, eps_slice, service
from tests.unit.test_nftables_delta import POOL, SPECS, Pod, small_tails, step, with_delta

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

KEY = ServicePortKey("ns", "svc", "http", Family.V4)


def objects(pods: dict[str, Pod]) -> list[dict[str, Any]]:
    eps = [ep(a, node=NODE if p.local else "node-b", ready=p.ready) for a, p in pods.items()]
    return [service(**SPECS["local"]), eps_slice("s1", eps)]


@pytest.mark.parametrize("tails", [False, True])
def test_delta_syncs_leave_what_a_fresh_full_sync_writes(
        monkeypatch: pytest.MonkeyPatch, tails: bool) -> None:
    """With `tails`, the large paths' slots split into a main map and a tail of 3 to 6
    (slot_tail.py): the split comes, goes and moves, and every endpoint keeps 1/n."""
    if tails:
        small_tails(monkeypatch)
    edits: list[bool] = []

    def counted(*args: Any) -> Any:
        edit = render_edit(*args)
        edits.append(edit is not None)
        return edit

    monkeypatch.setattr(nft_apply, "render_edit", counted)
    rng = random.Random(29)
    pods = {a: Pod(local=rng.random() < 0.95) for a in POOL[:SLOT_MAP_MIN + 20]}
    cluster = Cluster()
    with Lab([]) as lab:
        mine, theirs = lab.node_ns, lab.client_ns
        for ns in (mine, theirs):
            wipe(ns)
        plane = NodePlane(mine, mode="nftables", addresses=lambda: ADDRESSES)
        applied = cluster.become(*objects(pods))
        plane.sync(applied, full=True)
        for n in range(40):
            # Down across the threshold and back up: edits, and whole renders between.
            step(pods, rng, shrink=10 <= n < 25)
            resolved = cluster.become(*objects(pods)).ports[KEY]
            # The port with its delta from the one applied (as the model will send it).
            state: DesiredState = applied.evolve({KEY: with_delta(applied.ports[KEY],
                                                                  resolved)})
            report = plane.sync(state)
            assert not report.full and report.written == (KEY,)
            applied = state
        assert sum(edits) >= 10, edits
        fresh = NodePlane(theirs, mode="nftables", addresses=lambda: ADDRESSES)
        fresh.sync(applied, full=True)
        # The same, but for the port's fingerprint: gone once an edit wrote it (a
        # restart writes the port whole), where a fresh sync writes one.
        ours, fresh_listing = listing(mine), listing(theirs)
        if tails:
            assert_split_balances_evenly(mine, ours)
            ours, fresh_listing = unsplit(ours), unsplit(fresh_listing)
        marks = ("set", "ip", shard_of(KEY, 1), FINGERPRINTS)
        held, wanted = ours.pop(marks)["elem"], fresh_listing.pop(marks)["elem"]
        assert ours == fresh_listing
        assert set(held) < set(wanted) and len(wanted) - len(held) == 1
        if not tails:
            assert dump_rules(plane, KEY) == dump_rules(fresh, KEY)
        with entered(mine):
            assert plane.dp.check_drift() == []
        for p in (plane, fresh):
            p.cleanup()


def assert_split_balances_evenly(ns: str, held: dict[Any, Any]) -> None:
    """Each split path's rules, as the kernel holds them, give every endpoint 1/n: the
    tail's rule takes its share (t of n) and picks among its t slots, the main rule
    among the others."""
    maps = {name: len(obj["elem"]) for (kind, _, _, name), obj in held.items()
            if kind == "map" and "elem" in obj}
    tails = [name for name in maps if name.startswith(TAIL_PREFIX)]
    assert tails, "no path was split at the end"
    for tail in tails:
        path = tail.removeprefix(TAIL_PREFIX)
        t, main = maps[tail], maps[SLOTS + path]
        table = next(k[2] for k in held if k[0] == "map" and k[3] == tail)
        tail_rules = nft(ns, "list", "chain", "ip", table, tail)
        assert f"numgen random mod {main + t} < {t} " in tail_rules
        assert f"numgen random mod {t} map @{tail}" in tail_rules
        assert f"numgen random mod {main} map @{SLOTS}{path}" \
            in nft(ns, "list", "chain", "ip", table, path)


def unsplit(held: dict[Any, Any]) -> dict[Any, Any]:
    """`held` with each path's main map and tail as one sorted list of endpoints, and
    the rules that say where the split is left out: the split depends on the history
    (slot_tail.py), what each endpoint gets does not (assert_split_balances_evenly)."""
    out: dict[Any, Any] = {}
    paths = {name.removeprefix(TAIL_PREFIX) for (kind, _, _, name) in held
             if kind == "map" and name.startswith(TAIL_PREFIX)}
    for key, obj in held.items():
        kind, _, _, name = key
        path = name.removeprefix(TAIL_PREFIX).removeprefix(SLOTS)
        if kind == "map" and name.startswith((SLOTS, TAIL_PREFIX)):
            out.setdefault(("slots", path), []).extend(obj.get("elem", []))
        elif kind == "rules" and name.removeprefix(TAIL_PREFIX) in paths:
            out[key] = [r for r in obj if "numgen" not in r]
        elif not (kind == "chain" and name.startswith(TAIL_PREFIX)):
            out[key] = obj
    return {k: sorted(v) if k[0] == "slots" else v for k, v in out.items()}
