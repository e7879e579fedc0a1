"""IPVS `mh` and `sh` build their tables by walking the kernel's list of real servers,
which gets each new one at its head: the plane keeps that list in one canonical order
(order.py), so nodes that got the same endpoints in other batches send a flow to the
same endpoint. The pure plan, then the plane over a fake kernel that keeps the list as
the kernel does, read through a model of the kernel's schedulers
(tests/fakekernel/ipvs_schedulers.py)."""

from __future__ import annotations

import random
from ipaddress import ip_address

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs.apply import IpvsDataPlane
from proxy.dataplane.ipvs.diff import KernelDest, KernelService
from proxy.dataplane.ipvs.order import after_ops, canonical, diff_ordered, kept_tail, moves
from proxy.dataplane.ipvs.render import FLAG_SCHED1, FLAG_SCHED2, RsKey, VirtualServer, VsKey
from proxy.dataplane.ipvs.render import VsKind as Kind
from proxy.kube.ingest import apply_object
from proxy.model.tracker import ClusterModel
from proxy.model.types import Balancing, Family, Protocol
from tests.fakekernel.ipvs import FakeIpvs, on_fakes
from tests.fakekernel.ipvs_schedulers import mh_choice, mh_table, sh_choice, sh_table
from tests.unit.builders import NODE, ep, eps_slice, node, service

VS = VsKey(Protocol.TCP, ip_address("198.18.128.1"), 80)
UDP_VS = VsKey(Protocol.UDP, ip_address("198.18.128.1"), 53)
RS = [RsKey(ip_address(f"10.0.0.{i}"), 8080) for i in range(1, 11)]
ADDRESSES = [f"10.0.0.{i}" for i in range(1, 11)]


def rs(*numbers: int) -> list[RsKey]:
    return [RS[n - 1] for n in numbers]


def server(real: list[RsKey], key: VsKey = VS) -> VirtualServer:
    return VirtualServer(key, Kind.CLUSTER_IP, "mh", FLAG_SCHED1 | FLAG_SCHED2, 0,
                         tuple(sorted(real, key=RsKey.order)), "cluster")


def held(order: list[RsKey], weights: dict[RsKey, int] | None = None,
         key: VsKey = VS) -> KernelService:
    w = weights or {}
    return KernelService(key, "mh", FLAG_SCHED1 | FLAG_SCHED2, 0,
                         {r: KernelDest(w.get(r, 1)) for r in order})


def test_the_canonical_list_is_what_adding_in_ascending_order_leaves() -> None:
    ops = diff_ordered(server(rs(3, 1, 2)), None)
    assert [str(op) for op in ops][1:] == [f"add-dest {VS} -> {r} weight 1" for r in rs(1, 2, 3)]
    assert list(after_ops(None, server(rs(1, 2, 3)), ops).dests) == rs(3, 2, 1)
    assert canonical(set(rs(1, 2, 3))) == rs(3, 2, 1)


@pytest.mark.parametrize(("wanted", "kernel", "kept"), [
    (rs(3, 2, 1), rs(3, 2, 1), 3),
    (rs(3, 2, 1), rs(1, 2, 3), 1),
    (rs(4, 3, 2, 1), rs(3, 2, 1), 3),  # a new one at the head: nothing moves
    (rs(4, 3, 2, 1), rs(4, 2, 1), 2),  # a new one in the middle: 4 moves
    (rs(3, 2, 1), [], 0),
])
def test_the_tail_already_in_order_stays(wanted: list[RsKey], kernel: list[RsKey],
                                         kept: int) -> None:
    assert kept_tail(wanted, kernel) == kept


