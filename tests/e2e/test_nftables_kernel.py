"""The nftables data plane against the real kernel, inside throw-away namespaces: partial
equals full (read back with `nft -j list table`), repair of a foreign deletion, a refused
transaction, cleanup, and other tables left alone."""

from __future__ import annotations

import json
import re
import subprocess
import threading
from collections.abc import Collection, Iterator
from ipaddress import ip_address
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from proxy.dataplane.base import ApplyError
from proxy.dataplane.common import drift_watch
from proxy.dataplane.nftables import render
from proxy.dataplane.nftables.render import SLOTS
from proxy.dataplane.nftables.runner import NftRunner
from proxy.dataplane.nftables.slot_tail import TAIL_PREFIX
from proxy.dataplane.nftables.transaction import Script
from proxy.model.types import Family, ServicePortKey
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from tests.e2e.agent_support import wait_for
from tests.e2e.conftest import Cluster, NodePlane
from tests.unit.builders import ep, eps_slice, service
from tests.unit.test_iptables_sync import clusters

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

ADDRESSES = [ip_address("198.18.0.1"), ip_address("fd00:18::1")]
# Somebody else's table, which nothing of ours may touch.
FOREIGN = """table inet firewall {
  chain input { type filter hook input priority 0; policy accept; tcp dport 22 accept; }
}
"""


@pytest.fixture(scope="module")
def namespaces() -> Iterator[Lab]:
    with Lab([]) as lab:  # two bare namespaces: node_ns and client_ns
        yield lab


def nft(ns: str, *args: str, stdin: str | None = None) -> str:
    out = subprocess.run(["ip", "netns", "exec", ns, "nft", *args], input=stdin,
                         capture_output=True, text=True, check=True)
    return out.stdout


def wipe(ns: str) -> None:
    nft(ns, "flush", "ruleset")


def listing(ns: str) -> dict[str, Any]:
    """Every table of the namespace, as nft reads it back, without handles and with
    set elements in order: comparable between namespaces."""
    out: dict[str, Any] = {}
    for item in json.loads(nft(ns, "-j", "list", "ruleset"))["nftables"]:
        kind, obj = next(iter(item.items()))
        if kind == "metainfo":
            continue
        obj = {k: v for k, v in obj.items() if k != "handle"}
        if kind == "rule":
            out.setdefault(("rules", obj["family"], obj["table"], obj["chain"]), []).append(
                json.dumps(obj["expr"], sort_keys=True))
        else:
            if "elem" in obj and obj["name"].startswith((SLOTS, TAIL_PREFIX)):
                # Which endpoint has which slot depends on the history (render.
                # assign_slots); what counts is every slot used, each endpoint once.
                assert sorted(e[0] for e in obj["elem"]) == list(range(len(obj["elem"])))
                obj["elem"] = sorted(json.dumps(e[1], sort_keys=True) for e in obj["elem"])
            elif "elem" in obj:
                obj["elem"] = sorted(json.dumps(e, sort_keys=True) for e in obj["elem"])
            out[(kind, obj.get("family"), obj.get("table", ""), obj["name"])] = obj
    return out


def dump_rules(plane: NodePlane, key: ServicePortKey) -> list[str]:
    """The debug dump's lines for a port, slot numbers left out (as in `listing`)."""
    return sorted(re.sub(r"\{ \d+ : ", "{ : ", line) for line in plane.dp.applied_rules(key))


