"""Desired virtual server vs. kernel table -> netlink operations, and draining."""

from __future__ import annotations

from ipaddress import ip_address

from proxy.dataplane.ipvs.diff import (
    KernelDest,
    KernelService,
    believed_after,
    diff_service,
    drained,
)
from proxy.dataplane.ipvs.render import (
    FLAG_PERSISTENT,
    RsKey,
    VirtualServer,
    VsKey,
    VsKind,
)
from proxy.model.types import Protocol

TCP = VsKey(Protocol.TCP, ip_address("198.18.128.10"), 80)
UDP = VsKey(Protocol.UDP, ip_address("198.18.128.10"), 53)
R1, R2, R3 = (RsKey(ip_address(f"198.18.1.{n}"), 8080) for n in (10, 11, 12))


def vs(key: VsKey = TCP, reals: tuple[RsKey, ...] = (R1, R2), scheduler: str = "rr",
       flags: int = 0, timeout: int = 0) -> VirtualServer:
    return VirtualServer(key, VsKind.CLUSTER_IP, scheduler, flags, timeout, reals, "cluster")


def kernel(key: VsKey = TCP, dests: dict[RsKey, KernelDest] | None = None,
           scheduler: str = "rr", flags: int = 0, timeout: int = 0) -> KernelService:
    return KernelService(key, scheduler, flags, timeout, dests or {})


def ops(desired: VirtualServer | None, current: KernelService | None) -> list[str]:
    return [str(op) for op in diff_service(desired, current)]


def test_new_virtual_server_then_its_real_servers() -> None:
    assert ops(vs(), None) == [
        "add-service TCP 198.18.128.10:80 rr",
        "add-dest TCP 198.18.128.10:80 -> 198.18.1.10:8080 weight 1",
        "add-dest TCP 198.18.128.10:80 -> 198.18.1.11:8080 weight 1"]


def test_nothing_to_do_when_the_kernel_matches() -> None:
    current = kernel(dests={R1: KernelDest(1), R2: KernelDest(1, active=3)})
    assert ops(vs(), current) == []


def test_changed_scheduler_or_persistence_is_set_in_place() -> None:
    current = kernel(dests={R1: KernelDest(1), R2: KernelDest(1)})
    assert ops(vs(scheduler="lc"), current) == ["set-service TCP 198.18.128.10:80 lc"]
    assert ops(vs(flags=FLAG_PERSISTENT, timeout=60), current) == [
        "set-service TCP 198.18.128.10:80 rr persistent 60"]


def test_wrong_weight_or_forwarding_method_is_repaired() -> None:
    current = kernel(dests={R1: KernelDest(0), R2: KernelDest(1, fwd_method=3)})
    assert ops(vs(), current) == [
        "set-dest TCP 198.18.128.10:80 -> 198.18.1.10:8080 weight 1",
        "set-dest TCP 198.18.128.10:80 -> 198.18.1.11:8080 weight 1"]


def test_leaving_tcp_real_server_drains_udp_one_is_deleted() -> None:
    current = kernel(dests={R1: KernelDest(1), R2: KernelDest(1), R3: KernelDest(0)})
    # R3 is already at weight 0: left to the drain tracking, no operation.
    assert ops(vs(reals=(R1,)), current) == [
        "drain-dest TCP 198.18.128.10:80 -> 198.18.1.11:8080 weight 0"]
    after = believed_after(vs(reals=(R1,)), current)
    assert after is not None
    assert {str(r): d.weight for r, d in after.dests.items()} == {
        "198.18.1.10:8080": 1, "198.18.1.11:8080": 0, "198.18.1.12:8080": 0}
    udp = kernel(UDP, dests={R1: KernelDest(1), R2: KernelDest(1)})
    assert ops(vs(UDP, reals=(R1,)), udp) == [
        "del-dest UDP 198.18.128.10:53 -> 198.18.1.11:8080"]
    after = believed_after(vs(UDP, reals=(R1,)), udp)
    assert after is not None and set(after.dests) == {R1}


def test_virtual_server_gone_is_deleted_whole() -> None:
    assert ops(None, kernel(dests={R1: KernelDest(1)})) == ["del-service TCP 198.18.128.10:80"]
    assert ops(None, None) == []


def test_drained_when_idle_or_after_the_timeout() -> None:
    assert drained(KernelDest(0), since=100.0, now=100.0, timeout=900)
    busy = KernelDest(0, active=1)
    closing = KernelDest(0, inactive=2)  # TIME_WAIT and friends still count (upstream)
    assert not drained(busy, since=100.0, now=500.0, timeout=900)
    assert not drained(closing, since=100.0, now=500.0, timeout=900)
    assert drained(busy, since=100.0, now=1000.0, timeout=900)
