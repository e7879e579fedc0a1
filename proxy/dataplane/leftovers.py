"""Another mode's leftovers: found and removed when the agent starts, once its first
sync is in the kernel (proxy/agent/app.py says why then), so switching `--proxy-mode`
needs no `--cleanup` run in between.

Upstream kube-proxy does the same at every start (cmd/kube-proxy/app/server_linux.go,
`platformCleanup`, no flag): the nftables mode removes the iptables and IPVS modes'
rules, the iptables and IPVS modes remove the nftables mode's; failures are logged and
never stop it. Upstream cannot tell its iptables mode's KUBE-* chains from its IPVS
mode's, so it leaves those two alone when switching between them. Ours can (the IPVS
mode's chains are all `SPX-IPVS-*`), so every mode removes both others':

- nftables mode: the IPVS mode's virtual servers, dummy interface, `SPX-IPVS-*` chains
  and ipsets (IpvsDataPlane.cleanup), then every `SPX-*` chain (both iptables back ends);
- iptables mode: our nf_tables tables, and the IPVS mode's leftovers as above. Its own
  first full sync would also delete `SPX-IPVS-*` chains in its back end (they are
  `SPX-*` chains it does not want), but not the virtual servers, the dummy interface
  holding every service address, or the ipsets;
- IPVS mode: our nf_tables tables, and the iptables mode's `SPX-*` chains (and the jumps
  to them) except `SPX-IPVS-*`, which are its own.

A mode never touches its own rules: a restart keeps serving.

Each mode's names, its cleaner and the order of the clean-ups are in modes.py (the names
below are its). Cheap when there is nothing to clean (the usual restart): probes first,
and only what they find is cleaned, importing that plane's code only then.
- our nf_tables tables: one netlink dump of table names (every family);
- the iptables mode's chains: the marker chain `SPX-SERVICES` (nat; every iptables-mode
  ruleset has it), asked by name over netlink from nf_tables where an `ip`/`ip6` `nat`
  table exists, and read with `iptables-legacy-save -t nat` where the legacy nat table
  exists (/proc/thread-self/net/ip_tables_names: asking legacy for a table that does not
  exist would create it). Not probed in iptables mode (its own chains);
- the IPVS mode's: the dummy interface `spx-ipvs0` (a name lookup), or its marker chain
  `SPX-IPVS-SERVICES` found by the same probes. In iptables mode the legacy nat table is
  not read (it may be the mode's own, 100,000 rules at 10,000 services): there the dummy
  interface and nf_tables' marker decide.

Everything here runs on the data plane's worker thread: netlink sockets, children and
libnftables contexts belong to the network namespace of the thread that makes them.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

from proxy.dataplane import modes
from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.netlink import NFGEN, NetlinkSocket, nfgen, nla_string
from proxy.dataplane.common.netlink_constants import (
    NETLINK_NETFILTER,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO,
    NFPROTO_NAMES,
    NFT_MSG_GETCHAIN,
    NFT_MSG_GETTABLE,
    NFTA_CHAIN_NAME,
    NFTA_CHAIN_TABLE,
    NFTA_TABLE_NAME,
)
from proxy.model.types import Family

log = logging.getLogger(__name__)

# Each mode's names (its markers), its cleaner and the order in which modes are cleaned
# are in modes.py, which imports no mode: importing a plane's modules costs 5 to 30 ms.

# Our tables' families, by number, as nft names them.
NFT_FAMILIES = {NFPROTO[f]: NFPROTO_NAMES[NFPROTO[f]] for f in Family}
# nf_tables or its netlink subsystem absent: nothing of ours can be in it.
_ABSENT = {errno.EPROTONOSUPPORT, errno.ENOENT, errno.EAFNOSUPPORT, errno.EOPNOTSUPP}
_SAVE_TIMEOUT = 30.0


# --- what was found (pure) ---------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chain:
    """An SPX- chain seen in a nat table."""

    backend: str  # "nft" or "legacy"
    family: Family
    name: str

    def __str__(self) -> str:
        return f"{self.backend} {self.family.label} nat {self.name}"


@dataclass(slots=True)
class Found:
    """What the probes saw."""

    nft_tables: list[tuple[str, str]] = field(default_factory=list)  # ("ip", "sliceproxy")
    chains: list[Chain] = field(default_factory=list)
    dummy_interfaces: list[str] = field(default_factory=list)

    def of(self, mode: str) -> Found:
        """What of this is `mode`'s."""
        return Found([t for t in self.nft_tables if table_mode(t[1]) == mode],
                     [c for c in self.chains if chain_mode(c.name) == mode],
                     [i for i in self.dummy_interfaces if interface_mode(i) == mode])


