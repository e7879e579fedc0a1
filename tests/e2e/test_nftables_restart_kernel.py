"""A restart over our own tables in the real kernel (restart.py): the new agent's first
sync reads back names, fingerprints and the bases' elements over netlink and writes what
differs, ending where a start on a clean node ends; a port it did not write keeps its
very rules (the kernel's handles) and counts. Traffic through a restarted agent, with
no flow moved: tests/faults/test_restart_flows.py."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from proxy.dataplane.nftables import marks as marks_module
from proxy.dataplane.nftables import render, restart, slot_tail
from proxy.dataplane.nftables.marks import marks_for
from proxy.dataplane.nftables.render import FINGERPRINTS, port_chain
from proxy.model.types import Family, ServicePortKey
from proxy.netns_lab import Lab
from tests.e2e.conftest import Cluster, NodePlane
from tests.e2e.test_nftables_kernel import ADDRESSES, FOREIGN, listing, nft, wipe
from tests.unit.builders import ep, eps_slice, service
from tests.unit.test_iptables_sync import clusters
from tests.unit.test_nftables_restart_rewrite import another_build

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]


@pytest.fixture(scope="module")
def namespaces() -> Iterator[Lab]:
    with Lab([]) as lab:  # two bare namespaces: node_ns and client_ns
        yield lab


def handles(ns: str) -> dict[tuple[str, str, str], list[int]]:
    """Each of our chains' rules by the kernel's handle: a rule written again gets a new
    one."""
    out: dict[tuple[str, str, str], list[int]] = {}
    for item in json.loads(nft(ns, "-j", "-a", "list", "ruleset"))["nftables"]:
        rule = item.get("rule")
        if rule and rule["table"].startswith("sliceproxy"):
            out.setdefault((rule["family"], rule["table"], rule["chain"]), []).append(
                rule["handle"])
    return out


def web(i: int, endpoints: int = 2, counted: bool = False) -> list[dict[str, Any]]:
    """`counted`: each endpoint's connections counted (a named counter of its own)."""
    annotations = {"sliceproxy.io/traffic-per-endpoint": "true"} if counted else None
    return [service(f"web{i}", ips=(f"198.18.128.{10 + i}",), annotations=annotations),
            eps_slice(f"web{i}-a", [ep(f"198.18.1.{10 * i + k}") for k in range(endpoints)],
                      service_name=f"web{i}")]


def first_start(ns: str, cluster: Cluster, objects: list[dict[str, Any]]) -> None:
    """A first start on a wiped node, settled: its input marks added (marks.py)."""
    wipe(ns)
    plane = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    plane.sync(cluster.become(*objects), full=True)
    plane.settle()


def restart_of(report: Any) -> dict[str, int]:
    return report.details["IPv4"]["restart"]  # type: ignore[no-any-return]


@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(before=clusters(), after=clusters())
def test_a_restart_ends_where_a_start_on_a_clean_node_does(
        namespaces: Lab, monkeypatch: pytest.MonkeyPatch, before: list[dict[str, Any]],
        after: list[dict[str, Any]]) -> None:
    monkeypatch.setattr(render, "SLOT_MAP_MIN", 2)  # slot maps in these small clusters
    ns, clean = namespaces.node_ns, namespaces.client_ns
    for n in (ns, clean):
        wipe(n)
        nft(n, "-f", "-", stdin=FOREIGN)
    cluster = Cluster()
    first = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES, shards=2)
    first.sync(cluster.become(*before), full=True)
    first.settle()
    state = cluster.become(*after)
    restarted = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES, shards=2)
    report = restarted.sync(state)
    for family in report.details.values():
        assert family["applier"] in ("netlink", "none") and "restart" in family
    fresh = NodePlane(clean, mode="nftables", addresses=lambda: ADDRESSES, shards=2)
    fresh.sync(state, full=True)
    restarted.settle()
    fresh.settle()
    assert listing(ns) == listing(clean)
    assert "table inet firewall" in nft(ns, "list", "tables")


