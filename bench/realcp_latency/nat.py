"""Reading a node's nat table (iptables or nftables), in the calling thread's network namespace.

The nftables mode's tables are read in one family (`family`, IPv4 unless said): a
single-stack IPv6 cluster's are `ip6` tables. Endpoints are spelled as the agent's debug
dump spells them (`format_endpoint`: `ip:port`, `[ip]:port` for IPv6), in views, in
`picked_rules` and in what `dnats_to` looks for.
"""

from __future__ import annotations

import itertools
import json
import re
import subprocess
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from ipaddress import ip_address
from typing import Any

from bench.realcp_latency.settings import (
    NFT_LIVE_CHAIN,
    NFT_MAIN,
    NFT_MAX_SHARDS,
    NFTABLES,
)
from proxy.dataplane.common.netlink import NetlinkSocket, nfgen, nla_string
from proxy.dataplane.common.netlink_constants import (
    NETLINK_NETFILTER,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO,
    NFT_MSG_GETCHAIN,
    NFTA_CHAIN_NAME,
    NFTA_CHAIN_TABLE,
)
from proxy.dataplane.nftables.render import (
    PICK,
    PICKS,
    PORT_COUNTERS,
    SERVICE_IPS,
    pick_map,
    port_counter,
    table_family,
)
from proxy.dataplane.xtables.saved import target_of
from proxy.model.types import Family, ServicePortKey, format_endpoint

# `nft -j list table` of one table, for a view: seconds at 100,000 services (more on a
# busy machine). A hung nft, not a slow one, should end the run.
NFT_READ_TIMEOUT = 900.0

# --- reading a node's nat table (in the calling thread's network namespace) -------------


