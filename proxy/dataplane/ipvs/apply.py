"""The IPVS data plane: make the kernel's IPVS table, dummy-interface addresses, ipsets
and our few iptables rules match the desired state.

A full sync (the first one, periodic ones, and any after a failure) reads the kernel's
IPVS table and the dummy interface back over netlink and applies only the difference,
so a restart or someone's `ipvsadm -D` is repaired without disturbing anything that is
already right; it also rewrites every ipset (atomic swaps) and our iptables chains. A
partial sync re-renders only the service ports that changed and applies their
difference against what the last syncs left in the kernel.

Every method runs on the agent's one data-plane thread (pyroute2 sockets stay there)
and in that thread's network namespace. Netlink failures are logged, counted and
reported as one ApplyError at the end of the sync, after everything else has been
applied; the next sync is then a full one, which repairs half-built virtual servers.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from proxy.dataplane.base import ApplyError, DataplaneOptions, SyncReport
from proxy.dataplane.common import conntrack
from proxy.dataplane.common.drift_watch import (
    LegacyCanary,
    NftablesListener,
    how_xtables_are_watched,
    watch_xtables,
)
from proxy.dataplane.common.kube_proxy_objects import IPVS_INTERFACE as KUBE_IPVS_INTERFACE
from proxy.dataplane.ipvs.diff import (
    KernelDest,
    KernelService,
    Op,
    OpKind,
    believed_after,
    believed_after_change,
    diff_real_servers,
    diff_service,
    drained,
)
from proxy.dataplane.ipvs.drift import LinkListener
from proxy.dataplane.ipvs.index import Delta, RenderIndex
from proxy.dataplane.ipvs.kernel import IpsetError, Ipsets, IpvsTable, Links, ensure_sysctls
from proxy.dataplane.ipvs.netfilter import (
    cleanup_text,
    differences,
    ipset_replace,
    ipset_update,
    restore_text,
)
from proxy.dataplane.ipvs.ownership import Claims, is_ours, read_claims, read_set_keys
from proxy.dataplane.ipvs.render import (
    DUMMY_INTERFACE,
    SET_PREFIX,
    PortChange,
    PortRules,
    RealServerChange,
    RenderContext,
    RsKey,
    SetRole,
    VirtualServer,
    VsKey,
    address_order,
    describe_entries,
    describe_vs,
    render_all,
    render_change,
    render_port,
    set_name,
    usable_node_address,
)
from proxy.dataplane.ipvs.sample import TableSampler
from proxy.dataplane.xtables.restore_runner import (
    Backend,
    IptablesRunner,
    RunnerError,
)
from proxy.dataplane.xtables.saved import parse_save
from proxy.model.snapshot import DesiredState, ResolvedServicePort
from proxy.model.types import Family, IPAddress, ServicePortKey

log = logging.getLogger(__name__)

DRIFT_LIMIT = 8  # differences described by one check, then how many more


@dataclass(slots=True)
class _Drain:
    since: float
    owner: ServicePortKey | None


@dataclass(frozen=True, slots=True)
class _Plan:
    """One virtual server's operations, what the kernel holds once they succeed, and the
    real-server change they were diffed from (None: diffed whole)."""

    ops: list[Op]
    after: KernelService | None
    change: RealServerChange | None = None


@dataclass(slots=True)
class _Handles:
    ipvs: IpvsTable
    links: Links
    ipsets: Ipsets
    runners: dict[Family, IptablesRunner]
    thread: int

    def close(self) -> None:
        self.ipvs.close()
        self.links.close()


@dataclass(slots=True)
class _Run:
    """Book-keeping of one sync (or cleanup): failures and counts."""

    failures: list[tuple[str, str]] = field(default_factory=list)  # (operation, error)
    ipset_lines: int = 0
    iptables_lines: int = 0

    def fail(self, what: str, exc: BaseException, **extra: Any) -> None:
        self.failures.append((what, str(exc)))
        log.error("IPVS data plane operation failed",
                  extra={"operation": what, "error": str(exc), **extra})


def _error_code(exc: BaseException) -> int | None:
    code = getattr(exc, "code", None)
    return code if isinstance(code, int) else None


class IpvsDataPlane:
    """`proxy.dataplane.base.DataPlane` in IPVS mode."""

    def __init__(
        self,
        options: DataplaneOptions,
        *,
        iptables_backend: Backend | None = None,
        dummy_interface: str = DUMMY_INTERFACE,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.options = options
        self._backend = iptables_backend
        self._dummy_name = dummy_interface
        self._clock = clock
        self._h: _Handles | None = None
        self._families: tuple[Family, ...] = options.families
        self._index = RenderIndex()
        self._ctx: RenderContext | None = None
        self._last: DesiredState | None = None
        self._applied: dict[ServicePortKey, PortRules] = {}
        # What the kernel holds for the virtual servers we own, as far as we know.
        self._believed: dict[VsKey, KernelService] = {}
        self._draining: dict[tuple[VsKey, RsKey], _Drain] = {}
        self._dummy_index: int | None = None
        self._need_full = True
        self.failed_operations = 0  # netlink/ipset/iptables operations that failed, total
        # Held while we write iptables rules, so the legacy canary never reports our own.
        self._writing = threading.Lock()
        self._watches: list[NftablesListener | LegacyCanary | LinkListener] = []
        self._sampler: TableSampler | None = None
        # What the last `cleanup` removed (for its caller's log line).
        self.cleaned: dict[str, int] = {}

    @property
    def mode(self) -> str:
        return "ipvs"

    # --- set-up ----------------------------------------------------------------------

    def _handles(self) -> _Handles:
        me = threading.get_ident()
        if self._h is not None:
            if self._h.thread != me:
                raise RuntimeError("IpvsDataPlane used from a second thread; pyroute2 "
                                   "sockets must stay on the thread that opened them")
            return self._h
        try:
            ipvs = IpvsTable()
        except Exception as exc:
            raise ApplyError(f"IPVS is not available in this kernel ({exc}); load the "
                             "ip_vs module or use --proxy-mode iptables") from exc
        failed = ensure_sysctls()
        if failed:
            log.warning("IPVS sysctls not set; masquerading or draining may misbehave",
                        extra={"sysctls": failed})
        runners: dict[Family, IptablesRunner] = {}
        backend = self._backend
        for family in self.options.families:
            runner = IptablesRunner(family, backend)
            backend = runner.backend  # detect once
            if runner.available():
                runners[family] = runner
            else:
                log.warning("family dropped: its iptables tools or kernel support are "
                            "missing", extra={"family": family.label,
                                              "binary": runner.restore_cmd})
        self._families = tuple(runners)
        self._h = _Handles(ipvs, Links(self._dummy_name), Ipsets(), runners, me)
        return self._h

    # --- DataPlane -------------------------------------------------------------------

    def sync(self, state: DesiredState, full: bool = False) -> SyncReport:
        h = self._handles()
        full = full or self._need_full or self._last is None
        started = time.perf_counter()
        calls_before = h.ipvs.calls + h.links.calls
        writes_before = h.ipvs.writes
        run = _Run()
        if (self.options.nodeport_primary and self._ctx is not None
                and state.primary_ips != self._ctx.primary_ips):
            full = True  # NodePorts follow the Node's new primary addresses
        if full or self._ctx is None:
            # Node addresses are read at full syncs only (a dump of every address, the
            # dummy interface's thousands included): a NodePort follows a new node
            # address at the next periodic full sync.
            try:
                self._dummy_index = h.links.ensure()
                # kube-proxy's dummy interface holds service addresses, not the node's
                # (it is there between the switch from kube-proxy and its clean-up).
                services = {self._dummy_index, h.links.index(KUBE_IPVS_INTERFACE)}
                table = h.links.address_table()
            except Exception as exc:
                self._need_full = True
                self.failed_operations += 1
                raise ApplyError(f"cannot set up dummy interface {self._dummy_name}: {exc}",
                                 offending=f"link {self._dummy_name}") from exc
            ctx = RenderContext.build(
                self.options, (a for i, a in table if i not in services), state.primary_ips)
            present = {a for i, a in table
                       if i == self._dummy_index and usable_node_address(a)}
            delta = self._full(state, ctx, present, h, run)
        else:
            ctx = self._ctx
            delta = self._partial(state, ctx, h, run)
        self._ctx = ctx
        deleted: dict[str, int] = {}
        if not run.failures and self._last is not None:
            deleted = self._clear_conntrack(self._last, state, delta.written | delta.removed)
        seconds = time.perf_counter() - started
        operations = h.ipvs.calls + h.links.calls - calls_before + run.ipset_lines \
            + run.iptables_lines
        details = {
            "virtual_servers": len(self._believed),
            "real_servers": sum(len(s.dests) for s in self._believed.values()),
            "draining": len(self._draining),
            "addresses": self._index.address_count(),  # not a copy per sync
            "netlink_calls": h.ipvs.calls + h.links.calls - calls_before,
            "ipvs_changes": h.ipvs.writes - writes_before,
            "ipset_lines": run.ipset_lines,
            "iptables_lines": run.iptables_lines,
            "failed_operations": len(run.failures),
            "families": [f.label for f in self._families],
        }
        if run.failures:
            self._need_full = True
            self.failed_operations += len(run.failures)
            what, err = run.failures[0]
            raise ApplyError(f"{len(run.failures)} IPVS data plane operation(s) failed; "
                             f"first: {what}: {err}", offending=what)
        self._need_full = False
        self._last = state
        if self._sampler is not None and (full or delta.virtual_servers):
            self._sampler.publish(list(self._believed))
        if full:
            self._applied = dict(self._index.ports)
        else:
            for key in delta.removed:
                self._applied.pop(key, None)
            for key in delta.written:
                self._applied[key] = self._index.ports[key]
        return SyncReport(
            full=full,
            written=tuple(sorted(delta.written)),
            removed=tuple(sorted(delta.removed)),
            operations=operations,
            apply_seconds=seconds,
            conntrack_cleared=sum(deleted.values()), conntrack_deleted=deleted,
            details=details,
        )

    def render_ahead(self, ports: Sequence[ResolvedServicePort],
                     expected: Mapping[Family, int],
                     primary_ips: Sequence[IPAddress] = ()) -> None:
        """Nothing: IPVS's first sync is virtual servers, not one batch to build."""

    def applied_rules(self, key: ServicePortKey) -> Sequence[str]:
        rules = self._applied.get(key)
        if rules is None:
            return []
        lines: list[str] = []
        for vs in rules.virtual_servers:
            believed = self._believed.get(vs.key)
            weights = {rs: d.weight for rs, d in believed.dests.items()} if believed else None
            owner = self._index.virtual_server(vs.key)
            if owner is not None and owner[0] != key:
                lines.append(f"{vs.key}: not programmed, claimed by {owner[0]} as well")
                continue
            lines.extend(describe_vs(vs, weights))
        lines.extend(describe_entries(rules))
        return lines

    def housekeeping(self) -> None:
        """Delete draining real servers that have no connections left or drained long
        enough. Never raises: a failure is logged and makes the next sync a full one."""
        if not self._draining or self._h is None:
            return
        run = _Run()
        self._reap({vs for vs, _ in self._draining}, self._handles(), run)
        if run.failures:
            self._need_full = True
            self.failed_operations += len(run.failures)

    # --- drift: someone else changed what we own ---------------------------------------

    def watch_drift(self, notify: Callable[[str], None]) -> None:
        """Call `notify(reason)` (from another thread) whenever someone else may have
        changed our iptables rules (nf_tables announcements or the legacy canary, as the
        iptables plane) or our dummy interface and its addresses (rtnetlink
        announcements); see drift.py. The IPVS table announces nothing: a rotating
        sample of our virtual servers is asked for every half second (sample.py). Then
        `check_drift` tells whether they did."""
        if self._watches:
            return
        h = self._handles()
        rt_port = h.links.port_id
        watches: list[NftablesListener | LegacyCanary | LinkListener] = [LinkListener(
            self._dummy_name, lambda: self._dummy_index, lambda port: port == rt_port,
            notify)]
        watches[0].start()
        backend = next(iter(h.runners.values())).backend if h.runners else None
        if backend is not None:
            watches.append(watch_xtables(h.runners, backend is Backend.NFT, notify,
                                         self._writing))
        self._watches = watches
        sampler = TableSampler(notify)
        sampler.publish(list(self._believed))
        sampler.start()
        self._sampler = sampler
        log.info("watching for changes to our rules by other processes", extra={
            "backend": backend.value if backend else None,
            "how": ["rtnetlink announcements (dummy interface and its addresses)",
                    how_xtables_are_watched(backend is Backend.NFT),
                    f"{sampler.per_tick} of our virtual servers asked for every "
                    f"{sampler.interval:g} s (the IPVS table announces nothing)"]})

    def check_drift(self) -> list[str]:
        """How what we own in the kernel differs from what we last applied ([] when it
        agrees): our iptables chains and jumps (rule counts), the dummy interface (there,
        up, the same one) and its addresses, our ipsets (present), and which of our
        virtual servers exist (keys and schedulers, not real servers). Any difference
        makes the next sync a full one."""
        if self._h is None or self._last is None or self._need_full:
            return []  # nothing applied yet, or the next sync is full anyway
        h = self._handles()
        found: list[str] = []
        sampled = self._sampler.take_found() if self._sampler is not None else []
        if sampled:
            # The sampler saw these gone: asked again, still gone is difference enough
            # (the full sync rewrites the rest), so a flush costs no full check first.
            try:
                gone = [k for k in h.ipvs.missing(sampled) if k in self._believed]
            except Exception as exc:
                gone, found = [], [f"the IPVS table could not be read: {exc}"]
            found += [f"virtual server {k} is missing" for k in gone]
            if found:
                self._need_full = True
                return found[:DRIFT_LIMIT]
        for family, runner in h.runners.items():
            with self._writing:
                try:
                    saved = parse_save(runner.save())
                except RunnerError as exc:
                    found.append(f"{family.label}: our iptables rules could not be read: {exc}")
                    continue
                finally:
                    self._rebaseline()
            found += [f"{family.label}: {d}" for d in differences(family, self.options, saved)]
        found += self._link_differences(h)
        try:
            sets = set(h.ipsets.names())
        except IpsetError as exc:
            found.append(f"our ipsets could not be listed: {exc}")
        else:
            found += [f"ipset {n} is missing" for n in (
                set_name(role, family) for family in self._families for role in SetRole)
                if n not in sets]
        try:
            kernel = h.ipvs.service_keys()
        except Exception as exc:
            found.append(f"the IPVS table could not be read: {exc}")
        else:
            for key, believed in self._believed.items():
                there = kernel.get(key)
                if there is None:
                    found.append(f"virtual server {key} is missing")
                elif there.scheduler != believed.scheduler or there.flags != believed.flags:
                    found.append(f"virtual server {key} was changed (scheduler "
                                 f"{there.scheduler}, flags {there.flags:#x})")
        if found:
            self._need_full = True
        if len(found) > DRIFT_LIMIT:
            found = [*found[:DRIFT_LIMIT], f"and {len(found) - DRIFT_LIMIT} more"]
        return found

    def _link_differences(self, h: _Handles) -> list[str]:
        try:
            state = h.links.state()
        except Exception as exc:
            return [f"dummy interface {self._dummy_name} could not be read: {exc}"]
        if state is None:
            return [f"dummy interface {self._dummy_name} is missing"]
        index, up = state
        if index != self._dummy_index:
            return [f"dummy interface {self._dummy_name} was re-created"]
        found = [] if up else [f"dummy interface {self._dummy_name} is down"]
        try:
            present = {a for a in h.links.addresses(index) if usable_node_address(a)}
        except Exception as exc:
            return [*found, f"addresses of {self._dummy_name} could not be read: {exc}"]
        wanted = self._index.addresses()
        missing = sorted(wanted - present, key=address_order)
        extra = sorted(present - wanted, key=address_order)
        if missing:
            found.append(f"{len(missing)} address(es) missing from {self._dummy_name}, "
                         f"first {missing[0]}")
        if extra:
            found.append(f"{len(extra)} address(es) on {self._dummy_name} that are not "
                         f"ours, first {extra[0]}")
        return found

    def _rebaseline(self) -> None:
        """Our iptables write is done (caller holds `_writing`): the legacy canary's
        summaries of now are ours."""
        for watch in self._watches:
            if isinstance(watch, LegacyCanary):
                watch.rebaseline()

    def cleanup(self, *, announce: bool = True) -> None:
        """Remove our virtual servers, dummy interface, chains and ipsets; `cleaned`
        then says how many of each. `announce=False`: the caller logs the summary.
        Only virtual servers provably ours go (ownership.is_ours): a key kube-proxy
        also claims (its kube-ipvs0 holds the address, or its NodePort sets the port)
        is left to it, real servers and all."""
        h = self._handles()
        run = _Run()
        if self._sampler is not None:
            self._sampler.publish(())
        doomed: list[Op] = []
        try:
            claims = read_claims(h.links, h.ipsets, self._dummy_name)
            kernel = h.ipvs.service_keys()
        except Exception as exc:
            run.fail("read the IPVS table and its owners", exc)
        else:
            mine = Claims(claims.ours.addresses, claims.ours.keys | frozenset(self._believed))
            doomed = [Op(OpKind.DEL_SERVICE, k) for k in sorted(kernel, key=VsKey.order)
                      if is_ours(k, mine, claims.other_addresses, claims.kube_proxy)]
            kept = sorted((k for k in kernel if mine.claims(k)
                           and claims.kube_proxy.claims(k)), key=VsKey.order)
            if kept:
                log.info("left %d virtual servers that kube-proxy programs too", len(kept),
                         extra={"virtual_servers_kept": len(kept), "first": str(kept[0])})
        self._execute(h, doomed, [None] * len(doomed), run)
        cleaned = {"virtual servers": len(doomed), "dummy interfaces": 0,
                   "iptables lines": 0, "ipsets": 0}
        try:
            if h.links.delete():
                cleaned["dummy interfaces"] = 1
                if announce:
                    log.info("deleted dummy interface", extra={"interface": self._dummy_name})
        except Exception as exc:
            run.fail(f"delete link {self._dummy_name}", exc)
        for family, runner in h.runners.items():
            try:
                with self._writing:
                    text = cleanup_text(parse_save(runner.save()))
                    if text:
                        runner.restore(text, noflush=True)
                        run.iptables_lines += text.count("\n")
                    self._rebaseline()
            except RunnerError as exc:
                run.fail(f"remove iptables chains ({family.label})", exc)
        try:
            ours = [n for n in h.ipsets.names() if n.startswith(SET_PREFIX)]
            if ours:  # after the iptables rules: a set in use cannot be destroyed
                h.ipsets.restore("".join(f"destroy {n}\n" for n in ours))
                cleaned["ipsets"] = len(ours)
        except IpsetError as exc:
            run.fail("destroy ipsets", exc)
        self._believed.clear()
        self._draining.clear()
        self._index = RenderIndex()
        self._applied.clear()
        self._last = None
        self._dummy_index = None
        self._need_full = True
        cleaned["iptables lines"] = run.iptables_lines
        self.cleaned = cleaned
        if run.failures:
            self.failed_operations += len(run.failures)
            what, err = run.failures[0]
            raise ApplyError(f"IPVS clean-up incomplete: {what}: {err}", offending=what)
        if announce:
            log.info("IPVS data plane cleaned up: %d virtual servers deleted", len(doomed),
                     extra={"virtual_servers_deleted": len(doomed)})

    def close(self) -> None:
        for watch in self._watches:
            watch.stop()
        self._watches = []
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self._h is not None:
            self._h.close()
            self._h = None

    # --- full and partial syncs ----------------------------------------------------------

    def _full(self, state: DesiredState, ctx: RenderContext, present: set[IPAddress],
              h: _Handles, run: _Run) -> Delta:
        """Everything against the kernel: `present` are the dummy interface's addresses."""
        previous = set(self._index.ports)
        self._index = RenderIndex(render_all(state, ctx, self._families))
        delta = Delta(written=set(self._index.ports), removed=previous - set(self._index.ports))
        desired = self._index.virtual_servers()
        self._log_conflicts(desired)
        # Ownership of virtual servers on node addresses (NodePorts) is only recorded in
        # our SERVICES sets: read them before they are rewritten.
        owned = self._owned_by_sets(h)
        text = ipset_replace(self._families, self._index.entries())
        if self._ipset_restore(h, text, run):
            self._write_iptables(h, run)
        try:
            kernel = h.ipvs.services()
        except Exception as exc:
            run.fail("dump IPVS services", exc)
            return delta
        ours = set(desired) | {k for k in kernel if k.family in self._families and (
            k.address in present or k in owned or k in self._believed)}
        self._believed = {}
        self._sync_servers([(k, desired.get(k), kernel.get(k))
                            for k in sorted(ours, key=VsKey.order)], h, run)
        self._draining = {k: d for k, d in self._draining.items() if k[0] in self._believed}
        wanted = self._index.addresses()
        self._addresses(h, wanted - present, present - wanted, run)
        self._reap({vs for vs, _ in self._draining}, h, run)
        return delta

    def _partial(self, state: DesiredState, ctx: RenderContext, h: _Handles,
                 run: _Run) -> Delta:
        assert self._last is not None
        keys = state.changed_since(self._last)  # O(changes) when it follows (snapshot.py)
        delta = Delta()
        # Real servers that changed, by virtual server and the port that changed them.
        changed: dict[VsKey, tuple[ServicePortKey, RealServerChange]] = {}
        for key in keys:
            rsp = state.ports.get(key)
            change = self._render_change(key, rsp, ctx)
            if change is not None:
                self._index.update_endpoints(key, change, delta)
                changed.update((k, (key, c)) for k, c in change.real_servers.items())
                continue
            new = render_port(rsp, ctx) if rsp is not None and key.family in self._families \
                else None
            self._index.update(key, new, delta)
        self._log_conflicts(delta.virtual_servers)
        self._ipset_restore(h, ipset_update(delta.entries_added, ()), run)
        new_drains = self._sync_servers(
            [(k, self._index.virtual_server(k), self._believed.get(k))
             for k in sorted(delta.virtual_servers, key=VsKey.order)], h, run, changed)
        self._addresses(h, delta.addresses_added, delta.addresses_removed, run)
        self._ipset_restore(h, ipset_update((), delta.entries_removed), run)
        if new_drains:
            self._reap(new_drains, h, run)
        return delta

    def _render_change(self, key: ServicePortKey, rsp: ResolvedServicePort | None,
                       ctx: RenderContext) -> PortChange | None:
        """The port rendered from its endpoint delta against the one applied last
        (render.render_change, O(change)), when the model gives one and it fits."""
        old = self._last.ports.get(key) if self._last is not None else None
        rules = self._index.ports.get(key)
        delta = rsp.endpoint_delta(old) if rsp is not None and old is not None else None
        if delta is None or rules is None or old is None or rsp is None:
            return None
        return render_change(old, rsp, delta, ctx, rules)

    def _sync_servers(
        self,
        items: list[tuple[VsKey, tuple[ServicePortKey, VirtualServer] | None,
                          KernelService | None]],
        h: _Handles,
        run: _Run,
        changed: Mapping[VsKey, tuple[ServicePortKey, RealServerChange]] | None = None,
    ) -> set[VsKey]:
        """Apply each virtual server's difference (desired: (owner, server) or None), all
        operations in one batched exchange; returns those whose real servers started
        draining. `changed`: servers whose real servers alone changed, and how (diffed
        in O(change) when the port that changed them still owns them)."""
        plans = [(vs_key, entry, current, self._plan(vs_key, entry, current, changed or {}))
                 for vs_key, entry, current in items]
        ops = [op for *_, plan in plans for op in plan.ops]
        owners = [entry[0] if entry else None for _k, entry, _c, plan in plans
                  for _ in plan.ops]
        results = iter(self._execute(h, ops, owners, run))
        now = self._clock()
        started: set[VsKey] = set()
        for vs_key, entry, current, plan in plans:
            vs_ops, after = plan.ops, plan.after
            outcomes = [next(results) for _ in vs_ops]  # consume them all, not just to a False
            ok = all(outcomes)
            if entry is None:
                if ok:
                    self._believed.pop(vs_key, None)
                    self._draining = {k: d for k, d in self._draining.items()
                                      if k[0] != vs_key}
                continue
            owner, desired = entry
            assert after is not None
            if not ok:
                # Unknown now; the next sync is full and reads the kernel back.
                self._believed[vs_key] = current or after
                continue
            self._believed[vs_key] = after
            # Only what changed can have stopped or started draining.
            came = plan.change.added if plan.change else desired.real_servers
            for rs in came:
                self._draining.pop((vs_key, rs), None)
            went = plan.change.removed if plan.change else after.dests
            for rs in went:
                dest = after.dests.get(rs)
                if dest is not None and dest.weight == 0 and (vs_key, rs) not in self._draining:
                    self._draining[(vs_key, rs)] = _Drain(now, owner)
                    started.add(vs_key)
                    log.info("real server %s of %s (%s) draining", rs, vs_key, owner, extra={
                        "service": str(owner), "virtual_server": str(vs_key),
                        "real_server": str(rs), "timeout": self.options.ipvs_drain_timeout})
        return started

    @staticmethod
    def _plan(vs_key: VsKey, entry: tuple[ServicePortKey, VirtualServer] | None,
              current: KernelService | None,
              changed: Mapping[VsKey, tuple[ServicePortKey, RealServerChange]]) -> _Plan:
        """One server's operations and what the kernel holds once they succeed."""
        desired = entry[1] if entry else None
        change = changed.get(vs_key)
        if entry is not None and desired is not None and current is not None \
                and change is not None and change[0] == entry[0]:
            ops = diff_real_servers(desired, current, change[1])
            if ops is not None:
                return _Plan(ops, believed_after_change(desired, current, change[1]),
                             change[1])
        return _Plan(diff_service(desired, current), believed_after(desired, current))

    def _execute(self, h: _Handles, ops: list[Op], owners: list[ServicePortKey | None],
                 run: _Run) -> list[bool]:
        """Carry out `ops` in order; whether each reached its goal (deleting what is
        already gone counts as done)."""
        if not ops:
            return []
        try:
            codes = h.ipvs.apply_many(ops)
        except Exception as exc:  # the socket itself failed: nothing is known
            run.fail(f"{len(ops)} IPVS operations starting with {ops[0]}", exc)
            return [False] * len(ops)
        done = []
        failed_services: set[VsKey] = set()
        for op, owner, code in zip(ops, owners, codes, strict=True):
            if not code or (op.kind in (OpKind.DEL_SERVICE, OpKind.DEL_DEST)
                            and code in (errno.ENOENT, errno.ESRCH)):
                done.append(True)
                log.debug("IPVS operation %s", op, extra={
                    "operation": str(op), "service": str(owner) if owner else None})
                continue
            done.append(False)
            if op.vs in failed_services:
                continue  # its virtual server could not be made: one error is enough
            if op.kind is OpKind.ADD_SERVICE:
                failed_services.add(op.vs)
            why = os.strerror(code)
            if op.service is not None and code == errno.ENOENT:
                # The kernel's answer for a scheduler it cannot load.
                why += (f" (is the IPVS scheduler {op.service.scheduler!r} available? "
                        f"modprobe ip_vs_{op.service.scheduler})")
            run.fail(str(op), OSError(code, why), service=str(owner) if owner else None)
        return done

    def _reap(self, vs_keys: Iterable[VsKey], h: _Handles, run: _Run) -> None:
        """Delete the draining real servers of `vs_keys` that may go now."""
        now = self._clock()
        timeout = self.options.ipvs_drain_timeout
        pending: dict[VsKey, list[tuple[RsKey, _Drain]]] = {}
        for (v, rs), drain in self._draining.items():
            pending.setdefault(v, []).append((rs, drain))
        doomed: list[tuple[Op, _Drain, KernelDest]] = []
        for vs_key in sorted(set(vs_keys) & set(pending), key=VsKey.order):
            try:
                dests = h.ipvs.dests(vs_key)
            except Exception as exc:
                run.fail(f"dump real servers of {vs_key}", exc)
                continue
            for rs, drain in pending[vs_key]:
                dest = dests.get(rs)
                if dest is None:  # gone already (deleted by hand, or with its server)
                    self._forget_drain(vs_key, rs)
                elif drained(dest, drain.since, now, timeout):
                    doomed.append((Op(OpKind.DEL_DEST, vs_key, rs=rs), drain, dest))
        results = self._execute(h, [op for op, _d, _k in doomed],
                                [d.owner for _o, d, _k in doomed], run)
        for (op, drain, dest), ok in zip(doomed, results, strict=True):
            if not ok:
                continue
            assert op.rs is not None
            self._forget_drain(op.vs, op.rs)
            reason = "idle" if dest.connections == 0 else "drain timeout"
            log.info("real server %s of %s (%s) deleted after draining: %s", op.rs, op.vs,
                     drain.owner, reason, extra={
                         "service": str(drain.owner) if drain.owner else None,
                         "virtual_server": str(op.vs), "real_server": str(op.rs),
                         "reason": reason, "connections": dest.connections,
                         "drained_seconds": round(now - drain.since, 3)})

    def _forget_drain(self, vs_key: VsKey, rs: RsKey) -> None:
        self._draining.pop((vs_key, rs), None)
        believed = self._believed.get(vs_key)
        if believed is not None and rs in believed.dests:
            self._believed[vs_key] = KernelService(
                believed.key, believed.scheduler, believed.flags, believed.timeout,
                {k: v for k, v in believed.dests.items() if k != rs})

    # --- addresses, ipsets, iptables ---------------------------------------------------

    def _addresses(self, h: _Handles, add: Iterable[IPAddress], remove: Iterable[IPAddress],
                   run: _Run) -> None:
        index = self._dummy_index
        assert index is not None
        adding = sorted(add, key=address_order)
        removing = sorted(remove, key=address_order)
        if not adding and not removing:
            return
        try:
            codes = h.links.change(index, adding, removing)
        except Exception as exc:
            run.fail(f"change addresses of {self._dummy_name}", exc)
            return
        for address, code in zip(adding, codes[:len(adding)], strict=True):
            if code and code != errno.EEXIST:
                run.fail(f"add address {address} to {self._dummy_name}",
                         OSError(code, os.strerror(code)))
        for address, code in zip(removing, codes[len(adding):], strict=True):
            if code and code != errno.EADDRNOTAVAIL:
                run.fail(f"delete address {address} from {self._dummy_name}",
                         OSError(code, os.strerror(code)))

    def _ipset_restore(self, h: _Handles, text: str, run: _Run) -> bool:
        if not text:
            return True
        try:
            h.ipsets.restore(text)
        except IpsetError as exc:
            run.fail(exc.offending or "ipset restore", exc)
            return False
        run.ipset_lines += text.count("\n")
        return True

    def _write_iptables(self, h: _Handles, run: _Run) -> None:
        for family, runner in h.runners.items():
            try:
                with self._writing:
                    text = restore_text(family, self.options, parse_save(runner.save()))
                    try:
                        runner.restore(text, noflush=True)
                    finally:
                        self._rebaseline()
                run.iptables_lines += text.count("\n")
            except RunnerError as exc:
                run.fail(getattr(exc, "offending", None) or f"iptables-restore ({family.label})",
                         exc, family=family.label)

    def _owned_by_sets(self, h: _Handles) -> set[VsKey]:
        """Virtual servers our SERVICES sets list (what an earlier run programmed)."""
        return read_set_keys(h.ipsets, (set_name(SetRole.SERVICES, f) for f in Family))

    def _log_conflicts(self, vs_keys: Iterable[VsKey]) -> None:
        for vs_key, owners in self._index.conflicts(vs_keys).items():
            log.warning("service ports %s all claim virtual server %s; %s wins",
                        ", ".join(map(str, owners)), vs_key, owners[0],
                        extra={"virtual_server": str(vs_key),
                               "services": [str(o) for o in owners]})

    # --- conntrack -----------------------------------------------------------------------

    def _clear_conntrack(self, old: DesiredState, new: DesiredState,
                         keys: Iterable[ServicePortKey]) -> dict[str, int]:
        """Delete conntrack entries of UDP/SCTP flows to endpoints that left (shared with
        the iptables plane: with net.ipv4.vs.conntrack=1 IPVS keeps the same tuples).
        Linux 5.9+ already expires a deleted real server's IPVS connections, conntrack
        entries included (expire_nodest_conn=1), so this usually finds nothing there; it
        covers older kernels and entries of real servers deleted by other means.
        A failure is logged, not raised: the rules themselves are in place."""
        return conntrack.clear_after_sync(conntrack.stale_flows_between(old.ports, new.ports,
                                                                         keys))
