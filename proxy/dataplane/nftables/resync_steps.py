"""The nftables data plane's resync, a table at a time, changes going between.

Every --sync-period the agent writes everything it owns again, to repair what it did
not see changed, and it does so at once when its drift check finds our rules changed
(common/drift_watch.py). In one worker call that held every change for the whole
rewrite: 35 s at 100,000 services, 75 s with someone listening to nf_tables. Instead,
when the sync loop asks (`begin_resync`), each family's tables are queued (a periodic
resync asked again goes on; a repair starts over, as the drift may be in a table
written already), and each housekeeping call (the sync loop runs it again at once
while parts are left, a due change going first) writes one of them whole again, in a
transaction of its own (transaction.table_lines), from the kept state:

- a shard table: its ports rendered again from what was applied, each endpoint kept in
  its slot, their chains flushed and their rules written; the table's sets and its
  ports' slot maps flushed and refilled with what the state says they hold; and, in a
  periodic resync, its ports' elements of the main table's sets (their cluster IPs,
  their endpoints' hairpin pairs) added again;
- the main table last: its chains the same way, its maps refilled, its sets only added
  to with the bases' own elements (the ports' came with their shards: 1.1 million
  elements at 100,000 x 10, which made this part take 2 s), but in a repair after
  drift, whose part flushes and refills them all (an element someone added is heard by
  the drift watch, whose repair removes it); then what any of our tables holds that
  nobody wants (read back then, as a one-step resync reads it), but named counters,
  which count nothing of ours unless a rule of ours names them (their dump is the
  slowest read of our tables).

Each part's commit is made with our drift listener deaf, as a full sync's is: while
anyone listens, the kernel announces every object a transaction touches (an element
added that it holds already is no object touched). At 100,000 services our own listener
made the main table's part take 45 s; another's (a bench's, `nft monitor`) still made
its flush and refill of 1.1 million elements take 41 s.

Nothing of ours jumps or refers from one table to another, so each part is whole when
it commits. The state is not made anew: a port's chains must render to the digests the
state keeps (the partial syncs' invariant, their property tests'); a port that does not
is logged, the family's state dropped, and the next sync is full. So is any refusal.
A family whose state is unknown or whose ports outgrow its shards is resynced in one
step, as a full sync (`begin_resync` says no); so is one whose render context changed
(its sync is full whatever was asked, and drops the resync).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from proxy.dataplane.base import ApplyError
from proxy.dataplane.common import heap
from proxy.dataplane.common.drift_watch import LegacyCanary, NftablesListener, deaf_while
from proxy.dataplane.nftables.objects import Set
from proxy.dataplane.nftables.render import (
    TABLE,
    PortObjects,
    render_port,
    shard_table,
    shards_for,
)
from proxy.dataplane.nftables.transaction import (
    KeptPort,
    Script,
    TableState,
    kept_slots,
    stale_statements,
    table_lines,
)
from proxy.model.types import Family, ServicePortKey

if TYPE_CHECKING:  # restart_steps keeps the family, which holds a Resync
    from proxy.dataplane.nftables.restart_steps import NftFamily

log = logging.getLogger("proxy.dataplane.nftables.apply")  # the mode's one logger


@dataclass(slots=True)
class Resync:
    """One family's resync under way: the tables still to write (shards first,
    the main table last), and for the log what it wrote and how long it took."""

    tables: list[str]
    repair: bool  # after drift: the main table's sets flushed too (`_resync_table`)
    started: float = field(default_factory=time.monotonic)
    ports: int = 0
    work: float = 0.0  # seconds of the parts themselves
    longest: float = 0.0  # the longest part: what a change waited for at most

    @classmethod
    def of(cls, shards: int, repair: bool) -> Resync:
        return cls([*(shard_table(i) for i in range(shards)), TABLE], repair)


class _Plane(Protocol):
    """What the resync uses of the data plane (apply.NftablesDataPlane)."""

    _families: dict[Family, NftFamily]
    _watch: NftablesListener | LegacyCanary | None

    def _failed(self, fam: NftFamily) -> None: ...

    def _run(self, fam: NftFamily, text: str | Script, full: bool) -> str: ...

    def _kernel_objects(self, fam: NftFamily
                        ) -> tuple[set[str], list[tuple[str, str]], dict[tuple[str, str], str]]:
        ...


class ResyncSteps:
    """The resync's steps, as methods of the data plane (`_Plane`)."""

    def _begin_resync(self: _Plane, repair: bool) -> bool:
        """Queue every family's tables for a resync a table at a time (`repair`: after
        drift); False (nothing queued) when a family cannot be resynced so (module
        docstring)."""
        families = list(self._families.values())
        if not all(fam.resync is not None or _can_resync(fam) for fam in families):
            return False
        for fam in families:
            # One under way (longer than --sync-period) goes on; but for a repair, which
            # starts over: the drift may be in a table it wrote already.
            if fam.resync is not None and not repair:
                continue
            fam.resync = Resync.of(fam.shards, repair)
            log.info("resync: rewriting our tables one at a time", extra={
                "family": fam.family.label, "tables": len(fam.resync.tables),
                "repair": repair})
        return True

    def _resync_parts(self: _Plane) -> bool:
        """The next table of each family's resync; whether any is left after it. A
        family's failure (its ApplyError, raised after the other family's part) drops
        its resync alone."""
        failure: ApplyError | None = None
        for fam in self._families.values():
            if fam.resync is not None:
                try:
                    _resync_table(self, fam)
                except ApplyError as exc:
                    failure = failure or exc
        if failure is not None:
            raise failure
        return any(fam.resync is not None for fam in self._families.values())