def _run(cmd: Sequence[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          check=False)


def save_nat(backend: str) -> str:
    """The nat table as iptables-save prints it. For legacy, only tables that exist are
    read (asking legacy for `-t nat` would create it)."""
    if backend == "nft":
        res = _run(["iptables-nft-save", "-t", "nat"])
        return res.stdout if res.returncode == 0 else ""
    res = _run(["iptables-legacy-save"])
    if res.returncode != 0:
        return ""
    m = re.search(r"^\*nat\n(.*?)^COMMIT", res.stdout, re.MULTILINE | re.DOTALL)
    return m.group(1) if m else ""


_MISSING = ("No chain/target/match", "incompatible", "does not exist")


def chain_rules(backend: str, chain: str, family: Family = Family.V4) -> list[str] | None:
    """The `-A` lines of one nat chain: [] if the chain does not exist, None if the
    answer could not be read (try again). For the nftables mode, `chain` is "table
    chain" (of `family`) and the lines are nft's (`nft list chain` reads that chain
    alone: ~6 ms at 10,000 services, where `nft list tables` reads everything, 35 s)."""
    if backend == NFTABLES and chain.startswith(f"{PICKED} "):
        return picked_rules(chain, family)
    if backend == NFTABLES:
        table, name = chain.split()
        res = _run(["nft", "list", "chain", table_family(family), table, name], timeout=30)
        if res.returncode == 0:
            return [ln.strip() for ln in res.stdout.splitlines() if " dnat to " in ln]
        return [] if "No such file" in res.stderr else None
    if backend == "nft":
        res = _run(["iptables-nft", "-t", "nat", "-S", chain], timeout=30)
        if res.returncode == 0:
            return [ln for ln in res.stdout.splitlines() if ln.startswith("-A ")]
        return [] if any(s in res.stderr for s in _MISSING) else None
    prefix = f"-A {chain} "
    return [ln for ln in save_nat("legacy").splitlines() if ln.startswith(prefix)]


_RULE = re.compile(r"^-A (\S+) ")
_COMMENT = re.compile(r"--comment (\"[^\"]*\"|\S+)")
_DNAT = re.compile(r"-j DNAT\b.*--to-destination (\S+)")
@dataclass
class NatView:
    """What matters in one proxy's nat table for one namespace's services."""

    # (service port "ns/name:port", "ip:port") -> (service chain, endpoint chain)
    endpoints: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    rules: int = 0


def parse_nat(text: str, namespace: str, dispatch: str, svc_prefix: str) -> NatView:
    """Follow the rules from the dispatch chain's cluster-IP entries (commented with the
    service port by both proxies) to the service chains, their endpoint chains and those
    chains' DNAT targets. Comments further down are not relied on: kube-proxy v1.20 leaves
    them out of service and endpoint chains above 1,000 endpoints."""
    view = NatView()
    prefix = f"{namespace}/"
    services: dict[str, str] = {}  # service chain -> service port
    children: dict[str, list[str]] = {}  # chain -> chains it jumps to
    dnat: dict[str, str] = {}  # endpoint chain -> "ip:port"
    for line in text.splitlines():
        m = _RULE.match(line)
        if not m:
            continue
        view.rules += 1
        chain, target = m.group(1), target_of(line)
        if (d := _DNAT.search(line)) is not None:
            dnat[chain] = d.group(1)
            continue
        if target is None:
            continue
        children.setdefault(chain, []).append(target)
        comment = _COMMENT.search(line)
        if chain == dispatch and target.startswith(svc_prefix) and comment is not None:
            port = comment.group(1).strip('"').split()[0]
            if port.startswith(prefix):
                services[target] = port
    for svc_chain, port in services.items():
        for sep in children.get(svc_chain, ()):
            if sep in dnat:
                view.endpoints[(port, dnat[sep])] = (svc_chain, sep)
    return view


def dnats_to(rule: str, endpoint: str) -> bool:
    """An nft rule that DNATs to exactly `endpoint` ("ip:port", "[ip]:port")."""
    words = rule.split()
    return any(a == "to" and b == endpoint for a, b in itertools.pairwise(words))


def shows(backend: str, rules: Sequence[str], target: str) -> bool:
    """The chain's rules send to `target`: the endpoint chain (iptables) or the endpoint
    itself (the nftables mode DNATs in the service port's chain)."""
    if backend == NFTABLES:
        return any(dnats_to(r, target) for r in rules)
    return any(target_of(r) == target for r in rules)


def live_chain_lookup(family: Family = Family.V4) -> tuple[int, int, bytes]:
    """A netlink lookup of the main table's hooked `nat-postrouting` chain (for
    NetlinkSocket.execute_raw): it answers once the first sync is live, one transaction
    or the last of a first start's parts, which adds every hooked chain. A lookup, not
    `nft list chain`: nft reads the whole table first (0.5 s at 10,000 services), and a
    first start in parts has its table, partly filled, a second before its hooks."""
    return (NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETCHAIN, 0,
            nfgen(NFPROTO[family]) + nla_string(NFTA_CHAIN_TABLE, NFT_MAIN)
            + nla_string(NFTA_CHAIN_NAME, NFT_LIVE_CHAIN))


def nft_live(family: Family = Family.V4) -> bool:
    """The first sync is live in the calling thread's namespace (`live_chain_lookup`)."""
    sock = NetlinkSocket(NETLINK_NETFILTER)
    try:
        return sock.execute_raw([live_chain_lookup(family)])[0] == 0
    finally:
        sock.close()


def nft_view(namespace: str, ports: Collection[str] = (), family: Family = Family.V4
             ) -> tuple[NatView, float] | None:
    """The nftables mode's view in `family`, and when its tables were first seen
    (monotonic): every table read as JSON (~0.3 s a shard at 10,000 services, so only
    once the first sync is in), each DNAT rule carrying its service port as comment, and
    each picked port of `ports` ("ns/name:port", TCP) found by its counter's name in the
    counter map, its endpoints in its pick map (render.py). None while the first sync is
    not live (`nft_live`): once it is, all of it is, and the reading afterwards is not
    the proxy's time."""
    if not nft_live(family):
        return None
    there = time.monotonic()
    view = NatView()
    prefix = f"{namespace}/"
    names = {port_counter(_port_key(p, family), "tcp"): p for p in ports}
    counted: dict[tuple[str, str, str, int], str] = {}  # (table, ip, proto, port) -> port
    picked: dict[tuple[str, str, str, int], list[str]] = {}  # the same -> endpoints
    for table in [NFT_MAIN, *(f"{NFT_MAIN}-{i}" for i in range(NFT_MAX_SHARDS))]:
        # The main table's sets (@hairpin: an element per endpoint address) say nothing
        # here: without them (--terse) it reads in a blink at 100,000 x 10.
        terse = ("-t",) if table == NFT_MAIN else ()
        res = _run(["nft", *terse, "-j", "list", "table", table_family(family), table],
                   timeout=NFT_READ_TIMEOUT)
        if res.returncode != 0:
            break  # shards are numbered from 0 without gaps
        for item in json.loads(res.stdout)["nftables"]:
            if "map" in item:
                _picked_elements(item["map"], table, names, counted, picked)
                continue
            rule = item.get("rule")
            if rule is None:
                continue
            view.rules += 1
            port = str(rule.get("comment", "")).split(" ")[0]
            for expr in rule["expr"]:
                dnat = expr.get("dnat") if isinstance(expr, dict) else None
                # An address, not a slot map's lookup (ports that large are not read).
                if dnat and isinstance(dnat.get("addr"), str) and port.startswith(prefix):
                    endpoint = _endpoint(dnat["addr"], dnat["port"])
                    chain = f"{rule['table']} {rule['chain']}"
                    view.endpoints[(port, endpoint)] = (chain, endpoint)
    for key, port in counted.items():
        for endpoint in picked.get(key, ()):
            view.endpoints[(port, endpoint)] = (" ".join(map(str, (PICKED, *key))), endpoint)
    return view, there


# A picked port's "chain" in a view: PICKED, its table, cluster IP, protocol and port.
PICKED = "picked"


def _port_key(port: str, family: Family) -> ServicePortKey:
    """"ns/name:port" -> its key."""
    namespace, rest = port.split("/", 1)
    name, port_name = rest.rsplit(":", 1)
    return ServicePortKey(namespace, name, port_name, family)


def _endpoint(address: str, port: int | str) -> str:
    """An endpoint as nft's JSON gives it, spelled as views and `want` spell it."""
    return format_endpoint(ip_address(address), int(port))


def _picked_elements(found: dict[str, Any], table: str, names: dict[str, str],
                     counted: dict[tuple[str, str, str, int], str],
                     picked: dict[tuple[str, str, str, int], list[str]]) -> None:
    """A map of `table` in nft's JSON: the counter map's elements name picked ports
    (by their counters' `names`), a pick map's hold their endpoints by slot."""
    if found["name"] == PORT_COUNTERS:
        for key, counter in found.get("elem", []):
            if counter in names:
                ip, proto, port = key["concat"]
                counted[(table, ip, proto, port)] = names[counter]
    elif found["name"].startswith(PICKS):
        proto = found["name"].removeprefix(PICKS).split("-")[0]  # render.pick_map
        for key, value in found.get("elem", []):
            ip, port, _slot = key["concat"]
            address, target = value["concat"]
            picked.setdefault((table, ip, proto, port), []).append(_endpoint(address, target))


def picked_rules(chain: str, family: Family = Family.V4) -> list[str] | None:
    """A picked port's endpoints now (`chain` as nft_view names it), each as a DNAT rule
    to it would read: its dispatch element says its pick chain, and so its pick map."""
    _, table, ip, proto, port = chain.split()
    res = _run(["nft", "get", "element", table_family(family), table, SERVICE_IPS,
                f"{{ {ip} . {proto} . {port} }}"], timeout=30)
    count = re.search(rf"goto {PICK}(\d+)", res.stdout) if res.returncode == 0 else None
    if count is None:
        return [] if res.returncode == 0 or "No such file" in res.stderr else None
    res = _run(["nft", "-j", "list", "map", table_family(family), table,
                pick_map(proto, int(count[1]))], timeout=30)
    if res.returncode != 0:
        return None
    out = []
    for item in json.loads(res.stdout)["nftables"]:
        for key, value in item.get("map", {}).get("elem", []):
            if key["concat"][:2] == [ip, int(port)]:
                out.append(f"dnat to {_endpoint(*value['concat'])}")
    return out


def dispatch_count(backend: str, chain: str, namespace: str) -> int:
    """Rules of the proxy's dispatch chain that belong to this namespace's services."""
    rules = chain_rules(backend, chain) or []
    return sum(1 for r in rules if f"{namespace}/" in r)