# The property itself runs on the fake kernel at more examples (tests/unit/
# test_nftables_fake_sync.py); here it checks what the kernel adds: our netlink encoding
# of partial transactions, read back by nft.
@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=clusters(), second=clusters(), third=clusters())
def test_partial_syncs_end_where_a_full_sync_from_scratch_does(
        namespaces: Lab, monkeypatch: pytest.MonkeyPatch, first: list[dict[str, Any]],
        second: list[dict[str, Any]], third: list[dict[str, Any]]) -> None:
    # Ports of 2 endpoints and more balance through slot maps: both shapes, and ports
    # going from one to the other, in these small clusters.
    monkeypatch.setattr(render, "SLOT_MAP_MIN", 2)
    partial_ns, full_ns = namespaces.node_ns, namespaces.client_ns
    for ns in (partial_ns, full_ns):
        wipe(ns)
        nft(ns, "-f", "-", stdin=FOREIGN)
    cluster = Cluster()
    states = [cluster.become(*objs) for objs in (first, second, third)]
    # Four shards: changes spread over tables, one transaction touching several.
    plane = NodePlane(partial_ns, mode="nftables", addresses=lambda: ADDRESSES, shards=4)
    plane.sync(states[0], full=True)
    for state in states[1:]:
        report = plane.sync(state)
        assert not report.full
        # Encoded here, not handed to nft (which takes whatever the encoder cannot).
        assert {d["applier"] for d in report.details.values()} <= {"netlink", "none"}
    fresh = NodePlane(full_ns, mode="nftables", addresses=lambda: ADDRESSES, shards=4)
    fresh.sync(states[-1], full=True)
    assert listing(partial_ns) == listing(full_ns)
    # The debug dump's rules (rendered again from the last snapshot) agree too.
    for key in states[-1].ports:
        assert dump_rules(plane, key) == dump_rules(fresh, key), key
        assert plane.dp.applied_rules(key), key
    # ... and a full resync over what the partial syncs left changes nothing either.
    plane.sync(states[-1], full=True)
    assert listing(partial_ns) == listing(full_ns)
    for p in (plane, fresh):
        p.cleanup()
    # Cleanup takes our tables and nothing else.
    assert " sliceproxy" not in nft(partial_ns, "list", "tables")
    assert "table inet firewall" in nft(partial_ns, "list", "tables")


def web(endpoints: list[str]) -> list[dict[str, Any]]:
    return [service("web", ips=("198.18.128.10",), sessionAffinity="ClientIP"),
            eps_slice("web-1", [ep(a) for a in endpoints], service_name="web")]


def test_foreign_changes_are_noticed_and_repaired_by_the_next_sync(namespaces: Lab) -> None:
    ns = namespaces.node_ns
    wipe(ns)
    plane = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    cluster = Cluster()
    state = cluster.become(*web(["198.18.1.10", "198.18.1.11"]))
    plane.sync(state, full=True)
    before = listing(ns)
    heard: list[str] = []
    with entered(ns):
        plane.dp.watch_drift(heard.append)
    try:
        # A chain of ours emptied: announced by nf_tables, so noticed without a poll.
        table, chain = next(k[2:] for k in before
                            if k[0] == "chain" and k[3].startswith("svc-"))
        nft(ns, "flush", "chain", "ip", table, chain)
        wait_for(lambda: bool(heard), 10.0, "the nf_tables announcement")
        with entered(ns):
            found = plane.dp.check_drift()
        assert found, heard
        assert plane.sync(state).full  # drift makes the next sync a full one
        assert listing(ns) == before
        # The whole table deleted (a firewall reload): missing by name too.
        for gone in ("sliceproxy", table):  # the main table, then the service's shard
            nft(ns, "delete", "table", "ip", gone)
            with entered(ns):
                found = plane.dp.check_drift()
            assert any("missing" in f for f in found), found
            plane.sync(state)
            assert listing(ns) == before
    finally:
        with entered(ns):
            plane.dp.close()
        plane.cleanup()