def _can_resync(fam: NftFamily) -> bool:
    state = fam.state
    return (state is not None and fam.last is not None and fam.context is not None
            and not fam.pending and state.unfinished is None and state.shards == fam.shards
            and shards_for(len(state.ports)) <= fam.shards)


def _resync_table(plane: _Plane, fam: NftFamily) -> None:
    """Write the next table of `fam`'s resync (module docstring). ApplyError, with the
    resync dropped and the next sync full, if the kernel refuses it or a port's render
    is not what the state keeps."""
    todo, state = fam.resync, fam.state
    assert todo is not None
    if state is None or fam.last is None or fam.context is None:  # a failure since
        fam.resync = None
        return
    started = time.perf_counter()
    table = todo.tables.pop(0)
    try:
        if table == TABLE:
            # Not the counters: their dump walks every counter of the family for each
            # message it fills (3.8 s at 100,000 ports); the shards' parts add theirs.
            tables, chains, sets = plane._kernel_objects(fam)
            counters = state.counter_names()
            stale = stale_statements(state, chains, sets, counters, tables)
            # Its sets (every cluster IP, every endpoint's hairpin pair: 1.1 million
            # elements at 100,000 x 10) only added to, but after drift: flushed, each
            # element would be announced twice to anyone listening (41 s of the part).
            script = table_lines(state, [], table, counters, stale, _unflushed(state, todo))
            ports = 0
        else:
            ordered = _rendered(plane, fam, table)
            script = table_lines(state, ordered, table, mains=_unflushed(state, todo))
            ports = len(ordered)
        with deaf_while(plane._watch, True):  # our own, as a full sync (drift_watch.py)
            plane._run(fam, script, False)
    except ApplyError:  # logged where it failed; the state is dropped
        fam.resync = None
        raise
    took = time.perf_counter() - started
    log.debug("resync: table written", extra={
        "family": fam.family.label, "table": table, "ports": ports, "seconds": round(took, 3)})
    todo.ports += ports
    todo.work += took
    todo.longest = max(todo.longest, took)
    if not todo.tables:
        fam.resync = None
        heap.release_free_memory()  # every port rendered again: as after a full sync
        log.info("resync done", extra={
            "family": fam.family.label, "ports": todo.ports,
            "seconds": round(time.monotonic() - todo.started, 3),
            "work_seconds": round(todo.work, 3), "longest_part": round(todo.longest, 3)})


def _unflushed(state: TableState, todo: Resync) -> set[str]:
    """The main table's sets a periodic resync only adds to (none in a repair, which
    flushes them): every cluster IP, every endpoint's hairpin pair (1.1 million elements
    at 100,000 x 10), each added by the part of the shard its port is in, so the main
    table's part no longer takes seconds (module docstring)."""
    if todo.repair:
        return set()
    return {s.name for s in state.bases[0].sets if isinstance(s, Set)}


def _rendered(plane: _Plane, fam: NftFamily, table: str
              ) -> list[tuple[ServicePortKey, PortObjects]]:
    """The ports of `table`, rendered again from what was applied, each endpoint in the
    slot the state keeps it in; ApplyError (the state dropped) if one's chains do not
    render to what the state keeps."""
    state, last, ctx = fam.state, fam.last, fam.context
    assert state is not None and last is not None and ctx is not None
    ordered = []
    for key, kept in state.ports.items():
        if kept.table != table:
            continue
        p = render_port(last.ports[key], ctx, state.shards, kept_slots(kept))
        if KeptPort.chain_digests(p) != kept.chains:
            plane._failed(fam)
            log.error("resync: a port's rules are not what the state says the "
                      "kernel holds; next sync is full", extra={
                          "family": fam.family.label, "service_port": str(key),
                          "chains": [name for name, _ in kept.chains]})
            raise ApplyError(f"resync: the state of {key} differs from its rules")
        ordered.append((key, p))
    return ordered