# Removes one mode's leftovers (modes.Mode.cleaner names it): given what the probes found
# of that mode, the mode running and its options; says what it removed.
Cleaner = Callable[[Found, str, DataplaneOptions], str]


def chain_mode(name: str) -> str | None:
    """Which mode an x_tables chain belongs to, by the longest chain prefix that names it
    (the IPVS mode's SPX-IPVS- is within the iptables mode's SPX-); None: not ours."""
    owner, longest = None, 0
    for mode in modes.MODES:
        prefix = mode.markers.chain_prefix
        if prefix and len(prefix) > longest and name.startswith(prefix):
            owner, longest = mode.name, len(prefix)
    return owner


def table_mode(name: str) -> str | None:
    """Which mode an nf_tables table (ip or ip6) belongs to; None: not ours."""
    return next((m.name for m in modes.MODES if name in m.markers.tables()), None)


def interface_mode(name: str) -> str | None:
    """Which mode a dummy interface belongs to; None: not ours."""
    return next((m.name for m in modes.MODES if name and m.markers.dummy_interface == name),
                None)


def swept(mode: str) -> Callable[[str], bool]:
    """The chains the iptables mode's clean-up removes when running in `mode`: every
    chain of ours but `mode`'s own (in IPVS mode, its SPX-IPVS- ones stay)."""
    return lambda chain: chain_mode(chain) not in (None, mode)


def leftovers(mode: str, found: Found) -> dict[str, list[str]]:
    """The other modes' leftovers in `found`: mode -> what was seen of it (non-empty),
    in clean-up order. Never `mode` itself."""
    out: dict[str, list[str]] = {}
    for other in modes.names():
        if other == mode:
            continue
        mine = found.of(other)
        what = [*(f"table {family} {name}" for family, name in mine.nft_tables),
                *(f"chain {chain}" for chain in mine.chains),
                *(f"dummy interface {name}" for name in mine.dummy_interfaces)]
        if what:
            out[other] = sorted(what)
    return out


@dataclass(frozen=True, slots=True)
class Probes:
    """Which probes a mode runs (the cheap ones; see the module docstring)."""

    nft_tables: bool
    nft_markers: tuple[str, ...]
    legacy_nat: bool
    dummy_interfaces: tuple[str, ...]


def probes(mode: str) -> Probes:
    others = [m.markers for m in modes.MODES if m.name != mode]
    return Probes(nft_tables=True,
                  nft_markers=tuple(m.marker_chain for m in others if m.marker_chain),
                  legacy_nat=modes.get(mode).probe_legacy_nat,
                  dummy_interfaces=tuple(m.dummy_interface for m in others
                                         if m.dummy_interface))


def table_names(text: str) -> set[str]:
    """/proc/net/ip_tables_names (or ip6_): the legacy tables that exist."""
    return set(text.split())


def saved_chains(text: str) -> list[str]:
    """Our chain names declared in `iptables-save` output."""
    return [line[1:].split(" ", 1)[0] for line in text.splitlines()
            if line.startswith(":" + modes.CHAIN_PREFIX)]


# --- probes (kernel) ---------------------------------------------------------------------


