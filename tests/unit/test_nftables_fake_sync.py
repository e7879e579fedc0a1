"""The nftables mode on the fake kernel (tests/fakekernel/nftables.py), over random
clusters: a run of partial syncs leaves what a full sync from scratch writes, and every
service address sends a pod's connection to the same endpoints either way. The real
kernel checks the same on a few examples (tests/e2e/test_nftables_kernel.py), where
what it adds is the netlink encoding and nf_tables' own reading of it."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from proxy.dataplane.nftables import render
from proxy.dataplane.nftables.render import PICKS, SLOTS
from tests.fakekernel.nftables import NftTable
from tests.fakekernel.packet import Packet
from tests.fakekernel.planes import FakePlane
from tests.unit.test_iptables_sync import clusters


def comparable(tables: object) -> object:
    """The fake's tables with each slot map's elements as a sorted list of endpoints
    (which endpoint holds which slot depends on the history: render.assign_slots), and
    the names of their counters (what they counted depends on the traffic)."""
    assert isinstance(tables, dict)
    out: dict[Any, Any] = {}
    for key, table in tables.items():
        assert isinstance(table, NftTable)
        sets: dict[str, object] = {}
        for name, s in table.sets.items():
            if name.startswith(SLOTS):
                assert sorted(int(k[0]) for k in s.elements) == list(range(len(s.elements)))
                sets[name] = (s.body, sorted(s.elements.values()))
            elif name.startswith(PICKS):  # each picked port's endpoints, slots 0..n-1
                ports: dict[tuple[str, ...], list[str]] = {}
                for k, v in s.elements.items():
                    ports.setdefault(k[:-1], []).append(v)
                assert all(len(v) == int(name.rsplit("-", 1)[1]) for v in ports.values())
                sets[name] = (s.body, {k: sorted(v) for k, v in ports.items()})
            else:
                sets[name] = (s.body, s.elements)
        out[key] = (table.chains, sets, sorted(table.counters))
    return out


def addresses(objects: list[dict[str, Any]]) -> list[tuple[str, int, str]]:
    """Every service address and port of `objects`: (address, port, protocol)."""
    out = []
    for obj in objects:
        if obj["kind"] != "Service":
            continue
        spec = obj["spec"]
        ips = [*spec["clusterIPs"], *spec.get("externalIPs", ())]
        ips += [i["ip"] for i in obj.get("status", {}).get("loadBalancer", {}).get("ingress", ())]
        out += [(ip, p["port"], p.get("protocol", "TCP").lower())
                for ip in ips for p in spec["ports"]]
    return out


def assert_same_answers(plane: FakePlane, fresh: FakePlane,
                        objects: list[dict[str, Any]]) -> None:
    """A pod's connection to every service address of `objects` reaches the same
    endpoints, as likely, through either plane's rules."""
    for ip, port, protocol in addresses(objects):
        source = "198.18.1.50" if ":" not in ip else "fd00:18:1::50"
        packet = Packet.of(source, ip, port, protocol)
        assert plane.trace(packet).endpoints() == pytest.approx(fresh.trace(packet).endpoints())


@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=clusters(), second=clusters(), third=clusters())
def test_partial_syncs_end_where_a_full_sync_from_scratch_does(
        monkeypatch: pytest.MonkeyPatch, first: list[dict[str, Any]],
        second: list[dict[str, Any]], third: list[dict[str, Any]]) -> None:
    # Ports of 2 endpoints and more balance through slot maps: both shapes, and ports
    # going from one to the other, in these small clusters.
    monkeypatch.setattr(render, "SLOT_MAP_MIN", 2)
    plane = FakePlane("nftables", shards=4)
    plane.become(*first, full=True)
    for objects in (second, third):
        assert not plane.become(*objects).full
    fresh = FakePlane("nftables", shards=4)
    fresh.become(*third, full=True)
    assert comparable(plane.written()) == comparable(fresh.written())
    assert_same_answers(plane, fresh, third)
