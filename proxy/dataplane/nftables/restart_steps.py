"""The nftables data plane's side of a restart over our own tables: what it reads back,
whether it may keep every port unrendered, the kept state it makes after such a
restart, and the input marks it adds when idle (the pure parts: restart.py, marks.py).

`NftablesDataPlane` (apply.py) has these as a mixin, `RestartSteps`, and keeps per
family an `NftFamily`: what it knows of the family's tables.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.common.family_sync import FamilyState
from proxy.dataplane.nftables.expressions import Unencodable
from proxy.dataplane.nftables.marks import marks_for
from proxy.dataplane.nftables.objects import Key
from proxy.dataplane.nftables.readback import Held, Unreadable
from proxy.dataplane.nftables.render import (
    FINGERPRINTS,
    FINGERPRINTS_TYPES,
    TABLE,
    BaseObjects,
    PortObjects,
    our_tables,
    render_port,
    table_family,
)
from proxy.dataplane.nftables.restart import (
    KernelTables,
    RestartCounts,
    base_sets,
    sets_needed,
    unrendered,
)
from proxy.dataplane.nftables.runner import NftError, NftRunner
from proxy.dataplane.nftables.transaction import (
    KeptPort,
    Script,
    TableState,
    element_groups,
)
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family, ServicePortKey

log = logging.getLogger("proxy.dataplane.nftables.apply")  # the mode's one logger
T = TypeVar("T")
OUR_TABLES = frozenset(our_tables())


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
        # After a restart that found every port's input mark (restart.unrendered): the
        # ports whose kept state is still to be made (`_complete`), with their marks,
        # and the chains the kernel held then.
        self.pending: dict[ServicePortKey, Key] = {}  # -> its input mark
        self.restart_chains: set[tuple[str, str]] = set()

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

    def _complete(self, fam: NftFamily) -> None: ...


class RestartSteps:
    """The restart's steps, as methods of the data plane (`_Plane`)."""

    def _complete(self: _Plane, fam: NftFamily) -> None:
        """The kept state of the ports a restart kept unrendered (restart.unrendered):
        rendered now, from what was applied, which their input marks say is what the
        kernel holds (O(ports), after the restart's sync, not before its rules). Chains
        the kernel did not hold then (deleted by hand since their marks were written)
        make the next sync a full one."""
        pending, fam.pending = fam.pending, {}
        state, last, ctx = fam.kept, fam.last, fam.context
        if not pending or state is None or last is None or ctx is None:
            return
        started = time.perf_counter()
        for key, mark in pending.items():
            p = render_port(last.ports[key], ctx, state.shards)
            state.ports[key] = KeptPort.of(p).with_mark(mark)
            state.owners.add_rendered(key, p.elements)
            state.owners.add((TABLE, FINGERPRINTS, mark), key, ())
        missing = state.chain_names() - fam.restart_chains
        fam.restart_chains = set()
        log.info("restart: kept ports' state made", extra={
            "family": fam.family.label, "ports": len(pending), "chains_missing": len(missing),
            "seconds": round(time.perf_counter() - started, 3)})
        if missing:
            self._failed(fam)
            log.warning("our tables lack chains their marks promised; the next sync is "
                        "full", extra={"family": fam.family.label, "tables": fam.tables,
                                       "missing": sorted(missing)[:5]})

    def _unrendered(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
                    ports: Mapping[ServicePortKey, ResolvedServicePort], ctx: RenderContext,
                    names: tuple[set[str], set[tuple[str, str]], dict[tuple[str, str], str]]
                    ) -> tuple[dict[ServicePortKey, Key], bool]:
        """The ports' input marks (marks.py), and whether the kernel holds exactly what
        this sync would write by them (restart.unrendered): then nothing is rendered or
        written now, and each port's kept state is made after (`_complete`)."""
        tables, chains, sets = names
        if (TABLE, FINGERPRINTS) not in sets:
            return {}, False
        of = marks_for(ctx, fam.shards).of
        wanted = {k: of(v) for k, v in sorted(ports.items())}
        read = functools.partial(_read_elements, self.runner, TABLE, FINGERPRINTS,
                                 FINGERPRINTS_TYPES[fam.family], False)
        try:
            held = self._read_back(fam, f"{TABLE} {FINGERPRINTS}", read)
        except Unreadable:
            return wanted, False
        if not unrendered(bases, wanted, KernelTables(tables, chains, sets, set(),
                                                      {(TABLE, FINGERPRINTS): held})):
            return wanted, False
        fam.pending, fam.restart_chains = wanted, chains
        log.info("restart over our tables: writing what differs", extra={
            "family": fam.family.label, "ports_kept": len(ports), "ports_written": 0,
            "elements_deleted": 0, "elements_added": 0, "rendered": False})
        return wanted, True

    def _write_marks(self: _Plane, fam: NftFamily) -> None:
        """Each port's input mark the kernel lacks (marks.py), for a port whose rules are
        what its input alone renders: added in one transaction, when the agent is idle.
        One refused is logged and left: a restart then renders that port."""
        state, last, ctx = fam.kept, fam.last, fam.context
        if state is None or last is None or ctx is None:
            return
        todo = [k for k, kept in state.ports.items() if kept.from_input and not kept.input_mark]
        if not todo:
            return
        started = time.perf_counter()
        of = marks_for(ctx, state.shards).of
        new = {k: of(last.ports[k]) for k in todo}
        elements = [(TABLE, FINGERPRINTS, m, ()) for m in new.values()]
        try:
            self.runner.send(Script(functools.partial(element_groups, "add", elements),
                                    table_family(fam.family)), fam.family, OUR_TABLES)
        except (NftError, Unencodable) as exc:
            log.warning("could not add input marks; a restart will render those ports",
                        extra={"family": fam.family.label, "ports": len(new),
                               "error": str(exc)[-500:]})
            return
        for key, mark in new.items():
            state.ports[key] = state.ports[key].with_mark(mark)
            state.owners.add((TABLE, FINGERPRINTS, mark), key, ())
        log.debug("input marks added", extra={
            "family": fam.family.label, "ports": len(new),
            "seconds": round(time.perf_counter() - started, 3)})

    def _restart_base(self: _Plane, fam: NftFamily, bases: Sequence[BaseObjects],
                      ports: Mapping[ServicePortKey, PortObjects], kernel: KernelTables
                      ) -> KernelTables | None:
        """`kernel` with the elements of the bases' maps and @fingerprints read back,
        and of their other sets where restart.sets_needed says so; None when one cannot
        be read as this version declares it (a full sync then)."""
        elements: dict[tuple[str, str], Held] = {}
        kernel.elements = elements
        first = [s for s in base_sets(bases) if s[3] or s[1] == FINGERPRINTS]
        rest = [s for s in base_sets(bases) if s not in first]
        for sets in (first, rest):
            for table, name, types, is_map in sets:
                if (table, name) not in kernel.sets:
                    continue
                read = functools.partial(_read_elements, self.runner, table, name, types,
                                         is_map)
                try:
                    elements[table, name] = self._read_back(fam, f"{table} {name}", read)
                except Unreadable as exc:
                    log.info("our tables hold a set this version reads otherwise; full "
                             "rewrite", extra={"family": fam.family.label, "table": table,
                                               "set": name, "reason": str(exc)})
                    return None
            if not sets_needed(bases, ports, kernel):
                break
        return kernel

    def _complete_all(self: _Plane) -> None:
        for fam in self._families.values():
            self._complete(fam)


def _read_elements(runner: NftRunner, table: str, set_name: str, types: Sequence[str],
                   is_map: bool, family: Family, _ours: frozenset[str]) -> Held:
    """`runner.elements` in the shape `_read_back` calls."""
    return runner.elements(family, table, set_name, types, is_map)