@pytest.mark.parametrize(("kernel", "wanted", "expected"), [
    # Only removals: the rest keep their order, nothing moves (the leaving drain).
    (rs(5, 4, 3, 2, 1), rs(5, 3, 1), ["drain-dest 10.0.0.4:8080", "drain-dest 10.0.0.2:8080"]),
    # An endpoint after the others in the canonical order: added at the head.
    (rs(3, 2, 1), rs(4, 3, 2, 1), ["add-dest 10.0.0.4:8080"]),
    # One in the middle: those before it move (deleted and added back, back to back).
    (rs(5, 4, 2, 1), rs(5, 4, 3, 2, 1),
     ["add-dest 10.0.0.3:8080", "del-dest 10.0.0.4:8080", "add-dest 10.0.0.4:8080",
      "del-dest 10.0.0.5:8080", "add-dest 10.0.0.5:8080"]),
    # A history that left the list out of order (another agent, a restart): repaired.
    (rs(1, 2, 3), rs(3, 2, 1),
     ["del-dest 10.0.0.2:8080", "add-dest 10.0.0.2:8080",
      "del-dest 10.0.0.3:8080", "add-dest 10.0.0.3:8080"]),
])
def test_the_fewest_moves_leave_the_list_canonical(kernel: list[RsKey], wanted: list[RsKey],
                                                  expected: list[str]) -> None:
    current = held(kernel)
    ops = diff_ordered(server(wanted), current)
    assert [f"{o.kind.value} {o.rs}" for o in ops] == expected
    after = after_ops(current, server(wanted), ops)
    full = [r for r, d in after.dests.items() if d.weight]
    assert full == canonical(set(wanted))


def test_a_draining_real_server_keeps_its_place_and_its_weight_zero() -> None:
    """TCP: a leaving real server drains at weight 0 and stays in the list (both
    schedulers still give it slots), so it is ordered with the rest; moved, it comes
    back at full weight (mh keeps the last non-zero weight only across an edit) and is
    drained again at once."""
    current = held(rs(5, 4, 2, 1))
    ops = diff_ordered(server(rs(4, 3, 2, 1)), current)  # 5 leaves, 3 arrives
    assert [str(o).split(" -> ")[1] for o in ops] == [
        "10.0.0.3:8080 weight 1", "10.0.0.4:8080", "10.0.0.4:8080 weight 1",
        "10.0.0.5:8080", "10.0.0.5:8080 weight 1", "10.0.0.5:8080 weight 0"]
    after = after_ops(current, server(rs(4, 3, 2, 1)), ops)
    assert [(str(r), d.weight) for r, d in after.dests.items()] == [
        (str(r), 0 if r == RS[4] else 1) for r in rs(5, 4, 3, 2, 1)]
    # UDP does not drain: the leaving one is deleted, and that moves nothing.
    udp = diff_ordered(server(rs(4, 2, 1), UDP_VS), held(rs(5, 4, 2, 1), key=UDP_VS))
    assert [str(o) for o in udp] == [f"del-dest {UDP_VS} -> 10.0.0.5:8080"]


# --- the plane, three nodes with three histories ----------------------------------------


def cluster(balancing: str) -> ClusterModel:
    m = ClusterModel(NODE, balancing=Balancing.RANDOM)
    apply_object(m, node())
    apply_object(m, service(annotations={"sliceproxy.io/balancing": balancing}))
    return m


def plane(ipvs: FakeIpvs) -> IpvsDataPlane:
    return on_fakes(DataplaneOptions(NODE, families=(Family.V4,)), ipvs)


def give(m: ClusterModel, dp: IpvsDataPlane, batches: list[list[str]], full: bool) -> None:
    """Each batch of endpoints a slice of its own, a sync after each."""
    for i, batch in enumerate(batches):
        apply_object(m, eps_slice(f"s{i}", [ep(a) for a in batch]))
        dp.sync(m.resolve(), full=full and i == 0)


