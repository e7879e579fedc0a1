"""Rendering ahead (DataPlane.render_ahead, while the cluster still lists) changes when
the first full sync's render is done, never what it writes: the kernel reads back as
after a first sync that rendered everything itself, a port whose resolution changed
after it was rendered ahead gets its new rules, and the ports rendered ahead are not
rendered again."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.dataplane.nftables import apply as nft_apply
from proxy.model.types import Family
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from tests.e2e.conftest import Cluster, NodePlane
from tests.e2e.test_nftables_kernel import ADDRESSES, listing, wipe
from tests.unit.builders import ep, eps_slice, service

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

NAMES = [f"svc-{i}" for i in range(6)]


def objects(moved: int = 0) -> list[dict[str, Any]]:
    """Six services of 1-3 endpoints; `moved` shifts the first one's addresses."""
    out: list[dict[str, Any]] = []
    for i, name in enumerate(NAMES):
        base = 10 * i + (moved if i == 0 else 0)
        out.append(service(name=name, ips=(f"198.18.128.{i + 1}",)))
        out.append(eps_slice(f"{name}-1", [ep(f"198.18.1.{base + k}") for k in range(1 + i % 3)],
                             service_name=name))
    return out


def test_the_first_sync_after_rendering_ahead_writes_what_one_without_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    rendered: list[str] = []
    real = nft_apply.render_port

    def counted(rsp: Any, *args: Any) -> Any:
        rendered.append(rsp.key.name)
        return real(rsp, *args)

    monkeypatch.setattr(nft_apply, "render_port", counted)
    cluster = Cluster()
    early = cluster.model
    for obj in objects():
        cluster.become(*cluster.objects.values(), obj)
    with Lab([]) as lab:
        mine, theirs = lab.node_ns, lab.client_ns
        for ns in (mine, theirs):
            wipe(ns)
        plane = NodePlane(mine, mode="nftables", addresses=lambda: ADDRESSES)
        ahead = [rsp for key, rsp in cluster.model.state.ports.items()
                 if key.name in NAMES[:4]]
        with entered(mine):
            plane.dp.render_ahead(ahead, {Family.V4: len(cluster.model.state.ports)})
        assert sorted(rendered) == NAMES[:4]
        rendered.clear()
        # svc-0 changes after it was rendered ahead: a new resolution, rendered again.
        state = cluster.become(*objects(moved=5))
        assert early is cluster.model
        plane.sync(state, full=True)
        assert sorted(rendered) == ["svc-0", "svc-4", "svc-5"]
        fresh = NodePlane(theirs, mode="nftables", addresses=lambda: ADDRESSES)
        fresh.sync(state, full=True)
        assert listing(mine) == listing(theirs)
        # svc-0's one endpoint, moved: its DNAT target (its pick map's element).
        svc0 = plane.dp.applied_rules(next(k for k in state.ports if k.name == "svc-0"))
        assert any(": 198.18.1.5 . " in r for r in svc0), svc0
        assert not any(": 198.18.1.0 . " in r for r in svc0), svc0
        # Handed over once: the next full sync renders everything itself.
        rendered.clear()
        plane.sync(state, full=True)
        assert sorted(rendered) == NAMES
        for p in (plane, fresh):
            p.cleanup()
