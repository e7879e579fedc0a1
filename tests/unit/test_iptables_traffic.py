"""Traffic counting in the iptables mode: which nfacct objects a service port's rules
count into (rendering), which exist in the kernel after each sync (a `MemoryNfacct` over
simulated runners), and how `traffic()` reads them back by service port and endpoint.
The real kernel's side is tests/e2e/test_iptables_traffic_kernel.py."""

from __future__ import annotations

import errno
import struct
from dataclasses import replace
from ipaddress import ip_address, ip_network
from typing import Any

import pytest

from proxy.dataplane.base import ApplyError, Counted, DataplaneOptions, PortTraffic
from proxy.dataplane.common import nfacct
from proxy.dataplane.common.netlink import Reply, frame, nfgen, nla, nla_string
from proxy.dataplane.common.netlink_constants import (
    NFACCT_BYTES,
    NFACCT_NAME,
    NFACCT_NAME_MAX,
    NFACCT_PAD,
    NFACCT_PKTS,
    NFACCT_USE,
    NFNL_MSG_ACCT_NEW,
    NFNL_SUBSYS_ACCT,
)
from proxy.dataplane.iptables.apply import IptablesDataPlane
from proxy.dataplane.iptables.render import endpoint_counter, port_counter, render_port
from proxy.dataplane.xtables.simulate import SimulatedRunner
from proxy.model.types import Family, ServicePortKey
from tests.e2e.conftest import Cluster
from tests.unit.builders import ep, eps_slice, service
from tests.unit.test_iptables_render import CIDR4, pretty, resolve

# The node's --traffic-per-endpoint, for services without the annotation.
FLAG_ON = replace(CIDR4, traffic_per_endpoint=True)

PER_ENDPOINT = {"sliceproxy.io/traffic-per-endpoint": "true"}
KEY = ServicePortKey("ns", "svc", "http", Family.V4)
E10, E11, E12 = ((ip_address(f"198.18.1.{i}"), 8080) for i in (10, 11, 12))


def web(*ips: str, annotations: dict[str, str] | None = None,
        **spec: Any) -> list[dict[str, Any]]:
    return [service(annotations=annotations, **spec),
            eps_slice("s1", [ep(ip, node="node-a") for ip in ips])]


# --- rendering ------------------------------------------------------------------------


def test_a_port_counts_at_the_top_of_each_policy_chain_and_not_per_endpoint_by_default(
        ) -> None:
    rsp = resolve(*web("198.18.1.10", "198.18.1.11"))
    lines = pretty(rsp, counted=True)
    assert "-t nat -A <SVC> -m nfacct --nfacct-name  <COUNT>" in lines
    # First in the chain: before the masquerade marking and the affinity checks.
    assert lines[lines.index("-t nat -N <SVC>") + 1].endswith("<COUNT>")
    assert not [line for line in lines if "<COUNT 198" in line]
    assert render_port(rsp, CIDR4).counters == nfacct_counters(rsp.key, None)


def nfacct_counters(key: ServicePortKey, endpoints: list[tuple[Any, int]] | None) -> Any:
    from proxy.dataplane.iptables.render import PortCounters

    each = None if endpoints is None else tuple(
        (endpoint_counter(key, "tcp", f"{ip}:{port}"), ip, port) for ip, port in endpoints)
    return PortCounters(port_counter(key, "tcp"), each)


def test_the_annotation_counts_each_endpoint_before_its_dnat() -> None:
    rsp = resolve(*web("198.18.1.10", "198.18.1.11", annotations=PER_ENDPOINT))
    lines = pretty(rsp, counted=True)
    for text in ("198.18.1.10:8080", "198.18.1.11:8080"):
        first = lines.index(f"-t nat -N <SEP {text}>") + 1
        assert lines[first] == f"-t nat -A <SEP {text}> -m nfacct --nfacct-name  <COUNT {text}>"
        assert "DNAT" in lines[first + 2]
    # The node's flag does it too; the annotation "false" wins over the flag.
    flagged = resolve(*web("198.18.1.10"))
    assert render_port(flagged, FLAG_ON).counters.endpoints  # type: ignore[union-attr]
    off = resolve(*web("198.18.1.10", annotations={
        "sliceproxy.io/traffic-per-endpoint": "false"}))
    assert render_port(off, FLAG_ON).counters.endpoints is None  # type: ignore[union-attr]


def test_every_endpoint_of_the_slices_has_an_object_used_or_not() -> None:
    # A not-ready endpoint keeps its object (its count survives a readiness flap),
    # though no rule counts into it while it gets no traffic.
    rsp = resolve(service(annotations=PER_ENDPOINT),
                  eps_slice("s1", [ep("198.18.1.10"), ep("198.18.1.11", ready=False)]))
    counters = render_port(rsp, CIDR4).counters
    assert counters == nfacct_counters(rsp.key, [E10, E11])
    assert not [line for line in pretty(rsp, counted=True) if "<COUNT 198.18.1.11" in line]


