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
from proxy.dataplane.nftables.render import FINGERPRINTS, SLOT_MAP_MIN
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family, ServicePortKey
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from tests.e2e.conftest import Cluster, NodePlane
from tests.e2e.test_nftables_kernel import ADDRESSES, dump_rules, listing, wipe
from tests.unit.builders import NODE, ep, eps_slice, service
from tests.unit.test_nftables_delta import POOL, SPECS, Pod, step, with_delta

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

KEY = ServicePortKey("ns", "svc", "http", Family.V4)


def objects(pods: dict[str, Pod]) -> list[dict[str, Any]]:
    eps = [ep(a, node=NODE if p.local else "node-b", ready=p.ready) for a, p in pods.items()]
    return [service(**SPECS["local"]), eps_slice("s1", eps)]


def test_delta_syncs_leave_what_a_fresh_full_sync_writes(
        monkeypatch: pytest.MonkeyPatch) -> None:
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
        marks = ("set", "ip", "sliceproxy", FINGERPRINTS)
        held, wanted = ours.pop(marks)["elem"], fresh_listing.pop(marks)["elem"]
        assert ours == fresh_listing
        assert set(held) < set(wanted) and len(wanted) - len(held) == 1
        assert dump_rules(plane, KEY) == dump_rules(fresh, KEY)
        with entered(mine):
            assert plane.dp.check_drift() == []
        for p in (plane, fresh):
            p.cleanup()
