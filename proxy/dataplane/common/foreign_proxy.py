"""Reading kube-proxy's objects on this node: the kernel half of the foreign-proxy check
(what is read, and what counts as a write: kube_proxy_objects.py).

Cheap when nothing changes, which is nearly always:
- nf_tables, one socket for both users of it (iptables-nft's `ip`/`ip6` `nat` tables,
  kube-proxy's own `kube-proxy` tables): first the ruleset's generation (NFT_MSG_GETGEN,
  bumped by every commit on the node); unchanged since the last check, nothing in
  nf_tables changed and the last reading stands. Otherwise the table list (one dump),
  then per kube-proxy nat chain its handle by name and whether the rule with the highest
  handle seen last time is still there (one message each): kube-proxy flushes the chain
  at every write, so a rule still there means no write since, and only a chain that
  changed is read again in full (KUBE-SERVICES: two rules per service port). Of a
  `kube-proxy` table, its handle and the rules of its few base chains;
- iptables-legacy: `iptables-legacy-save -c -t nat`, only where a legacy nat table
  exists (asking legacy for a table that does not exist would create it). This reads
  the whole table, everyone's rules, so it costs in proportion to the table
  (docs/monitoring.md has the figures);
- kube-ipvs0: its index by name, and its addresses (one rtnetlink dump, filtered by
  the kernel to that interface).

Each part is read again only once 100 times what its last read cost has passed (this
thread's CPU, and the legacy tool's run time; BUDGET): the check never takes more than
about 1% of a core, however large the tables, and a part that costs little (all but a
large legacy table or kube-ipvs0) is read at every check. A part that fails keeps its
last reading, so a failed read is never taken for a write or for a removal.

Runs on one thread: netlink sockets belong to the network namespace of the thread that
made them.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import time
from collections.abc import Callable, Hashable

from proxy.dataplane.common.kube_proxy_objects import (
    IPVS_INTERFACE,
    NAT_CHAINS,
    NFT_BASE_CHAINS,
    NFT_TABLE,
    PROXY,
    Marks,
    Place,
    saved_marks,
)
from proxy.dataplane.common.netlink import (
    NFGEN,
    NetlinkError,
    NetlinkSocket,
    find_attr,
    nfgen,
    nla,
    nla_string,
)
from proxy.dataplane.common.netlink_constants import (
    NETLINK_GET_STRICT_CHK,
    NETLINK_NETFILTER,
    NETLINK_ROUTE,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO,
    NFPROTO_NAMES,
    NFT_MSG_GETCHAIN,
    NFT_MSG_GETGEN,
    NFT_MSG_GETRULE,
    NFT_MSG_GETTABLE,
    NFTA_CHAIN_HANDLE,
    NFTA_CHAIN_NAME,
    NFTA_CHAIN_TABLE,
    NFTA_GEN_ID,
    NFTA_RULE_CHAIN,
    NFTA_RULE_HANDLE,
    NFTA_RULE_TABLE,
    NFTA_TABLE_HANDLE,
    NFTA_TABLE_NAME,
    RTM_GETADDR,
    SOL_NETLINK,
)
from proxy.dataplane.common.rtnetlink import IFADDR, decode_address
from proxy.model.types import Family

# (nft's family name, the label kube_proxy_objects uses) of each NFPROTO family read.
_FAMILIES = {NFPROTO[f]: (NFPROTO_NAMES[NFPROTO[f]], f.label) for f in Family}
_LEGACY = (("IPv4", "ip_tables_names", "iptables-legacy-save"),
           ("IPv6", "ip6_tables_names", "ip6tables-legacy-save"))
# nf_tables or its netlink subsystem absent: nothing of kube-proxy's can be in it.
_ABSENT = {errno.EPROTONOSUPPORT, errno.ENOENT, errno.EAFNOSUPPORT, errno.EOPNOTSUPP}
_SAVE_TIMEOUT = 30.0
BUDGET = 0.01  # of one core: a part is read again after 100x what its last read cost

Reading = dict[Place, Marks]


class _Socket(NetlinkSocket):
    def strict(self) -> None:
        """Let the kernel filter dumps by the request's keys (rtnetlink: an interface)."""
        self._sock.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)


def _u64(raw: bytes) -> int:
    return int.from_bytes(raw[:8], "big")