def histories(balancing: str) -> list[FakeIpvs]:
    """The same 10 endpoints: all at once; one by one in a shuffled order; 5, then a
    restart of the agent (a fresh plane over the same kernel), then 5 more."""
    shuffled = random.Random(7).sample(ADDRESSES, len(ADDRESSES))
    kernels = []
    for batches, restart in (([ADDRESSES], False), ([[a] for a in shuffled], False),
                             ([shuffled[:5], shuffled[5:]], True)):
        ipvs, m = FakeIpvs(applies=True), cluster(balancing)
        dp = plane(ipvs)
        give(m, dp, batches[:1], full=True)
        if restart:
            dp = plane(ipvs)
            dp.sync(m.resolve(), full=True)
        for i, batch in enumerate(batches[1:], start=1):
            apply_object(m, eps_slice(f"s{i}", [ep(a) for a in batch]))
            dp.sync(m.resolve())
        kernels.append(ipvs)
    return kernels


def flows(count: int) -> list[tuple[object, int]]:
    rng = random.Random(3)
    return [(ip_address(f"198.18.{rng.randrange(2, 250)}.{rng.randrange(1, 250)}"),
             rng.randrange(1024, 65535)) for _ in range(count)]


def only_list(ipvs: FakeIpvs) -> list[RsKey]:
    (svc,) = ipvs.held.values()
    return list(svc.dests)


def test_three_histories_leave_one_list_and_one_maglev_table() -> None:
    kernels = histories("maglev")
    lists = [only_list(k) for k in kernels]
    assert lists[0] == lists[1] == lists[2] == canonical(set(lists[0]))
    tables = [mh_table(lst) for lst in lists]
    sample = flows(10_000)
    choices = [[mh_choice(t, a, p) for a, p in sample] for t in tables]  # type: ignore[arg-type]
    assert choices[0] == choices[1] == choices[2]
    # What the kernel would hold without the order kept: each history's own list.
    plain = [rs(*range(1, 11))[::-1], [RsKey(ip_address(a), 8080) for a in
                                       random.Random(7).sample(ADDRESSES, 10)][::-1]]
    t0, t1 = (mh_table(lst) for lst in plain)
    differ = sum(mh_choice(t0, a, p) != mh_choice(t1, a, p) for a, p in sample)  # type: ignore[arg-type]
    print(f"maglev: 5-tuples on another endpoint between two orders: {differ} of "
          f"{len(sample)}; with the order kept: 0")


def test_three_histories_agree_on_source_hashing_too() -> None:
    kernels = histories("source-hash")
    lists = [only_list(k) for k in kernels]
    assert lists[0] == lists[1] == lists[2]
    tables = [sh_table(lst) for lst in lists]
    sources = [a for a, _ in flows(2_000)]
    assert [[sh_choice(t, a) for a in sources] for t in tables].count(  # type: ignore[arg-type]
        [sh_choice(tables[0], a) for a in sources]) == 3  # type: ignore[arg-type]


def test_a_restart_over_a_list_out_of_order_repairs_it_and_counts_the_moves() -> None:
    """A list some other history left (e.g. an older agent): the first full sync puts it
    in canonical order with the fewest moves, and the next sync moves nothing."""
    m = cluster("maglev")
    for i, address in enumerate(ADDRESSES[:4]):
        apply_object(m, eps_slice(f"s{i}", [ep(address)]))
    first = plane(FakeIpvs(applies=True))
    first.sync(m.resolve(), full=True)
    (believed,) = first._servers.believed.values()
    scrambled = held(rs(1, 4, 2, 3))
    ipvs = FakeIpvs({believed.key: KernelService(
        believed.key, believed.scheduler, believed.flags, believed.timeout,
        scrambled.dests)}, applies=True)
    dp = plane(ipvs)
    dp.sync(m.resolve(), full=True)
    assert only_list(ipvs) == rs(4, 3, 2, 1)
    assert ipvs.ops == [f"{kind} {believed.key} -> 10.0.0.{n}:8080" + tail
                        for n in (2, 3, 4) for kind, tail in (("del-dest", ""),
                                                           ("add-dest", " weight 1"))]
    ipvs.ops.clear()
    dp.sync(m.resolve(), full=True)
    assert ipvs.ops == []
    assert moves(diff_ordered(server(rs(4, 3, 2, 1)), scrambled)) == 3
