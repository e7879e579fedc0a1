"""The nftables data plane: desired state in, nf_tables transactions out.

One `NftablesDataPlane` per agent, called from one worker thread, in that thread's
network namespace. Per family it keeps the `TableState` it last applied:

- a full sync (the first one, `full=True`, after any failure, after drift, or when this
  node's addresses changed) reads back the names of what our table holds and rewrites
  all of it: in one transaction (transaction.full_lines: the rendered ports' chains,
  rules and elements as statements the encoder frames one by one, never a text held
  whole; ports rendered ahead while the cluster listed, `render_ahead`, taken as they
  are if still current), or over tables this process wrote, the same shard count, a
  transaction per table (transaction.resync_lines: a full sync the loop asks for over
  tables it knows, or a restart over tables whose ports another build rendered
  otherwise, restart.rewrite_of). The periodic resync and the repair after drift
  are not full syncs here, where they can help it: a table per housekeeping part,
  changes going between (resync_steps.py);
- a partial sync renders only the service ports whose snapshot entry is not the very
  object applied last time (found in O(changes): `DesiredState.changed_since`), and
  sends only their chains and elements; a port whose endpoints alone changed (the
  model's `endpoint_delta`) and that balances through slot maps is rendered from the
  endpoints that changed only (port_edit.py: O(change), not O(service)).

Both are encoded here into netlink (wire.py) rather than handed to nft, which would
first read our tables back (per change) and parse the text in C into a heap of its own
(per full sync: 10,000 services took 3.7 s in `nft -f`, 1.1 s encoded and sent). nft
stays the fallback: for a script outside the encoder's dialect, and for a full script
the kernel refused from the encoder (the refusal left nothing changed; if nft is
refused too, the refusal is real, and if nft is not, the encoder has a bug, logged).

A transaction is atomic: if nf_tables refuses it, the previous rules stay, the state is
dropped and the next sync is a full one. A full one refused over tables this process has
not written since it read them back (another version's, at start) is sent again as their
replacement, deleted and written anew in one transaction (transaction.replace_lines):
over a version that gave a set another type or a hooked chain another priority, the
first sync converges, with no moment without rules. Our tables are `ip sliceproxy` and `ip6
sliceproxy` and their shards; nothing outside them is ever touched.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import TypeVar

from proxy.dataplane.base import (
    ApplyError,
    DataplaneOptions,
    GiveWay,
    PortTraffic,
    TrafficRead,
    offer_lock,
)
from proxy.dataplane.common import heap
from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.common.drift_watch import LOST, NftablesListener
from proxy.dataplane.common.family_sync import FamilySyncPlane, Written
from proxy.dataplane.common.netlink_constants import NFPROTO
from proxy.dataplane.common.nfnetlink import nat_unsupported
from proxy.dataplane.common.rtnetlink import node_addresses
from proxy.dataplane.nftables.counters import read_traffic
from proxy.dataplane.nftables.expressions import Unencodable
from proxy.dataplane.nftables.mark_steps import MarkSteps
from proxy.dataplane.nftables.objects import Key
from proxy.dataplane.nftables.port_edit import render_edit
from proxy.dataplane.nftables.render import (
    MAX_SHARDS,
    OUR_TABLES,
    TABLE,
    PortObjects,
    our_tables,
    render_base,
    render_port,
    render_shard,
    shard_table,
    shards_for,
    table_family,
)
from proxy.dataplane.nftables.restart import (
    KernelTables,
    Rewrite,
    with_input_mark,
)
from proxy.dataplane.nftables.restart_steps import RENDERS_PER_TRIM, NftFamily, RestartSteps
from proxy.dataplane.nftables.resync_steps import ResyncSteps
from proxy.dataplane.nftables.runner import NftError, NftRunner, unavailable
from proxy.dataplane.nftables.transaction import (
    PortEdit,
    Script,
    TableState,
    first_lines,
    full_lines,
    kept_slots,
    partial_lines,
    replace_lines,
    resync_lines,
)
from proxy.model.snapshot import DesiredState, ResolvedServicePort
from proxy.model.types import Family, IPAddress, ServicePortKey

log = logging.getLogger(__name__)
T = TypeVar("T")
# Kept ports a traffic reading makes during a restart's completion (~125 us each at
# 100,000 services): a small cluster's all, a large one's the next 0.1 s of them.
READ_COMPLETES = 1_000


class NftablesUnavailable(Exception):
    """This host cannot run the nftables mode (tools or kernel support missing)."""


class NftablesDataPlane(FamilySyncPlane[NftFamily], RestartSteps, MarkSteps, ResyncSteps):
    """`runner` and `addresses` replace libnftables/nft and the netlink address dump in
    tests; `probe=False` skips the kernel's NAT check (done by the caller); `shards`
    is the least number of shard tables (more as the service ports need them)."""

    mode = "nftables"

    def __init__(self, options: DataplaneOptions, *, runner: NftRunner | None = None,
                 addresses: Callable[[], Sequence[IPAddress]] | None = None,
                 clear_conntrack: bool = True, probe: bool = True, shards: int = 1) -> None:
        if not 1 <= shards <= MAX_SHARDS:
            raise ValueError(f"shards must be 1 to {MAX_SHARDS}, not {shards}")
        self.min_shards = shards
        why = unavailable() if runner is None else None
        if why:
            raise NftablesUnavailable(f"{why}; install Debian's nftables package or use "
                                      "--proxy-mode iptables")
        super().__init__(options, clear_conntrack, addresses or node_addresses)
        self.runner = runner or NftRunner()
        refused: list[str] = []
        for family in options.families:
            reason = nat_unsupported(family) if probe else None
            if reason:
                refused.append(reason)
                log.warning("family dropped: nf_tables cannot do NAT for it here",
                            extra={"family": family.label, "reason": reason})
                continue
            self._families[family] = NftFamily(family, shards)
        if not self._families:
            raise NftablesUnavailable(
                f"this kernel's nf_tables cannot do NAT ({'; '.join(refused) or 'no family'})"
                "; load nft_chain_nat or use --proxy-mode iptables or ipvs")
        self._foreign: list[str] = []  # foreign transactions on our tables, not yet checked
        self._foreign_lock = threading.Lock()
        self._notify_drift: Callable[[str], None] | None = None
        self._drift_later = False  # a check held back by a restart's completion

    # --- sync: render and write (the loop is FamilySyncPlane's) -----------------------------

    def _render_partial(self, fam: NftFamily,
                        ports: Mapping[ServicePortKey, ResolvedServicePort],
                        changed: set[ServicePortKey], ctx: RenderContext
                        ) -> tuple[Script | str, TableState]:
        table: TableState = fam.kept
        if fam.marks_aside:  # none outlives a write (restart_steps.NftFamily)
            self._delete_marks_aside(fam, None)
        # A port a restart kept whose state is not made yet: made now, from what was
        # applied, so that the change is a diff from what the kernel holds.
        self._make_kept(fam, [k for k in changed if k in fam.pending])
        script = partial_lines(table, {k: self._render_change(fam, table, ports.get(k), ctx)
                                       for k in changed})
        return script or "", table

    def _render_change(self, fam: NftFamily, table: TableState,
                       rsp: ResolvedServicePort | None, ctx: RenderContext
                       ) -> PortObjects | PortEdit | None:
        """A changed port: only its endpoints that changed when the model says which and
        the port balances through slot maps (port_edit.py, O(change)), else whole."""
        if rsp is None:
            return None
        kept = table.ports.get(rsp.key)
        applied = fam.applied(rsp.key)
        if kept is not None and applied is not None:
            delta = rsp.endpoint_delta(applied[0])
            edit = render_edit(applied[0], rsp, delta, ctx, kept) if delta else None
            if edit is not None:
                return edit
        return render_port(rsp, ctx, table.shards, kept_slots(kept))

    def _write(self, fam: NftFamily, text: str | Script, full: bool) -> Written:
        try:
            applier = self._run(fam, text, full) if text else "none"
        finally:
            fam.replacement = None  # it may hold every port's objects
        lines = text.count("\n") if isinstance(text, str) else text.count or 0
        details: dict[str, object] = {"applier": applier}
        counts, fam.restart_counts = fam.restart_counts, None
        if counts is not None:
            restart = {"ports_kept": counts.kept, "ports_written": counts.written,
                       "elements_deleted": counts.deleted, "elements_added": counts.added}
            if counts.rewrite is not None:  # another build's ports, every table rewritten
                restart["tables_rewritten"] = counts.tables
                restart["transactions"] = \
                    counts.tables if counts.rewrite is Rewrite.TABLES else 1
            details["restart"] = restart
        return Written(lines, details)

    def _after_sync(self, full: bool) -> None:
        if full:  # the script and batch were tens of MB: give the heap back
            heap.release_free_memory()

    def _render_full(self, fam: NftFamily, state: DesiredState,
                     ctx: RenderContext) -> tuple[Script | str, TableState]:
        tables, chains, sets = self._kernel_objects(fam)
        ports = {k: v for k, v in state.ports.items() if k.family is fam.family}
        shards = max(fam.shards, shards_for(len(ports)))
        bases = [render_base(ctx), *(render_shard(ctx, shard_table(i)) for i in range(shards))]
        ahead, fam.ahead = fam.ahead, {}

        def objects(key: ServicePortKey, rsp: ResolvedServicePort) -> PortObjects:
            done = ahead.pop(key, None)
            if done is not None and done[0] is rsp and done[1] == ctx and done[2] == shards:
                return done[3]
            return render_port(rsp, ctx, shards)

        fam.shards = shards
        fam.drop_restart()  # every port's state is made anew
        fam.resync = None  # and every table written
        # Only the process's first full sync may be a restart's diff (NftFamily).
        restart, fam.restart = fam.restart and fam.state is None, False
        if not tables:
            # None of our tables yet (a node's first start): in parts, each port
            # rendered as the script is read, the kernel taking one part while the
            # next is made (transaction.first_lines).
            return first_lines(bases, {k: functools.partial(objects, k, v)
                                       for k, v in ports.items()})
        marks: Mapping[ServicePortKey, Key] = {}
        if restart:
            marks, written = self._restart_by_marks(fam, bases, ports, ctx,
                                                    (tables, set(chains), sets), objects)
            if written is not None:
                return written
        elif fam.state is not None and tables == {b.table for b in bases}:
            # Over the tables this process wrote (the periodic resync, a repair): a
            # table per part, each port rendered as its part is read. Every port's state
            # is made anew, so the old one (as large: 460 MiB at 100,000 services) goes
            # now, not after the write; a refused part leaves the next sync full anyway.
            counters = self._kernel_counters(fam)
            fam.kept = None
            return resync_lines(bases, {k: functools.partial(objects, k, v)
                                        for k, v in ports.items()},
                                chains, sets, counters)
        # A restart's ports carry the input marks the kernel holds (`_restart_by_marks`).
        def render(key: ServicePortKey) -> PortObjects:
            p = objects(key, ports[key])
            return with_input_mark(p, marks[key]) if key in marks else p

        counters = self._kernel_counters(fam)
        if restart:
            # Each port rendered as it is asked, and let go unless written (restart.py).
            each = _Rendering(ports.keys(), render)
            # Not written by this process since: maybe another version.
            fam.replacement = functools.partial(replace_lines, bases, each, tables)
            done = self._restart_all(fam, bases, each, KernelTables(
                tables, set(chains), sets, set(counters)))
            if done is not None:  # the first sync over our own tables: the diff alone
                script, kept, counts = done
                fam.restart_counts = counts
                if counts.rewrite is not None:
                    log.info("restart over our tables, another build's ports: rewriting "
                             "every table", extra={
                                 "family": fam.family.label, "ports_kept": 0,
                                 "ports_written": counts.written, "tables": counts.tables,
                                 "how": counts.rewrite.value})
                    return script, kept
                log.info("restart over our tables: writing what differs", extra={
                    "family": fam.family.label, "ports_kept": counts.kept,
                    "ports_written": counts.written, "elements_deleted": counts.deleted,
                    "elements_added": counts.added, "marks_deleted_after": counts.aside})
                return script, kept
        rendered = {k: render(k) for k in ports}
        if fam.state is None:  # not written by this process since: maybe another version
            fam.replacement = functools.partial(replace_lines, bases, rendered, tables)
        return full_lines(bases, rendered, chains, sets, tables, counters)

    def _render_ahead(self, fam: NftFamily, ports: Sequence[ResolvedServicePort],
                      ctx: RenderContext, expected: int) -> None:
        # The shard count _render_full will choose if `expected` ports come; a port
        # rendered for another count, context or resolution is rendered again there.
        shards = max(fam.shards, shards_for(expected))
        for rsp in ports:
            fam.ahead[rsp.key] = (rsp, ctx, shards, render_port(rsp, ctx, shards))

    def _kernel_objects(self, fam: NftFamily
                        ) -> tuple[set[str], list[tuple[str, str]], dict[tuple[str, str], str]]:
        """Our tables, and the (table, name) of their chains and of their sets and maps
        (-> "set" or "map"), as the kernel holds them now."""
        return self._read_back(fam, "tables", self.runner.names)

    def _kernel_counters(self, fam: NftFamily) -> dict[tuple[str, str], int]:
        """Our named counters as the kernel holds them now: (table, name) -> count."""
        return self._read_back(fam, "counters", self.runner.counters)

    def _read_back(self, fam: NftFamily, what: str,
                   read: Callable[[Family, frozenset[str]], T]) -> T:
        """`read` of our tables in `fam`'s family; a failure drops what we knew (the next
        sync is a full one) and is the sync's ApplyError."""
        try:
            return read(fam.family, OUR_TABLES)
        except NftError as exc:
            self._failed_transaction(fam, str(exc), None, True)
            raise ApplyError(f"cannot read back our {table_family(fam.family)} {what}: "
                             f"{exc}") from exc

    def _run(self, fam: NftFamily, text: str | Script, full: bool) -> str:
        """Apply `text`; which applier took it. A full sync the kernel refuses over tables
        another version wrote is sent again as their replacement (module docstring)."""
        try:
            return self._apply(fam, text, full)
        except NftError as exc:
            replaced = self._replace(fam, exc) if full and fam.replacement else None
            if replaced is not None:
                return f"{replaced}, replacing our tables"
            self._failed_transaction(fam, str(exc), exc.offending, full, exc.line)
            raise ApplyError(f"nf_tables refused the {'full' if full else 'partial'} "
                             f"transaction on {fam.tables}: {exc}",
                             offending=exc.offending) from exc

    def _apply(self, fam: NftFamily, text: str | Script, full: bool) -> str:
        """Encoded into netlink here (module docstring), or nft for what the encoder does
        not speak (and, for a full sync, for what the kernel refused of our encoding);
        which applier took it. NftError if nft is refused too."""
        try:
            self.runner.send(text, fam.family, OUR_TABLES)
            return "netlink"
        except Unencodable as exc:
            log.warning("nftables script outside the encoder's dialect; applied "
                        "through nft", extra={"family": fam.family.label, "full": full,
                                              "reason": str(exc)})
        except NftError as exc:
            if not full:
                raise
            log.warning("the kernel refused our encoding of a full sync; trying nft "
                        "with the same script", extra={
                            "family": fam.family.label, "line": exc.line,
                            "offending": exc.offending, "error": str(exc)[-500:]})
        self.runner.run(text if isinstance(text, str) else text.text())
        return "nft"

    def _replace(self, fam: NftFamily, refused: NftError) -> str | None:
        """Send the replacement of our tables (module docstring); which applier took it,
        or None if the kernel refused it too."""
        assert fam.replacement is not None
        script, fam.replacement = fam.replacement(), None
        try:
            applier = self._apply(fam, script, True)
        except NftError as exc:
            log.error("nf_tables refused the replacement of our tables too", extra={
                "family": fam.family.label, "tables": fam.tables, "error": str(exc)[-1000:]})
            return None
        log.warning("our tables held what this version cannot take over as it is (written "
                    "by another version?): replaced them whole, in one transaction",
                    extra={"family": fam.family.label, "tables": fam.tables,
                           "refused": str(refused)[-500:]})
        return applier

    def _failed_transaction(self, fam: NftFamily, error: str, offending: str | None,
                            full: bool, line: int | None = None) -> None:
        self._failed(fam)
        fam.restart = False
        log.error("nftables transaction failed; previous rules stay, next sync is full",
                  extra={"family": fam.family.label, "tables": fam.tables, "full": full,
                         "line": line, "offending": offending, "error": error[-2000:]})

    # --- the rest of the contract -------------------------------------------------------------

    def housekeeping(self) -> dict[str, int]:
        """A part of the restart's leftover work (`_complete`, then another build's input
        marks it left, `_marks_aside_parts`), else a table of the periodic resync
        (`_resync_parts`), else a part of the input marks the kernel lacks
        (`_write_marks`), first: the sync loop calls this when idle, right after
        a sync that left parts too, and again at once while parts are left, so a change
        waits for one part at most."""
        if self._complete_parts() or self._marks_aside_parts() or self._resync_parts():
            return {}
        if self._drift_later:  # the restart's completion is over: the check now
            self._drift_later = False
            if self._notify_drift is not None:
                self._notify_drift("a drift check held back by the restart's completion")
        for fam in self._families.values():
            self._write_marks(fam)
        return super().housekeeping()

    def housekeeping_pending(self) -> bool:
        return self._drift_later or any(fam.pending or fam.marks_aside or fam.resync is not None
                                        or fam.marks_todo for fam in self._families.values())

    def begin_resync(self, repair: bool) -> bool:
        """The resync a table at a time, changes going between (resync_steps.py),
        where every family allows it."""
        return self._begin_resync(repair)

    def applied_rules(self, key: ServicePortKey) -> Sequence[str]:
        fam = self._families.get(key.family)
        if fam is not None and fam.state is not None and key in fam.pending:
            self._make_kept(fam, [key])  # this port's alone, not every kept port's
        applied = fam.applied(key) if fam is not None else None
        if fam is None or fam.state is None or applied is None:
            return ()
        # The state keeps digests, not rules: render them again from what they were
        # rendered from (pure, so the same text).
        rsp, ctx = applied
        objects = render_port(rsp, ctx, fam.state.shards, kept_slots(fam.state.ports[key]))
        return objects.lines(key.family)

    def traffic(self) -> Mapping[ServicePortKey, PortTraffic]:
        return self.traffic_reader()()

    def traffic_reader(self, give_way: GiveWay = offer_lock) -> TrafficRead:
        """On this plane's thread: each family's applied ports as kept now, and a socket
        of the reading's own; the reading itself (counters.py: each counter asked for
        by name, the expensive part, ~0.7 s at 100,000 ports) then runs on any thread,
        beside this one's commits, pausing at `give_way`. During a restart's completion,
        READ_COMPLETES more of its kept ports are made first; the ports not made yet are
        left out (all at once was 12 s at 100,000 for a scrape)."""
        plan = []
        for fam in self._families.values():
            if fam.pending:
                self._complete(fam, READ_COMPLETES)
            if fam.state is not None:
                plan.append((fam.family, fam.state.ports.copy()))
        if not plan:
            return dict
        return functools.partial(read_traffic, self.runner.counter_reader(), plan, give_way)

    def watch_drift(self, notify: Callable[[str], None]) -> None:
        """Listen to nf_tables' announcements; a transaction on one of our tables that we
        did not make is drift (`check_drift` then says so, and the next sync repairs)."""
        if self._watch is not None:
            return

        def foreign(reason: str) -> None:
            with self._foreign_lock:
                self._foreign.append(reason)
            notify(reason)

        self._notify_drift = notify

        watch = NftablesListener({(NFPROTO[f], t) for f in self._families for t in OUR_TABLES},
                                 self.runner.started_here, foreign)
        watch.start()
        self._watch = watch
        log.info("watching for changes to our tables by other processes",
                 extra={"how": "nf_tables announcements",
                        "tables": [f"{table_family(f)} {TABLE}, {TABLE}-0..{MAX_SHARDS - 1}"
                                    for f in self._families]})

    def check_drift(self) -> list[str]:
        """How our tables differ from what we last applied ([] when they agree): any
        foreign transaction on them, or chains and sets missing or extra by name.

        During a restart's completion the check waits for its end ([] now; the
        housekeeping that ends it asks for the check again): the names a port owns
        are in its kept state, and making every kept port's state at once took 12 s
        at 100,000, holding every change."""
        if any(fam.pending for fam in self._families.values()):
            if not self._drift_later:
                log.info("drift check held back until the restart's kept state is made",
                         extra={"ports_left": sum(len(f.pending)
                                                  for f in self._families.values())})
            self._drift_later = True
            return []
        with self._foreign_lock:
            heard, self._foreign = self._foreign, []
        # Lost announcements prove nothing: our own full sync overflows the listener's
        # buffer from about 10,000 services on, and counting that as drift made every
        # full sync trigger the next one. The name check below still runs; a foreign
        # change of rule contents lost with them waits for the periodic full sync.
        found = [r for r in heard if r != LOST][:1]
        for fam in self._families.values():
            if fam.state is None:
                continue  # its next sync is full already
            try:
                _tables, chains, sets = self._kernel_objects(fam)
            except ApplyError as exc:
                found.append(str(exc))
                continue
            wanted_chains = fam.state.chain_names()
            missing = sorted(wanted_chains - set(chains))
            extra = sorted(set(chains) - wanted_chains)
            missing_sets = sorted(fam.state.set_names() - set(sets))
            ip = table_family(fam.family)
            for what, names in (("chains missing", missing), ("chains not ours", extra),
                                ("sets missing", missing_sets)):
                if names:
                    shown = ", ".join(f"{ip} {t} {n}" for t, n in names[:5])
                    found.append(f"{what}: {shown}"
                                 + (f" and {len(names) - 5} more" if len(names) > 5 else ""))
        if found:
            for fam in self._families.values():
                fam.kept = None
                fam.restart = False
        return found

    def cleanup(self) -> None:
        """Remove our tables (main and shards, both families); nothing else."""
        for family in self.options.families:
            ip = table_family(family)
            # `add` first makes the delete succeed whether or not the table exists.
            self.runner.run("".join(f"add table {ip} {t}\ndelete table {ip} {t}\n"
                                    for t in our_tables()))
            log.info("removed sliceproxy's nftables tables",
                     extra={"tables": f"{ip} {TABLE}, {ip} {TABLE}-*"})
        self._forget_all()
        for fam in self._families.values():
            fam.shards = self.min_shards

    def close(self) -> None:
        super().close()
        self.runner.close()


class _Rendering(Mapping[ServicePortKey, PortObjects]):
    """Ports rendered each time one is asked for, none kept: a restart that renders
    every port lets go of those the kernel holds as rendered (restart.render_all), and
    the rare replacement of another version's tables renders them again. The freed
    heap goes back every RENDERS_PER_TRIM ports (heap.py), not only after the last."""

    def __init__(self, keys: Collection[ServicePortKey],
                 render: Callable[[ServicePortKey], PortObjects]) -> None:
        self._keys, self._render = keys, render
        self._rendered = 0

    def __getitem__(self, key: ServicePortKey) -> PortObjects:
        if key not in self._keys:
            raise KeyError(key)
        self._rendered += 1
        if self._rendered % RENDERS_PER_TRIM == 0:
            heap.release_free_memory()
        return self._render(key)

    def __iter__(self) -> Iterator[ServicePortKey]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)
