"""Real servers that drain: set to weight 0 when their endpoint left (diff.py's graceful
termination), they keep their established connections and are deleted once they have
none left or the drain timeout (--ipvs-drain-timeout) has passed.

The tracker remembers when each began draining and for which service port; the virtual
server table (virtual_servers.py) starts and ends drains as it applies changes, and asks
`reap` which may go.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass

from proxy.dataplane.ipvs.diff import KernelDest, Op, OpKind, drained
from proxy.dataplane.ipvs.kernel import IpvsTable
from proxy.dataplane.ipvs.render import RsKey, VsKey
from proxy.dataplane.ipvs.run_record import RunRecord
from proxy.model.types import ServicePortKey

log = logging.getLogger(__name__)

# Carries out operations in order; whether each reached its goal (VirtualServers.execute).
Execute = Callable[[IpvsTable, list[Op], list[ServicePortKey | None], RunRecord], list[bool]]


@dataclass(slots=True)
class Drain:
    since: float
    owner: ServicePortKey | None


class DrainTracker:
    def __init__(self, clock: Callable[[], float], timeout: float) -> None:
        self.clock = clock
        self.timeout = timeout
        self.draining: dict[tuple[VsKey, RsKey], Drain] = {}

    def __len__(self) -> int:
        return len(self.draining)

    def servers(self) -> set[VsKey]:
        """The virtual servers with a real server draining."""
        return {vs for vs, _ in self.draining}

    def clear(self) -> None:
        self.draining.clear()

    def keep_only(self, vs_keys: Collection[VsKey]) -> None:
        """Forget the drains of every virtual server but `vs_keys`."""
        self.draining = {k: d for k, d in self.draining.items() if k[0] in vs_keys}

    def drop_server(self, vs_key: VsKey) -> None:
        """`vs_key` is deleted, its real servers with it."""
        self.draining = {k: d for k, d in self.draining.items() if k[0] != vs_key}

    def stop(self, vs_key: VsKey, rs: RsKey) -> None:
        self.draining.pop((vs_key, rs), None)

    def start(self, vs_key: VsKey, rs: RsKey, owner: ServicePortKey, now: float) -> bool:
        """`rs` of `vs_key` is at weight 0: whether that begins a drain (not one already
        followed)."""
        if (vs_key, rs) in self.draining:
            return False
        self.draining[(vs_key, rs)] = Drain(now, owner)
        log.info("real server %s of %s (%s) draining", rs, vs_key, owner, extra={
            "service": str(owner), "virtual_server": str(vs_key),
            "real_server": str(rs), "timeout": self.timeout})
        return True

    def reap(self, vs_keys: Iterable[VsKey], ipvs: IpvsTable, execute: Execute,
             forget: Callable[[VsKey, RsKey], None], run: RunRecord) -> None:
        """Delete the draining real servers of `vs_keys` that may go now; `forget(vs, rs)`
        for each that is gone (deleted now, or already)."""
        now = self.clock()
        pending: dict[VsKey, list[tuple[RsKey, Drain]]] = {}
        for (v, rs), drain in self.draining.items():
            pending.setdefault(v, []).append((rs, drain))
        doomed: list[tuple[Op, Drain, KernelDest]] = []
        for vs_key in sorted(set(vs_keys) & set(pending), key=VsKey.order):
            try:
                dests = ipvs.dests(vs_key)
            except Exception as exc:
                run.fail(f"dump real servers of {vs_key}", exc)
                continue
            for rs, drain in pending[vs_key]:
                dest = dests.get(rs)
                if dest is None:  # gone already (deleted by hand, or with its server)
                    forget(vs_key, rs)
                elif drained(dest, drain.since, now, self.timeout):
                    doomed.append((Op(OpKind.DEL_DEST, vs_key, rs=rs), drain, dest))
        results = execute(ipvs, [op for op, _d, _k in doomed],
                          [d.owner for _o, d, _k in doomed], run)
        for (op, drain, dest), ok in zip(doomed, results, strict=True):
            if not ok:
                continue
            assert op.rs is not None
            forget(op.vs, op.rs)
            reason = "idle" if dest.connections == 0 else "drain timeout"
            log.info("real server %s of %s (%s) deleted after draining: %s", op.rs, op.vs,
                     drain.owner, reason, extra={
                         "service": str(drain.owner) if drain.owner else None,
                         "virtual_server": str(op.vs), "real_server": str(op.rs),
                         "reason": reason, "connections": dest.connections,
                         "drained_seconds": round(now - drain.since, 3)})
