"""Desired virtual servers against the kernel's table -> netlink operations (pure).

Graceful termination, as upstream's IPVS proxier: a TCP real server that leaves first
gets weight 0 (the scheduler stops choosing it, established connections keep flowing)
and the applier deletes it once it has no connections, or after the drain timeout.
UDP and SCTP real servers are deleted at once (upstream: no graceful termination for
them; with expire_nodest_conn the kernel drops their IPVS connections on the next packet,
and conntrack clean-up sends the client elsewhere).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from proxy.dataplane.ipvs.render import (
    OUR_FLAGS,
    WEIGHT,
    RealServerChange,
    RsKey,
    VirtualServer,
    VsKey,
)
from proxy.model.types import Protocol

FWD_MASQ = 0  # IP_VS_CONN_F_MASQ; pyroute2's IPVSDest defaults to 3 (direct routing)


@dataclass(frozen=True, slots=True)
class KernelDest:
    weight: int
    fwd_method: int = FWD_MASQ
    active: int = 0
    inactive: int = 0

    @property
    def connections(self) -> int:
        return self.active + self.inactive


@dataclass(frozen=True, slots=True)
class KernelService:
    """A virtual server as the kernel reports it (or as we believe it is)."""

    key: VsKey
    scheduler: str
    flags: int  # FLAG_HASHED and other kernel-only bits removed
    timeout: int
    dests: Mapping[RsKey, KernelDest] = field(default_factory=dict)


class OpKind(enum.Enum):
    ADD_SERVICE = "add-service"
    SET_SERVICE = "set-service"
    DEL_SERVICE = "del-service"
    ADD_DEST = "add-dest"
    SET_DEST = "set-dest"
    DRAIN_DEST = "drain-dest"  # set weight 0, then track until it can be deleted
    DEL_DEST = "del-dest"


@dataclass(frozen=True, slots=True)
class Op:
    kind: OpKind
    vs: VsKey
    service: VirtualServer | None = None  # for ADD_SERVICE / SET_SERVICE
    rs: RsKey | None = None
    weight: int = 0

    def __str__(self) -> str:
        text = f"{self.kind.value} {self.vs}"
        if self.service is not None:
            text += f" {self.service.scheduler}"
            if self.service.persistent:
                text += f" persistent {self.service.timeout}"
        if self.rs is not None:
            text += f" -> {self.rs}"
            if self.kind in (OpKind.ADD_DEST, OpKind.SET_DEST, OpKind.DRAIN_DEST):
                text += f" weight {self.weight}"
        return text


def graceful(protocol: Protocol) -> bool:
    """Whether a leaving real server drains (weight 0) instead of being deleted at once."""
    return protocol is Protocol.TCP


def same_service(desired: VirtualServer, current: KernelService) -> bool:
    return (desired.scheduler == current.scheduler
            and desired.flags == current.flags & OUR_FLAGS
            and desired.timeout == current.timeout)


def diff_service(desired: VirtualServer | None, current: KernelService | None) -> list[Op]:
    """The operations turning `current` into `desired` (either may be None).

    Leaving real servers: TCP ones get DRAIN_DEST (unless already at weight 0, which is
    left alone: the applier tracks it); others get DEL_DEST.
    """
    if desired is None:
        return [] if current is None else [Op(OpKind.DEL_SERVICE, current.key)]
    key = desired.key
    ops: list[Op] = []
    dests: Mapping[RsKey, KernelDest] = {}
    if current is None:
        ops.append(Op(OpKind.ADD_SERVICE, key, service=desired))
    else:
        dests = current.dests
        if not same_service(desired, current):
            ops.append(Op(OpKind.SET_SERVICE, key, service=desired))
    wanted = set(desired.real_servers)
    for rs in desired.real_servers:
        _keep(ops, key, rs, dests.get(rs))
    for rs, dest in sorted(dests.items(), key=lambda item: item[0].order()):
        if rs not in wanted:
            _let_go(ops, key, rs, dest)
    return ops


def _keep(ops: list[Op], key: VsKey, rs: RsKey, dest: KernelDest | None) -> None:
    """The op, if any, that makes `rs` a full-weight real server of `key`."""
    if dest is None:
        ops.append(Op(OpKind.ADD_DEST, key, rs=rs, weight=WEIGHT))
    elif dest.weight != WEIGHT or dest.fwd_method != FWD_MASQ:
        ops.append(Op(OpKind.SET_DEST, key, rs=rs, weight=WEIGHT))


def _let_go(ops: list[Op], key: VsKey, rs: RsKey, dest: KernelDest) -> None:
    """The op, if any, for a real server `key` no longer wants: drained to weight 0
    where connections end gracefully (`graceful`: TCP), deleted otherwise."""
    if not graceful(key.protocol):
        ops.append(Op(OpKind.DEL_DEST, key, rs=rs))
    elif dest.weight != 0:
        ops.append(Op(OpKind.DRAIN_DEST, key, rs=rs, weight=0))


def leaving(desired: VirtualServer | None, current: KernelService | None) -> list[RsKey]:
    """Real servers of `current` that `desired` no longer has and that drain (TCP)."""
    if current is None or desired is None or not graceful(desired.key.protocol):
        return []
    wanted = set(desired.real_servers)
    return sorted((rs for rs in current.dests if rs not in wanted), key=RsKey.order)


def believed_after(desired: VirtualServer | None, current: KernelService | None
                   ) -> KernelService | None:
    """What the kernel holds for this virtual server once `diff_service`'s operations
    have succeeded: the desired real servers at full weight plus the draining ones."""
    if desired is None:
        return None
    dests = {rs: KernelDest(WEIGHT) for rs in desired.real_servers}
    for rs in leaving(desired, current):
        dests[rs] = KernelDest(0)
    return KernelService(desired.key, desired.scheduler, desired.flags, desired.timeout, dests)


def diff_real_servers(desired: VirtualServer, current: KernelService,
                      change: RealServerChange) -> list[Op] | None:
    """`diff_service(desired, current)` when only `change`'s real servers differ from
    the last sync (render.render_change), in O(change): the same operations in the same
    order. None when the server itself differs: diff it whole."""
    if not same_service(desired, current):
        return None
    key, dests = desired.key, current.dests
    ops: list[Op] = []
    for rs in change.added:
        _keep(ops, key, rs, dests.get(rs))
    for rs in change.removed:
        dest = dests.get(rs)
        if dest is not None:
            _let_go(ops, key, rs, dest)
    return ops


def believed_after_change(desired: VirtualServer, current: KernelService,
                          change: RealServerChange) -> KernelService:
    """`believed_after(desired, current)` when only `change`'s real servers differ:
    `current`'s real servers edited in place (a copy was 1 ms at 50,000 of them; what
    we believe before a sync is never needed after it: a failed sync is followed by a
    full one, which reads the kernel back)."""
    dests = current.dests
    assert isinstance(dests, dict)
    for rs in change.removed:
        if graceful(desired.key.protocol) and rs in dests:
            dests[rs] = KernelDest(0)
        else:
            dests.pop(rs, None)
    for rs in change.added:
        dests[rs] = KernelDest(WEIGHT)
    return KernelService(desired.key, desired.scheduler, desired.flags, desired.timeout, dests)


def drained(dest: KernelDest, since: float, now: float, timeout: float) -> bool:
    """A draining real server may go: no connections left, or it drained long enough."""
    return dest.connections == 0 or now - since >= timeout
