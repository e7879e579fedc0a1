"""The nftables data plane's side of a restart over our own tables: what it reads back,
which ports it keeps unrendered by their input marks and writes the others, and the
kept state (and the sweep of what nobody claims) it makes after, a part at a time (the
pure parts: restart.py, marks.py; the input marks added and deleted when idle:
mark_steps.py).

A restart in two steps, when the kernel holds the bases and most ports' input marks:
the first sync renders and writes only the ports whose marks are not there (changed or
new while no agent ran, edited since their last whole write), deleting nothing it does
not replace. Then, COMPLETE_PER_PART ports per housekeeping (the sync loop runs it when
idle, again at once while parts are left), the kept ports are rendered from what was
applied (12 s at 100,000 ports: in one step, a change waited for all of it). Changes go
between the parts: a changed port not made yet is made first (apply.py), and the
partial scripts meanwhile delete no element of the bases' sets, which a port not made
yet may own, and note what they delete and write (transaction.Unfinished). Once every
port is made: if anything may be nobody's any more (a port gone, a port written anew, a
kept port's chain missing), the sweep deletes what nobody claims (restart.sweep_lines)
against what the first sync read, what the syncs since left, the sets it did not read,
and the counters and @hairpin pairs that may be nobody's, from the rules of the chains
it deletes or the first sync replaced (`_sweep_refs`); else the deletions held back
are done (transaction.deferred_lines). Until then the kernel holds what the cluster
wants plus, at most, what it held before for ports that are gone or changed (a port
gone keeps its rules, also where a new service takes its address meanwhile with no
endpoints): never less.

`NftablesDataPlane` (apply.py) has these as a mixin, `RestartSteps`, and keeps per
family an `NftFamily`: what it knows of the family's tables (the input marks' steps'
too).
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Mapping, Sequence, Set
from typing import Protocol, TypeVar

from proxy.dataplane.base import ApplyError
from proxy.dataplane.common import heap
from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.common.family_sync import FamilyState
from proxy.dataplane.nftables.marks import marks_for
from proxy.dataplane.nftables.objects import CounterRef, Key, Value, Verdict
from proxy.dataplane.nftables.readback import Held, Keep, Unreadable
from proxy.dataplane.nftables.render import (
    FINGERPRINTS,
    HAIRPIN,
    PICK,
    PICKS,
    PORT_COUNTERS,
    TABLE,
    BaseObjects,
    PortObjects,
    destinations,
    hairpin_element,
    render_port,
    table_family,
)
from proxy.dataplane.nftables.restart import (
    KernelTables,
    RenderedAll,
    RestartCounts,
    Rewrite,
    base_sets,
    dispatch_keys,
    kept_by_marks,
    marks_aside,
    marks_back,
    picks_to_probe,
    render_all,
    restart_lines,
    rewrite_of,
    sets_needed,
    sweep_lines,
    with_input_mark,
)
from proxy.dataplane.nftables.resync_steps import Resync
from proxy.dataplane.nftables.rule_refs import RuleRefs
from proxy.dataplane.nftables.runner import NftRunner
from proxy.dataplane.nftables.transaction import (
    ElementKey,
    KeptPort,
    Named,
    Owners,
    Script,
    TableState,
    Unfinished,
    deferred_lines,
    kept_slots,
    resync_lines,
    rewrite_lines,
    unclaimed,
)
from proxy.dataplane.nftables.wire import element_keys
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family, ServicePortKey

log = logging.getLogger("proxy.dataplane.nftables.apply")  # the mode's one logger
T = TypeVar("T")
# Chains whose rules the sweep may read one by one (~13 us each: 3 ms for 256) however
# small the tables, before it dumps every counter instead.
NAMED_DUMPS_MIN = 256
# Where those rules are not read, @hairpin is read whole too (gone_hairpins), which walks
# the set from its start for every message it fills: ~33 ps x pairs squared (0.31 s at
# 100,000 IPv6 pairs, 33 s at 1,000,000), where a chain's rules read alone cost ~61 us
# with their decoding (2026-12-02, bench/RESULTS.md). Chains read one by one cost less
# than that whole read below pairs squared / PAIRS_SQUARED_PER_CHAIN of them.
PAIRS_SQUARED_PER_CHAIN = 2_000_000
# Kept ports whose state is made per part after a restart (`_complete`), each ~125 us at
# 100,000 services (all of them: 12.4 s in 1,563 parts of ~8 ms), which is what a change
# arriving meanwhile waits at most (in one step, the first change waited 12.1 s).
COMPLETE_PER_PART = 64
# Ports a restart renders between two returns of the freed heap (heap.py), the ports it
# renders and lets go leaving holes in glibc's (29 MiB by the end of 100,000, at the
# peak of an upgrade's restart); a return costs ~0.2-3 ms.
RENDERS_PER_TRIM = 5_000
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
        self.drop_restart()
        # Ports that may still lack their input mark, for `_write_marks` to take a part
        # at a time (empty: list them again from the kept state).
        self.marks_todo: list[ServicePortKey] = []
        self.marks_added = 0  # in this pass over marks_todo, for the log
        # A resync under way (periodic, or a repair), a table at a time (resync_steps.py).
        self.resync: Resync | None = None

    def drop_restart(self) -> None:
        """Nothing left of a restart's steps (none yet, done, or dropped by a full sync
        or a failure)."""
        # After a restart that kept ports by their input marks (restart.kept_by_marks):
        # those ports, whose kept state is still to be made (`_complete`), with their
        # marks; the names the kernel held then (tables, chains, sets); whether a sweep
        # is due; the chains of kept ports the kernel lacked; how many ports were made
        # and in how many seconds, for the log.
        self.pending: dict[ServicePortKey, Key] = {}  # -> its input mark
        self.restart_names: _Names = (set(), set(), {})
        self.sweep_due = False
        self.missing: set[ServicePortKey] = set()
        self.completed, self.completing = 0, 0.0
        # For that sweep: what the restart read of the bases' sets (it holds that plus
        # what the restart wrote, so they are not read again), and what the rules of
        # the ports it wrote referred to before: the counters they counted into, the
        # addresses they DNATed to (None: not read; the sweep then dumps every counter,
        # and reads @hairpin whole if a port not picked went or was written).
        self.restart_read: dict[Named, Held] = {}
        self.restart_refs: RuleRefs | None = None
        # The cluster-IP destinations of the ports that restart wrote (their elements
        # before it are what it read of them, `gone_hairpins`).
        self.restart_written: set[Key] = set()
        # After a restart that rendered every port and wrote nothing: the elements of
        # @fingerprints nobody claims (another build's input marks, restart.marks_aside)
        # left to delete, table -> keys as laid out; a part per housekeeping, and all of
        # them before any sync writes (`_delete_marks_aside`): a write may make one
        # untrue (a port edited, then back to the input it names, in another layout of
        # its slots), and a rollback to that build would then keep the port unrendered.
        # A full sync deletes what nobody claims itself.
        self.marks_aside: dict[str, list[bytes]] = {}

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

    def _rule_refs(self, fam: NftFamily, chains: Sequence[Named], of: int,
                   pairs: int) -> RuleRefs | None: ...

    def _sweep_refs(self, fam: NftFamily, state: TableState,
                    chains: set[Named]) -> RuleRefs | None: ...

    def _complete(self, fam: NftFamily, part: int | None = None) -> None: ...

    def _make_kept(self, fam: NftFamily, keys: Sequence[ServicePortKey]) -> None: ...

    def _finish(self, fam: NftFamily, state: TableState) -> None: ...

    def _sweep(self, fam: NftFamily, state: TableState, names: _Names) -> None: ...

    def _read_sets(self, fam: NftFamily, kernel: KernelTables,
                   sets: Sequence[tuple[str, str, tuple[str, ...], bool]]) -> bool: ...

    def _read_maps(self, fam: NftFamily, bases: Sequence[BaseObjects],
                   kernel: KernelTables, kept: Set[Key]) -> int | None: ...

    def _maps_as_owned(self, fam: NftFamily, bases: Sequence[BaseObjects],
                       kernel: KernelTables, owners: Owners) -> bool: ...

    def _old_dnat(self, fam: NftFamily, rendered: RenderedAll,
                  kernel: KernelTables) -> set[str] | None: ...


class RestartSteps:
    """The restart's steps, as methods of the data plane (`_Plane`)."""

    def _complete(self: _Plane, fam: NftFamily, part: int | None = None) -> None:
        """The kept state of `part` more of the ports a restart kept by their marks (all
        of them: None), and, once none is left, the restart's end (`_finish`)."""
        state = fam.kept
        if state is None or fam.last is None or fam.context is None:
            fam.drop_restart()
            return
        if fam.pending:
            self._make_kept(fam, list(itertools.islice(fam.pending, part)))
        if not fam.pending and state.unfinished is not None:
            self._finish(fam, state)

    def _make_kept(self: _Plane, fam: NftFamily, keys: Sequence[ServicePortKey]) -> None:
        """The kept state of `keys` (pending ports), rendered from what was applied,
        which their input marks say the kernel holds: O(ports), after the restart's
        sync, a part per housekeeping (or a changed port first, apply.py), so no
        change waits for all of them. Chains the kernel did not hold then (deleted by
        hand since their marks were written) are noted for `_finish`."""
        state, last, ctx = fam.kept, fam.last, fam.context
        assert state is not None and last is not None and ctx is not None
        started = time.perf_counter()
        held = fam.restart_names[1]
        for key in keys:
            mark = fam.pending.pop(key)
            p = render_port(last.ports[key], ctx, state.shards)
            state.ports[key] = KeptPort.of(p).with_mark(mark)
            state.owners.add_rendered(key, p.elements, p.picked)
            state.owners.add((p.table, FINGERPRINTS, mark), key, ())
            if any((p.table, c.name) not in held for c in p.chains):
                fam.missing.add(key)
        if fam.completed // RENDERS_PER_TRIM != (fam.completed + len(keys)) // RENDERS_PER_TRIM:
            heap.release_free_memory()
        fam.completed += len(keys)
        fam.completing += time.perf_counter() - started

    def _finish(self: _Plane, fam: NftFamily, state: TableState) -> None:
        """Every kept port in `state`: the sweep, if one is due or a kept port's chain
        was missing (`_sweep` writes those ports), or else the deletions the syncs
        meanwhile held back (transaction.Unfinished)."""
        names, sweep = fam.restart_names, fam.sweep_due or bool(fam.missing)
        log.info("restart: kept ports' state made", extra={
            "family": fam.family.label, "ports": fam.completed,
            "ports_missing_chains": len(fam.missing), "seconds": round(fam.completing, 3)})
        heap.release_free_memory()  # the rendered ports the kept state was made from
        try:
            if sweep:
                self._sweep(fam, state, names)
            else:
                script = deferred_lines(state)
                if script is not None:
                    self._run(fam, script, False)
        except ApplyError:  # logged where it failed; the state is dropped
            pass
        finally:
            state.unfinished = None
            fam.drop_restart()
            # Every kept port rendered, and what the restart read let go: as after a
            # full sync (measured in bench/RESULTS.md).
            heap.release_free_memory()

    def _sweep(self: _Plane, fam: NftFamily, state: TableState, names: _Names) -> None:
        """Every port now in `state`: what nobody claims deleted (restart.sweep_lines),
        from the names the kernel held at the restart (`names`) less what the syncs
        since deleted, the sets (those the first sync read: what it read, what is
        wanted now and what the syncs since held back, `after_writing`; the others
        read now; @hairpin's pairs that may be nobody's asked for one by one,
        `gone_hairpins`) and the counters (`_sweep_refs`). A refusal leaves the next sync
        full (apply.py logs it). Nothing the first sync read is dumped again: the dumps
        of chain names, counters and large sets grow faster than the tables
        (nf_tables walks the list from its start for every message it fills), and
        nobody else writes our tables."""
        started = time.perf_counter()
        assert state.unfinished is not None
        gone = state.unfinished.gone
        tables, chains, sets = names
        chains = chains - gone
        sets = {k: kind for k, kind in sets.items() if k not in gone}
        bases = state.bases
        refs = self._sweep_refs(fam, state, chains)
        # (From what the restart read, before after_writing brings it up to date.)
        left = gone_hairpins(fam.restart_read, state.owners, fam.restart_written,
                             None if refs is None else refs.addresses) \
            if (TABLE, HAIRPIN) in sets and (TABLE, HAIRPIN) not in fam.restart_read else None
        elements = after_writing(fam.restart_read, state.owners, base_sets(bases),
                                 fam.family, state.unfinished.kernel)
        if left is not None:
            # (With the pairs the syncs since let go of: their deletions held back.)
            left |= {k for (t, name, k), held in state.unfinished.kernel.items()
                     if (t, name) == (TABLE, HAIRPIN) and held is not None}
            keys = sorted(left)
            elements[TABLE, HAIRPIN] = self._read_back(
                fam, f"{TABLE} {HAIRPIN}",
                lambda family, _ours: self.runner.probe(family, TABLE, HAIRPIN, keys))
        counters = set(self._kernel_counters(fam)) if refs is None else refs.counters
        kernel = KernelTables(tables, chains, sets, counters - gone, elements)
        if not self._read_sets(fam, kernel, [s for s in base_sets(bases)
                                             if (s[0], s[1]) not in elements]):
            self._failed(fam)
            return
        # A picked port's counter is named by its counter map's element, no rule: those
        # of the elements nobody holds as they are (the port that does claims it).
        kernel.counters |= {(t, v.name) for (t, name), held in kernel.elements.items()
                            if name == PORT_COUNTERS for k, v in held.decoded.items()
                            if isinstance(v, CounterRef) and state.owners.held((t, name, k)) != v}
        # Kept ports whose chains were missing (deleted by hand since their marks were
        # written), rendered as they are kept, to be written whole.
        last, ctx = fam.last, fam.context
        assert last is not None and ctx is not None
        rewrite = [render_port(last.ports[k], ctx, state.shards, kept_slots(state.ports[k]))
                   for k in sorted(fam.missing) if k in state.ports]
        script, counts = sweep_lines(state, kernel, rewrite)
        if script:
            self._run(fam, script, False)
        log.info("restart: what nobody claims deleted", extra={
            "family": fam.family.label, "ports_written": counts.written,
            "elements_deleted": counts.deleted, "elements_added": counts.added,
            "hairpins_probed": None if left is None else len(left),
            "seconds": round(time.perf_counter() - started, 3)})

    def _restart_by_marks(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
                          ports: Mapping[ServicePortKey, ResolvedServicePort],
                          ctx: RenderContext, names: _Names,
                          objects: Callable[[ServicePortKey, ResolvedServicePort],
                                            PortObjects]
                          ) -> tuple[dict[ServicePortKey, Key], _Written | None]:
        """The ports' input marks the kernel holds (marks.py), and, where the kernel
        holds the bases as written and most ports' marks (restart.kept_by_marks), what
        this restart writes: the other ports, rendered (with their marks, in the same
        transaction), against the maps and @fingerprints read back, without deleting
        what they do not claim (restart_lines without a sweep). The kept ports' state is
        made after the sync (`_complete`), and the sweep then if one is due. None: every
        port is to be rendered and diffed now, those marks with them (true of what the
        kernel then holds: a port kept, or written from its input alone); the other
        ports' marks come when idle (`_write_marks`): 100,000 of them added in an
        upgrade's transaction were ~25 MiB of its peak."""
        tables, chains, sets = names
        if not any(name == FINGERPRINTS for _table, name in sets):
            return {}, None
        of = marks_for(ctx, fam.shards).of
        marks = {k: of(v) for k, v in sorted(ports.items())}
        kernel = KernelTables(tables, chains, sets, set())
        found = self._read_sets(fam, kernel, [s for s in base_sets(bases)
                                              if s[1] == FINGERPRINTS])
        kept_sweep = kept_by_marks(bases, marks, kernel) if found else None
        if kept_sweep is None:
            return {}, None
        kept, sweep = kept_sweep
        held = {k: marks[k] for k in kept}
        if len(ports) - len(kept) > len(ports) // 2:
            return held, None  # most ports differ (another build): render them all
        written = {k: with_input_mark(objects(k, ports[k]), marks[k])
                   for k in marks if k not in kept}
        # The maps: what the ports written replace, and what a port gone while no agent
        # ran left, which a change before the sweep may replace (transaction.Unfinished).
        probed = self._read_maps(fam, bases, kernel, {
            d for k in kept for d in destinations(ports[k])}) if written or sweep else 0
        if probed is None:
            return held, None
        if sweep:  # what the sweep needs of the kernel before this sync writes
            fam.restart_read = dict(kernel.elements)
            fam.restart_written = {d for k in written for d in destinations(ports[k])}
            fam.restart_refs = self._rule_refs(fam, [
                (p.table, c.name) for p in written.values() for c in p.chains
                if (p.table, c.name) in chains], len(chains),
                sum(len(rsp.endpoints) for rsp in ports.values()))
        # Held counters not read (a dump that grows faster than the table): declaring
        # one that is there changes nothing.
        script, state, counts = restart_lines(bases, written, kernel, sweep=False)
        counts.kept += len(kept)
        fam.pending = {k: marks[k] for k in kept}
        fam.restart_names, fam.sweep_due = names, sweep
        if kept or sweep:  # kept ports' elements are not in the state yet (Unfinished)
            shared = base_sets(bases)
            state.unfinished = Unfinished(
                frozenset((t, name) for t, name, _types, is_map in shared if not is_map),
                frozenset(chains | set(sets)),
                {(t, name): kernel.elements[t, name].decoded
                 for t, name, _types, is_map in shared if is_map and (t, name) in kernel.elements})
        fam.restart_counts = counts
        log.info("restart over our tables: writing what differs", extra={
            "family": fam.family.label, "ports_kept": counts.kept,
            "ports_written": counts.written, "elements_deleted": counts.deleted,
            "elements_added": counts.added, "rendered": len(written), "sweep": sweep,
            "pick_elements_probed": probed})
        return marks, (script, state)

    def _sweep_refs(self: _Plane, fam: NftFamily, state: TableState,
                    chains: set[Named]) -> RuleRefs | None:
        """What the rules the sweep deletes or the first sync replaced referred to: of
        the chains nobody claims, and of the ports the first sync wrote as they were
        (fam.restart_refs). Their counters are those that may be nobody's, which the
        sweep compares with what `state` claims (not the claimed ones too: a set of them
        all was ~8 MiB at the sweep's peak at 100,000 services, and an `add` of one held
        changes nothing); their addresses, the @hairpin pairs that may be nobody's
        (`gone_hairpins`). None when those are too many chains to read one by one (every
        counter dumped then)."""
        before, fam.restart_refs = fam.restart_refs, None
        stale = self._rule_refs(fam, unclaimed(chains, state.claimed_chains()), len(chains),
                                state.owners.count(TABLE, HAIRPIN)) \
            if before is not None else None
        if before is None or stale is None:
            return None
        stale.update(before)
        return stale

    def _rule_refs(self: _Plane, fam: NftFamily, chains: Sequence[Named], of: int,
                   pairs: int) -> RuleRefs | None:
        """What the rules of `chains` refer to (runner.rule_refs); None when reading them
        one by one costs more than what is read instead: the dump of every counter (more
        than an eighth of the `of` chains the kernel holds), and @hairpin's whole read
        (~`pairs`, the pairs wanted: PAIRS_SQUARED_PER_CHAIN)."""
        if len(chains) > max(NAMED_DUMPS_MIN, of // 8, pairs * pairs // PAIRS_SQUARED_PER_CHAIN):
            return None
        return self._read_back(fam, "rules' references",
                               lambda family, _ours: self.runner.rule_refs(family, chains))

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
            held = _readable(self, fam, table, name, functools.partial(
                _read_elements, self.runner, table, name, types, is_map))
            if held is None:
                return False
            elements[table, name] = held
        return True

    def _read_maps(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
                   kernel: KernelTables, kept: Set[Key]) -> int | None:
        """The bases' maps into `kernel.elements`: read whole, but the pick maps, of
        which the elements a port written or gone may have left are asked for one by
        one (restart.picks_to_probe: `kept`, the destinations of the ports kept by their
        marks, are not); how many were asked for. None when one cannot be read as this
        version declares it (`_read_sets`)."""
        maps = [s for s in base_sets(bases) if s[3]]
        if not self._read_sets(fam, kernel, [s for s in maps if not s[1].startswith(PICKS)]):
            return None
        types = {(t, name): key for t, name, key, _is_map in maps}
        elements = dict(kernel.elements)
        asked = 0
        for (table, name), keys in picks_to_probe(kernel, kept).items():
            asked += len(keys)
            held = _readable(self, fam, table, name, functools.partial(
                _probe_map, self.runner, table, name, keys, types.get((table, name), ()))
            ) if keys else Held(partial=True)
            if held is None:
                return None
            elements[table, name] = held
        kernel.elements = elements
        return asked

    def _restart_all(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
                     ports: Mapping[ServicePortKey, PortObjects], kernel: KernelTables
                     ) -> tuple[Script | str, TableState, RestartCounts] | None:
        """A restart that renders every port (`ports` renders each as it is asked: only
        those the kernel does not hold as rendered are kept, restart.render_all), as the
        diff from what `kernel` holds: @fingerprints read first, then the bases' maps
        (the pick maps' elements of the ports written, `_read_maps`), and their other
        sets where restart.sets_needed says so (@hairpin's pairs asked for one by one
        where `gone_hairpins` says which). None when one cannot be read as this version
        declares it (a full sync then)."""
        kernel.elements = {}
        first = [s for s in base_sets(bases) if s[3] or s[1] == FINGERPRINTS]
        if not self._read_sets(fam, kernel, [s for s in first if not s[3]]):
            return None
        rewrite = rewrite_of(bases, ports, kernel)
        if rewrite is not None:
            # Another build's ports: every port written again, each rendered as the
            # script is read (nothing else read back).
            each = {k: functools.partial(ports.__getitem__, k) for k in ports}
            fam.marks_aside = {}
            if rewrite is Rewrite.TABLES:
                parts, state = resync_lines(bases, each, kernel.chains, kernel.sets,
                                            kernel.counters)
                return parts, state, RestartCounts(written=len(ports), tables=len(bases),
                                                   rewrite=rewrite)
            whole, state = rewrite_lines(bases, each, kernel.chains, kernel.sets,
                                         kernel.counters, kernel.tables)
            return whole, state, RestartCounts(written=len(ports), tables=len(bases),
                                               rewrite=rewrite)
        rendered = render_all(bases, ports, kernel)
        heap.release_free_memory()  # the rendered ports it kept and let go
        as_owned = not rendered.written \
            and self._maps_as_owned(fam, bases, kernel, rendered.state.owners)
        if not as_owned and self._read_maps(fam, bases, kernel, rendered.intact) is None:
            return None
        if sets_needed(rendered, kernel):
            rest = [s for s in base_sets(bases) if s not in first]
            # (Shard tables that go, the shard count having shrunk, are read no map of.)
            left = gone_hairpins(kernel.elements, rendered.state.owners,
                                 dispatch_keys(p for _key, p in rendered.written)
                                 - rendered.intact, self._old_dnat(fam, rendered, kernel)) \
                if (TABLE, HAIRPIN) in kernel.sets \
                and kernel.tables <= {b.table for b in bases} else None
            if left is not None:
                keys = sorted(left)
                kernel.elements[TABLE, HAIRPIN] = self._read_back(
                    fam, f"{TABLE} {HAIRPIN}",
                    lambda family, _ours: self.runner.probe(family, TABLE, HAIRPIN, keys))
                rest = [s for s in rest if (s[0], s[1]) != (TABLE, HAIRPIN)]
            if not self._read_sets(fam, kernel, rest):
                return None
        made = (rendered.state, rendered.written)
        # Nothing written (an upgrade over an unchanged cluster): the other build's marks
        # stay true, and go after (`_delete_marks_aside`), not in this transaction, which
        # then has nothing to do (deleting their 100,000 at 100,000 services was ~25 MiB
        # of its peak). Where anything else is written, they go with it.
        aside = marks_aside(rendered.state, kernel) if as_owned else {}
        script, state, counts = restart_lines(bases, dict(rendered.written), kernel,
                                              made=made)
        if aside and script:
            marks_back(aside, kernel)
            aside = {}
            script, state, counts = restart_lines(bases, dict(rendered.written), kernel,
                                                  made=made)
        fam.marks_aside = aside
        counts.kept += rendered.kept
        counts.aside = sum(map(len, aside.values()))
        return script, state, counts

    def _old_dnat(self: _Plane, fam: NftFamily, rendered: RenderedAll,
                  kernel: KernelTables) -> set[str] | None:
        """The addresses the kernel's rules DNAT to that the restart replaces or
        deletes: of the chains of the ports it writes that the kernel holds, and of
        those nobody claims (`gone_hairpins`); None where they cannot tell (rule_refs.py)
        or are too many to read one by one."""
        chains = [(p.table, c.name) for _key, p in rendered.written for c in p.chains
                  if (p.table, c.name) in kernel.chains]
        chains += unclaimed(kernel.chains, rendered.state.claimed_chains())
        refs = self._rule_refs(fam, chains, len(kernel.chains),
                               rendered.state.owners.count(TABLE, HAIRPIN))
        return None if refs is None else refs.addresses

    def _maps_as_owned(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
                       kernel: KernelTables, owners: Owners) -> bool:
        """Whether the bases' maps (but the pick maps) hold what `owners` want and nothing
        else, checked as they are read, where nothing is to be written: then the diff
        has nothing to read in them. Only what differs is held (held whole, the 200,000
        dispatch and counter elements of an unchanged upgrade at 100,000 services put
        its peak 117 MiB higher). False, to read them whole, if one cannot be read or
        is not there (`kernel`'s names)."""
        for table, name, types, is_map in base_sets(bases):
            if not is_map or name.startswith(PICKS):
                continue
            if (table, name) not in kernel.sets:
                return False
            seen = 0

            def unwanted(key: Key, value: Value, named: Named = (table, name)) -> bool:
                nonlocal seen
                seen += 1
                return owners.held((*named, key)) != value

            held = _readable(self, fam, table, name, functools.partial(
                _read_elements, self.runner, table, name, types, True, keep=unwanted))
            if held is None or held.decoded \
                    or seen != sum(1 for _ in owners.items(table, name)):
                return False
        return True

    def _complete_parts(self: _Plane) -> bool:
        """A part (COMPLETE_PER_PART ports) of each family's restart left to complete;
        whether any is left after it."""
        for fam in self._families.values():
            self._complete(fam, COMPLETE_PER_PART)
        return any(fam.pending for fam in self._families.values())


def _readable(plane: _Plane, fam: NftFamily, table: str, name: str,
              read: Callable[[Family, frozenset[str]], Held]) -> Held | None:
    """`read` of set `name` of `table` (`_read_back`); None, logged, when the kernel
    holds it in a layout this version reads otherwise (its caller rewrites then)."""
    try:
        return plane._read_back(fam, f"{table} {name}", read)
    except Unreadable as exc:
        log.info("our tables hold a set this version reads otherwise; full rewrite",
                 extra={"family": fam.family.label, "table": table, "set": name,
                        "reason": str(exc)})
        return None


def after_writing(read: dict[Named, Held], owners: Owners,
                  sets: Sequence[tuple[str, str, tuple[str, ...], bool]],
                  family: Family, touched: Mapping[ElementKey, Value | None]
                  ) -> dict[Named, Held]:
    """What the kernel holds of the sets in `read` (base_sets' tuples: `sets`) once a
    restart's kept ports are all in its state: what the restart read, every element
    `owners` (the state) wants, with its value (the restart wrote them, or their marks
    say they are there), and, for the elements the syncs since touched, what they left
    (`touched`: transaction.Unfinished.kernel). `read` itself, brought up to date: a
    copy of it (the dispatch and counter maps, @fingerprints) put the sweep's peak 40
    MiB higher at 100,000 x 10, and what the restart read is not needed after."""
    maps = {(t, name) for t, name, _types, is_map in sets if is_map}
    for (table, name), asked in read.items():
        if asked.partial:  # only the keys asked for: each now as its owner has it, if any
            for key in asked.decoded:
                value = owners.held((table, name, key))
                if value is not None:
                    asked.decoded[key] = value
    for table, name, pairs in owners.sets():
        held = read.get((table, name))
        if held is None or held.partial:
            continue
        if (table, name) in maps:
            held.decoded.update(pairs)
        else:
            held.raw.update(element_keys(family, [k for k, _v in pairs]))
    for (table, name, key), value in touched.items():
        held = read.get((table, name))
        if held is None:
            continue
        raw = element_keys(family, [key])[0] if (table, name) not in maps else None
        if value is None:
            held.decoded.pop(key, None)
            if raw is not None:
                held.raw.discard(raw)
        elif raw is None:
            held.decoded[key] = value
        elif key not in held.decoded:  # a set read whole is in `decoded`
            held.raw.add(raw)
    return read


def gone_hairpins(read: Mapping[Named, Held], owners: Owners, written: Set[Key],
                  dnat: Set[str] | None) -> set[Key] | None:
    """The @hairpin elements the ports gone or changed while no agent ran may have left
    (the sweep asks for these one by one rather than dump @hairpin, which walks the set
    from its start for every message: 70 s at 100,000 x 10, the data plane held
    meanwhile): those of the endpoints `owners` want no more among the addresses in the
    pick elements a restart read (`read`) and those the rules of the ports gone or
    written DNATed to (`dnat`, rule_refs.py). `dnat` None: those rules were not read, or
    one DNATs to a map's value; then None if a port that was not picked is gone or was
    written (a dispatch element read, to another chain than a pick chain, that `owners`
    do not want as it was, or of a destination in `written`: the ports the restart
    wrote), as its endpoints before are in no map read: @hairpin is read whole."""
    addresses: set[str] = set(dnat or ())
    for (table, name), held in read.items():
        if name.startswith(PICKS):  # values: (address, port)
            addresses.update(v[0] for v in held.decoded.values()
                             if type(v) is tuple and isinstance(v[0], str))
        elif dnat is None and any(
                isinstance(value, Verdict) and not value.chain.startswith(PICK)
                and (key in written or owners.held((table, name, key)) != value)
                for key, value in held.decoded.items()):
            return None
    return {hairpin_element(a) for a in owners.unowned_pairs(TABLE, HAIRPIN, addresses)}


def _read_elements(runner: NftRunner, table: str, set_name: str, types: Sequence[str],
                   is_map: bool, family: Family, _ours: frozenset[str],
                   keep: Keep | None = None) -> Held:
    """`runner.elements` in the shape `_read_back` calls."""
    return runner.elements(family, table, set_name, types, is_map, keep)


def _probe_map(runner: NftRunner, table: str, name: str, keys: Sequence[Key],
               types: Sequence[str], family: Family, _ours: frozenset[str]) -> Held:
    """`runner.probe` of a map in the shape `_read_back` calls."""
    return runner.probe(family, table, name, keys, types, True)
