"""One order for the kernel's list of real servers, under the schedulers whose table
follows it (`mh`, `sh`: render.ORDERED_SCHEDULERS), so that every node builds the same
table from the same real servers whatever their history. Pure.

The kernel walks a virtual server's list of real servers in list order when it builds
either table (ip_vs_mh.c: who claims a contested slot first; ip_vs_sh.c: buckets dealt
round robin), and adds a new real server at the list's head (ip_vs_ctl.c,
__ip_vs_update_dest). Two nodes that got the same endpoints in other batches (partial
syncs at other moments, an agent restart) would hold other lists, and could send the same
flow to other endpoints. The canonical list, head first, is the real servers in
descending `RsKey.order`: what adding them in ascending order (as a new virtual server
gets them) leaves.

The only way to move a real server in the kernel's list is to delete it and add it back
(it comes back from IPVS's trash with its connections, at the head). Real servers that
stay in place keep their relative order and end up behind every one added or moved, so
the fewest moves keep the longest tail of the canonical list that the kernel already holds
in that order, and add or move the rest, last first. Removals never move anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from proxy.dataplane.ipvs.diff import (
    FWD_MASQ,
    KernelDest,
    KernelService,
    Op,
    OpKind,
    graceful,
    same_service,
)
from proxy.dataplane.ipvs.render import WEIGHT, RsKey, VirtualServer


def canonical(real_servers: Sequence[RsKey] | set[RsKey]) -> list[RsKey]:
    """The kernel's list as it should be, head first."""
    return sorted(real_servers, key=RsKey.order, reverse=True)


def kept_tail(wanted: Sequence[RsKey], held: Sequence[RsKey]) -> int:
    """How many real servers at the end of `wanted` (a canonical list) `held` (the
    kernel's list, head first) already has in that order: those stay where they are."""
    position = {rs: i for i, rs in enumerate(held)}
    kept, limit = 0, len(held)
    for rs in reversed(wanted):
        i = position.get(rs)
        if i is None or i >= limit:
            break
        kept, limit = kept + 1, i
    return kept


def diff_ordered(desired: VirtualServer, current: KernelService | None) -> list[Op]:
    """diff.diff_service for an ordered scheduler: the same real servers at the same
    weights, and the kernel's list left in canonical order (DEL_DEST then ADD_DEST back
    to back for each real server moved).

    A draining real server (weight 0) stays in the list, and in its order: both
    schedulers still give it slots. Moved, it is added back at full weight and drained
    again at once, since the kernel keeps the last non-zero weight for `mh`'s table only
    across an edit, not an add."""
    key = desired.key
    ops: list[Op] = []
    dests: Mapping[RsKey, KernelDest] = current.dests if current is not None else {}
    if current is None:
        ops.append(Op(OpKind.ADD_SERVICE, key, service=desired))
    elif not same_service(desired, current):
        ops.append(Op(OpKind.SET_SERVICE, key, service=desired))
    wanted = set(desired.real_servers)
    stays_draining = graceful(key.protocol)
    for rs in sorted(dests, key=RsKey.order):
        if rs not in wanted and not stays_draining:
            ops.append(Op(OpKind.DEL_DEST, key, rs=rs))
    held = [rs for rs in dests if rs in wanted or stays_draining]
    target = canonical(wanted | set(held))
    moved = len(target) - kept_tail(target, held)
    for rs in reversed(target[:moved]):
        if rs in dests:
            ops.append(Op(OpKind.DEL_DEST, key, rs=rs))
        ops.append(Op(OpKind.ADD_DEST, key, rs=rs, weight=WEIGHT))
        if rs not in wanted:
            ops.append(Op(OpKind.DRAIN_DEST, key, rs=rs, weight=0))
    for rs in target[moved:]:
        dest = dests[rs]
        if rs not in wanted:
            if dest.weight != 0:
                ops.append(Op(OpKind.DRAIN_DEST, key, rs=rs, weight=0))
        elif dest.weight != WEIGHT or dest.fwd_method != FWD_MASQ:
            ops.append(Op(OpKind.SET_DEST, key, rs=rs, weight=WEIGHT))
    return ops


def after_ops(current: KernelService | None, desired: VirtualServer,
              ops: Sequence[Op]) -> KernelService:
    """What the kernel holds once `ops` have succeeded, its list in the kernel's order
    (head first): an add goes to the head, a weight change stays in place."""
    held = dict(current.dests) if current is not None else {}
    # A place in the list for each: the ones held by their index, each added one before
    # all of them (and before the ones added earlier).
    place = {rs: float(i) for i, rs in enumerate(held)}
    added = 0
    for op in ops:
        if op.rs is None:
            continue
        if op.kind is OpKind.DEL_DEST:
            held.pop(op.rs, None)
            continue
        if op.kind is OpKind.ADD_DEST:
            added += 1
            place[op.rs] = -float(added)
        held[op.rs] = KernelDest(op.weight)
    dests = {rs: held[rs] for rs in sorted(held, key=place.__getitem__)}
    return KernelService(desired.key, desired.scheduler, desired.flags, desired.timeout,
                         dests)


def moves(ops: Sequence[Op]) -> int:
    """How many real servers `ops` delete and add back (to reorder the list)."""
    deleted = {(op.vs, op.rs) for op in ops if op.kind is OpKind.DEL_DEST}
    return sum(1 for op in ops if op.kind is OpKind.ADD_DEST and (op.vs, op.rs) in deleted)
