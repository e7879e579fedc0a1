"""The sync of the rule-based planes (iptables, nftables): one loop over the families,
each mode supplying how to render and how to write.

Per family, a sync is full (the first one, when asked, after any failure, or when this
node's addresses, or the primary ones its Node object gives, changed the render context)
or partial (only the service ports whose snapshot entry is not the very object applied
last time, found in O(changes): `DesiredState.changed_since`). A family whose write
fails keeps its previous rules and forgets what it applied, so its next sync is full;
the other family is still synced, then the first failure is raised. Conntrack entries
made stale by what was applied are cleared once, after every family, and the TCP flows
of endpoints that left are ended where asked (fail_fast.py).
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from proxy.dataplane.base import ApplyError, DataplaneOptions, SyncReport
from proxy.dataplane.common import conntrack, conntrack_reconcile, fail_fast
from proxy.dataplane.common.context import RenderContext, context_for
from proxy.dataplane.common.drift_watch import LegacyCanary, NftablesListener, deaf_while
from proxy.model.snapshot import DesiredState, ResolvedServicePort
from proxy.model.types import Family, IPAddress, ServicePortKey


class Kept(Protocol):
    """What a mode keeps of what it applied (iptables' Ruleset, nftables' TableState)."""

    @property
    def ports(self) -> Mapping[ServicePortKey, Any]: ...


class FamilyState:
    """What one family's rules are, as far as we know."""

    def __init__(self, family: Family) -> None:
        self.family = family
        self.kept: Any = None  # the mode's Kept; None: unknown, the next sync is full
        self.context: RenderContext | None = None
        # The snapshot the kept state was last rendered from (kept after a failure: what
        # conntrack cleanup compares against is what traffic last saw).
        self.last: DesiredState | None = None

    def forget(self) -> None:
        self.kept, self.context, self.last = None, None, None

    def applied(self, key: ServicePortKey) -> tuple[ResolvedServicePort, RenderContext] | None:
        """The service port as last applied and the context it was rendered in, if its
        rules are in the kernel."""
        if self.kept is None or self.last is None or self.context is None:
            return None
        if key not in self.kept.ports or key not in self.last.ports:
            return None
        return self.last.ports[key], self.context


@dataclass(slots=True)
class Written:
    """What one family's write did: its size and the mode's own details for the report."""

    lines: int
    details: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class _Totals:
    written: list[ServicePortKey] = field(default_factory=list)
    removed: list[ServicePortKey] = field(default_factory=list)
    flows: list[conntrack.StaleFlows] = field(default_factory=list)
    vanished: list[fail_fast.Vanished] = field(default_factory=list)
    # Families synced whole (start, resync, repair): their conntrack is reconciled.
    whole: list[Family] = field(default_factory=list)
    operations: int = 0
    apply_seconds: float = 0.0
    full: bool = False


S = TypeVar("S", bound=FamilyState)

# Seconds between reconciles of conntrack with the rules (besides the one after every
# first or full sync). One costs a dump of every UDP and SCTP entry: docs/reliability.md.
CONNTRACK_RECONCILE_PERIOD = 60.0


