"""The nftables data plane's side of a restart over our own tables: what it reads back,
which ports it keeps unrendered by their input marks and writes the others, the kept
state (and the sweep of what nobody claims) it makes right after, and the input marks
it adds when idle (the pure parts: restart.py, marks.py).

A restart in two steps, when the kernel holds the bases and most ports' input marks:
the first sync renders and writes only the ports whose marks are not there (changed or
new while no agent ran, edited since their last whole write), deleting nothing it does
not replace; right after it (housekeeping, or the start of the next sync, whichever
comes first), the kept ports are rendered from what was applied and, if anything may
be nobody's any more (a port gone, a port written anew), what nobody claims is deleted:
restart_lines over every port, which then writes no port, against what the first sync
read plus what it wrote, the sets it did not read, and the counters that may be
nobody's (`_sweep_counters`). Between the two, the kernel holds what the cluster wants
plus, at most, what it held before for ports that are gone or changed: never less.

`NftablesDataPlane` (apply.py) has these as a mixin, `RestartSteps`, and keeps per
family an `NftFamily`: what it knows of the family's tables.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from proxy.dataplane.base import ApplyError
from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.common.family_sync import FamilyState
from proxy.dataplane.nftables.expressions import Unencodable
from proxy.dataplane.nftables.marks import marks_for
from proxy.dataplane.nftables.objects import CounterRef, Key
from proxy.dataplane.nftables.readback import Held, Unreadable
from proxy.dataplane.nftables.render import (
    FINGERPRINTS,
    OUR_TABLES,
    PORT_COUNTERS,
    TABLE,
    BaseObjects,
    PortObjects,
    render_port,
    table_family,
)
from proxy.dataplane.nftables.restart import (
    KernelTables,
    RestartCounts,
    base_sets,
    kept_by_marks,
    restart_lines,
    sets_needed,
    with_input_mark,
)
from proxy.dataplane.nftables.runner import NftError, NftRunner
from proxy.dataplane.nftables.transaction import (
    KeptPort,
    Named,
    Owners,
    Script,
    TableState,
    element_groups,
)
from proxy.dataplane.nftables.wire import element_keys
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family, ServicePortKey

log = logging.getLogger("proxy.dataplane.nftables.apply")  # the mode's one logger
T = TypeVar("T")
# Chains whose rules the sweep may read one by one (~13 us each: 3 ms for 256) however
# small the tables, before it dumps every counter instead.
NAMED_DUMPS_MIN = 256
# Input marks per part (`_write_marks`), each ~9 ms of work at 100,000 services (all of
# them: 4.4 s), which is what a change arriving meanwhile waits at most: with parts of
# 1,000, the first changes after a start at 100,000 waited 43 and 47 ms.
MARKS_PER_PART = 200
# Our tables, and the (table, name) of their chains and of their sets (-> "set"|"map").
_Names = tuple[set[str], set[tuple[str, str]], dict[tuple[str, str], str]]
_Written = tuple[Script | str, TableState]  # a first sync's script and the state it leaves


class NftFamily(FamilyState):
    """One family's tables as far as we know (`kept`: its TableState)."""

    def __init__(self, family: Family, shards: int) -> None:
        super().__init__(family)
        # Shard tables (render.py): set by each full sync, only ever grown while running
        # (shrinking would move every port for nothing).
        self.shards = shards
        # Ports rendered before the first full sync (render_ahead), with what they were
        # rendered from: the resolution itself, the context and the shard count.
        self.ahead: dict[ServicePortKey, tuple[ResolvedServicePort, RenderContext, int,
                                               PortObjects]] = {}
        # During a full sync over tables we have not written since they were read back:
        # the script that replaces them whole, if the kernel refuses to take them over.
        self.replacement: Callable[[], Script] | None = None
        # Whether the next full sync, if over our tables, may write only what differs
        # from what they hold (restart.py): the first one of this process alone, as
        # after a failure or drift the kernel is no longer trusted to be ours.
        self.restart = True
        self.restart_counts: RestartCounts | None = None  # of the sync being written
        # After a restart that kept ports by their input marks (restart.kept_by_marks):
        # those ports, whose kept state is still to be made (`_complete`), with their
        # marks; the names the kernel held then (tables, chains, sets); and, if a sweep
        # is due, the ports that restart wrote.
        self.pending: dict[ServicePortKey, Key] = {}  # -> its input mark
        self.restart_names: _Names = (set(), set(), {})
        self.sweep: dict[ServicePortKey, PortObjects] | None = None
        # For that sweep: what the restart read of the bases' sets (it holds that plus
        # what the restart wrote, so they are not read again), and the counters the
        # rules of the ports it wrote counted into before (None: not read; the sweep
        # then dumps every counter).
        self.restart_read: dict[Named, Held] = {}
        self.restart_counters: set[Named] | None = None
        # Ports that may still lack their input mark, for `_write_marks` to take a part
        # at a time (empty: list them again from the kept state).
        self.marks_todo: list[ServicePortKey] = []

    @property
    def state(self) -> TableState | None:
        kept: TableState | None = self.kept
        return kept

    @property
    def tables(self) -> str:
        """Our tables of this family, for messages: the main one and its shards."""
        return f"{table_family(self.family)} {TABLE} and {TABLE}-0..{self.shards - 1}"