def test_local_policy_counts_in_the_local_chain_into_the_same_object() -> None:
    rsp = resolve(*web("198.18.1.10", type="NodePort", externalTrafficPolicy="Local",
                       ports=({"name": "http", "port": 80, "nodePort": 30080},)))
    lines = pretty(rsp, counted=True)
    assert "-t nat -A <SVC> -m nfacct --nfacct-name  <COUNT>" in lines
    assert "-t nat -A <SVL> -m nfacct --nfacct-name  <COUNT>" in lines
    # External traffic passes EXT on its way to one of them: not counted twice.
    assert not [line for line in lines if line.startswith("-t nat -A <EXT>") and "nfacct" in line]


def test_object_names_are_ours_short_per_family_and_hold_no_user_text() -> None:
    long = "n" * 63
    v4 = ServicePortKey(long, long, long, Family.V4)
    v6 = v4._replace(family=Family.V6)
    names = {port_counter(v4, "tcp"), port_counter(v6, "tcp"),
             endpoint_counter(v4, "tcp", "198.18.1.10:80"),
             endpoint_counter(v4, "tcp", "198.18.1.11:80"), port_counter(v4, "udp")}
    assert len(names) == 5
    for name in names:
        assert nfacct.ours(name) and len(name.encode()) < NFACCT_NAME_MAX
        assert "n" not in name
    assert nfacct.of_family(port_counter(v6, "tcp"), "6")
    assert not nfacct.of_family(port_counter(v6, "tcp"), "4")


# --- syncing: which objects exist ---------------------------------------------------------


class Node:
    """An iptables data plane over simulated tables and a model of nfacct: both outlive
    the plane, as the kernel outlives the agent (`restart`)."""

    def __init__(self, per_endpoint: bool = False) -> None:
        self.runners = {f: SimulatedRunner(f) for f in Family}
        self.acct = nfacct.MemoryNfacct()
        self.options = DataplaneOptions("node-a", cluster_cidrs=(ip_network("198.18.1.0/24"),),
                                        traffic_per_endpoint=per_endpoint)
        self.cluster = Cluster()
        self.restart()

    def restart(self) -> None:
        self.dp = IptablesDataPlane(self.options, runners=self.runners,
                                    addresses=lambda: [ip_address("198.18.0.1")],
                                    clear_conntrack=False, accounting=self.acct)

    def become(self, *objects: dict[str, Any], full: bool = False) -> None:
        self.dp.sync(self.cluster.become(*objects), full)

    def count(self, key: ServicePortKey, endpoint: tuple[Any, int] | None, n: int) -> None:
        """`n` new connections through the rules: into the port's object and the
        endpoint's (when counted per endpoint)."""
        self.acct.add(port_counter(key, "tcp"), n)
        if endpoint is not None:
            self.acct.add(endpoint_counter(key, "tcp", f"{endpoint[0]}:{endpoint[1]}"), n)


def test_counts_survive_restarts_and_rewrites_and_go_with_their_endpoint() -> None:
    node = Node()
    node.become(*web("198.18.1.10", "198.18.1.11", "198.18.1.12", annotations=PER_ENDPOINT))
    node.count(KEY, E10, 3)
    node.count(KEY, E11, 2)
    node.count(KEY, E12, 1)
    assert node.dp.traffic() == {KEY: PortTraffic(Counted(6), {E10: Counted(3), E11: Counted(2),
                                                              E12: Counted(1)})}
    node.restart()  # a new agent: its first sync is full, over the kernel's objects
    node.become(*web("198.18.1.10", "198.18.1.11", "198.18.1.12", annotations=PER_ENDPOINT))
    assert node.dp.traffic()[KEY].total == Counted(6)
    # An endpoint leaves (its chains rewritten): its object goes, the others keep counting.
    node.become(*web("198.18.1.10", "198.18.1.11", annotations=PER_ENDPOINT))
    assert node.dp.traffic() == {KEY: PortTraffic(Counted(6), {E10: Counted(3),
                                                              E11: Counted(2)})}
    assert endpoint_counter(KEY, "tcp", "198.18.1.12:8080") not in node.acct.objects
    node.become(*web("198.18.1.10", "198.18.1.11", annotations=PER_ENDPOINT), full=True)
    assert node.dp.traffic()[KEY].endpoints == {E10: Counted(3), E11: Counted(2)}


def test_a_port_without_endpoints_keeps_its_count_and_a_removed_port_loses_it() -> None:
    node = Node()
    node.become(*web("198.18.1.10"))
    node.count(KEY, None, 4)
    node.become(*web())
    assert node.dp.traffic() == {KEY: PortTraffic(Counted(4), None)}
    node.become()
    assert node.dp.traffic() == {}
    assert node.acct.objects == {}
    # Back again: a new port, counted from zero.
    node.become(*web("198.18.1.10"))
    assert node.dp.traffic() == {KEY: PortTraffic(Counted(0), None)}