@pytest.mark.parametrize("counted", [False, True], ids=["port", "endpoint"])
def test_a_restart_rewrites_only_what_changed_while_no_agent_ran(
        namespaces: Lab, counted: bool, caplog: pytest.LogCaptureFixture) -> None:
    """Ten services; while the agent is down one loses an endpoint, one goes, one comes:
    the restart writes the changed and the new port, and right after deletes the gone
    one's objects (and the counters of what went, when endpoints are counted one by
    one); every other port keeps its rules (handles) and its fingerprint, and a restart
    over an unchanged cluster writes no port at all. The @hairpin pairs of the three
    endpoints gone are asked for by key, from the pick elements read or (counted, a
    chain per endpoint) the DNAT rules read back, and deleted: @hairpin is not dumped."""
    ns = namespaces.node_ns
    wipe(ns)
    cluster = Cluster()
    objects = [o for i in range(10) for o in web(i, 3 if i == 3 else 2, counted)]
    plane = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    plane.sync(cluster.become(*objects), full=True)
    plane.settle()
    before = handles(ns)
    marks = nft(ns, "list", "set", "ip", "sliceproxy-0", FINGERPRINTS)

    again = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    report = again.sync(cluster.become(*objects))
    assert restart_of(report) == {"ports_kept": 10, "ports_written": 0,
                                  "elements_deleted": 0, "elements_added": 0}
    assert handles(ns) == before
    assert nft(ns, "list", "set", "ip", "sliceproxy-0", FINGERPRINTS) == marks

    def svc(i: int) -> tuple[str, str, str]:
        """Port i's chain: its own (counted one by one), or its pick chain (picked)."""
        key = ServicePortKey("ns", f"web{i}", "http", Family.V4)
        chain = port_chain("svc", key, "tcp") if counted else f"pick-{3 if i == 3 else 2}"
        return ("ip", render.shard_of(key, 1), chain)

    changed = [o for i in range(11) if i != 7 for o in web(i, 2, counted)]
    restarted = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    report = restarted.sync(cluster.become(*changed))
    assert restart_of(report)["ports_kept"] == 8
    assert restart_of(report)["ports_written"] == 2
    # The gone port's objects go right after (the sweep, once every port is rendered).
    assert svc(7) in handles(ns)
    with caplog.at_level(logging.INFO, logger="proxy.dataplane.nftables.apply"):
        restarted.settle()
    swept = [r.__dict__["hairpins_probed"] for r in caplog.records
             if r.getMessage() == "restart: what nobody claims deleted"]
    assert swept == [3]  # web7's two endpoints, and the one web3 lost
    after = handles(ns)

    if counted:
        assert svc(7) not in after and svc(10) in after
        assert after[svc(3)] != before[svc(3)]
    # Rules unchanged: the other ports' own, or (picked) every pick chain's.
    assert all(after[svc(i)] == before[svc(i)] for i in (0, 1, 2, 4, 5, 6, 8, 9))
    # Where a start on a clean node would end.
    clean = namespaces.client_ns
    wipe(clean)
    started = NodePlane(clean, mode="nftables", addresses=lambda: ADDRESSES)
    started.sync(Cluster().become(*changed), full=True)
    restarted.settle()
    started.settle()
    assert listing(ns) == listing(clean)


def test_after_a_restart_that_rendered_nothing_a_change_is_partial_and_right(
        namespaces: Lab) -> None:
    """Over an unchanged cluster every port's input mark is there: the restart writes
    nothing (and renders no port); the kept state made after it takes the next change
    as any partial sync, ending where a start on a clean node ends."""
    ns, clean = namespaces.node_ns, namespaces.client_ns
    cluster = Cluster()
    objects = [o for i in range(6) for o in web(i)]
    first_start(ns, cluster, objects)
    before = handles(ns)
    restarted = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    report = restarted.sync(cluster.become(*objects))
    assert report.details["IPv4"]["lines"] == 0 and restart_of(report)["ports_kept"] == 6
    assert handles(ns) == before
    changed = [o for i in range(6) for o in web(i, 3 if i == 2 else 2)]
    assert not restarted.sync(cluster.become(*changed)).full
    wipe(clean)
    started = NodePlane(clean, mode="nftables", addresses=lambda: ADDRESSES)
    started.sync(Cluster().become(*changed), full=True)
    restarted.settle()
    started.settle()
    assert listing(ns) == listing(clean)


