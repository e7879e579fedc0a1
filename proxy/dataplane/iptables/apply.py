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

iptables-restore commits each table at its COMMIT: if it refuses a line, that table
keeps its previous rules. nat is written before filter, so the one window where tables
disagree (nat committed, filter refused) leaves old REJECT rules that no longer match
anything nat rewrote, instead of new jumps missing. Either way the record is dropped and
the next sync is full.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from proxy.dataplane.base import ApplyError, DataplaneOptions, SyncReport
from proxy.dataplane.common import conntrack
from proxy.dataplane.common.context import RenderContext, context_for
from proxy.dataplane.common.drift_watch import LegacyCanary, NftablesListener, Notify
from proxy.dataplane.common.nfnetlink import NFPROTO
from proxy.dataplane.common.rtnetlink import node_addresses
from proxy.dataplane.iptables.render import render_base, render_port
from proxy.dataplane.iptables.ruleset import Ruleset, Wanted
from proxy.dataplane.xtables.cleanup import cleanup_runners, remove_chains
from proxy.dataplane.xtables.restore_runner import (
    Backend,
    IptablesRunner,
    RestoreError,
    Runner,
    RunnerError,
    started_here,
)
from proxy.dataplane.xtables.saved import RestoreText, Saved, parse_save
from proxy.model.snapshot import DesiredState, ResolvedServicePort
from proxy.model.types import Family, IPAddress, ServicePortKey

log = logging.getLogger(__name__)

# "restore": the iptables-restore binary of the host's back end (the default).
# "iptc": python-iptables for IPv4 on legacy hosts (IPv6 still goes through
# ip6tables-legacy-restore: python-iptables 1.2 cannot load the IPv6 DNAT and
# MASQUERADE extensions of iptables 1.8.9). Slower; see iptc_runner and the README.
APPLIERS = ("restore", "iptc")

# A full sync on nf_tables declares at most about this many chains per restore (a
# service port has 2-5): iptables-nft-restore's time grows with the square of the chains
# in one transaction. bench/iptables_bench: 10,000 services in one restore 256 s.
NFT_CHAINS_PER_RESTORE = 4000
# Seconds between looks at the legacy tables' summaries (drift_watch.LegacyCanary): a
# foreign flush is noticed within this, at the cost of one getsockopt per table.
CANARY_INTERVAL = 2.0


