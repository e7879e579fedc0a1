"""The nftables data plane: desired state in, nf_tables transactions out.

One `NftablesDataPlane` per agent, called from one worker thread, in that thread's
network namespace. Per family it keeps the `TableState` it last applied:

- a full sync (the first one, `full=True`, after any failure, after drift, or when this
  node's addresses changed) reads back the names of what our table holds and rewrites
  all of it in one transaction (transaction.full_lines: made line by line as it is
  encoded, never held whole);
- a partial sync renders only the service ports whose snapshot entry is not the very
  object applied last time (found in O(changes): `DesiredState.changed_since`), and
  sends only their chains and elements.

Both are encoded here into netlink (wire.py) rather than handed to nft, which would
first read our tables back (per change) and parse the text in C into a heap of its own
(per full sync: 10,000 services took 3.7 s in `nft -f`, 1.1 s encoded and sent). nft
stays the fallback: for a script outside the encoder's dialect, and for a full script
the kernel refused from the encoder (the refusal left nothing changed; if nft is
refused too, the refusal is real, and if nft is not, the encoder has a bug, logged).

A transaction is atomic: if nf_tables refuses it, the previous rules stay, the state is
dropped and the next sync is a full one. Our tables are `ip sliceproxy` and `ip6
sliceproxy` and their shards; nothing outside them is ever touched.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from proxy.dataplane.base import ApplyError, DataplaneOptions, SyncReport
from proxy.dataplane.common import conntrack, heap
from proxy.dataplane.common.context import RenderContext, context_for
from proxy.dataplane.common.drift_watch import LOST, NftablesListener
from proxy.dataplane.common.nfnetlink import NFPROTO, nat_unsupported
from proxy.dataplane.common.rtnetlink import node_addresses
from proxy.dataplane.nftables.expressions import Unencodable
from proxy.dataplane.nftables.render import (
    MAX_SHARDS,
    TABLE,
    our_tables,
    render_base,
    render_port,
    render_shard,
    shard_table,
    shards_for,
    table_family,
)
from proxy.dataplane.nftables.runner import NftError, NftRunner, unavailable
from proxy.dataplane.nftables.transaction import (
    Script,
    TableState,
    full_lines,
    kept_slots,
    partial_script,
)
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family, IPAddress, ServicePortKey

log = logging.getLogger(__name__)
OUR_TABLES = frozenset(our_tables())


class NftablesUnavailable(Exception):
    """This host cannot run the nftables mode (tools or kernel support missing)."""


class _FamilyState:
    def __init__(self, family: Family, shards: int) -> None:
        self.family = family
        self.state: TableState | None = None  # None: unknown, the next sync is full
        self.context: RenderContext | None = None
        # Shard tables (render.py): set by each full sync, only ever grown while running
        # (shrinking would move every port for nothing).
        self.shards = shards
        # The snapshot this family's state was last rendered from (kept after a failure:
        # what conntrack cleanup compares against is what traffic last saw).
        self.last: DesiredState | None = None

    @property
    def tables(self) -> str:
        """Our tables of this family, for messages: the main one and its shards."""
        return f"{table_family(self.family)} {TABLE} and {TABLE}-0..{self.shards - 1}"


class NftablesDataPlane:
    """`runner` and `addresses` replace libnftables/nft and the netlink address dump in
    tests; `probe=False` skips the kernel's NAT check (done by the caller); `shards`
    is the least number of shard tables (more as the service ports need them)."""

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
        self.options = options
        self.runner = runner or NftRunner()
        self.clear_conntrack = clear_conntrack
        self._addresses = addresses or node_addresses
        self._families: dict[Family, _FamilyState] = {}
        refused: list[str] = []
        for family in options.families:
            reason = nat_unsupported(family) if probe else None
            if reason:
                refused.append(reason)
                log.warning("family dropped: nf_tables cannot do NAT for it here",
                            extra={"family": family.label, "reason": reason})
                continue
            self._families[family] = _FamilyState(family, shards)
        if not self._families:
            raise NftablesUnavailable(
                f"this kernel's nf_tables cannot do NAT ({'; '.join(refused) or 'no family'})"
                "; load nft_chain_nat or use --proxy-mode iptables or ipvs")
        self.failures = 0  # transactions refused since start (a metric's source)
        self._watch: NftablesListener | None = None
        self._foreign: list[str] = []  # foreign transactions on our tables, not yet checked
        self._foreign_lock = threading.Lock()

    @property
    def mode(self) -> str:
        return "nftables"

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
        details: dict[str, Any] = {}
        ports = state.ports
        for family, fam in self._families.items():
            ctx = context_for(family, self.options, node_ips)
            is_full = full or fam.state is None or ctx != fam.context
            started = time.perf_counter()
            # O(changes) when `state` follows the last one applied (snapshot.py).
            changed = {k for k in state.changed_since(fam.last) if k.family is family}
            text: str | Script
            try:
                if is_full:
                    text, table = self._full(fam, state, ctx)
                else:
                    assert fam.state is not None
                    table = fam.state
                    text = partial_script(table, {
                        k: render_port(ports[k], ctx, table.shards,
                                       kept_slots(table.ports.get(k)))
                        if k in ports else None for k in changed})
                render_seconds = time.perf_counter() - started
                started = time.perf_counter()
                # Nobody of ours listening while we write everything: the kernel then
                # announces nothing to us (netlink.MulticastListener.deaf).
                with (self._watch.deaf() if is_full and self._watch is not None
                      else contextlib.nullcontext()):
                    applier = self._run(fam, text, is_full) if text else "none"
            except ApplyError as exc:
                # The other family may still be fine: finish it, then report this one.
                failure = failure or exc
                continue
            elapsed = time.perf_counter() - started
            lines = text.count("\n") if isinstance(text, str) else text.count or 0
            any_full |= is_full
            apply_seconds += elapsed
            operations += lines
            flows += conntrack.stale_flows_between(fam.last.ports if fam.last else {},
                                                   ports, changed)
            written += [k for k in changed if k in ports]
            removed += [k for k in changed if k not in ports]
            fam.state, fam.context, fam.last = table, ctx, state
            details[family.label] = {"full": is_full, "lines": lines, "applier": applier,
                                     "render_seconds": round(render_seconds, 6),
                                     "apply_seconds": round(elapsed, 6)}
        cleared = conntrack.clear_after_sync(flows) if self.clear_conntrack else 0
        if any_full:  # the script and batch were tens of MB: give the heap back
            heap.release_free_memory()
        if failure is not None:
            raise failure
        log.info("nftables sync applied", extra={
            "full": any_full, "written": len(written), "removed": len(removed),
            "lines": operations, "apply_seconds": round(apply_seconds, 4),
            "conntrack_cleared": cleared})
        return SyncReport(full=any_full, written=tuple(sorted(written)),
                          removed=tuple(sorted(removed)), operations=operations,
                          apply_seconds=apply_seconds, conntrack_cleared=cleared,
                          details=details)

    def _full(self, fam: _FamilyState, state: DesiredState,
              ctx: RenderContext) -> tuple[Script, TableState]:
        tables, chains, sets = self._kernel_objects(fam)
        ports = {k: v for k, v in state.ports.items() if k.family is fam.family}
        shards = max(fam.shards, shards_for(len(ports)))
        bases = [render_base(ctx), *(render_shard(ctx, shard_table(i)) for i in range(shards))]
        text, table = full_lines(bases, {k: render_port(v, ctx, shards)
                                          for k, v in ports.items()}, chains, sets, tables)
        fam.shards = shards
        return text, table

    def _kernel_objects(self, fam: _FamilyState
                        ) -> tuple[set[str], list[tuple[str, str]], dict[tuple[str, str], str]]:
        """Our tables, and the (table, name) of their chains and of their sets and maps
        (-> "set" or "map"), as the kernel holds them now."""
        try:
            return self.runner.names(fam.family, OUR_TABLES)
        except NftError as exc:
            self._failed(fam, str(exc), None, True)
            raise ApplyError(f"cannot read back our {table_family(fam.family)} tables: "
                             f"{exc}") from exc

    def _run(self, fam: _FamilyState, text: str | Script, full: bool) -> str:
        """Apply `text`; which applier took it: encoded into netlink here (module
        docstring), or nft for what the encoder does not speak."""
        try:
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
        except NftError as exc:
            self._failed(fam, str(exc), exc.offending, full, exc.line)
            raise ApplyError(f"nf_tables refused the {'full' if full else 'partial'} "
                             f"transaction on {fam.tables}: {exc}",
                             offending=exc.offending) from exc

    def _failed(self, fam: _FamilyState, error: str, offending: str | None, full: bool,
                line: int | None = None) -> None:
        self.failures += 1
        fam.state = None  # what the kernel holds is no longer certain: next sync is full
        log.error("nftables transaction failed; previous rules stay, next sync is full",
                  extra={"family": fam.family.label, "tables": fam.tables, "full": full,
                         "line": line, "offending": offending, "error": error[-2000:]})

    # --- the rest of the contract -------------------------------------------------------------

    def applied_rules(self, key: ServicePortKey) -> Sequence[str]:
        fam = self._families.get(key.family)
        if fam is None or fam.state is None or fam.last is None or fam.context is None:
            return ()
        if key not in fam.state.ports or key not in fam.last.ports:
            return ()
        # The state keeps digests, not rules: render them again from what they were
        # rendered from (pure, so the same text).
        objects = render_port(fam.last.ports[key], fam.context, fam.state.shards,
                              kept_slots(fam.state.ports[key]))
        return objects.lines(key.family)

    def housekeeping(self) -> None:
        """Nothing to do between syncs: affinity entries expire in the kernel."""

    def watch_drift(self, notify: Callable[[str], None]) -> None:
        """Listen to nf_tables' announcements; a transaction on one of our tables that we
        did not make is drift (`check_drift` then says so, and the next sync repairs)."""
        if self._watch is not None:
            return

        def foreign(reason: str) -> None:
            with self._foreign_lock:
                self._foreign.append(reason)
            notify(reason)

        self._watch = NftablesListener({(NFPROTO[f], t) for f in self._families
                                        for t in OUR_TABLES},
                                       self.runner.started_here, foreign)
        self._watch.start()
        log.info("watching for changes to our tables by other processes",
                 extra={"how": "nf_tables announcements",
                        "tables": [f"{table_family(f)} {TABLE}, {TABLE}-0..{MAX_SHARDS - 1}"
                                    for f in self._families]})

    def check_drift(self) -> list[str]:
        """How our tables differ from what we last applied ([] when they agree): any
        foreign transaction on them, or chains and sets missing or extra by name."""
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
                fam.state = None
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
        for fam in self._families.values():
            fam.state, fam.context, fam.last = None, None, None
            fam.shards = self.min_shards

    def close(self) -> None:
        if self._watch is not None:
            self._watch.stop()
            self._watch = None
        self.runner.close()
