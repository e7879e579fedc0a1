"""Maglev (`mh`) and source hashing (`sh`) in the kernel: the same flow goes to the same
endpoint from every node, whatever order each node got the endpoints in, and removing
one endpoint of ten moves few of the others' flows (docs/dataplanes.md#balancing).

IPVS state is per network namespace, so each "node" is a namespace with its own
IpvsDataPlane. A node's choice for a flow is read without a backend answering: one SYN
per (source address, source port), sent on a raw socket into the node's virtual server,
and the real server IPVS chose for it read back from /proc/net/ip_vs_conn. Real servers
are routed into a dummy interface (nothing answers; nothing needs to).

SLICEPROXY_MAGLEV_FLOWS sets how many 5-tuples (default 2,000; 10,000 for the goal's
figure, run by hand: docs/kernel-tests.md).
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import statistics
import subprocess
import time
from collections.abc import Iterator
from ipaddress import IPv4Address, ip_address
from pathlib import Path

import pytest

from proxy.dataplane.common.fail_fast import tcp_segment
from proxy.dataplane.ipvs.diff import Op, OpKind
from proxy.dataplane.ipvs.kernel import IpvsTable
from proxy.dataplane.ipvs.moves import connections_kept
from proxy.dataplane.ipvs.render import RsKey, VsKey
from proxy.model.types import Protocol
from proxy.netns_lab.poll import wait
from tests.fakekernel.ipvs_schedulers import mh_choice, mh_table
from tests.kernel.scenario_guest import Cluster, NodeThread, options
from tests.unit.builders import ep, eps_slice, service

FLOWS = int(os.environ.get("SLICEPROXY_MAGLEV_FLOWS", "2000"))
MH_VIP, SH_VIP = "198.18.128.71", "198.18.128.72"
ENDPOINTS = [f"198.19.77.{i}" for i in range(1, 11)]
SHUFFLED = random.Random(39).sample(ENDPOINTS, len(ENDPOINTS))
Choices = dict[tuple[str, int], str]


SYN, ACK = 0x02, 0x10


def segment(source: str, sport: int, dest: str, dport: int, flags: int = SYN) -> bytes:
    """An IPv4 TCP SYN (or `flags`), checksums and all (IPVS checks the TCP one)."""
    return tcp_segment(IPv4Address(source), sport, IPv4Address(dest), dport, 1, 0, flags)


def flows(count: int) -> list[tuple[str, int]]:
    rng = random.Random(391)
    found: set[tuple[str, int]] = set()
    while len(found) < count:
        found.add((f"198.19.{rng.randrange(0, 64)}.{rng.randrange(1, 255)}",
                   rng.randrange(1024, 65535)))
    return sorted(found)


class Node:
    """One namespace with its own data plane, fed its own history of the endpoints."""

    def __init__(self, name: str) -> None:
        self.name = name
        for cmd in (["ip", "netns", "add", name],
                    ["ip", "-n", name, "link", "set", "lo", "up"],
                    ["ip", "-n", name, "link", "add", "sink0", "type", "dummy"],
                    ["ip", "-n", name, "link", "set", "sink0", "up"],
                    ["ip", "-n", name, "route", "add", "198.19.77.0/24", "dev", "sink0"]):
            subprocess.run(cmd, check=True, capture_output=True, timeout=30)
        self.thread = NodeThread(name)
        self.thread.start_plane(options())
        self.cluster = Cluster()
        self.cluster.apply(
            service("mh", ips=(MH_VIP,),
                    annotations={"sliceproxy.io/balancing": "maglev"}),
            service("sh", ips=(SH_VIP,),
                    annotations={"sliceproxy.io/balancing": "source-hash"}))

    def give(self, batch: list[str], slice_name: str, full: bool = False) -> None:
        """`batch` as one more slice of each service, then a sync."""
        for svc in ("mh", "sh"):
            state = self.cluster.apply(eps_slice(f"{svc}-{slice_name}",
                                                 [ep(a) for a in batch], service_name=svc))
        self.thread.sync(state, full)

    def restart(self) -> None:
        """A fresh plane over what the kernel holds (the agent restarted)."""
        self.thread.start_plane(options())
        self.thread.sync(self.cluster.state, True)

    def remove(self, address: str) -> None:
        """One endpoint leaves both services (slice "all"): a TCP real server drains at
        weight 0 while it has connections, and is deleted at once when it has none."""
        rest = [a for a in ENDPOINTS if a != address]
        for svc in ("mh", "sh"):
            state = self.cluster.apply(eps_slice(f"{svc}-all", [ep(a) for a in rest],
                                                 service_name=svc))
        self.thread.sync(state)

    def weights(self, vip: str) -> dict[str, int]:
        def read() -> dict[str, int]:
            table = IpvsTable()
            try:
                dests = table.dests(VsKey(Protocol.TCP, ip_address(vip), 80))
                return {str(r.address): d.weight for r, d in dests.items()}
            finally:
                table.close()
        return self.thread.run(read)

    def choices(self, vip: str, sample: list[tuple[str, int]]) -> Choices:
        """Which real server this node's IPVS picks for each (source, port) of `sample`."""
        def send_and_read() -> Choices:
            with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as s:
                for source, sport in sample:
                    s.sendto(segment(source, sport, vip, 80), (vip, 0))
            return read_conns(vip)
        return self.thread.run(send_and_read, timeout=600)

    def close(self) -> None:
        try:
            self.thread.run(self.thread.plane.cleanup)  # type: ignore[union-attr]
        finally:
            self.thread.close()
            subprocess.run(["ip", "netns", "del", self.name], check=False, timeout=30)