class _FamilyState:
    """What one family's tables hold, as far as we know."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.ruleset: Ruleset | None = None  # None: unknown, the next sync is full
        self.context: RenderContext | None = None
        # The snapshot the ruleset was last rendered from (kept after a failure: what
        # conntrack cleanup compares against is what traffic last saw).
        self.last: DesiredState | None = None


class IptablesDataPlane:
    """`runners` and `addresses` replace the real binaries and the netlink address dump
    (a `simulate.SimulatedRunner` for pure tests); `clear_conntrack=False` skips
    conntrack cleanup (with simulated runners there is no kernel to clean)."""

    def __init__(self, options: DataplaneOptions, *, applier: str | None = None,
                 backend: Backend | None = None, lock_wait: float = 5.0,
                 clear_conntrack: bool = True,
                 runners: Mapping[Family, Runner] | None = None,
                 addresses: Callable[[], Sequence[IPAddress]] | None = None) -> None:
        applier = applier or options.iptables_applier
        if applier not in APPLIERS:
            raise ValueError(f"unknown iptables applier {applier!r}; supported: "
                             f"{', '.join(APPLIERS)}")
        self.options = options
        self.applier = applier
        self.clear_conntrack = clear_conntrack
        self._addresses = addresses or node_addresses
        self._injected = runners is not None
        self._families: dict[Family, _FamilyState] = {}
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
        self.failures = 0  # applies refused since start (a metric's source)
        # Held while we write, so the legacy canary never reports our own restores.
        self._writing = threading.Lock()
        self._watch: NftablesListener | LegacyCanary | None = None

    def _runner(self, family: Family, backend: Backend | None, lock_wait: float) -> Runner:
        runner = IptablesRunner(family, backend, lock_wait)
        if self.applier != "iptc" or family is not Family.V4:
            return runner
        if runner.backend is not Backend.LEGACY:
            raise ValueError("the iptc applier (python-iptables) programs legacy tables "
                             f"only; this host uses {runner.backend.value}")
        from proxy.dataplane.iptables.iptc_runner import IptcRunner

        return IptcRunner(family, runner.backend, lock_wait)

    @property
    def mode(self) -> str:
        return "iptables"

    @property
    def families(self) -> tuple[Family, ...]:
        return tuple(self._families)

    # --- sync -------------------------------------------------------------------------------

    def sync(self, state: DesiredState, full: bool = False) -> SyncReport:
        node_ips = self._addresses()
        written: list[ServicePortKey] = []
        removed: list[ServicePortKey] = []
        flows: list[conntrack.StaleFlows] = []
        operations, apply_seconds, any_full = 0, 0.0, False
        failure: ApplyError | None = None
        details: dict[str, Any] = {"backend": self.backend.value if self.backend else None}
        ports = state.ports
        for family, fam in self._families.items():
            ctx = context_for(family, self.options, node_ips)
            is_full = full or fam.ruleset is None or ctx != fam.context
            started = time.perf_counter()
            # O(changes) when `state` follows the last one applied (snapshot.py).
            changed = {k for k in state.changed_since(fam.last) if k.family is family}
            try:
                if is_full:
                    texts, ruleset = self._full(fam, state, ctx)
                else:
                    assert fam.ruleset is not None
                    text, ruleset = self._partial(fam.ruleset, ports, changed, ctx)
                    texts = [text] if text.operations() else []
                render_seconds = time.perf_counter() - started
                started = time.perf_counter()
                # Our listener deaf to a full sync: the kernel then writes no announcement
                # of each rule for us (netlink.MulticastListener.deaf).
                deaf = (self._watch.deaf() if is_full and isinstance(self._watch,
                                                                     NftablesListener)
                        else contextlib.nullcontext())
                with self._writing, deaf:
                    try:
                        for text in texts:
                            self._apply(fam, text, is_full)
                    finally:
                        if isinstance(self._watch, LegacyCanary):
                            self._watch.rebaseline()
            except ApplyError as exc:
                # The other family may still be fine: finish it, then report this one.
                failure = failure or exc
                continue
            elapsed = time.perf_counter() - started
            lines = sum(text.line_count() for text in texts)
            any_full |= is_full
            apply_seconds += elapsed
            operations += lines
            flows += conntrack.stale_flows_between(fam.last.ports if fam.last else {},
                                                   ports, changed)
            written += [k for k in changed if k in ports]
            removed += [k for k in changed if k not in ports]
            fam.ruleset, fam.context, fam.last = ruleset, ctx, state
            details[family.label] = {"full": is_full, "lines": lines, "restores": len(texts),
                                     "render_seconds": round(render_seconds, 6),
                                     "apply_seconds": round(elapsed, 6)}
        cleared = conntrack.clear_after_sync(flows) if self.clear_conntrack else 0
        if failure is not None:
            raise failure
        report = SyncReport(full=any_full, written=tuple(sorted(written)),
                            removed=tuple(sorted(removed)), operations=operations,
                            apply_seconds=apply_seconds, conntrack_cleared=cleared,
                            details=details)
        log.info("iptables sync applied", extra={
            "full": any_full, "written": len(written), "removed": len(removed),
            "lines": operations, "apply_seconds": round(apply_seconds, 4),
            "conntrack_cleared": cleared})
        return report

    def _full(self, fam: _FamilyState, state: DesiredState,
              ctx: RenderContext) -> tuple[list[RestoreText], Ruleset]:
        wanted = Wanted(render_base(ctx), {k: render_port(v, ctx)
                                           for k, v in state.ports.items()
                                           if k.family is ctx.family})
        kernel = self._saved(fam)
        if fam.runner.backend is Backend.NFT:
            batches = wanted.full_restore_batches(kernel, NFT_CHAINS_PER_RESTORE)
        else:  # legacy rewrites the whole table per restore: one is cheapest
            batches = [wanted.full_restore(kernel)]
        return [b for b in batches if b.operations()], wanted.kept()

    @staticmethod
    def _partial(applied: Ruleset, ports: Mapping[ServicePortKey, ResolvedServicePort],
                 changed: set[ServicePortKey], ctx: RenderContext
                 ) -> tuple[RestoreText, Ruleset]:
        updates = {k: (render_port(ports[k], ctx) if k in ports else None) for k in changed}
        return applied.partial_restore(updates)

    def _saved(self, fam: _FamilyState) -> Saved:
        """What the tables hold, our chains' rules skipped (read line by line)."""
        try:
            return parse_save(fam.runner.save_lines(), our_rules=False)
        except RunnerError as exc:
            self._failed(fam, str(exc), None)
            raise ApplyError(f"{fam.runner.save_cmd} failed: {exc}") from exc

    def _apply(self, fam: _FamilyState, text: RestoreText, full: bool) -> None:
        try:
            fam.runner.restore(text)
        except RestoreError as exc:
            self._failed(fam, str(exc), exc.offending, exc.line, full)
            # nf_tables reports some errors (a jump to a missing chain) only at COMMIT,
            # so the binary's own words go in the message too.
            said = str(exc).split(": ", 1)[-1].splitlines()[0] if str(exc) else ""
            raise ApplyError(f"{fam.runner.restore_cmd} refused line {exc.line} "
                             f"({exc.offending!r}): {said}", offending=exc.offending) from exc

    def _failed(self, fam: _FamilyState, error: str, offending: str | None,
                line: int | None = None, full: bool = True) -> None:
        self.failures += 1
        fam.ruleset = None  # what the kernel holds is no longer certain: next sync is full
        log.error("iptables apply failed; previous rules stay, next sync is full", extra={
            "family": fam.runner.family.label, "binary": fam.runner.restore_cmd,
            "full": full, "line": line, "offending": offending, "error": error[-2000:]})

    # --- the rest of the contract -------------------------------------------------------------

    def applied_rules(self, key: ServicePortKey) -> Sequence[str]:
        fam = self._families.get(key.family)
        if fam is None or fam.ruleset is None or fam.last is None or fam.context is None:
            return ()
        if key not in fam.ruleset.ports or key not in fam.last.ports:
            return ()
        # The ruleset keeps digests, not rules: render them again from what they were
        # rendered from (pure, so the same text).
        return render_port(fam.last.ports[key], fam.context).lines()

    def housekeeping(self) -> None:
        """Nothing to do between syncs for iptables."""

    # --- drift: someone else changed our rules ----------------------------------------------

    def watch_drift(self, notify: Notify) -> None:
        """Call `notify(reason)` (from another thread) whenever someone else may have
        changed the tables our rules are in: announced by nf_tables, or seen by the
        legacy canary (see drift_watch). Then `check_drift` tells whether they did."""
        if self._injected or self._watch is not None or not self._families:
            return
        tables = ("nat", "filter")
        if self.backend is Backend.NFT:
            self._watch = NftablesListener(
                {(NFPROTO[f], t) for f in self._families for t in tables}, started_here,
                notify)
        else:
            self._watch = LegacyCanary([(f, t) for f in self._families for t in tables],
                                       notify, self._writing, CANARY_INTERVAL)
            with self._writing:
                self._watch.rebaseline()
        self._watch.start()
        log.info("watching for changes to our rules by other processes", extra={
            "backend": self.backend.value if self.backend else None,
            "how": "nf_tables announcements" if self.backend is Backend.NFT
                   else f"legacy table summaries every {CANARY_INTERVAL:g}s"})

    def check_drift(self) -> list[str]:
        """How our rules in the kernel differ from what we last applied ([] when they
        agree); a family that differs is rewritten whole at the next sync."""
        found: list[str] = []
        for family, fam in self._families.items():
            if fam.ruleset is None:
                continue  # its next sync is full already
            with self._writing:
                try:
                    kernel = parse_save(fam.runner.save_lines())
                except RunnerError as exc:
                    found.append(f"{family.label}: our rules could not be read: {exc}")
                    fam.ruleset = None
                    continue
                finally:
                    if isinstance(self._watch, LegacyCanary):
                        self._watch.rebaseline()
            differences = fam.ruleset.differences(kernel)
            if differences:
                fam.ruleset = None
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
        for fam in self._families.values():
            fam.ruleset, fam.context, fam.last = None, None, None

    def close(self) -> None:
        """Stop watching for drift; runners are processes, netlink sockets are per call."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