def test_our_own_full_sync_overflowing_the_listener_is_no_drift(
        namespaces: Lab, monkeypatch: pytest.MonkeyPatch) -> None:
    """From about 10,000 services a full sync announced more than the listener's buffer
    holds; that loss once counted as drift, and every full sync caused the next one. (The
    listener is now deaf to our own full syncs; a partial sync of many ports, or someone
    else's big transaction, can still overflow it.)"""
    monkeypatch.setattr(drift_watch, "LISTEN_BUFFER", 4096)  # overflow at 40 services
    ns = namespaces.node_ns
    wipe(ns)
    plane = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    def objects(subnet: int) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for i in range(40):
            out += [service(f"s{i}", ips=(f"198.18.129.{i + 1}",)),
                    eps_slice(f"s{i}-1", [ep(f"198.18.{subnet}.{j + 1}") for j in range(5)],
                              service_name=f"s{i}")]
        return out

    cluster = Cluster()
    plane.sync(cluster.become(*objects(2)), full=True)
    heard: list[str] = []
    with entered(ns):
        plane.dp.watch_drift(heard.append)
    try:
        # Every service's endpoints replaced at once: one partial transaction of ours
        # announcing every chain and element again, while the listener is held on the
        # first datagram (else it may keep up: it reads on the other core).
        listener = plane.dp._watch
        assert listener is not None
        held, feed = threading.Event(), listener._feed

        def slow(datagram: bytes) -> None:
            held.wait(10.0)
            feed(datagram)

        listener._feed = slow  # type: ignore[method-assign]
        state = cluster.become(*objects(3))
        assert not plane.sync(state).full
        held.set()
        wait_for(lambda: drift_watch.LOST in heard, 10.0, "the listener to overflow")
        with entered(ns):
            assert plane.dp.check_drift() == []
        assert not plane.sync(state).full
        # What the loss may have hidden is still found by name.
        nft(ns, "delete", "table", "ip", "sliceproxy")
        with entered(ns):
            found = plane.dp.check_drift()
        assert any("missing" in f for f in found), found
    finally:
        with entered(ns):
            plane.dp.close()
        plane.cleanup()


def test_our_listener_hears_nothing_of_our_full_sync_and_foreign_changes_after_it(
        namespaces: Lab) -> None:
    """While anyone listens, the kernel writes an announcement of every object a
    transaction touches (a full sync of 10,000 services took 3x as long), so our
    listener leaves the group for our own full syncs and joins it again after."""
    ns = namespaces.node_ns
    wipe(ns)
    plane = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    state = Cluster().become(*web(["198.18.1.10", "198.18.1.11"]))
    plane.sync(state, full=True)
    heard: list[str] = []
    with entered(ns):
        plane.dp.watch_drift(heard.append)
    listener = plane.dp._watch
    assert listener is not None
    fed: list[int] = []
    feed = listener._feed
    listener._feed = lambda datagram: (fed.append(len(datagram)), feed(datagram))[1]  # type: ignore[method-assign]
    try:
        plane.sync(state, full=True)
        assert fed == [] and heard == []  # nothing of our own transaction reached us
        with entered(ns):
            assert plane.dp.check_drift() == []
        nft(ns, "add", "chain", "ip", "sliceproxy", "intruder")
        wait_for(lambda: bool(heard), 10.0, "the foreign change to be heard")
        assert "nf_tables transaction" in heard[0], heard
        assert fed
    finally:
        with entered(ns):
            plane.dp.close()
        plane.cleanup()


def as_text(script: str | Script) -> str:
    """A full sync's script is made as it is read (transaction.Script): join it to
    append to it."""
    return script if isinstance(script, str) else script.text()


def test_a_refused_transaction_keeps_the_old_rules_and_the_retry_is_full(
        namespaces: Lab) -> None:
    ns = namespaces.node_ns
    wipe(ns)

    class Sabotaged(NftRunner):
        inject: str | None = None

        def run(self, text: str) -> None:
            super().run(text + (self.inject or ""))

        def send(self, text: str | Script, family: Family, tables: Collection[str]) -> None:
            super().send(as_text(text) + (self.inject or ""), family, tables)

    with entered(ns):
        runner = Sabotaged()
    plane = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES, runner=runner)
    cluster = Cluster()
    plane.sync(cluster.become(*web(["198.18.1.10"])), full=True)
    before = listing(ns)
    runner.inject = "add rule ip sliceproxy services jump no-such-chain\n"
    with pytest.raises(ApplyError) as refused:
        plane.sync(cluster.become(*web(["198.18.1.11"])))
    assert "no-such-chain" in f"{refused.value} {refused.value.offending}"
    assert listing(ns) == before  # all or nothing
    runner.inject = None
    report = plane.sync(cluster.model.state)
    assert report.full
    assert "198.18.1.11" in nft(ns, "list", "table", "ip", "sliceproxy")
    plane.cleanup()


