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
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import Any

from proxy.dataplane import conntrack
from proxy.dataplane.base import ApplyError, DataplaneOptions, SyncReport
from proxy.dataplane.iptables.runner import Backend, IptablesRunner, RunnerError
from proxy.dataplane.ipvs.diff import (
    KernelService,
    Op,
    OpKind,
    believed_after,
    diff_service,
    drained,
)
from proxy.dataplane.ipvs.index import Delta, RenderIndex
from proxy.dataplane.ipvs.kernel import IpsetError, Ipsets, IpvsTable, Links, ensure_sysctls
from proxy.dataplane.ipvs.netfilter import (
    cleanup_text,
    ipset_replace,
    ipset_update,
    parse_ipset_save,
    restore_text,
)
from proxy.dataplane.ipvs.render import (
    DUMMY_INTERFACE,
    SET_PREFIX,
    PortRules,
    RenderContext,
    RsKey,
    SetRole,
    VirtualServer,
    VsKey,
    address_order,
    describe_entries,
    describe_vs,
    needs_node_addresses,
    render_all,
    render_port,
    set_name,
    usable_node_address,
)
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family, IPAddress, Protocol, ServicePortKey

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _Drain:
    since: float
    owner: ServicePortKey | None


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
        log.error("IPVS data plane operation failed: %s: %s", what, exc,
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
        try:
            if full or self._dummy_index is None:
                self._dummy_index = h.links.ensure()
            node_addresses = h.links.node_addresses(exclude=self._dummy_index)
        except Exception as exc:
            self._need_full = True
            self.failed_operations += 1
            raise ApplyError(f"cannot set up dummy interface {self._dummy_name}: {exc}",
                             offending=f"link {self._dummy_name}") from exc
        ctx = RenderContext.build(self.options, node_addresses)
        delta = self._full(state, ctx, h, run) if full else self._partial(state, ctx, h, run)
        self._ctx = ctx
        cleared = 0
        if not run.failures and self._last is not None:
            cleared = self._clear_conntrack(self._last, state, delta.written | delta.removed)
        seconds = time.perf_counter() - started
        operations = h.ipvs.calls + h.links.calls - calls_before + run.ipset_lines \
            + run.iptables_lines
        details = {
            "virtual_servers": sum(1 for _ in self._believed),
            "real_servers": sum(len(s.dests) for s in self._believed.values()),
            "draining": len(self._draining),
            "addresses": len(self._index.addresses()),
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
            conntrack_cleared=cleared,
            details=details,
        )

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

    def cleanup(self) -> None:
        h = self._handles()
        run = _Run()
        index = h.links.index()
        dummy_addresses = self._dummy_addresses(h, index) if index is not None else set()
        owned = self._owned_by_sets(h)
        try:
            kernel = h.ipvs.services()
        except Exception as exc:
            run.fail("dump IPVS services", exc)
            kernel = {}
        for vs_key in sorted(kernel, key=VsKey.order):
            if vs_key.address in dummy_addresses or vs_key in owned or vs_key in self._believed:
                self._do(h, Op(OpKind.DEL_SERVICE, vs_key), run)
        try:
            if h.links.delete():
                log.info("deleted dummy interface", extra={"interface": self._dummy_name})
        except Exception as exc:
            run.fail(f"delete link {self._dummy_name}", exc)
        for family, runner in h.runners.items():
            try:
                text = cleanup_text({t: runner.save(t) for t in ("nat", "filter")})
                if text:
                    runner.restore(text, noflush=True)
                    run.iptables_lines += text.count("\n")
            except RunnerError as exc:
                run.fail(f"remove iptables chains ({family.label})", exc)
        try:
            ours = [n for n in h.ipsets.names() if n.startswith(SET_PREFIX)]
            if ours:  # after the iptables rules: a set in use cannot be destroyed
                h.ipsets.restore("".join(f"destroy {n}\n" for n in ours))
        except IpsetError as exc:
            run.fail("destroy ipsets", exc)
        self._believed.clear()
        self._draining.clear()
        self._index = RenderIndex()
        self._applied.clear()
        self._last = None
        self._dummy_index = None
        self._need_full = True
        if run.failures:
            self.failed_operations += len(run.failures)
            what, err = run.failures[0]
            raise ApplyError(f"IPVS clean-up incomplete: {what}: {err}", offending=what)
        log.info("IPVS data plane cleaned up", extra={"virtual_servers_deleted": len(
            [k for k in kernel if k.address in dummy_addresses or k in owned])})

    def close(self) -> None:
        if self._h is not None:
            self._h.close()
            self._h = None

    # --- full and partial syncs ----------------------------------------------------------

    def _full(self, state: DesiredState, ctx: RenderContext, h: _Handles, run: _Run) -> Delta:
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
        assert self._dummy_index is not None
        present = self._dummy_addresses(h, self._dummy_index)
        ours = set(desired) | {k for k in kernel if k.family in self._families and (
            k.address in present or k in owned or k in self._believed)}
        self._believed = {}
        for vs_key in sorted(ours, key=VsKey.order):
            entry = desired.get(vs_key)
            self._sync_vs(vs_key, entry[1] if entry else None, kernel.get(vs_key),
                          entry[0] if entry else None, h, run)
        self._draining = {k: d for k, d in self._draining.items() if k[0] in self._believed}
        wanted = self._index.addresses()
        self._addresses(h, wanted - present, present - wanted, run)
        self._reap({vs for vs, _ in self._draining}, h, run)
        return delta

    def _partial(self, state: DesiredState, ctx: RenderContext, h: _Handles,
                 run: _Run) -> Delta:
        assert self._last is not None
        last = self._last.ports
        keys = {k for k, v in state.ports.items() if last.get(k) is not v}
        keys.update(k for k in last if k not in state.ports)
        if ctx != self._ctx:  # node addresses changed: NodePorts move with them
            keys.update(k for k, v in state.ports.items() if needs_node_addresses(v))
        delta = Delta()
        for key in keys:
            rsp = state.ports.get(key)
            new = render_port(rsp, ctx) if rsp is not None and key.family in self._families \
                else None
            self._index.update(key, new, delta)
        self._log_conflicts(delta.virtual_servers)
        self._ipset_restore(h, ipset_update(delta.entries_added, ()), run)
        new_drains: set[VsKey] = set()
        for vs_key in sorted(delta.virtual_servers, key=VsKey.order):
            entry = self._index.virtual_server(vs_key)
            if self._sync_vs(vs_key, entry[1] if entry else None, self._believed.get(vs_key),
                             entry[0] if entry else None, h, run):
                new_drains.add(vs_key)
        assert self._dummy_index is not None
        self._addresses(h, delta.addresses_added, delta.addresses_removed, run)
        self._ipset_restore(h, ipset_update((), delta.entries_removed), run)
        if new_drains:
            self._reap(new_drains, h, run)
        return delta

    def _sync_vs(self, vs_key: VsKey, desired: VirtualServer | None, current: KernelService | None,
                 owner: ServicePortKey | None, h: _Handles, run: _Run) -> bool:
        """Apply one virtual server's difference; True if real servers started draining."""
        ops = diff_service(desired, current)
        ok = True
        for op in ops:
            if not self._do(h, op, run, owner):
                ok = False
                if op.kind is OpKind.ADD_SERVICE:
                    break  # nothing to add real servers to; the next (full) sync retries
        if desired is None:
            if ok:
                self._believed.pop(vs_key, None)
                self._draining = {k: d for k, d in self._draining.items() if k[0] != vs_key}
            return False
        after = believed_after(desired, current)
        assert after is not None
        if not ok:
            # Unknown now; the next sync is full and reads the kernel back.
            self._believed[vs_key] = current or after
            return False
        self._believed[vs_key] = after
        now = self._clock()
        started = False
        for rs in desired.real_servers:
            self._draining.pop((vs_key, rs), None)
        for rs, dest in after.dests.items():
            if dest.weight == 0 and (vs_key, rs) not in self._draining:
                self._draining[(vs_key, rs)] = _Drain(now, owner)
                started = True
                log.info("real server draining", extra={
                    "service": str(owner) if owner else None, "virtual_server": str(vs_key),
                    "real_server": str(rs), "timeout": self.options.ipvs_drain_timeout})
        return started

    def _do(self, h: _Handles, op: Op, run: _Run, owner: ServicePortKey | None = None) -> bool:
        try:
            h.ipvs.apply(op)
        except Exception as exc:
            code = _error_code(exc)
            # Already there / already gone: the kernel is where we wanted it.
            if (op.kind in (OpKind.DEL_SERVICE, OpKind.DEL_DEST) and code in (
                    errno.ENOENT, errno.ESRCH)):
                return True
            why = str(exc)
            if op.service is not None and code == errno.ENOENT:
                # The kernel's answer for a scheduler it cannot load.
                why += (f" (is the IPVS scheduler {op.service.scheduler!r} available? "
                        f"modprobe ip_vs_{op.service.scheduler})")
            run.fail(str(op), RuntimeError(why), service=str(owner) if owner else None)
            return False
        log.debug("IPVS operation", extra={"operation": str(op),
                                           "service": str(owner) if owner else None})
        return True

    def _reap(self, vs_keys: Iterable[VsKey], h: _Handles, run: _Run) -> None:
        """Delete the draining real servers of `vs_keys` that may go now."""
        now = self._clock()
        timeout = self.options.ipvs_drain_timeout
        for vs_key in sorted(vs_keys, key=VsKey.order):
            pending = [(rs, d) for (v, rs), d in self._draining.items() if v == vs_key]
            if not pending:
                continue
            try:
                dests = h.ipvs.dests(vs_key)
            except Exception as exc:
                run.fail(f"dump real servers of {vs_key}", exc)
                continue
            for rs, drain in pending:
                dest = dests.get(rs)
                if dest is not None and not drained(dest, drain.since, now, timeout):
                    continue
                if dest is not None:
                    reason = "idle" if dest.connections == 0 else "drain timeout"
                    if not self._do(h, Op(OpKind.DEL_DEST, vs_key, rs=rs), run, drain.owner):
                        continue
                    log.info("real server deleted after draining", extra={
                        "service": str(drain.owner) if drain.owner else None,
                        "virtual_server": str(vs_key), "real_server": str(rs),
                        "reason": reason, "connections": dest.connections,
                        "drained_seconds": round(now - drain.since, 3)})
                del self._draining[(vs_key, rs)]
                believed = self._believed.get(vs_key)
                if believed is not None and rs in believed.dests:
                    dests_left = {k: v for k, v in believed.dests.items() if k != rs}
                    self._believed[vs_key] = KernelService(
                        believed.key, believed.scheduler, believed.flags, believed.timeout,
                        dests_left)

    # --- addresses, ipsets, iptables ---------------------------------------------------

    def _dummy_addresses(self, h: _Handles, index: int) -> set[IPAddress]:
        # The kernel gives the dummy interface an IPv6 link-local address of its own.
        return {a for a in h.links.addresses(index) if usable_node_address(a)}

    def _addresses(self, h: _Handles, add: Iterable[IPAddress], remove: Iterable[IPAddress],
                   run: _Run) -> None:
        index = self._dummy_index
        assert index is not None
        for address in sorted(add, key=address_order):
            try:
                h.links.add_address(index, address)
            except Exception as exc:
                if _error_code(exc) != errno.EEXIST:
                    run.fail(f"add address {address} to {self._dummy_name}", exc)
        for address in sorted(remove, key=address_order):
            try:
                h.links.del_address(index, address)
            except Exception as exc:
                if _error_code(exc) != errno.EADDRNOTAVAIL:
                    run.fail(f"delete address {address} from {self._dummy_name}", exc)

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
                saved = {t: runner.save(t) for t in ("nat", "filter")}
                text = restore_text(family, self.options, saved)
                runner.restore(text, noflush=True)
                run.iptables_lines += text.count("\n")
            except RunnerError as exc:
                run.fail(getattr(exc, "offending", None) or f"iptables-restore ({family.label})",
                         exc, family=family.label)

    def _owned_by_sets(self, h: _Handles) -> set[VsKey]:
        """Virtual servers our SERVICES sets list (what an earlier run programmed)."""
        owned: set[VsKey] = set()
        for family in Family:
            name = set_name(SetRole.SERVICES, family)
            for entry in parse_ipset_save(h.ipsets.save(name)).get(name, []):
                try:
                    address, rest = entry.rsplit(",", 1)
                    proto, port = rest.split(":", 1)
                    owned.add(VsKey(Protocol(proto.upper()), ip_address(address), int(port)))
                except ValueError:
                    continue
        return owned

    def _log_conflicts(self, vs_keys: Iterable[VsKey]) -> None:
        for vs_key, owners in self._index.conflicts(vs_keys).items():
            log.warning("service ports %s all claim virtual server %s; %s wins",
                        ", ".join(map(str, owners)), vs_key, owners[0],
                        extra={"virtual_server": str(vs_key),
                               "services": [str(o) for o in owners]})

    # --- conntrack -----------------------------------------------------------------------

    def _clear_conntrack(self, old: DesiredState, new: DesiredState,
                         keys: Iterable[ServicePortKey]) -> int:
        """Delete conntrack entries of UDP/SCTP flows to endpoints that left (shared with
        the iptables plane: with net.ipv4.vs.conntrack=1 IPVS keeps the same tuples).
        Linux 5.9+ already expires a deleted real server's IPVS connections, conntrack
        entries included (expire_nodest_conn=1), so this usually finds nothing there; it
        covers older kernels and entries of real servers deleted by other means.
        A failure is logged, not raised: the rules themselves are in place."""
        flows = conntrack.stale_flows_between(old.ports, new.ports, keys)
        if not flows:
            return 0
        try:
            return conntrack.clear(flows)
        except Exception as exc:
            log.warning("conntrack cleanup failed", extra={"error": str(exc),
                                                           "flows": len(flows)})
            return 0