def test_a_full_sync_deletes_stale_objects_of_its_family_only_and_keeps_held_ones() -> None:
    node = Node()
    stale4 = nfacct.object_name("p", "4", "0" * 16)
    held4 = nfacct.object_name("e", "4", "1" * 16)
    other6 = nfacct.object_name("p", "6", "2" * 16)
    node.acct.create([stale4, held4, other6])
    node.acct.held.add(held4)
    node.dp._families = {Family.V4: node.dp._families[Family.V4]}  # an IPv4-only node
    node.become(*web("198.18.1.10"))
    assert set(node.acct.objects) == {port_counter(KEY, "tcp"), held4, other6}


def test_cleanup_deletes_every_object_of_ours() -> None:
    node = Node(per_endpoint=True)
    node.become(*web("198.18.1.10", "198.18.1.11"))
    assert len(node.acct.objects) == 3
    node.dp.cleanup()
    assert node.acct.objects == {}
    assert node.dp.traffic() == {}


def test_a_kernel_without_nfacct_gets_its_rules_without_counting() -> None:
    class NoNfacct(nfacct.MemoryNfacct):
        def dump(self) -> dict[str, nfacct.Reading]:
            raise OSError(errno.EOPNOTSUPP, "no nfnetlink_acct")

    node = Node(per_endpoint=True)
    node.acct = NoNfacct()
    node.restart()
    node.become(*web("198.18.1.10"))
    assert node.dp.traffic() == {KEY: PortTraffic(Counted(0))}
    assert "nfacct" not in " ".join(node.dp.applied_rules(KEY))
    assert node.runners[Family.V4].kernel  # the rules are there all the same


def test_iptables_without_the_nfacct_match_gets_its_rules_at_the_retry() -> None:
    node = Node()
    for runner in node.runners.values():
        runner.fail_on = "-m nfacct"  # refused as a missing extension's line would be
    with pytest.raises(ApplyError):
        node.become(*web("198.18.1.10"))
    node.become(*web("198.18.1.10"))  # the retry: full, without counting
    assert node.dp.traffic() == {KEY: PortTraffic(Counted(0))}
    assert node.runners[Family.V4].kernel


def test_no_object_is_ever_replaced_nor_anyone_elses_deleted() -> None:
    acct = nfacct.MemoryNfacct()
    name = nfacct.object_name("p", "4", "A" * 16)
    acct.create([name])
    acct.add(name, 5)
    assert acct.create([name]) == 0 and acct.objects[name].packets == 5
    for bad in ("", "nfacct-of-someone", "spx-p4-short"):
        with pytest.raises(ValueError):
            acct.delete([bad])
        with pytest.raises(ValueError):
            nfacct.Nfacct().delete([bad])  # refused before any socket is opened


# --- the wire --------------------------------------------------------------------------


def acct_message(name: str, packets: int, count: int, use: int, pad: bool = False) -> Reply:
    """One object as nfnl_acct_fill_info writes it (`pad`: with the empty NFACCT_PAD
    attribute before each 64-bit value, as on machines that align them)."""
    padding = nla(NFACCT_PAD, b"") if pad else b""
    body = (nfgen(0) + nla_string(NFACCT_NAME, name)
            + padding + nla(NFACCT_PKTS, struct.pack("!Q", packets))
            + padding + nla(NFACCT_BYTES, struct.pack("!Q", count))
            + nla(NFACCT_USE, struct.pack("!I", use)))
    return Reply(NFNL_SUBSYS_ACCT << 8 | NFNL_MSG_ACCT_NEW, 1, body)


def test_a_dump_is_read_for_our_objects_only() -> None:
    ours = nfacct.object_name("e", "6", "0123456789ABCDEF")
    other = nfacct.object_name("p", "4", "FEDCBA9876543210")
    replies = [acct_message(ours, 7, 420, 2), acct_message("someone-else", 1, 1, 1),
               acct_message("spx-but-not-ours", 1, 1, 1),
               acct_message("x" + other[:20], 1, 1, 1),
               acct_message(other, 2**40, 2**63, 1, pad=True)]
    datagram = b"".join(frame(r.kind, 2, r.seq, r.payload) for r in replies)
    assert nfacct.parse_datagrams([datagram]) == {
        ours: nfacct.Reading(7, 420, 2), other: nfacct.Reading(2**40, 2**63, 1)}


def test_create_never_asks_for_a_reset_and_takes_busy_as_there(
        monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[tuple[int, int, bytes]] = []

    class FakeSocket:
        def __init__(self, protocol: int) -> None:
            pass

        def execute_raw(self, requests: list[tuple[int, int, bytes]]) -> list[int]:
            sent.extend(requests)
            return [0, errno.EBUSY, errno.EEXIST][:len(requests)]

        def close(self) -> None:
            pass

    monkeypatch.setattr(nfacct, "NetlinkSocket", FakeSocket)
    names = [nfacct.object_name("p", "4", f"{i}" * 16) for i in range(3)]
    assert nfacct.Nfacct().create(names) == 1
    nlm_f_replace = 0x100
    assert [(kind, flags & nlm_f_replace) for kind, flags, _ in sent] == [(7 << 8, 0)] * 3
    assert sent[0][2].endswith(names[0].encode() + b"\0")  # NUL-terminated