class FamilySyncPlane(ABC, Generic[S]):
    """The shared part of the iptables and nftables data planes (base.DataPlane)."""

    mode: ClassVar[str]

    def __init__(self, options: DataplaneOptions, clear_conntrack: bool,
                 addresses: Callable[[], Sequence[IPAddress]]) -> None:
        self.options = options
        self.clear_conntrack = clear_conntrack
        self._addresses = addresses
        self._families: dict[Family, S] = {}
        # The mode's own logger: operators filter on it (docs/logging.md).
        self._log = logging.getLogger(type(self).__module__)
        # Held while we write, so the legacy canary never reports our own writes.
        self._writing = threading.Lock()
        self._watch: NftablesListener | LegacyCanary | None = None
        self._next_reconcile = 0.0
        self._fail_fast = fail_fast.FailFast()

    @property
    def families(self) -> tuple[Family, ...]:
        return tuple(self._families)

    # --- what each mode supplies ----------------------------------------------------------

    @abstractmethod
    def _render_full(self, fam: S, state: DesiredState, ctx: RenderContext) -> tuple[Any, Any]:
        """(what to write, the Kept it leaves) for every service port of the family."""

    @abstractmethod
    def _render_partial(self, fam: S, ports: Mapping[ServicePortKey, ResolvedServicePort],
                        changed: set[ServicePortKey], ctx: RenderContext) -> tuple[Any, Any]:
        """(what to write, the Kept it leaves) for the `changed` ports only."""

    @abstractmethod
    def _write(self, fam: S, payload: Any, full: bool) -> Written:
        """Send `payload` to the kernel; ApplyError (after `_failed`) if refused."""

    def _report_details(self) -> dict[str, Any]:
        """The report's details before any family's (iptables: its back end)."""
        return {}

    def _after_sync(self, full: bool) -> None:
        """After every family, before a failure is raised."""

    def _render_ahead(self, fam: S, ports: Sequence[ResolvedServicePort], ctx: RenderContext,
                      expected: int) -> None:
        """Render `ports` now for the family's first full sync (`render_ahead`), which
        will have `expected` service ports; nothing by default."""

    def render_ahead(self, ports: Sequence[ResolvedServicePort],
                     expected: Mapping[Family, int],
                     primary_ips: Sequence[IPAddress] = ()) -> None:
        """base.DataPlane.render_ahead: each family's ports, in the mode's
        `_render_ahead`."""
        node_ips = self._addresses()
        for family, fam in self._families.items():
            mine = [p for p in ports if p.key.family is family]
            if mine:
                ctx = context_for(family, self.options, node_ips, primary_ips)
                self._render_ahead(fam, mine, ctx, expected.get(family, 0))

    # --- the loop -----------------------------------------------------------------------------

    def sync(self, state: DesiredState, full: bool = False) -> SyncReport:
        node_ips = self._addresses()
        totals = _Totals()
        failure: ApplyError | None = None
        details = self._report_details()
        for family, fam in self._families.items():
            try:
                details[family.label] = self._sync_family(fam, state, full, node_ips, totals)
            except ApplyError as exc:
                # The other family may still be fine: finish it, then report this one.
                failure = failure or exc
        deleted = self._clear_conntrack(totals, node_ips)
        cleared = sum(deleted.values())
        reset = self._fail_fast.end(totals.vanished)
        self._after_sync(totals.full)
        if failure is not None:
            raise failure
        self._log.info(f"{self.mode} sync applied", extra={
            "full": totals.full, "written": len(totals.written),
            "removed": len(totals.removed), "lines": totals.operations,
            "apply_seconds": round(totals.apply_seconds, 4), "conntrack_cleared": cleared,
            "flows_reset": reset})
        return SyncReport(full=totals.full, written=tuple(sorted(totals.written)),
                          removed=tuple(sorted(totals.removed)), operations=totals.operations,
                          apply_seconds=totals.apply_seconds, conntrack_cleared=cleared,
                          conntrack_deleted=deleted, flows_reset=reset, details=details)

    def _sync_family(self, fam: S, state: DesiredState, full: bool,
                     node_ips: Sequence[IPAddress], totals: _Totals) -> dict[str, Any]:
        ctx = context_for(fam.family, self.options, node_ips, state.primary_ips)
        is_full = full or fam.kept is None or ctx != fam.context
        started = time.perf_counter()
        ports = state.ports
        # O(changes) when `state` follows the last one applied (snapshot.py).
        changed = {k for k in state.changed_since(fam.last) if k.family is fam.family}
        if is_full:
            payload, kept = self._render_full(fam, state, ctx)
        else:
            payload, kept = self._render_partial(fam, ports, changed, ctx)
        render_seconds = time.perf_counter() - started
        started = time.perf_counter()
        with deaf_while(self._watch, is_full):
            written = self._write(fam, payload, is_full)
        elapsed = time.perf_counter() - started
        totals.full |= is_full
        totals.apply_seconds += elapsed
        totals.operations += written.lines
        if fam.last is None or is_full:
            totals.whole.append(fam.family)
        if fam.last is not None:
            # After a change; a first sync has no "before": the reconcile decides alone.
            totals.flows += conntrack.stale_flows_between(fam.last.ports, ports, changed)
            totals.vanished += fail_fast.vanished_between(fam.last.ports, ports, changed,
                                                          self.options.fail_fast)
        totals.written += [k for k in changed if k in ports]
        totals.removed += [k for k in changed if k not in ports]
        fam.kept, fam.context, fam.last = kept, ctx, state
        return {"full": is_full, "lines": written.lines, **written.details,
                "render_seconds": round(render_seconds, 6), "apply_seconds": round(elapsed, 6)}

    def _failed(self, fam: S) -> None:
        """A write or read-back failed: the kernel's rules are no longer certain, so the
        family's next sync is full (the mode logs why, in its own words)."""
        fam.kept = None

    # --- conntrack ---------------------------------------------------------------------------

    def _clear_conntrack(self, totals: _Totals, node_ips: Sequence[IPAddress]
                         ) -> dict[str, int]:
        """Entries made stale by this sync's changes, then, for the families synced whole,
        every stale entry in the kernel's table (conntrack_reconcile.py)."""
        if not self.clear_conntrack:
            return {}
        deleted = conntrack.clear_after_sync(totals.flows)
        if totals.whole:
            for reason, count in self._reconcile(totals.whole, node_ips).items():
                deleted[reason] = deleted.get(reason, 0) + count
        return deleted

    def _reconcile(self, families: Sequence[Family], node_ips: Sequence[IPAddress]
                   ) -> dict[str, int]:
        started = time.monotonic()
        applied = {f: self._families[f].last for f in families if f in self._families}
        deleted = conntrack_reconcile.reconcile(
            {f: state.datagram_ports.values() for f, state in applied.items()
             if state is not None}, node_ips)
        # At most ~3% of the agent's thread however large the table (one reconcile at
        # 100,000 entries: about 2 s).
        took = time.monotonic() - started
        self._next_reconcile = started + max(CONNTRACK_RECONCILE_PERIOD, 30 * took)
        return deleted

    def housekeeping_pending(self) -> bool:
        return False

    def begin_resync(self, repair: bool) -> bool:
        return False  # the mode's full sync is its resync (base.DataPlane)

    def housekeeping(self) -> dict[str, int]:
        """The periodic conntrack reconcile (entries left stale by missed events or by
        anyone else), every CONNTRACK_RECONCILE_PERIOD; affinity entries expire in the
        kernel by themselves."""
        if not self.clear_conntrack or time.monotonic() < self._next_reconcile:
            return {}
        return self._reconcile(tuple(self._families), self._addresses())

    # --- the rest of the contract shared by both -------------------------------------------

    def _forget_all(self) -> None:
        for fam in self._families.values():
            fam.forget()

    def close(self) -> None:
        """Stop watching for drift."""
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