def read_conns(vip: str) -> Choices:
    """/proc/net/ip_vs_conn of this thread's namespace: (source, port) -> real server,
    for connections to `vip` (hex: Pro FromIP FPrt ToIP TPrt DestIP DPrt ...)."""
    want = f"{int(IPv4Address(vip)):08X}"
    out: Choices = {}
    with open("/proc/thread-self/net/ip_vs_conn") as f:  # this thread's namespace
        next(f)
        for line in f:
            w = line.split()
            if len(w) >= 7 and w[3] == want:
                out[(str(IPv4Address(int(w[1], 16))), int(w[2], 16))] = \
                    str(IPv4Address(int(w[5], 16)))
    return out


@pytest.fixture(scope="module")
def sample() -> list[tuple[str, int]]:
    return flows(FLOWS)


@pytest.fixture(scope="module")
def nodes() -> Iterator[list[Node]]:
    """Three nodes, the same ten endpoints, three histories: all at once; one at a time
    in a shuffled order; five, an agent restart, then the other five."""
    # Every SYN makes a conntrack entry too (net.ipv4.vs.conntrack=1): room for them all.
    Path("/proc/sys/net/netfilter/nf_conntrack_max").write_text("262144")
    made = [Node(f"mh{i}") for i in range(3)]
    try:
        a, b, c = made
        a.give(ENDPOINTS, "all", full=True)
        for i, address in enumerate(SHUFFLED):
            b.give([address], f"one{i}", full=i == 0)
        c.give(SHUFFLED[:5], "first", full=True)
        c.restart()
        c.give(SHUFFLED[5:], "then")
        yield made
    finally:
        for node in made:
            node.close()


def test_every_node_sends_a_flow_to_the_same_endpoint(nodes: list[Node],
                                                       sample: list[tuple[str, int]]) -> None:
    started = time.monotonic()
    seen = [n.choices(MH_VIP, sample) for n in nodes]
    for n, got in zip(nodes, seen, strict=True):
        assert len(got) == len(sample), f"{n.name}: {len(got)} of {len(sample)} read back"
    same = sum(len({s[f] for s in seen}) == 1 for f in sample)
    spread = {e: sum(1 for f in sample if seen[0][f] == e) for e in ENDPOINTS}
    print(f"maglev: {same} of {len(sample)} 5-tuples on the same endpoint from 3 nodes "
          f"with 3 histories; per endpoint {sorted(spread.values())}; read in "
          f"{time.monotonic() - started:.1f} s (emulated)")
    # The kernel against the Python model of ip_vs_mh.c (canonical list, head first).
    table = mh_table([RsKey(ip_address(a), 8080) for a in
                      sorted(ENDPOINTS, key=lambda a: int(IPv4Address(a)), reverse=True)])
    modelled = sum(str(getattr(mh_choice(table, IPv4Address(s), p), "address", None))
                   == seen[0][(s, p)] for s, p in sample)
    print(f"maglev: the Python model of ip_vs_mh.c predicts {modelled} of {len(sample)}")
    assert same == len(sample)
    sources = sorted({s for s, _ in sample})[:500]
    sh = [n.choices(SH_VIP, [(s, 40000) for s in sources]) for n in nodes]
    agree = sum(len({c[(s, 40000)] for c in sh}) == 1 for s in sources)
    print(f"source-hash: {agree} of {len(sources)} sources on the same endpoint from 3 nodes")
    assert agree == len(sources)


def test_the_kernel_lists_are_canonical(nodes: list[Node]) -> None:
    def listed() -> list[str]:
        table = IpvsTable()
        try:
            return [str(r.address) for r in
                    table.dests(VsKey(Protocol.TCP, ip_address(MH_VIP), 80))]
        finally:
            table.close()
    lists = [n.thread.run(listed) for n in nodes]
    assert lists[0] == lists[1] == lists[2] == sorted(
        ENDPOINTS, key=lambda a: int(IPv4Address(a)), reverse=True)


def test_a_move_s_window_is_one_batched_exchange(nodes: list[Node]) -> None:
    """The re-add that reorders: delete and add back in one netlink exchange. Its time
    bounds how long the real server is unavailable (expire_nodest_conn expires a
    connection whose packet arrives then)."""
    vs = VsKey(Protocol.TCP, ip_address(MH_VIP), 80)
    rs = RsKey(ip_address(ENDPOINTS[0]), 8080)

    def timed() -> list[float]:
        table = IpvsTable()
        try:
            took = []
            for _ in range(30):
                started = time.perf_counter()
                codes = table.apply_many([Op(OpKind.DEL_DEST, vs, rs=rs),
                                          Op(OpKind.ADD_DEST, vs, rs=rs, weight=1)])
                took.append(time.perf_counter() - started)
                assert codes == [0, 0]
            return took
        finally:
            table.close()
    took = nodes[0].thread.run(timed)
    # It went back to the head: put the list back in order for whoever runs next.
    nodes[0].restart()
    print(f"delete + add back, one exchange: median {statistics.median(took) * 1e6:.0f} µs, "
          f"max {max(took) * 1e6:.0f} µs (emulated: an upper bound)")