def test_a_full_sync_the_kernel_refuses_from_the_encoder_is_retried_through_nft(
        namespaces: Lab) -> None:
    """Full syncs go through our netlink encoder; if the kernel ever refuses what it
    sent (an encoder bug, or a kernel reading a shape differently), the same script
    goes to nft, so the node is programmed instead of retrying the same refusal."""
    ns = namespaces.node_ns
    wipe(ns)

    class EncoderRefused(NftRunner):
        sent = 0

        def send(self, text: str | Script, family: Family, tables: Collection[str]) -> None:
            self.sent += 1
            # What a wrong encoding looks like from here: the kernel refuses a line.
            super().send(as_text(text) + "add rule ip sliceproxy services jump no-such-chain\n"
                         if family is Family.V4 else text, family, tables)

    with entered(ns):
        runner = EncoderRefused()
    plane = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES, runner=runner)
    report = plane.sync(Cluster().become(*web(["198.18.1.10"])), full=True)
    assert runner.sent == 2  # both families tried the encoder first
    assert report.details["IPv4"]["applier"] == "nft"
    assert report.details["IPv6"]["applier"] == "netlink"
    assert "198.18.1.10" in nft(ns, "list", "table", "ip", "sliceproxy")
    assert "no-such-chain" not in nft(ns, "list", "table", "ip", "sliceproxy")
    plane.cleanup()


# Our tables as another version of the agent might have left them: a set and a map of
# another type, hooked chains at other priorities, a chain and a shard table this
# version does not have. nf_tables refuses to redefine a set's type or a hooked chain's
# priority, so no full sync can take these over as they are.
OTHER_VERSION = """table ip sliceproxy {
  set cluster-ips { type ipv4_addr . inet_service; elements = { 198.18.128.10 . 80 }; }
  chain nat-postrouting { type nat hook postrouting priority srcnat + 5; policy accept; }
}
table ip sliceproxy-0 {
  chain svc-old { meta l4proto tcp dnat to 198.18.1.5:80; }
  map service-ips { type ipv4_addr . inet_service : verdict;
                    elements = { 198.18.128.10 . 80 : goto svc-old }; }
  chain nat-prerouting { type nat hook prerouting priority dstnat - 5; policy accept;
                         ip daddr . tcp dport vmap @service-ips; }
}
table ip sliceproxy-7 { chain stale { }; }
"""


def test_a_start_over_another_versions_tables_replaces_them_in_one_transaction(
        namespaces: Lab) -> None:
    """An agent (a new data plane: nothing written by it yet) starting over tables of a
    layout it cannot take over: its first full sync is refused, then sent again as
    their replacement, deleted and written anew in one transaction (never a moment
    without rules), and the tables end as a start on a clean node leaves them."""
    ns, clean = namespaces.node_ns, namespaces.client_ns
    for n in (ns, clean):
        wipe(n)
        nft(n, "-f", "-", stdin=FOREIGN)
    nft(ns, "-f", "-", stdin=OTHER_VERSION)
    state = Cluster().become(*web(["198.18.1.5", "198.18.1.6"]))
    plane = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
    report = plane.sync(state, full=True)
    assert report.details["IPv4"]["applier"] == "netlink, replacing our tables"
    fresh = NodePlane(clean, mode="nftables", addresses=lambda: ADDRESSES)
    fresh.sync(state, full=True)
    assert listing(ns) == listing(clean)
    assert "sliceproxy-7" not in nft(ns, "list", "tables")
    # From then on, ordinary syncs: written by this process, taken over as they are.
    assert plane.sync(state, full=True).details["IPv4"]["applier"] == "netlink"
    for p in (plane, fresh):
        p.cleanup()
    assert "table inet firewall" in nft(ns, "list", "tables")