def _nft(found: Found, wanted: Probes) -> None:
    """Table names of every family in one dump; then the marker chains by name, where
    an `ip`/`ip6` nat table exists (iptables-nft's)."""
    try:
        sock = NetlinkSocket(NETLINK_NETFILTER)
    except OSError as exc:
        if exc.errno in _ABSENT:
            return
        raise
    try:
        try:
            replies = sock.dump_raw(NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETTABLE, nfgen(0))
        except OSError as exc:
            if exc.errno in _ABSENT:
                return
            raise
        tables: set[tuple[int, str]] = set()
        for reply in replies:
            attrs = reply.attrs(NFGEN.size)
            name = attrs.get(NFTA_TABLE_NAME, b"").split(b"\0", 1)[0].decode(errors="replace")
            tables.add((reply.payload[0], name))
        if wanted.nft_tables:
            found.nft_tables += sorted((NFT_FAMILIES[f], n) for f, n in tables
                                       if f in NFT_FAMILIES and table_mode(n) is not None)
        asks = [(family, marker) for family in Family for marker in wanted.nft_markers
                if (NFPROTO[family], "nat") in tables]
        if not asks:
            return
        kind = NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETCHAIN
        codes = sock.execute_raw([
            (kind, 0, nfgen(NFPROTO[family]) + nla_string(NFTA_CHAIN_TABLE, "nat")
             + nla_string(NFTA_CHAIN_NAME, marker)) for family, marker in asks])
        for (family, marker), code in zip(asks, codes, strict=True):
            if code == 0:
                found.chains.append(Chain("nft", family, marker))
            elif code != errno.ENOENT:
                raise OSError(code, f"nf_tables: asking for nat chain {marker}: "
                                    f"{os.strerror(code)}")
    finally:
        sock.close()


def _legacy(found: Found) -> None:
    """Our chains in the legacy nat tables that exist (never asking for one that does
    not: legacy would create it)."""
    for family, names in ((Family.V4, "ip_tables_names"), (Family.V6, "ip6_tables_names")):
        try:
            with open(f"/proc/thread-self/net/{names}", encoding="ascii") as f:
                present = table_names(f.read())
        except OSError:
            continue  # x_tables not loaded: no legacy table at all
        if "nat" not in present:
            continue
        tool = "iptables-legacy-save" if family is Family.V4 else "ip6tables-legacy-save"
        try:
            result = subprocess.run([tool, "-t", "nat"], capture_output=True, text=True,
                                    timeout=_SAVE_TIMEOUT, check=False)
        except FileNotFoundError:
            continue  # no legacy tools: the other modes could not have used it either
        if result.returncode != 0:
            raise OSError(f"{tool} -t nat exited {result.returncode}: "
                          f"{result.stderr.strip()[:300]}")
        found.chains += [Chain("legacy", family, name) for name in saved_chains(result.stdout)]


def _interfaces(names: Sequence[str]) -> list[str]:
    """Those of `names` that are network interfaces in this namespace."""
    present = []
    for name in names:
        try:
            socket.if_nametoindex(name)
        except OSError:
            continue
        present.append(name)
    return present


def probe(mode: str) -> Found:
    """Run the cheap probes for `mode` (module docstring) in this thread's namespace."""
    wanted = probes(mode)
    found = Found()
    if wanted.nft_tables or wanted.nft_markers:
        _nft(found, wanted)
    if wanted.legacy_nat:
        _legacy(found)
    found.dummy_interfaces = _interfaces(wanted.dummy_interfaces)
    return found


# --- cleaning (kernel) -------------------------------------------------------------------


def clean_nftables(found: Found, running: str, options: DataplaneOptions) -> str:
    """Delete exactly the tables found (an `add` first makes each delete succeed even if
    the table went away since), in one transaction."""
    from proxy.dataplane.nftables.runner import NftRunner

    tables = [f"{family} {name}" for family, name in found.nft_tables]
    with NftRunner() as runner:
        runner.run("".join(f"add table {t}\ndelete table {t}\n" for t in tables))
    return f"tables {', '.join(tables)}"


def _chains_removed(done: Sequence[tuple[Any, int]]) -> str:
    total = sum(count for _runner, count in done)
    where = ", ".join(f"{r.backend.value} {r.family.label}: {count}" for r, count in done)
    return f"{total} chains ({where or 'none left'})"