class _Plane(Protocol):
    """What the steps use of the data plane (apply.NftablesDataPlane)."""

    runner: NftRunner
    _families: dict[Family, NftFamily]

    def _read_back(self, fam: NftFamily, what: str,
                   read: Callable[[Family, frozenset[str]], T]) -> T: ...

    def _failed(self, fam: NftFamily) -> None: ...

    def _run(self, fam: NftFamily, text: str | Script, full: bool) -> str: ...

    def _kernel_objects(self, fam: NftFamily
                        ) -> tuple[set[str], list[tuple[str, str]], dict[tuple[str, str], str]]:
        ...

    def _kernel_counters(self, fam: NftFamily) -> dict[tuple[str, str], int]: ...

    def _counters_named(self, fam: NftFamily, chains: Sequence[Named],
                        of: int) -> set[Named] | None: ...

    def _sweep_counters(self, fam: NftFamily, bases: Sequence[BaseObjects],
                        ports: Mapping[ServicePortKey, PortObjects],
                        chains: set[Named]) -> set[Named]: ...

    def _complete(self, fam: NftFamily) -> None: ...

    def _sweep(self, fam: NftFamily, bases: Sequence[BaseObjects],
               ports: Mapping[ServicePortKey, PortObjects], names: _Names) -> None: ...

    def _read_sets(self, fam: NftFamily, kernel: KernelTables,
                   sets: Sequence[tuple[str, str, tuple[str, ...], bool]]) -> bool: ...