def test_a_moved_real_server_keeps_its_connections(nodes: list[Node]) -> None:
    """A packet of a connection arriving while its real server is deleted for a move:
    with the plane's guard (ipvs/moves.py: expire_nodest_conn 0 for the exchange) it is
    dropped and the connection stays, with its real server, once it is back; without
    it (expire_nodest_conn=1) the same packet ends the connection. The packet is sent
    between the delete and the add on purpose, not left to a race."""
    a = nodes[0]
    candidates = [(f"198.18.2.{i}", 41000 + i) for i in range(1, 41)]
    chosen = a.choices(MH_VIP, candidates)
    target = chosen[candidates[0]]
    kept, ended = [f for f in candidates if chosen[f] == target][:2]
    vs = VsKey(Protocol.TCP, ip_address(MH_VIP), 80)
    rs = RsKey(ip_address(target), 8080)

    def move_with_a_packet(flow: tuple[str, int], guarded: bool) -> str | None:
        table = IpvsTable()
        try:
            with connections_kept(1 if guarded else 0):
                assert table.apply_many([Op(OpKind.DEL_DEST, vs, rs=rs)]) == [0]
                with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_RAW) as s, \
                        contextlib.suppress(PermissionError):  # IPVS dropped it: NF_DROP
                    s.sendto(segment(*flow, MH_VIP, 80, flags=ACK), (MH_VIP, 0))
            assert table.apply_many([Op(OpKind.ADD_DEST, vs, rs=rs, weight=1)]) == [0]
            if not guarded:  # an expired connection leaves the table at its timer's next run
                wait(lambda: flow not in read_conns(MH_VIP), 5, "the connection expired")
            return read_conns(MH_VIP).get(flow)
        finally:
            table.close()
    assert a.thread.run(lambda: move_with_a_packet(kept, True)) == target
    assert a.thread.run(lambda: move_with_a_packet(ended, False)) is None
    a.restart()  # the moves put it at the head: the list back in order for what follows
    print("a moved real server: a packet meeting it deleted kept its connection with "
          "expire_nodest_conn 0 for the move, and ended it with 1")


def test_removing_one_endpoint_of_ten_moves_few_of_the_others_flows(
        nodes: list[Node]) -> None:
    """Fresh 5-tuples (the first test's have IPVS connections already). Node a's
    leaving endpoint has connections, so it drains at weight 0: its slots stay and the
    fallback sends its flows on, so no other flow moves. A fresh node's has none, so it
    is deleted and the table rebuilt: Maglev's disruption."""
    a, b, _ = nodes
    gone = ENDPOINTS[5]
    sample = [(s, p ^ 1) for s, p in flows(FLOWS)]
    base = b.choices(MH_VIP, sample)
    # Connections to it on node a (the first test's may have expired: SYN_RECV, 60 s).
    extra = [(f"198.18.{i // 250}.{i % 250 + 1}", 33333) for i in range(300)]
    assert gone in set(a.choices(MH_VIP, extra).values())
    a.remove(gone)
    assert a.weights(MH_VIP)[gone] == 0, "expected it to drain: it has connections"
    drained = a.choices(MH_VIP, sample)
    e = Node("mh-e")
    try:
        e.give(ENDPOINTS, "all", full=True)
        e.remove(gone)
        assert gone not in e.weights(MH_VIP)
        deleted = e.choices(MH_VIP, sample)
    finally:
        e.close()
    others = [f for f in sample if base[f] != gone]
    on_gone = [f for f in sample if base[f] == gone]
    refused = [f for f in sample if f not in drained or f not in deleted]
    assert not refused, f"{len(refused)} of {len(sample)} flows refused, e.g. {refused[:3]}"
    moved_drained = sum(drained[f] != base[f] for f in others)
    moved_deleted = sum(deleted[f] != base[f] for f in others)
    print(f"maglev, 1 of 10 endpoints removed: of {len(others)} 5-tuples on the other 9, "
          f"{moved_drained} moved while it drains (weight 0, fallback) and "
          f"{moved_deleted} ({100 * moved_deleted / len(others):.2f}%) once it is deleted; "
          f"its own {len(on_gone)} went to {len({drained[f] for f in on_gone})} others "
          f"while draining")
    assert moved_drained == 0
    assert all(drained[f] != gone and deleted[f] != gone for f in on_gone)
    # The goal's 2% is judged on 10,000 5-tuples (1.63%: docs/dataplanes.md); the suite's
    # 2,000 sample 1,808 of them (1.99% here), so it holds them to 3%.
    assert moved_deleted <= (0.02 if len(sample) >= 10_000 else 0.03) * len(others)
