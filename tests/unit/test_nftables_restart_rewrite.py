"""A restart over tables another build wrote whose ports it renders otherwise (restart.
rewrite_of), on the fake kernel: every table written again, reading nothing back but
names and @fingerprints; a transaction each over bases written alike, every service
answering after each of them, else in one. The real kernel's side, with traffic
through it: tests/e2e/test_nftables_restart_kernel.py."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from proxy.dataplane.nftables import marks as marks_module
from proxy.dataplane.nftables import render, restart
from proxy.dataplane.nftables.marks import marks_for
from proxy.dataplane.nftables.render import FINGERPRINTS, TABLE
from tests.fakekernel.packet import Outcome, Packet
from tests.fakekernel.planes import FakePlane
from tests.unit.test_nftables_fake_sync import addresses, assert_same_answers, comparable
from tests.unit.test_nftables_restart import cluster, restart_details

PORTS = 12


def another_build(monkeypatch: pytest.MonkeyPatch, alike: tuple[str, ...] = ()) -> None:
    """From now on the agent is another build, which renders every port otherwise (the
    same rules, each port's fingerprint made otherwise) but those of services `alike`,
    and its bases alike."""
    fingerprint, salt = render.fingerprint, "b"

    def salted(family: Any, owner: tuple[object, ...], *rest: Any, **named: Any) -> Any:
        other = len(owner) > 1 and owner[1] not in alike
        return fingerprint(family, (*owner, salt) if other else owner, *rest, **named)

    monkeypatch.setattr(render, "fingerprint", salted)
    monkeypatch.setattr(marks_module, "source_digest", lambda: b"another build")
    marks_for.cache_clear()


@pytest.fixture(autouse=True)
def small_rewrites(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A rewrite from 8 ports on, told from the first 4."""
    monkeypatch.setattr(restart, "REWRITE_MIN_PORTS", 8)
    monkeypatch.setattr(restart, "REWRITE_SAMPLE", 4)
    yield
    marks_for.cache_clear()


def started(objects: list[dict[str, Any]], shards: int = 2) -> FakePlane:
    """A first start over `objects`, settled: its input marks added, as when idle."""
    plane = FakePlane("nftables", shards=shards)
    plane.become(*objects, full=True)
    return plane.settle()


@contextmanager
def answering_throughout(plane: FakePlane, objects: list[dict[str, Any]]
                         ) -> Iterator[list[str]]:
    """The transactions the fake kernel takes meanwhile, each checked as it commits:
    a new connection to every service of `objects`, from another pod and from one of
    its own endpoints (hairpin: masqueraded), ends as it did before, every way."""
    packets = [Packet.of(source, ip, port, protocol) for ip, port, protocol in addresses(objects)
               for source in ("198.18.1.50", endpoint_of(objects, ip))]
    before = {p: outcomes(plane, p) for p in packets}
    assert all(before.values())
    run, taken = plane.nft.run, []

    def checked(text: str) -> None:
        run(text)
        taken.append(text)
        for p, ways in before.items():
            assert outcomes(plane, p) == ways, (p, len(taken))

    plane.nft.run = checked  # type: ignore[method-assign]
    try:
        yield taken
    finally:
        plane.nft.run = run  # type: ignore[method-assign]


def outcomes(plane: FakePlane, p: Packet) -> list[Outcome]:
    return sorted(plane.trace(p).outcomes, key=repr)


def endpoint_of(objects: list[dict[str, Any]], cluster_ip: str) -> str:
    """The first endpoint address of the service whose ClusterIP is `cluster_ip`."""
    name = next(o["metadata"]["name"] for o in objects if o["kind"] == "Service"
                and cluster_ip in o["spec"]["clusterIPs"])
    return next(str(o["endpoints"][0]["addresses"][0]) for o in objects
                if o["kind"] == "EndpointSlice"
                and o["metadata"]["labels"]["kubernetes.io/service-name"] == name)


def test_another_builds_ports_are_rewritten_a_table_a_transaction_none_missing(
        monkeypatch: pytest.MonkeyPatch) -> None:
    objects = cluster(range(PORTS), changed=3)
    plane = started(objects)
    dumped = len(plane.nft.dumped)
    another_build(monkeypatch)
    restarted = plane.restarted()
    with answering_throughout(plane, objects) as taken:
        report = restarted.become(*objects)
    # The shards then the main table, each in its own transaction, and nothing read
    # back but the names and @fingerprints (no map, no @hairpin, nothing asked by key).
    assert restart_details(report) == {"ports_kept": 0, "ports_written": PORTS,
                                       "elements_deleted": 0, "elements_added": 0,
                                       "tables_rewritten": 3, "transactions": 3}
    assert [tables_of(t) for t in taken] == [{"sliceproxy-0"}, {"sliceproxy-1"}, {TABLE}]
    assert {name for _t, name in plane.nft.dumped[dumped:]} == {FINGERPRINTS}
    assert plane.nft.probed == []
    # What a fresh start of that build writes, the old build's input marks gone.
    fresh = started(objects)
    assert comparable(restarted.settle().written()) == comparable(fresh.written())
    assert_same_answers(restarted, fresh, objects)
    # And it goes on as after any full sync: a change is partial.
    changed = cluster(range(PORTS), changed=5)
    assert not restarted.become(*changed).full
    assert_same_answers(restarted, started(changed), changed)


def tables_of(text: str) -> set[str]:
    """The tables a transaction's lines name."""
    return {line.split()[3] for line in text.splitlines()
            if line.split()[:1] in (["add"], ["flush"], ["delete"]) and len(line.split()) > 3}


def test_a_cluster_that_changed_while_no_agent_ran_over_the_same_build_is_a_diff() -> None:
    """The same build, a few ports changed while no agent ran: written in one
    transaction, the others kept."""
    plane = started(cluster(range(PORTS)))
    objects = cluster(range(PORTS), changed=7)
    restarted = plane.restarted()
    sent = len(plane.nft.scripts)
    report = restarted.become(*objects)
    details = restart_details(report)
    assert "tables_rewritten" not in details and details["ports_written"] == 1
    assert len(plane.nft.scripts[sent:]) == 1


@pytest.mark.parametrize("why", ["fewer ports", "sample kept"])
def test_a_rewrite_needs_many_ports_most_of_them_changed(
        monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """Another build's ports, but too few of them, or with the first ports in key order
    held as rendered: the diff, in one transaction."""
    objects = cluster(range(PORTS))
    plane = started(objects)
    if why == "fewer ports":
        monkeypatch.setattr(restart, "REWRITE_MIN_PORTS", PORTS + 1)
    # "sample kept": the first four ports in key order rendered as before.
    another_build(monkeypatch, ("s0", "s1", "s10", "s11") if why == "sample kept" else ())
    restarted = plane.restarted()
    with answering_throughout(plane, objects) as taken:
        report = restarted.become(*objects)
    assert "tables_rewritten" not in restart_details(report)
    assert len(taken) == 1
    assert comparable(restarted.settle().written()) == comparable(started(objects).written())


@pytest.mark.parametrize("why", ["a base otherwise", "fewer shards"])
def test_over_bases_another_build_writes_otherwise_the_rewrite_is_one_transaction(
        monkeypatch: pytest.MonkeyPatch, why: str) -> None:
    """Another build's ports over bases it writes otherwise (a base's fingerprint not
    there; or tables it no longer uses, its ports fewer than the shards the kernel
    holds): a table going live alone might not agree with the others, so every port
    is written again in one transaction, as a first start writes them with every set
    flushed and what nobody wants deleted, nothing read back but names and
    @fingerprints. It ends where that build's clean start does."""
    objects = cluster(range(PORTS))
    plane = started(objects)
    shards = 1 if why == "fewer shards" else 2
    dumped = len(plane.nft.dumped)
    another_build(monkeypatch)
    if why == "a base otherwise":
        main = plane.nft.tables["ip", TABLE]
        fam = plane.dp._families[next(iter(plane.dp._families))]
        assert fam.context is not None
        mine = render.render_base(fam.context).fingerprint
        del main.sets[FINGERPRINTS].elements[tuple(str(p) for p in mine)]
    restarted = FakePlane("nftables", shards=shards)
    restarted.nft = plane.nft
    restarted.dp.runner = plane.nft  # type: ignore[assignment]
    with answering_throughout(plane, objects) as taken:
        report = restarted.become(*objects)
    assert restart_details(report) == {"ports_kept": 0, "ports_written": PORTS,
                                       "elements_deleted": 0, "elements_added": 0,
                                       "tables_rewritten": shards + 1, "transactions": 1}
    assert len([t for t in taken if " ip6 " not in t]) == 1  # (IPv6 has no port)
    read = {name for _t, name in plane.nft.dumped[dumped:]}
    if why == "a base otherwise":
        assert read == {FINGERPRINTS}
    else:  # IPv6's restart, no port, deletes its other shard: it reads its maps
        assert render.HAIRPIN not in read and not any(n.startswith(render.PICKS) for n in read)
    assert plane.nft.probed == []
    assert comparable(restarted.settle().written()) \
        == comparable(started(objects, shards).written())