def clean_iptables(found: Found, running: str, options: DataplaneOptions) -> str:
    """Every chain of ours but the running mode's own, in both back ends and families
    (the IPVS mode's too, cleaned before: what its clean-up left)."""
    from proxy.dataplane.xtables.cleanup import cleanup_runners, remove_chains

    removed = _chains_removed(remove_chains(cleanup_runners(options.families),
                                            swept(running)))
    if running != modes.IPTABLES.name:
        # The iptables mode's traffic counters, which no rule names any more.
        from proxy.dataplane.common.nfacct import remove_ours

        counters, _held = remove_ours()
        if counters:
            removed += f", {counters} nfacct counters"
    own = modes.get(running).markers.chain_prefix
    return removed + (f"; {own}* kept" if own else "")


def ipvs_in_kernel() -> bool:
    """The kernel answers for IPVS (asking may load ip_vs, as the IPVS mode would)."""
    from proxy.dataplane.ipvs.netlink import IpvsSocket

    try:
        IpvsSocket().close()
    except OSError:
        return False
    return True


def clean_ipvs(found: Found, running: str, options: DataplaneOptions,
               in_kernel: Callable[[], bool] = ipvs_in_kernel) -> str:
    from proxy.dataplane.xtables.cleanup import cleanup_runners, remove_chains

    if not found.dummy_interfaces and not in_kernel():
        # Only chains: without IPVS in the kernel there are no virtual servers either
        # (and the IPVS plane, which needs it, cannot start).
        done = remove_chains(cleanup_runners(options.families),
                             lambda chain: chain_mode(chain) == modes.IPVS.name)
        return _chains_removed(done) + "; IPVS is not in this kernel"
    from proxy.dataplane.ipvs.apply import IpvsDataPlane
    from proxy.dataplane.xtables.restore_runner import Backend

    # Its chains' back end, when the probes saw them in one; else the plane detects it.
    seen = {c.backend for c in found.chains}
    backend = Backend(seen.pop()) if len(seen) == 1 else None
    plane = IpvsDataPlane(options, iptables_backend=backend)
    try:
        plane.cleanup(announce=False)
    finally:
        plane.close()
    return ", ".join(f"{what}: {count}" for what, count in plane.cleaned.items())


def clean(mode: str, options: DataplaneOptions,
          probe_fn: Callable[[str], Found] = probe,
          cleaners: Mapping[str, Cleaner] | None = None) -> dict[str, str]:
    """Remove the other modes' leftovers, in this thread's network namespace, each by
    its mode's cleaner (modes.py). Never raises: a failed probe or clean-up is a
    warning. Returns what was removed (mode -> a description). `probe_fn` and
    `cleaners` replace the kernel in tests."""
    started = time.perf_counter()
    try:
        found = probe_fn(mode)
    except Exception as exc:
        log.warning("cannot tell whether another proxy mode left rules behind: %s", exc,
                    extra={"mode": mode, "error": str(exc)})
        return {}
    others = leftovers(mode, found)
    probed = time.perf_counter() - started
    if not others:
        log.log(logging.INFO - 2, "no other proxy mode's leftovers",  # -v 2
                extra={"mode": mode, "probe_seconds": f"{probed:.4f}"})
        return {}
    removed: dict[str, str] = {}
    for other, what in others.items():
        began = time.perf_counter()
        try:
            cleaner = (cleaners[other] if cleaners is not None
                       else cast(Cleaner, modes.load(modes.get(other).cleaner)))
            result = cleaner(found.of(other), mode, options)
        except Exception as exc:
            log.warning("cannot remove the %s mode's leftovers: %s; they stay until "
                        "`--cleanup --proxy-mode %s`", other, exc, other, extra={
                            "mode": mode, "leftovers_of": other, "found": _shown(what),
                            "error": str(exc)})
            continue
        removed[other] = result
        log.info("removed the %s mode's leftovers: %s", other, result, extra={
            "mode": mode, "leftovers_of": other, "found": _shown(what),
            "seconds": f"{time.perf_counter() - began:.3f}"})
    return removed


def _shown(what: Sequence[str], limit: int = 6) -> str:
    shown = ", ".join(what[:limit])
    return shown + (f" and {len(what) - limit} more" if len(what) > limit else "")
