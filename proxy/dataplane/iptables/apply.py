"""The iptables data plane: desired state in, iptables-restore out (the kernel side).

One `IptablesDataPlane` per agent, called from one worker thread, working in that
thread's network namespace. Per family it keeps the `Ruleset` it last applied and the
service ports it was rendered from:

- a full sync (the first one, `full=True`, after any failure, or when this node's
  addresses changed) reads our chains back with iptables-save and rewrites all of them
  in one restore per family (on nf_tables, in batches of service ports, then one for
  the rest: see `Wanted.full_restore_batches`), deleting chains of ours nobody wants
  any more;
- a partial sync renders only the service ports whose snapshot entry is not the very
  object applied last time, and writes only what differs (see `ruleset`).

Traffic is counted in nfacct objects (common/nfacct.py; render.PortCounters says which):
the objects a restore will name are created before it (a rule naming a missing one is
refused), and those no rule of ours names any more are deleted after it; a full sync
reads the kernel's first, so one left by an earlier run is kept, counts and all, and
one nobody wants goes. `traffic()` reads them all in one dump.

iptables-restore commits each table at its COMMIT: if it refuses a line, that table
keeps its previous rules. nat is written before filter, so the one window where tables
disagree (nat committed, filter refused) leaves old REJECT rules that no longer match
anything nat rewrote, instead of new jumps missing. Either way the record is dropped and
the next sync is full.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.dataplane.base import (
    NOTHING,
    ApplyError,
    Counted,
    DataplaneOptions,
    GiveWay,
    TrafficByPort,
    TrafficRead,
    offer_lock,
    read_now,
)
from proxy.dataplane.common import nfacct
from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.common.drift_watch import (
    LegacyCanary,
    Notify,
    how_xtables_are_watched,
    watch_xtables,
)
from proxy.dataplane.common.family_sync import FamilyState, FamilySyncPlane, Written
from proxy.dataplane.common.rtnetlink import node_addresses
from proxy.dataplane.common.traffic import port_traffic
from proxy.dataplane.iptables.render import PortCounters, render_base, render_port
from proxy.dataplane.iptables.ruleset import Ruleset, Wanted
from proxy.dataplane.modes import (
    IPTABLES,
    IPTABLES_PARTIAL_RESTORE_FAILURES,
    IPTABLES_RESTORE_FAILURES,
)
from proxy.dataplane.xtables.cleanup import cleanup_runners, remove_chains
from proxy.dataplane.xtables.restore_runner import (
    Backend,
    IptablesRunner,
    RestoreError,
    Runner,
    RunnerError,
)
from proxy.dataplane.xtables.saved import RestoreText, Saved, parse_save
from proxy.dataplane.xtables.simulate import SimulatedRunner
from proxy.model.snapshot import DesiredState, ResolvedServicePort
from proxy.model.types import Balancing, Family, IPAddress, ServicePortKey

log = logging.getLogger(__name__)

# "restore": the iptables-restore binary of the host's back end (the default).
# "iptc": python-iptables for IPv4 on legacy hosts (IPv6 still goes through
# ip6tables-legacy-restore: python-iptables 1.2 cannot load the IPv6 DNAT and
# MASQUERADE extensions of iptables 1.8.9). Slower; see iptc_runner and docs/speed.md.
APPLIERS = ("restore", "iptc")

# A full sync on nf_tables declares at most about this many chains per restore (a
# service port has 2-5): iptables-nft-restore's time grows with the square of the chains
# in one transaction. bench/rule_sync: 10,000 services in one restore 256 s.
NFT_CHAINS_PER_RESTORE = 4000


class _FamilyState(FamilyState):
    """What one family's tables hold, as far as we know (`kept`: its Ruleset)."""

    def __init__(self, runner: Runner) -> None:
        super().__init__(runner.family)
        self.runner = runner
        # The nfacct objects of each service port as last written (kept when a write
        # fails: what traffic() reads is what the kernel's rules still count into).
        self.counters: dict[ServicePortKey, PortCounters] = {}

    @property
    def ruleset(self) -> Ruleset | None:
        kept: Ruleset | None = self.kept
        return kept


