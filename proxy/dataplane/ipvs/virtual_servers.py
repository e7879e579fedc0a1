"""Our virtual servers in the kernel's IPVS table: what we believe it holds for them, and
how each is brought to what is desired (diff.py's operations, all of one sync in one
batched netlink exchange), with the drains that follow (drain.py).

`believed` is what the kernel holds for the virtual servers we own, as far as we know:
a full sync rebuilds it from a dump, a partial one diffs against it.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from proxy.dataplane.ipvs.diff import (
    KernelService,
    Op,
    OpKind,
    believed_after,
    believed_after_change,
    diff_real_servers,
    diff_service,
)
from proxy.dataplane.ipvs.drain import DrainTracker
from proxy.dataplane.ipvs.kernel import IpvsTable
from proxy.dataplane.ipvs.moves import connections_kept
from proxy.dataplane.ipvs.order import after_ops, diff_ordered, moves
from proxy.dataplane.ipvs.render import (
    ORDERED_SCHEDULERS,
    RealServerChange,
    RsKey,
    VirtualServer,
    VsKey,
)
from proxy.dataplane.ipvs.run_record import RunRecord
from proxy.model.types import ServicePortKey

log = logging.getLogger(__name__)

# One virtual server to sync: its key, what is desired ((owner, server), None: not
# ours any more) and what the kernel holds (None: nothing).
Item = tuple[VsKey, tuple[ServicePortKey, VirtualServer] | None, KernelService | None]
# Servers whose real servers alone changed, by the port that changed them, and how.
Changed = Mapping[VsKey, tuple[ServicePortKey, RealServerChange]]


@dataclass(frozen=True, slots=True)
class _Plan:
    """One virtual server's operations, what the kernel holds once they succeed, and the
    real-server change they were diffed from (None: diffed whole)."""

    ops: list[Op]
    after: KernelService | None
    change: RealServerChange | None = None


class VirtualServers:
    def __init__(self, clock: Callable[[], float], drain_timeout: float) -> None:
        self.clock = clock
        self.believed: dict[VsKey, KernelService] = {}
        self.drains = DrainTracker(clock, drain_timeout)

    def real_server_count(self) -> int:
        return sum(len(s.dests) for s in self.believed.values())

    def clear(self) -> None:
        self.believed.clear()
        self.drains.clear()

    def sync_all(self, items: list[Item], ipvs: IpvsTable, run: RunRecord) -> None:
        """A full sync's: `items` are every virtual server that is ours, desired or found
        in the kernel; what was believed of the others is forgotten, drains with it."""
        self.believed = {}
        self.sync(items, ipvs, run)
        self.drains.keep_only(self.believed)

    def sync(self, items: list[Item], ipvs: IpvsTable, run: RunRecord,
             changed: Changed | None = None) -> set[VsKey]:
        """Apply each virtual server's difference, all operations in one batched
        exchange; returns those whose real servers started draining. `changed`: servers
        whose real servers alone changed, and how (diffed in O(change) when the port that
        changed them still owns them)."""
        items = [(k, e, _in_kernel_order(k, e, c, ipvs, run)) for k, e, c in items]
        plans = [(vs_key, entry, current, _plan(vs_key, entry, current, changed or {}))
                 for vs_key, entry, current in items]
        ops = [op for *_, plan in plans for op in plan.ops]
        owners = [entry[0] if entry else None for _k, entry, _c, plan in plans
                  for _ in plan.ops]
        with connections_kept(moves(ops)):
            results = iter(self.execute(ipvs, ops, owners, run))
        now = self.clock()
        started: set[VsKey] = set()
        for vs_key, entry, current, plan in plans:
            outcomes = [next(results) for _ in plan.ops]  # consume them all, not to a False
            ok = all(outcomes)
            if entry is None:
                if ok:
                    self.believed.pop(vs_key, None)
                    self.drains.drop_server(vs_key)
                continue
            assert plan.after is not None
            if not ok:
                # Unknown now; the next sync is full and reads the kernel back.
                self.believed[vs_key] = current or plan.after
                continue
            self.believed[vs_key] = plan.after
            if self._follow_drains(vs_key, entry, plan, now):
                started.add(vs_key)
        return started

    def _follow_drains(self, vs_key: VsKey, entry: tuple[ServicePortKey, VirtualServer],
                       plan: _Plan, now: float) -> bool:
        """Only what changed can have stopped or started draining; whether a drain
        started."""
        owner, desired = entry
        after = plan.after
        assert after is not None
        came = plan.change.added if plan.change else desired.real_servers
        for rs in came:
            self.drains.stop(vs_key, rs)
        went = plan.change.removed if plan.change else after.dests
        started = False
        for rs in went:
            dest = after.dests.get(rs)
            if dest is not None and dest.weight == 0:
                started = self.drains.start(vs_key, rs, owner, now) or started
        return started

    def execute(self, ipvs: IpvsTable, ops: list[Op], owners: list[ServicePortKey | None],
                run: RunRecord) -> list[bool]:
        """Carry out `ops` in order; whether each reached its goal (deleting what is
        already gone counts as done)."""
        if not ops:
            return []
        try:
            codes = ipvs.apply_many(ops)
        except Exception as exc:  # the socket itself failed: nothing is known
            run.fail(f"{len(ops)} IPVS operations starting with {ops[0]}", exc)
            return [False] * len(ops)
        done = []
        failed_services: set[VsKey] = set()
        for op, owner, code in zip(ops, owners, codes, strict=True):
            if not code or (op.kind in (OpKind.DEL_SERVICE, OpKind.DEL_DEST)
                            and code in (errno.ENOENT, errno.ESRCH)):
                done.append(True)
                log.debug("IPVS operation %s", op, extra={
                    "operation": str(op), "service": str(owner) if owner else None})
                continue
            done.append(False)
            if op.vs in failed_services:
                continue  # its virtual server could not be made: one error is enough
            if op.kind is OpKind.ADD_SERVICE:
                failed_services.add(op.vs)
            why = os.strerror(code)
            if op.service is not None and code == errno.ENOENT:
                # The kernel's answer for a scheduler it cannot load.
                why += (f" (is the IPVS scheduler {op.service.scheduler!r} available? "
                        f"modprobe ip_vs_{op.service.scheduler})")
            run.fail(str(op), OSError(code, why), service=str(owner) if owner else None)
        return done

    def reap(self, vs_keys: Iterable[VsKey], ipvs: IpvsTable, run: RunRecord) -> None:
        """Delete the draining real servers of `vs_keys` that may go now."""
        self.drains.reap(vs_keys, ipvs, self.execute, self._forget_drain, run)

    def _forget_drain(self, vs_key: VsKey, rs: RsKey) -> None:
        self.drains.stop(vs_key, rs)
        believed = self.believed.get(vs_key)
        if believed is not None and rs in believed.dests:
            self.believed[vs_key] = KernelService(
                believed.key, believed.scheduler, believed.flags, believed.timeout,
                {k: v for k, v in believed.dests.items() if k != rs})

    def differences(self, kernel: Mapping[VsKey, KernelService]) -> list[str]:
        """How the kernel's virtual servers (keys and schedulers, not real servers)
        differ from what we believe of ours."""
        found = []
        for key, believed in self.believed.items():
            there = kernel.get(key)
            if there is None:
                found.append(f"virtual server {key} is missing")
            elif there.scheduler != believed.scheduler or there.flags != believed.flags:
                found.append(f"virtual server {key} was changed (scheduler "
                             f"{there.scheduler}, flags {there.flags:#x})")
        return found


def _plan(vs_key: VsKey, entry: tuple[ServicePortKey, VirtualServer] | None,
          current: KernelService | None, changed: Changed) -> _Plan:
    """One server's operations and what the kernel holds once they succeed."""
    desired = entry[1] if entry else None
    if desired is not None and desired.scheduler in ORDERED_SCHEDULERS:
        ordered = diff_ordered(desired, current)  # whole: the list's order matters too
        return _Plan(ordered, after_ops(current, desired, ordered))
    change = changed.get(vs_key)
    if entry is not None and desired is not None and current is not None \
            and change is not None and change[0] == entry[0]:
        ops = diff_real_servers(desired, current, change[1])
        if ops is not None:
            return _Plan(ops, believed_after_change(desired, current, change[1]), change[1])
    return _Plan(diff_service(desired, current), believed_after(desired, current))


def _in_kernel_order(vs_key: VsKey, entry: tuple[ServicePortKey, VirtualServer] | None,
                     current: KernelService | None, ipvs: IpvsTable,
                     run: RunRecord) -> KernelService | None:
    """`current`, its real servers in the kernel's list order where that order is about
    to matter: a server turning to an ordered scheduler, whose list we followed without
    its order (a partial sync appends an added real server; the kernel puts it at the
    head). One dump of its real servers, at that change only."""
    desired = entry[1] if entry else None
    if (current is None or desired is None or desired.scheduler not in ORDERED_SCHEDULERS
            or current.scheduler in ORDERED_SCHEDULERS):
        return current
    try:
        dests = ipvs.dests(vs_key)
    except Exception as exc:
        run.fail(f"dump real servers of {vs_key}", exc)
        return current
    return KernelService(current.key, current.scheduler, current.flags, current.timeout,
                         dests)