@pytest.mark.parametrize("by_hand", [False, True], ids=["unchanged", "element-deleted"])
def test_an_upgrade_checks_the_maps_as_it_reads_them(
        namespaces: Lab, monkeypatch: pytest.MonkeyPatch, by_hand: bool) -> None:
    """Another build (the kernel holds the old build's input marks) over an unchanged
    cluster renders every port and writes nothing: the kernel's dispatch and counter
    maps, checked element by element as they are dumped, hold what the ports write; the
    old build's marks are deleted, and this one's added, when idle. A dispatch element
    deleted by hand (its port's fingerprint still there) is found missing and written
    again, the old marks deleted with it: the node ends where a clean start does."""
    ns, clean = namespaces.node_ns, namespaces.client_ns
    cluster = Cluster()
    objects = [o for i in range(6) for o in web(i)]
    first_start(ns, cluster, objects)
    if by_hand:
        nft(ns, "delete", "element", "ip", "sliceproxy-0", render.SERVICE_IPS,
            "{ 198.18.128.12 . tcp . 80 }")
    before = handles(ns)
    monkeypatch.setattr(marks_module, "source_digest", lambda: b"another build")
    marks_for.cache_clear()
    try:
        restarted = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
        report = restarted.sync(cluster.become(*objects))
        restarted.settle()
        wipe(clean)  # a clean start by the same build, for its input marks
        started = NodePlane(clean, mode="nftables", addresses=lambda: ADDRESSES)
        started.sync(Cluster().become(*objects), full=True)
        started.settle()
    finally:
        monkeypatch.undo()
        marks_for.cache_clear()
    # Nothing, or the element deleted by hand and the old build's input marks with it.
    assert restart_of(report) == {"ports_kept": 6, "ports_written": 0,
                                  "elements_deleted": 6 * by_hand, "elements_added": by_hand}
    assert handles(ns) == before
    assert listing(ns) == listing(clean)


def test_a_restart_over_a_split_the_deltas_moved_ends_where_a_clean_start_does(
        namespaces: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """A large path's slots split between a main map and a tail (slot_tail.py; small
    here) where endpoint deltas left it, not where a fresh render puts it: the
    restarted agent rewrites the port, and the kernel ends as on a clean node."""
    monkeypatch.setattr(slot_tail, "SPLIT_MIN", 140)
    monkeypatch.setattr(slot_tail, "TAIL", 3)
    monkeypatch.setattr(slot_tail, "TAIL_MAX", 6)
    addrs = [f"198.18.{2 + i // 200}.{1 + i % 200}" for i in range(180)]

    def objects(n: int) -> list[dict[str, Any]]:
        return [service(), eps_slice("s1", [ep(a) for a in addrs[:n]])]

    ns, clean = namespaces.node_ns, namespaces.client_ns
    for n in (ns, clean):
        wipe(n)
    cluster = Cluster()
    first = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    first.sync(cluster.become(*objects(180)), full=True)
    for n in range(179, 150, -1):  # the split moves (a tail of 3 to 6)
        assert not first.sync(cluster.become(*objects(n))).full
    first.settle()
    svc = port_chain("svc", ServicePortKey("ns", "svc", "http", Family.V4), "tcp")
    tails = nft(ns, "list", "chain", "ip", render.shard_table(0), slot_tail.TAIL_PREFIX + svc)
    assert "numgen random mod 151 < " in tails and "numgen random mod 151 < 3 " not in tails
    state = cluster.become(*objects(150))
    restarted = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    assert restart_of(restarted.sync(state))["ports_written"] == 1
    restarted.settle()
    fresh = NodePlane(clean, mode="nftables", addresses=lambda: ADDRESSES)
    fresh.sync(state, full=True)
    fresh.settle()
    assert listing(ns) == listing(clean)


@pytest.mark.parametrize("shards", [2, 1], ids=["same-bases", "fewer-shards"])
def test_another_build_that_renders_ports_otherwise_rewrites_every_table(
        namespaces: Lab, monkeypatch: pytest.MonkeyPatch, shards: int) -> None:
    """Another build whose every port renders otherwise (here: the same rules, each
    port's fingerprint made otherwise) writes every table again, reading nothing back
    but names and @fingerprints (restart.rewrite_of): over bases it writes alike, a
    transaction each; over tables it does not all use (one shard fewer), in one. The
    node ends where that build's clean start does."""
    monkeypatch.setattr(restart, "REWRITE_MIN_PORTS", 8)
    monkeypatch.setattr(restart, "REWRITE_SAMPLE", 4)
    ns, clean = namespaces.node_ns, namespaces.client_ns
    cluster = Cluster()
    objects = [o for i in range(10) for o in web(i)]
    wipe(ns)
    first = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES, shards=2)
    first.sync(cluster.become(*objects), full=True)
    first.settle()
    another_build(monkeypatch)
    try:
        restarted = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES,
                              shards=shards)
        report = restarted.sync(cluster.become(*objects))
        restarted.settle()
        wipe(clean)
        started = NodePlane(clean, mode="nftables", addresses=lambda: ADDRESSES,
                            shards=shards)
        started.sync(Cluster().become(*objects), full=True)
        started.settle()
    finally:
        monkeypatch.undo()
        marks_for.cache_clear()
    assert restart_of(report) == {"ports_kept": 0, "ports_written": 10, "elements_deleted": 0,
                                  "elements_added": 0, "tables_rewritten": shards + 1,
                                  "transactions": 3 if shards == 2 else 1}
    assert listing(ns) == listing(clean)