@dataclass(slots=True)
class _Payload:
    """One family's write: the restores, and the nfacct objects of the ports they
    write (a full sync: every port; a partial one: the changed ports, None: removed)."""

    texts: list[RestoreText]
    counters: dict[ServicePortKey, PortCounters | None]
    full: bool
    stale: set[str] = field(default_factory=set)  # ours, to delete once written


class IptablesDataPlane(FamilySyncPlane[_FamilyState]):
    """`runners` and `addresses` replace the real binaries and the netlink address dump
    (a `simulate.SimulatedRunner` for pure tests); `clear_conntrack=False` skips
    conntrack cleanup (with simulated runners there is no kernel to clean);
    `accounting` replaces the kernel's nfacct objects (a `MemoryNfacct` by default with
    simulated runners)."""

    mode = IPTABLES.name

    def __init__(self, options: DataplaneOptions, *, applier: str | None = None,
                 backend: Backend | None = None, lock_wait: float = 5.0,
                 clear_conntrack: bool = True,
                 runners: Mapping[Family, Runner] | None = None,
                 addresses: Callable[[], Sequence[IPAddress]] | None = None,
                 accounting: nfacct.Accounting | None = None) -> None:
        applier = applier or options.iptables_applier
        if applier not in APPLIERS:
            raise ValueError(f"unknown iptables applier {applier!r}; supported: "
                             f"{', '.join(APPLIERS)}")
        super().__init__(options, clear_conntrack, addresses or node_addresses)
        self.applier = applier
        self._injected = runners is not None
        simulated = runners is not None and all(isinstance(r, SimulatedRunner)
                                                for r in runners.values())
        self._accounting: nfacct.Accounting = accounting or (
            nfacct.MemoryNfacct() if simulated else nfacct.Nfacct())
        for family in options.families:
            runner: Runner
            if runners is not None:
                if family not in runners:
                    continue
                runner = runners[family]
            else:
                runner = self._runner(family, backend, lock_wait)
            backend = runner.backend  # detect once, use for both families
            if runner.available():
                self._families[family] = _FamilyState(runner)
            else:
                log.warning("iptables family unavailable; not programming it", extra={
                    "family": family.label, "binary": runner.restore_cmd})
        self.backend = backend
        # Services already told that this mode balances at random (_random_only).
        self._told: set[tuple[str, Balancing]] = set()
        # Traffic counting, until the kernel shows it has no nfacct (_without_counting);
        # whether it was asked (once, at the first full sync).
        self._counting, self._probed = True, False

    def _runner(self, family: Family, backend: Backend | None, lock_wait: float) -> Runner:
        runner = IptablesRunner(family, backend, lock_wait)
        if self.applier != "iptc" or family is not Family.V4:
            return runner
        if runner.backend is not Backend.LEGACY:
            raise ValueError("the iptc applier (python-iptables) programs legacy tables "
                             f"only; this host uses {runner.backend.value}")
        from proxy.dataplane.iptables.iptc_runner import IptcRunner

        return IptcRunner(family, runner.backend, lock_wait)

    # --- sync: render and write (the loop is FamilySyncPlane's) -----------------------------

    def _report_details(self) -> dict[str, Any]:
        return {"backend": self.backend.value if self.backend else None}

    def _render_full(self, fam: _FamilyState, state: DesiredState,
                     ctx: RenderContext) -> tuple[_Payload, Ruleset]:
        self._random_only(state.ports.values())
        self._probe_counting()
        wanted = Wanted(render_base(ctx), {k: render_port(v, ctx, self._counting)
                                           for k, v in state.ports.items()
                                           if k.family is ctx.family})
        kernel = self._saved(fam)
        if fam.runner.backend is Backend.NFT:
            batches = wanted.full_restore_batches(kernel, NFT_CHAINS_PER_RESTORE)
        else:  # legacy rewrites the whole table per restore: one is cheapest
            batches = [wanted.full_restore(kernel)]
        counters = {k: r.counters for k, r in wanted.ports.items()}
        return _Payload([b for b in batches if b.operations()], counters, True), wanted.kept()

    def _render_partial(self, fam: _FamilyState,
                        ports: Mapping[ServicePortKey, ResolvedServicePort],
                        changed: set[ServicePortKey], ctx: RenderContext
                        ) -> tuple[_Payload, Ruleset]:
        applied: Ruleset = fam.kept
        self._random_only(ports[k] for k in changed if k in ports)
        updates = {k: (render_port(ports[k], ctx, self._counting) if k in ports
                       else None) for k in changed}
        text, ruleset = applied.partial_restore(updates)
        counters = {k: (r.counters if r is not None else None) for k, r in updates.items()}
        return _Payload(([text] if text.operations() else []), counters, False), ruleset

    def _random_only(self, ports: Iterable[ResolvedServicePort]) -> None:
        """Say once per service and choice that maglev and source-hash balance at random
        here: x_tables has no map from a hash to an endpoint, so a Maglev table would be
        one rule per slot, thousands per service port (docs/dataplanes.md#balancing)."""
        for rsp in ports:
            told = (rsp.key.service, rsp.balancing)
            if rsp.balancing is not Balancing.RANDOM and told not in self._told:
                self._told.add(told)
                log.warning("balancing not available in iptables mode; random used", extra={
                    "service": rsp.key.service, "balancing": rsp.balancing.value})

    def _write(self, fam: _FamilyState, payload: _Payload, full: bool) -> Written:
        texts = payload.texts
        created = self._create_counters(fam, payload)
        with self._writing:
            try:
                for text in texts:
                    self._apply(fam, text, full)
            finally:
                if isinstance(self._watch, LegacyCanary):
                    self._watch.rebaseline()
        deleted = self._retire_counters(fam, payload)
        return Written(sum(text.line_count() for text in texts), {
            "restores": len(texts), "counters_created": created,
            "counters_deleted": deleted})

    # --- traffic counters (nfacct) ------------------------------------------------------------

    def _probe_counting(self) -> None:
        """Once: whether this kernel has nfacct at all (nfnetlink_acct); without it the
        rules are written without counting rather than not at all."""
        if self._probed or not self._counting:
            return
        self._probed = True
        try:
            self._accounting.dump()
        except OSError as exc:
            self._without_counting(str(exc))

    def _without_counting(self, why: str) -> None:
        self._counting = False
        log.error("traffic counting unavailable: this kernel lacks nfacct "
                  "(nfnetlink_acct, xt_nfacct); rules are written without it and "
                  "traffic reads 0", extra={"error": why[-500:]})

    def _create_counters(self, fam: _FamilyState, payload: _Payload) -> int:
        """Create the objects the restores will name that may not exist yet: a full sync
        reads the kernel's (and notes ours of this family nobody wants: `stale`), a
        partial one takes the changed ports' new names. Never resets one."""
        if not self._counting:
            return 0
        new = {n for c in payload.counters.values() if c is not None for n in c.names()}
        try:
            if payload.full:
                present = set(self._accounting.dump())
                digit = "4" if fam.family is Family.V4 else "6"
                payload.stale = {n for n in present
                                 if nfacct.of_family(n, digit) and n not in new}
                return self._accounting.create(new - present)
            old = {n for k in payload.counters if k in fam.counters
                   for n in fam.counters[k].names()}
            payload.stale = old - new
            return self._accounting.create(new - old)
        except OSError as exc:
            self._failed(fam)
            log.error("nfacct objects could not be created; rules not written", extra={
                "family": fam.family.label, "error": str(exc)})
            raise ApplyError(f"creating nfacct objects (traffic counters) failed: {exc} "
                             "(does the kernel have nfnetlink_acct and xt_nfacct?)") from exc

    def _retire_counters(self, fam: _FamilyState, payload: _Payload) -> int:
        """After a write: record the ports' objects, delete those no rule of ours names.
        One still held (a rule of someone else's, or of the other back end) stays until
        a later full sync finds it free; a failure here costs nothing but an object."""
        if payload.full:
            fam.counters = {k: c for k, c in payload.counters.items() if c is not None}
        else:
            for key, counters in payload.counters.items():
                if counters is None:
                    fam.counters.pop(key, None)
                else:
                    fam.counters[key] = counters
        if not payload.stale:
            return 0
        try:
            busy = self._accounting.delete(payload.stale)
        except OSError as exc:
            log.warning("nfacct objects not deleted", extra={
                "family": fam.family.label, "error": str(exc)})
            return 0
        if busy:
            log.info("nfacct objects still in use; kept", extra={
                "family": fam.family.label, "objects": len(busy), "first": busy[0]})
        return len(payload.stale) - len(busy)

    def traffic_reader(self, give_way: GiveWay = offer_lock) -> TrafficRead:
        return read_now(self)  # one nfacct dump, fast at the sizes this mode runs

    def traffic(self) -> TrafficByPort:
        """Each applied service port's new connections, from one dump of our nfacct
        objects (common/traffic.py): an object's packets are the connections its rules
        saw, as nat chains see only a connection's first packet."""
        out = TrafficByPort()
        if not self._counting:
            for fam in self._families.values():
                for k in fam.last.ports if fam.last is not None else ():
                    if k.family is fam.family:
                        out.add_connections(k, 0)
            return out
        readings = self._accounting.dump()
        for fam in self._families.values():
            for key, counters in fam.counters.items():
                found = readings.get(counters.port)
                if counters.endpoints is None:
                    out.add_connections(key, found.packets if found is not None else 0)
                    continue
                total = Counted(found.packets) if found is not None else NOTHING
                out.add(key, port_traffic(total, [
                    ((ip, port), Counted(readings[name].packets))
                    for name, ip, port in counters.endpoints if name in readings]))
        return out

    def _saved(self, fam: _FamilyState) -> Saved:
        """What the tables hold, our chains' rules skipped (read line by line)."""
        try:
            return parse_save(fam.runner.save_lines(), our_rules=False)
        except RunnerError as exc:
            self._failed_apply(fam, str(exc), None)
            raise ApplyError(f"{fam.runner.save_cmd} failed: {exc}") from exc

    def _apply(self, fam: _FamilyState, text: RestoreText, full: bool) -> None:
        try:
            fam.runner.restore(text)
        except RestoreError as exc:
            if self._counting and _counting_refused(exc):
                self._without_counting(str(exc))  # no xt_nfacct: the retry goes without
            self._failed_apply(fam, str(exc), exc.offending, exc.line, full)
            # nf_tables reports some errors (a jump to a missing chain) only at COMMIT,
            # so the binary's own words go in the message too.
            said = str(exc).split(": ", 1)[-1].splitlines()[0] if str(exc) else ""
            counted = {IPTABLES_RESTORE_FAILURES.name: 1}
            if not full:
                counted[IPTABLES_PARTIAL_RESTORE_FAILURES.name] = 1
            raise ApplyError(f"{fam.runner.restore_cmd} refused line {exc.line} "
                             f"({exc.offending!r}): {said}{_legacy_hint(fam, exc)}",
                             offending=exc.offending, counted=counted) from exc

    def _failed_apply(self, fam: _FamilyState, error: str, offending: str | None,
                      line: int | None = None, full: bool = True) -> None:
        self._failed(fam)
        log.error("iptables apply failed; previous rules stay, next sync is full", extra={
            "family": fam.family.label, "binary": fam.runner.restore_cmd, "full": full,
            "line": line, "offending": offending, "error": error[-2000:]})

    # --- the rest of the contract -------------------------------------------------------------

    def applied_rules(self, key: ServicePortKey) -> Sequence[str]:
        fam = self._families.get(key.family)
        applied = fam.applied(key) if fam is not None else None
        if applied is None:
            return ()
        # The ruleset keeps digests, not rules: render them again from what they were
        # rendered from (pure, so the same text).
        return render_port(*applied, self._counting).lines()

    # --- drift: someone else changed our rules ----------------------------------------------

    def watch_drift(self, notify: Notify) -> None:
        """Call `notify(reason)` (from another thread) whenever someone else may have
        changed the tables our rules are in: announced by nf_tables, or seen by the
        legacy canary (see drift_watch). Then `check_drift` tells whether they did."""
        if self._injected or self._watch is not None or not self._families:
            return
        nft = self.backend is Backend.NFT
        self._watch = watch_xtables(self._families, nft, notify, self._writing)
        log.info("watching for changes to our rules by other processes", extra={
            "backend": self.backend.value if self.backend else None,
            "how": how_xtables_are_watched(nft)})

    def check_drift(self) -> list[str]:
        """How our rules in the kernel differ from what we last applied ([] when they
        agree); a family that differs is rewritten whole at the next sync."""
        found: list[str] = []
        for family, fam in self._families.items():
            if fam.kept is None:
                continue  # its next sync is full already
            with self._writing:
                try:
                    kernel = parse_save(fam.runner.save_lines())
                except RunnerError as exc:
                    found.append(f"{family.label}: our rules could not be read: {exc}")
                    fam.kept = None
                    continue
                finally:
                    if isinstance(self._watch, LegacyCanary):
                        self._watch.rebaseline()
            differences = fam.kept.differences(kernel)
            if differences:
                fam.kept = None
                found += [f"{family.label}: {d}" for d in differences]
        return found

    def cleanup(self) -> None:
        """Remove every chain of ours, and every rule jumping to one, in both back ends
        (a host may have switched since we last ran); nothing else."""
        runners = ([fam.runner for fam in self._families.values()] if self._injected
                   else cleanup_runners(self.options.families))
        for runner, _chains in remove_chains(runners):
            log.info("removed sliceproxy's iptables rules", extra={
                "family": runner.family.label, "backend": runner.backend.value})
        # Our traffic counters, now that no rule of ours holds them.
        deleted, busy = nfacct.remove_ours(self._accounting)
        if deleted or busy:
            log.info("removed sliceproxy's nfacct objects", extra={
                "deleted": deleted, "still_in_use": len(busy)})
        self._forget_all()
        for fam in self._families.values():
            fam.counters = {}


# A counting rule as restore text writes it: nothing but the match.
_COUNTING_LINE = re.compile(r"-[AI] \S+ (?:\d+ )?-m nfacct --nfacct-name +\S+$")


def _counting_refused(exc: RestoreError) -> bool:
    """Whether the restore failed on a counting rule (a kernel or iptables without
    xt_nfacct): the refused line is one, or the binary could not load the match."""
    return bool(_COUNTING_LINE.match(exc.offending or "")) or "match `nfacct'" in str(exc)


def _legacy_hint(fam: _FamilyState, exc: RestoreError) -> str:
    """Why a legacy COMMIT may be refused: the kernel takes a legacy table whole, in one
    call, and allocates none of 512 MiB or more (XT_MAX_TABLE_SIZE); ~590 bytes a rule
    with its comment (30,000 services x 10 endpoints: 541 MiB, ENOMEM). A bad rule is
    refused at its own line, so a refused COMMIT is the kernel's."""
    if fam.runner.backend is not Backend.LEGACY or exc.offending != "COMMIT":
        return ""
    return ("; if the table is large: the kernel refuses a legacy table of 512 MiB or "
            "more (about 900,000 of our rules), which only --proxy-mode nftables or "
            "iptables on nf_tables can go past")
