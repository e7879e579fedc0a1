"""The IPVS data plane: make the kernel's IPVS table, dummy-interface addresses, ipsets
and our few iptables rules match the desired state.

A full sync (the first one, periodic ones, and any after a failure) reads the kernel's
IPVS table and the dummy interface back over netlink and applies only the difference,
so a restart or someone's `ipvsadm -D` is repaired without disturbing anything that is
already right; it also rewrites every ipset (atomic swaps) and our iptables chains. A
partial sync re-renders only the service ports that changed and applies their
difference against what the last syncs left in the kernel.

The plane holds the render index and the sync logic; the jobs it hands out have their
own modules: virtual_servers.py (the IPVS table, batched), drain.py (real servers that
drain), dummy_interface.py (the interface and its addresses), ipsets_iptables.py (the
ipset and iptables side).

Every method runs on the agent's one data-plane thread (pyroute2 sockets stay there)
and in that thread's network namespace. Netlink failures are logged, counted and
reported as one ApplyError at the end of the sync, after everything else has been
applied; the next sync is then a full one, which repairs half-built virtual servers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from proxy.dataplane.base import (
    ApplyError,
    DataplaneOptions,
    GiveWay,
    PortTraffic,
    SyncReport,
    TrafficRead,
    offer_lock,
    read_now,
)
from proxy.dataplane.common import conntrack, fail_fast
from proxy.dataplane.common.drift_watch import (
    LegacyCanary,
    NftablesListener,
    how_xtables_are_watched,
)
from proxy.dataplane.ipvs.diff import Op, OpKind
from proxy.dataplane.ipvs.drift import LinkListener
from proxy.dataplane.ipvs.dummy_interface import DummyInterface
from proxy.dataplane.ipvs.index import RenderIndex, Touched
from proxy.dataplane.ipvs.ipsets_iptables import IpsetsAndIptables
from proxy.dataplane.ipvs.kernel import Ipsets, IpvsTable, Links, ensure_sysctls
from proxy.dataplane.ipvs.netfilter import ipset_replace, ipset_update
from proxy.dataplane.ipvs.ownership import Claims, is_ours, read_claims
from proxy.dataplane.ipvs.render import (
    DUMMY_INTERFACE,
    IpvsContext,
    PortChange,
    PortRules,
    RealServerChange,
    VsKey,
    describe_entries,
    describe_vs,
    render_all,
    render_change,
    render_port,
)
from proxy.dataplane.ipvs.run_record import RunRecord
from proxy.dataplane.ipvs.sample import TableSampler
from proxy.dataplane.ipvs.traffic import TrafficReader
from proxy.dataplane.ipvs.virtual_servers import VirtualServers
from proxy.dataplane.xtables.restore_runner import Backend, IptablesRunner
from proxy.model.snapshot import DesiredState, ResolvedServicePort
from proxy.model.types import Family, IPAddress, ServicePortKey

log = logging.getLogger(__name__)

DRIFT_LIMIT = 8  # differences described by one check, then how many more


@dataclass(slots=True)
class KernelHandles:
    """What the plane opened on its thread (pyroute2 sockets stay there)."""

    ipvs: IpvsTable
    links: Links
    ipsets: Ipsets
    runners: dict[Family, IptablesRunner]
    thread: int

    def close(self) -> None:
        self.ipvs.close()
        self.links.close()


def _open_handles(options: DataplaneOptions, backend: Backend | None, dummy_name: str,
                  thread: int) -> KernelHandles:
    """Open the plane's kernel handles; a family whose iptables tools or kernel support
    are missing is dropped (no runner)."""
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
    for family in options.families:
        runner = IptablesRunner(family, backend)
        backend = runner.backend  # detect once
        if runner.available():
            runners[family] = runner
        else:
            log.warning("family dropped: its iptables tools or kernel support are "
                        "missing", extra={"family": family.label,
                                          "binary": runner.restore_cmd})
    return KernelHandles(ipvs, Links(dummy_name), Ipsets(), runners, thread)


class IpvsDataPlane:
    """`proxy.dataplane.base.DataPlane` in IPVS mode."""

    def __init__(self, options: DataplaneOptions, *, iptables_backend: Backend | None = None,
                 dummy_interface: str = DUMMY_INTERFACE,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.options = options
        self._backend = iptables_backend
        self._h: KernelHandles | None = None
        self._families: tuple[Family, ...] = options.families
        self._index = RenderIndex()
        self._ctx: IpvsContext | None = None
        self._last: DesiredState | None = None
        self._applied: dict[ServicePortKey, PortRules] = {}
        self._servers = VirtualServers(clock, options.ipvs_drain_timeout)
        self._dummy = DummyInterface(dummy_interface)
        self._netfilter = IpsetsAndIptables(options)
        self._need_full = True
        self._watches: list[NftablesListener | LegacyCanary | LinkListener] = []
        self._sampler: TableSampler | None = None
        self._traffic = TrafficReader()
        self._fail_fast = fail_fast.FailFast(ipvs=True)
        # What the last `cleanup` removed (for its caller's log line).
        self.cleaned: dict[str, int] = {}

    @property
    def mode(self) -> str:
        return "ipvs"

    # --- set-up ----------------------------------------------------------------------

    def _handles(self) -> KernelHandles:
        me = threading.get_ident()
        if self._h is not None:
            if self._h.thread != me:
                raise RuntimeError("IpvsDataPlane used from a second thread; pyroute2 "
                                   "sockets must stay on the thread that opened them")
            return self._h
        self._h = _open_handles(self.options, self._backend, self._dummy.name, me)
        self._families = tuple(self._h.runners)
        return self._h

    # --- DataPlane -------------------------------------------------------------------

    def sync(self, state: DesiredState, full: bool = False) -> SyncReport:
        h = self._handles()
        full = full or self._need_full or self._last is None
        started = time.perf_counter()
        calls_before = h.ipvs.calls + h.links.calls
        writes_before = h.ipvs.writes
        run = RunRecord()
        if (self.options.nodeport_primary and self._ctx is not None
                and state.primary_ips != self._ctx.primary_ips):
            full = True  # NodePorts follow the Node's new primary addresses
        if full or self._ctx is None:
            ctx, touched = self._full(state, h, run)
        else:
            ctx = self._ctx
            touched = self._partial(state, ctx, h, run)
        self._ctx = ctx
        deleted: dict[str, int] = {}
        reset = 0
        if not run.failures and self._last is not None:
            deleted, reset = self._clear_conntrack(self._last, state,
                                                   touched.written | touched.removed)
        seconds = time.perf_counter() - started
        netlink_calls = h.ipvs.calls + h.links.calls - calls_before
        details = {
            "virtual_servers": len(self._servers.believed),
            "real_servers": self._servers.real_server_count(),
            "draining": len(self._servers.drains),
            "addresses": self._index.address_count(),  # not a copy per sync
            "netlink_calls": netlink_calls,
            "ipvs_changes": h.ipvs.writes - writes_before,
            "ipset_lines": run.ipset_lines,
            "iptables_lines": run.iptables_lines,
            "failed_operations": len(run.failures),
            "flows_reset": reset,
            "families": [f.label for f in self._families],
        }
        if run.failures:
            self._need_full = True
            what, err = run.failures[0]
            raise ApplyError(f"{len(run.failures)} IPVS data plane operation(s) failed; "
                             f"first: {what}: {err}", offending=what)
        self._need_full = False
        self._last = state
        if self._sampler is not None and (full or touched.virtual_servers):
            self._sampler.publish(list(self._servers.believed))
        self._remember_applied(full, touched)
        return SyncReport(
            full=full,
            written=tuple(sorted(touched.written)),
            removed=tuple(sorted(touched.removed)),
            operations=netlink_calls + run.ipset_lines + run.iptables_lines,
            apply_seconds=seconds,
            conntrack_cleared=sum(deleted.values()), conntrack_deleted=deleted,
            flows_reset=reset, details=details,
        )

    def _remember_applied(self, full: bool, touched: Touched) -> None:
        """What `applied_rules` describes: the ports as the last good sync left them."""
        if full:
            self._applied = dict(self._index.ports)
            return
        for key in touched.removed:
            self._applied.pop(key, None)
        for key in touched.written:
            self._applied[key] = self._index.ports[key]

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
            believed = self._servers.believed.get(vs.key)
            weights = {rs: d.weight for rs, d in believed.dests.items()} if believed else None
            owner = self._index.virtual_server(vs.key)
            if owner is not None and owner[0] != key:
                lines.append(f"{vs.key}: not programmed, claimed by {owner[0]} as well")
                continue
            lines.extend(describe_vs(vs, weights))
        lines.extend(describe_entries(rules))
        return lines

    def traffic_reader(self, give_way: GiveWay = offer_lock) -> TrafficRead:
        return read_now(self)  # its handles are this thread's

    def traffic(self) -> Mapping[ServicePortKey, PortTraffic]:
        """Each applied port's counts from IPVS's statistics of its virtual servers (and
        real servers, where counted per endpoint): traffic.py."""
        if self._h is None or self._last is None:
            return {}
        return self._traffic.read(self._applied, self._index, self._handles().ipvs,
                                  self.options.traffic_per_endpoint)

    def housekeeping_pending(self) -> bool:
        return False

    def begin_resync(self, repair: bool) -> bool:
        return False  # a full sync is the resync

    def housekeeping(self) -> None:
        """Delete draining real servers that have no connections left or drained long
        enough. Never raises: a failure is logged and makes the next sync a full one."""
        if not self._servers.drains or self._h is None:
            return
        run = RunRecord()
        self._servers.reap(self._servers.drains.servers(), self._handles().ipvs, run)
        if run.failures:
            self._need_full = True

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
        link = LinkListener(self._dummy.name, lambda: self._dummy.index,
                            lambda port: port == rt_port, notify)
        link.start()
        watches: list[NftablesListener | LegacyCanary | LinkListener] = [link]
        backend = next(iter(h.runners.values())).backend if h.runners else None
        if backend is not None:
            watches.append(self._netfilter.watch(h.runners, backend is Backend.NFT, notify))
        self._watches = watches
        sampler = TableSampler(notify)
        sampler.publish(list(self._servers.believed))
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
        found = self._sampled_missing(h.ipvs)
        if found:
            # Difference enough (the full sync rewrites the rest): a flush costs no full
            # check first.
            self._need_full = True
            return found[:DRIFT_LIMIT]
        found += self._netfilter.rule_differences(h.runners)
        found += self._dummy.differences(h.links, self._index.addresses())
        found += self._netfilter.set_differences(h.ipsets, self._families)
        try:
            kernel = h.ipvs.service_keys()
        except Exception as exc:
            found.append(f"the IPVS table could not be read: {exc}")
        else:
            found += self._servers.differences(kernel)
        if found:
            self._need_full = True
        if len(found) > DRIFT_LIMIT:
            found = [*found[:DRIFT_LIMIT], f"and {len(found) - DRIFT_LIMIT} more"]
        return found

    def _sampled_missing(self, ipvs: IpvsTable) -> list[str]:
        """The virtual servers the sampler saw gone that are still gone, asked again."""
        sampled = self._sampler.take_found() if self._sampler is not None else []
        if not sampled:
            return []
        try:
            gone = [k for k in ipvs.missing(sampled) if k in self._servers.believed]
        except Exception as exc:
            return [f"the IPVS table could not be read: {exc}"]
        return [f"virtual server {k} is missing" for k in gone]

    def cleanup(self, *, announce: bool = True) -> None:
        """Remove our virtual servers, dummy interface, chains and ipsets; `cleaned`
        then says how many of each. `announce=False`: the caller logs the summary.
        Only virtual servers provably ours go (ownership.is_ours): a key kube-proxy
        also claims (its kube-ipvs0 holds the address, or its NodePort sets the port)
        is left to it, real servers and all."""
        h = self._handles()
        run = RunRecord()
        if self._sampler is not None:
            self._sampler.publish(())
        doomed = self._ours_to_delete(h, run)
        self._servers.execute(h.ipvs, doomed, [None] * len(doomed), run)
        cleaned = {"virtual servers": len(doomed), "dummy interfaces": 0,
                   "iptables lines": 0, "ipsets": 0}
        if self._dummy.delete(h.links, run):
            cleaned["dummy interfaces"] = 1
            if announce:
                log.info("deleted dummy interface", extra={"interface": self._dummy.name})
        self._netfilter.remove_rules(h.runners, run)
        cleaned["ipsets"] = self._netfilter.destroy_sets(h.ipsets, run)
        self._servers.clear()
        self._index = RenderIndex()
        self._applied.clear()
        self._last = None
        self._need_full = True
        cleaned["iptables lines"] = run.iptables_lines
        self.cleaned = cleaned
        if run.failures:
            what, err = run.failures[0]
            raise ApplyError(f"IPVS clean-up incomplete: {what}: {err}", offending=what)
        if announce:
            log.info("IPVS data plane cleaned up: %d virtual servers deleted", len(doomed),
                     extra={"virtual_servers_deleted": len(doomed)})

    def _ours_to_delete(self, h: KernelHandles, run: RunRecord) -> list[Op]:
        """Deletions of the virtual servers in the kernel that are provably ours."""
        try:
            claims = read_claims(h.links, h.ipsets, self._dummy.name)
            kernel = h.ipvs.service_keys()
        except Exception as exc:
            run.fail("read the IPVS table and its owners", exc)
            return []
        mine = Claims(claims.ours.addresses,
                      claims.ours.keys | frozenset(self._servers.believed))
        kept = sorted((k for k in kernel if mine.claims(k)
                       and claims.kube_proxy.claims(k)), key=VsKey.order)
        if kept:
            log.info("left %d virtual servers that kube-proxy programs too", len(kept),
                     extra={"virtual_servers_kept": len(kept), "first": str(kept[0])})
        return [Op(OpKind.DEL_SERVICE, k) for k in sorted(kernel, key=VsKey.order)
                if is_ours(k, mine, claims.other_addresses, claims.kube_proxy)]

    def close(self) -> None:
        for watch in self._watches:
            watch.stop()
        self._watches = []
        self._netfilter.unwatch()
        if self._sampler is not None:
            self._sampler.stop()
            self._sampler = None
        if self._h is not None:
            self._h.close()
            self._h = None

    # --- full and partial syncs ----------------------------------------------------------

    def _full(self, state: DesiredState, h: KernelHandles,
              run: RunRecord) -> tuple[IpvsContext, Touched]:
        """Everything against the kernel. Node addresses are read at full syncs only (a
        dump of every address, the dummy interface's thousands included): a NodePort
        follows a new node address at the next periodic full sync."""
        try:
            node_addresses, present = self._dummy.set_up(h.links)
        except ApplyError:
            self._need_full = True
            raise
        ctx = IpvsContext.build(self.options, node_addresses, state.primary_ips)
        previous = set(self._index.ports)
        self._index = RenderIndex(render_all(state, ctx, self._families))
        touched = Touched(written=set(self._index.ports),
                          removed=previous - set(self._index.ports))
        desired = self._index.virtual_servers()
        self._log_conflicts(desired)
        # Ownership of virtual servers on node addresses (NodePorts) is only recorded in
        # our SERVICES sets: read them before they are rewritten.
        owned = self._netfilter.owned_by_sets(h.ipsets)
        text = ipset_replace(self._families, self._index.entries())
        if self._netfilter.restore_sets(h.ipsets, text, run):
            self._netfilter.write_rules(h.runners, run)
        try:
            kernel = h.ipvs.services()
        except Exception as exc:
            run.fail("dump IPVS services", exc)
            return ctx, touched
        believed = self._servers.believed
        ours = set(desired) | {k for k in kernel if k.family in self._families and (
            k.address in present or k in owned or k in believed)}
        self._servers.sync_all([(k, desired.get(k), kernel.get(k))
                                for k in sorted(ours, key=VsKey.order)], h.ipvs, run)
        wanted = self._index.addresses()
        self._dummy.change(h.links, wanted - present, present - wanted, run)
        self._servers.reap(self._servers.drains.servers(), h.ipvs, run)
        return ctx, touched

    def _partial(self, state: DesiredState, ctx: IpvsContext, h: KernelHandles,
                 run: RunRecord) -> Touched:
        assert self._last is not None
        keys = state.changed_since(self._last)  # O(changes) when it follows (snapshot.py)
        touched = Touched()
        # Real servers that changed, by virtual server and the port that changed them.
        changed: dict[VsKey, tuple[ServicePortKey, RealServerChange]] = {}
        for key in keys:
            rsp = state.ports.get(key)
            change = self._render_change(key, rsp, ctx)
            if change is not None:
                self._index.update_endpoints(key, change, touched)
                changed.update((k, (key, c)) for k, c in change.real_servers.items())
                continue
            new = render_port(rsp, ctx) if rsp is not None and key.family in self._families \
                else None
            self._index.update(key, new, touched)
        self._log_conflicts(touched.virtual_servers)
        self._netfilter.restore_sets(h.ipsets, ipset_update(touched.entries_added, ()), run)
        new_drains = self._servers.sync(
            [(k, self._index.virtual_server(k), self._servers.believed.get(k))
             for k in sorted(touched.virtual_servers, key=VsKey.order)], h.ipvs, run, changed)
        self._dummy.change(h.links, touched.addresses_added, touched.addresses_removed, run)
        self._netfilter.restore_sets(h.ipsets, ipset_update((), touched.entries_removed), run)
        if new_drains:
            self._servers.reap(new_drains, h.ipvs, run)
        return touched

    def _render_change(self, key: ServicePortKey, rsp: ResolvedServicePort | None,
                       ctx: IpvsContext) -> PortChange | None:
        """The port rendered from its endpoint delta against the one applied last
        (render.render_change, O(change)), when the model gives one and it fits."""
        old = self._last.ports.get(key) if self._last is not None else None
        rules = self._index.ports.get(key)
        delta = rsp.endpoint_delta(old) if rsp is not None and old is not None else None
        if delta is None or rules is None or old is None or rsp is None:
            return None
        return render_change(old, rsp, delta, ctx, rules)

    def _log_conflicts(self, vs_keys: Iterable[VsKey]) -> None:
        for vs_key, owners in self._index.conflicts(vs_keys).items():
            log.warning("service ports %s all claim virtual server %s; %s wins",
                        ", ".join(map(str, owners)), vs_key, owners[0],
                        extra={"virtual_server": str(vs_key),
                               "services": [str(o) for o in owners]})

    # --- conntrack -----------------------------------------------------------------------

    def _clear_conntrack(self, old: DesiredState, new: DesiredState,
                         keys: Iterable[ServicePortKey]) -> tuple[dict[str, int], int]:
        """Delete conntrack entries of UDP/SCTP flows to endpoints that left (shared with
        the iptables plane: with net.ipv4.vs.conntrack=1 IPVS keeps the same tuples).
        Linux 5.9+ already expires a deleted real server's IPVS connections, conntrack
        entries included (expire_nodest_conn=1), so this usually finds nothing there; it
        covers older kernels and entries of real servers deleted by other means. Then
        reset the TCP flows of endpoints that left, where asked (common/fail_fast.py: a
        TCP real server drains at weight 0, its connections kept). What was deleted by
        reason, and how many flows were reset. A failure is logged, not raised: the
        rules themselves are in place."""
        keys = set(keys)
        deleted = conntrack.clear_after_sync(
            conntrack.stale_flows_between(old.ports, new.ports, keys))
        gone = fail_fast.vanished_between(old.ports, new.ports, keys, self.options.fail_fast)
        return deleted, self._fail_fast.end(gone)