class RestartSteps:
    """The restart's steps, as methods of the data plane (`_Plane`)."""

    def _complete(self: _Plane, fam: NftFamily) -> None:
        """The kept state of the ports a restart kept by their marks: rendered now, from
        what was applied, which their input marks say is what the kernel holds (O(ports),
        after the restart's sync, not before its rules); then the sweep, if one is due.
        Chains the kernel did not hold then (deleted by hand since their marks were
        written) make the next sync a full one (the sweep rewrites their ports)."""
        pending, fam.pending = fam.pending, {}
        sweep, fam.sweep = fam.sweep, None
        state, last, ctx = fam.kept, fam.last, fam.context
        if (not pending and sweep is None) or state is None or last is None or ctx is None:
            fam.restart_read, fam.restart_counters = {}, None
            return
        started = time.perf_counter()
        rendered: dict[ServicePortKey, PortObjects] = {}
        for key, mark in pending.items():
            p = render_port(last.ports[key], ctx, state.shards)
            if sweep is not None:
                rendered[key] = with_input_mark(p, mark)
                continue
            state.ports[key] = KeptPort.of(p).with_mark(mark)
            state.owners.add_rendered(key, p.elements)
            state.owners.add((p.table, FINGERPRINTS, mark), key, ())
        missing = {(p.table, c.name) for p in rendered.values() for c in p.chains} \
            if sweep is not None else state.chain_names()
        names, fam.restart_names = fam.restart_names, (set(), set(), {})
        missing -= names[1]
        log.info("restart: kept ports' state made", extra={
            "family": fam.family.label, "ports": len(pending), "chains_missing": len(missing),
            "seconds": round(time.perf_counter() - started, 3)})
        if sweep is not None:
            tables, chains, sets = names
            for p in sweep.values():  # what the restart wrote
                chains = chains | {(p.table, c.name) for c in p.chains}
                sets = {**sets, **{(p.table, s.name): s.kind for s in p.sets}}
            self._sweep(fam, state.bases, {**rendered, **sweep}, (tables, chains, sets))
        elif missing:
            self._failed(fam)
            log.warning("our tables lack chains their marks promised; the next sync is "
                        "full", extra={"family": fam.family.label, "tables": fam.tables,
                                       "missing": sorted(missing)[:5]})

    def _sweep(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
               ports: Mapping[ServicePortKey, PortObjects], names: _Names) -> None:
        """Every port now rendered (`ports`): what nobody claims deleted (restart_lines,
        which writes a port only if the kernel lacks what it writes), from the names
        the kernel holds (`names`: the restart's, with what it wrote), the sets (those
        the first sync read: what it read and what it wrote, `after_writing`; the others
        read now) and the counters (`_sweep_counters`); the state it leaves is the
        family's. A refusal leaves the next sync full (apply.py logs it). Nothing the
        first sync read is dumped again: the dumps of chain names, counters and large
        sets grow faster than the tables (nf_tables walks the list from its start for
        every message it fills), and nobody else writes our tables."""
        started = time.perf_counter()
        tables, chains, sets = names
        read, fam.restart_read = fam.restart_read, {}
        try:
            # Every set known: a port the first sync wrote may have left elements it no
            # longer has, and its new marks no longer tell (restart.sets_needed). What
            # that sync read is what it held then plus what it wrote; the rest is read.
            elements = after_writing(read, fam.kept.owners, base_sets(bases), fam.family) \
                if fam.kept is not None else {}
            kernel = KernelTables(tables, chains, sets,
                                  self._sweep_counters(fam, bases, ports, chains), elements)
            if not self._read_sets(fam, kernel, [s for s in base_sets(bases)
                                                 if (s[0], s[1]) not in elements]):
                self._failed(fam)
                return
            # A picked port's counter is named by its counter map's element, no rule.
            kernel.counters |= {(t, v.name) for (t, name), held in kernel.elements.items()
                                if name == PORT_COUNTERS for v in held.decoded.values()
                                if isinstance(v, CounterRef)}
            script, state, counts = restart_lines(bases, ports, kernel)
            if script:
                self._run(fam, script, False)
        except ApplyError:  # logged where it failed; the state is dropped
            return
        fam.kept = state
        log.info("restart: what nobody claims deleted", extra={
            "family": fam.family.label, "ports_written": counts.written,
            "elements_deleted": counts.deleted, "elements_added": counts.added,
            "seconds": round(time.perf_counter() - started, 3)})

    def _restart_by_marks(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
                          ports: Mapping[ServicePortKey, ResolvedServicePort],
                          ctx: RenderContext, names: _Names,
                          objects: Callable[[ServicePortKey, ResolvedServicePort],
                                            PortObjects]
                          ) -> tuple[dict[ServicePortKey, Key], _Written | None]:
        """The ports' input marks (marks.py), and, where the kernel holds the bases as
        written and most ports' marks (restart.kept_by_marks), what this restart writes:
        the other ports, rendered, against the maps and @fingerprints read back, without
        deleting what they do not claim (restart_lines without a sweep). The kept ports'
        state is made after the sync (`_complete`), and the sweep then if one is due.
        None: every port is to be rendered and diffed now."""
        tables, chains, sets = names
        if not any(name == FINGERPRINTS for _table, name in sets):
            return {}, None
        of = marks_for(ctx, fam.shards).of
        marks = {k: of(v) for k, v in sorted(ports.items())}
        kernel = KernelTables(tables, chains, sets, set())
        found = self._read_sets(fam, kernel, [s for s in base_sets(bases)
                                              if s[1] == FINGERPRINTS])
        kept_sweep = kept_by_marks(bases, marks, kernel) if found else None
        if kept_sweep is None or len(ports) - len(kept_sweep[0]) > len(ports) // 2:
            return marks, None  # most ports differ (another build): render them all
        kept, sweep = kept_sweep
        written = {k: with_input_mark(objects(k, ports[k]), marks[k])
                   for k in marks if k not in kept}
        if written and not self._read_sets(fam, kernel, [s for s in base_sets(bases)
                                                         if s[3]]):
            return marks, None
        if sweep:  # what the sweep needs of the kernel before this sync writes
            fam.restart_read = dict(kernel.elements)
            fam.restart_counters = self._counters_named(fam, [
                (p.table, c.name) for p in written.values() for c in p.chains
                if (p.table, c.name) in chains], len(chains))
        # Held counters not read (a dump that grows faster than the table): declaring
        # one that is there changes nothing.
        script, state, counts = restart_lines(bases, written, kernel, sweep=False)
        counts.kept += len(kept)
        fam.pending = {k: marks[k] for k in kept}
        fam.restart_names, fam.sweep = names, (written if sweep else None)
        fam.restart_counts = counts
        log.info("restart over our tables: writing what differs", extra={
            "family": fam.family.label, "ports_kept": counts.kept,
            "ports_written": counts.written, "elements_deleted": counts.deleted,
            "elements_added": counts.added, "rendered": len(written), "sweep": sweep})
        return marks, (script, state)

    def _sweep_counters(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
                        ports: Mapping[ServicePortKey, PortObjects],
                        chains: set[Named]) -> set[Named]:
        """The counters the sweep compares with what every port (`ports`) claims: their
        own (the first sync wrote them, or their marks say they are there), and those
        that may be nobody's: what the rules of the chains nobody claims count into, and
        what those of the ports the first sync wrote counted into before. Every counter
        dumped when those are too many chains to read one by one."""
        before, fam.restart_counters = fam.restart_counters, None
        claimed = {(b.table, c.name) for b in bases for c in b.chains} \
            | {(p.table, c.name) for p in ports.values() for c in p.chains}
        stale = self._counters_named(fam, sorted(chains - claimed), len(chains)) \
            if before is not None else None
        if before is None or stale is None:
            return set(self._kernel_counters(fam))
        return {(p.table, name) for p in ports.values() for name, _ in p.counters} \
            | before | stale

    def _counters_named(self: _Plane, fam: NftFamily, chains: Sequence[Named],
                        of: int) -> set[Named] | None:
        """The counters the rules of `chains` count into (runner.counters_named); None
        when they are more than an eighth of the `of` chains the kernel holds, where
        the dump of every counter costs less."""
        if len(chains) > max(NAMED_DUMPS_MIN, of // 8):
            return None
        return self._read_back(fam, "rules' counters",
                               lambda family, _ours: self.runner.counters_named(family, chains))

    def _read_sets(self: _Plane, fam: NftFamily, kernel: KernelTables,
                   sets: Sequence[tuple[str, str, tuple[str, ...], bool]]) -> bool:
        """The elements of `sets` (base_sets' tuples) the kernel has, read into
        `kernel.elements`; False when one cannot be read as this version declares it
        (the caller rewrites then)."""
        elements = dict(kernel.elements)
        kernel.elements = elements
        for table, name, types, is_map in sets:
            if (table, name) not in kernel.sets:
                continue
            read = functools.partial(_read_elements, self.runner, table, name, types, is_map)
            try:
                elements[table, name] = self._read_back(fam, f"{table} {name}", read)
            except Unreadable as exc:
                log.info("our tables hold a set this version reads otherwise; full "
                         "rewrite", extra={"family": fam.family.label, "table": table,
                                           "set": name, "reason": str(exc)})
                return False
        return True

    def _write_marks(self: _Plane, fam: NftFamily) -> None:
        """Input marks the kernel lacks (marks.py), for ports whose rules are what their
        input alone renders, when the agent is idle: MARKS_PER_PART ports per call and
        transaction, so that a change waits for one part at most; `fam.marks_todo`
        holds what is left for the next call. A part refused is logged, and the rest
        waits for the next interval: a restart renders the ports still without marks."""
        state, last, ctx = fam.kept, fam.last, fam.context
        if state is None or last is None or ctx is None:
            fam.marks_todo = []
            return
        if not fam.marks_todo:
            fam.marks_todo = [k for k, kept in state.ports.items() if _unmarked(kept)]
        part = fam.marks_todo[-MARKS_PER_PART:]
        del fam.marks_todo[-MARKS_PER_PART:]
        # A sync since the list was made may have changed or removed some of them.
        todo = [k for k in part if _unmarked(state.ports.get(k))]
        if not todo:
            return
        started = time.perf_counter()
        of = marks_for(ctx, state.shards).of
        new = {k: of(last.ports[k]) for k in todo}
        elements = [(state.ports[k].table, FINGERPRINTS, m, ()) for k, m in new.items()]
        try:
            self.runner.send(Script(functools.partial(element_groups, "add", elements),
                                    table_family(fam.family)), fam.family, OUR_TABLES)
        except (NftError, Unencodable) as exc:
            log.warning("could not add input marks; a restart will render those ports",
                        extra={"family": fam.family.label, "ports": len(new),
                               "error": str(exc)[-500:]})
            fam.marks_todo = []  # tried again at the next interval: one warning each
            return
        for key, mark in new.items():
            state.ports[key] = state.ports[key].with_mark(mark)
            state.owners.add((state.ports[key].table, FINGERPRINTS, mark), key, ())
        log.debug("input marks added", extra={
            "family": fam.family.label, "ports": len(new), "left": len(fam.marks_todo),
            "seconds": round(time.perf_counter() - started, 3)})

    def _restart_base(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
                      ports: Mapping[ServicePortKey, PortObjects], kernel: KernelTables
                      ) -> KernelTables | None:
        """`kernel` with the elements of the bases' maps and @fingerprints read back,
        and of their other sets where restart.sets_needed says so; None when one cannot
        be read as this version declares it (a full sync then)."""
        kernel.elements = {}
        first = [s for s in base_sets(bases) if s[3] or s[1] == FINGERPRINTS]
        if not self._read_sets(fam, kernel, first):
            return None
        if sets_needed(bases, ports, kernel) and not self._read_sets(
                fam, kernel, [s for s in base_sets(bases) if s not in first]):
            return None
        return kernel

    def _complete_all(self: _Plane) -> None:
        for fam in self._families.values():
            self._complete(fam)


def _unmarked(kept: KeptPort | None) -> bool:
    """A kept port whose input mark the kernel lacks, which it may have."""
    return kept is not None and kept.from_input and not kept.input_mark


def after_writing(read: Mapping[Named, Held], owners: Owners,
                  sets: Sequence[tuple[str, str, tuple[str, ...], bool]],
                  family: Family) -> dict[Named, Held]:
    """What the kernel holds of the sets in `read` (base_sets' tuples: `sets`) after a
    restart's first sync, which deletes a map's element only to add it with another
    value: what it read, and every element `owners` (its state) wants, with its value."""
    maps = {(t, name) for t, name, _types, is_map in sets if is_map}
    out = {k: Held(dict(h.decoded), set(h.raw)) for k, h in read.items()}
    for table, name, pairs in owners.sets():
        held = out.get((table, name))
        if held is None:
            continue
        if (table, name) in maps:
            held.decoded.update(pairs)
        else:
            held.raw.update(element_keys(family, [k for k, _v in pairs]))
    return out


def _read_elements(runner: NftRunner, table: str, set_name: str, types: Sequence[str],
                   is_map: bool, family: Family, _ours: frozenset[str]) -> Held:
    """`runner.elements` in the shape `_read_back` calls."""
    return runner.elements(family, table, set_name, types, is_map)