class KubeProxyReader:
    """kube-proxy's objects in this thread's network namespace, as a Reading (Place ->
    Marks). Keeps what it read last, so a check where nothing changed stays cheap."""

    def __init__(self, save: Callable[[list[str]], str | None] | None = None,
                 clock: Callable[[], float] = time.monotonic,
                 cpu: Callable[[], float] = time.thread_time,
                 budget: float | None = BUDGET) -> None:
        """`budget` None: every part read at every check (the benchmark's cost)."""
        self._save = save or _run_save
        self._budget = budget
        self._clock, self._cpu = clock, cpu
        self._due: dict[str, float] = {}  # part -> when it may be read again
        self._nl: _Socket | None = None
        self._gen: int | None = None
        self._last: dict[str, Reading] = {}  # per part
        # Per iptables-nft chain: (table handle, chain handle, highest rule handle).
        self._probe: dict[Place, tuple[int, int, int | None]] = {}
        self.errors: dict[str, str] = {}  # part -> why its last read failed, while it does
        self.costs: dict[str, float] = {}  # part -> seconds its last read took
        self._tool_seconds = 0.0

    def _timed(self, argv: list[str]) -> str | None:
        """The save, its time counted (wall clock: a child's CPU is only known in the
        process's total, which the data plane's own tools share)."""
        began = time.perf_counter()
        try:
            return self._save(argv)
        finally:
            self._tool_seconds += time.perf_counter() - began

    def close(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None

    def read(self) -> Reading:
        out: Reading = {}
        parts: tuple[tuple[str, Callable[[], Reading]], ...] = (
            ("nf_tables", self._nf_tables), ("iptables-legacy", lambda: _legacy_part(self._timed)),
            ("ipvs", _ipvs_part))
        for part, fn in parts:
            if part in self._last and self._clock() < self._due.get(part, 0.0):
                out.update(self._last[part])
                continue
            began, cpu, self._tool_seconds = self._clock(), self._cpu(), 0.0
            try:
                got = fn()
                self.errors.pop(part, None)
            except OSError as exc:
                self.errors[part] = str(exc)
                if part == "nf_tables":  # read it all again, against the last good reading
                    self.close()
                    self._gen = None
                    self._probe.clear()
                got = self._last.get(part, {})
            cost = self._cpu() - cpu + self._tool_seconds
            self._due[part] = began + (cost / self._budget if self._budget else 0.0)
            self.costs[part] = cost
            self._last[part] = got
            out.update(got)
        return out

    # --- nf_tables ---------------------------------------------------------------------

    def _socket(self) -> _Socket | None:
        if self._nl is None:
            try:
                self._nl = _Socket(NETLINK_NETFILTER)
            except OSError as exc:
                if exc.errno in _ABSENT:
                    return None
                raise
        return self._nl

    def _nf_tables(self) -> Reading:
        nl = self._socket()
        if nl is None:
            return {}
        try:
            gen_reply = nl.get(NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETGEN, nfgen(0))
        except NetlinkError as exc:
            if exc.errno in _ABSENT:
                return {}
            raise
        gen = None
        if gen_reply is not None:
            raw = gen_reply.attrs(NFGEN.size).get(NFTA_GEN_ID)
            gen = int.from_bytes(raw[:4], "big") if raw else None
        if gen is not None and gen == self._gen and "nf_tables" in self._last:
            return self._last["nf_tables"]
        tables: dict[tuple[int, str], int] = {}
        for reply in nl.dump_raw(NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETTABLE, nfgen(0)):
            attrs = reply.attrs(NFGEN.size)
            name = attrs.get(NFTA_TABLE_NAME, b"").split(b"\0", 1)[0].decode(errors="replace")
            tables[reply.payload[0], name] = _u64(attrs.get(NFTA_TABLE_HANDLE, b""))
        out: Reading = {}
        for family, (nft_family, label) in _FAMILIES.items():
            if (family, "nat") in tables:
                out.update(self._nat_chains(nl, family, label, tables[family, "nat"]))
            if (family, NFT_TABLE) in tables:
                out.update(_kube_proxy_table(nl, family, nft_family, label,
                                             tables[family, NFT_TABLE]))
        self._gen = gen
        return out

    def _nat_chains(self, nl: _Socket, family: int, label: str, table: int) -> Reading:
        """kube-proxy's nat chains written by iptables-nft: each chain's handle and its
        rules' handles, read in full only when the chain changed (module docstring)."""
        out: Reading = {}
        for name in NAT_CHAINS:
            place = Place(PROXY, "iptables-nft", label, f"nat chain {name}")
            key = (nfgen(family) + nla_string(NFTA_CHAIN_TABLE, "nat")
                   + nla_string(NFTA_CHAIN_NAME, name))
            reply = nl.get(NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETCHAIN, key)
            if reply is None:
                self._probe.pop(place, None)
                continue
            chain = _u64(reply.attrs(NFGEN.size).get(NFTA_CHAIN_HANDLE, b""))
            rule_key = (nfgen(family) + nla_string(NFTA_RULE_TABLE, "nat")
                        + nla_string(NFTA_RULE_CHAIN, name))
            last = self._probe.get(place)
            previous = self._last.get("nf_tables", {}).get(place)
            if last is not None and last[:2] == (table, chain) and previous is not None:
                probe = last[2]
                if probe is None or nl.get(NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETRULE,
                                           rule_key + nla(NFTA_RULE_HANDLE,
                                                          probe.to_bytes(8, "big"))):
                    # Unchanged since (an empty chain: only its handle tells).
                    out[place] = previous
                    continue
            handles = _rule_handles(nl, rule_key)
            self._probe[place] = (table, chain, max(handles, default=None))
            out[place] = Marks(frozenset([("chain", table, chain),
                                          *((table, h) for h in handles)]))
        return out


def _rule_handles(nl: _Socket, key: bytes) -> list[int]:
    """The handles of a chain's rules (a dump the kernel filters to that chain). Only
    the handle is read from each rule (before its expressions), not every attribute:
    KUBE-SERVICES has two rules per service port."""
    out = []
    for reply in nl.dump_raw(NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETRULE, key):
        raw = find_attr(reply.payload, NFGEN.size, NFTA_RULE_HANDLE)
        if raw:
            out.append(_u64(raw))
    return out


def _kube_proxy_table(nl: _Socket, family: int, nft_family: str, label: str,
                      table: int) -> Reading:
    """The nftables mode's table: its handle, and its base chains' rules (each sync
    flushes and refills them)."""
    name = f"table {nft_family} {NFT_TABLE}"
    out: Reading = {Place(PROXY, "nftables", label, name): Marks(frozenset([table]))}
    for chain in NFT_BASE_CHAINS:
        handles = _rule_handles(nl, nfgen(family) + nla_string(NFTA_RULE_TABLE, NFT_TABLE)
                                + nla_string(NFTA_RULE_CHAIN, chain))
        if handles:
            out[Place(PROXY, "nftables", label, f"{name} chain {chain}")] = Marks(
                frozenset((table, h) for h in handles))
    return out


# --- iptables-legacy ---------------------------------------------------------------------


def _run_save(argv: list[str]) -> str | None:
    """The tool's output; None when the tool is not installed."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True,
                                timeout=_SAVE_TIMEOUT, check=False)
    except FileNotFoundError:
        return None
    if result.returncode != 0:
        raise OSError(f"{argv[0]} exited {result.returncode}: {result.stderr.strip()[:300]}")
    return result.stdout


def _legacy_part(save: Callable[[list[str]], str | None]) -> Reading:
    out: Reading = {}
    for label, names, tool in _LEGACY:
        try:
            with open(f"/proc/thread-self/net/{names}", encoding="ascii") as f:
                present = f.read().split()
        except OSError:
            continue  # x_tables not loaded: no legacy table at all
        if "nat" not in present:
            continue
        text = save([tool, "-c", "-t", "nat"])
        if text is None:
            continue
        for obj, marks in saved_marks(text).items():
            out[Place(PROXY, "iptables-legacy", label, obj)] = marks
    return out


# --- kube-ipvs0 ---------------------------------------------------------------------------


def _ipvs_part() -> Reading:
    try:
        index = socket.if_nametoindex(IPVS_INTERFACE)
    except OSError:
        return {}
    tokens: set[Hashable] = {("interface", index)}
    sock = _Socket(NETLINK_ROUTE)
    try:
        sock.strict()
        for af in (socket.AF_INET, socket.AF_INET6):
            for reply in sock.dump_raw(RTM_GETADDR, IFADDR.pack(af, 0, 0, 0, index)):
                found = decode_address(reply.payload)
                if found is not None and found[0] == index:
                    tokens.add(found)
    finally:
        sock.close()
    return {Place(PROXY, "ipvs", "", f"interface {IPVS_INTERFACE}"): Marks(frozenset(tokens))}

