"""kube-proxy's objects on a node, by name (the one place sliceproxy spells them), and
the pure half of the foreign-proxy check: is another service proxy *writing* them?

What counts as kube-proxy's, and why not every `KUBE-` chain:
- in the nat table (both x_tables back ends, both families), the fixed-name chains only
  kube-proxy writes: iptables mode's KUBE-SERVICES and KUBE-NODEPORTS, IPVS mode's
  KUBE-SERVICES, KUBE-NODE-PORT, KUBE-LOAD-BALANCER and nat KUBE-FIREWALL. Not its
  KUBE-PROXY-CANARY: `kube-proxy --cleanup` (v1.20) leaves it behind, and a kube-proxy
  that made only that has programmed no Service. Every kube-proxy sync rewrites
  KUBE-SERVICES in full (its per-service KUBE-SVC-*/KUBE-SEP-* chains change only with
  a service, and always with KUBE-SERVICES), so these few chains show every write. Not
  the kubelet's chains (KUBE-MARK-MASQ, KUBE-MARK-DROP, KUBE-POSTROUTING and its
  canaries): kube-proxy writes some of them too, but the kubelet puts them back whenever
  they go, so they move after `kube-proxy --cleanup` with no kube-proxy running. Nor
  other tools' `KUBE-` chains (kube-router's KUBE-ROUTER-*, KUBE-POD-FW-*, KUBE-NWPLCY-*);
- the nftables mode's (1.29+) tables `ip kube-proxy` and `ip6 kube-proxy`;
- the IPVS mode's dummy interface `kube-ipvs0` and its addresses.

"Being written", not "being there": leftovers nobody writes any more are normal during
a migration. Each check reads a fingerprint of those objects, object by object, as a set
of *marks* that a write adds to and a removal only takes from:
- nf_tables (iptables-nft, and kube-proxy's own table): the handles of the objects and
  of their rules. The kernel gives every new chain and rule a handle never used before
  in its table, so a chain flushed and refilled (what every kube-proxy sync does to
  KUBE-SERVICES, and to its nftables table's base chains) has new ones, while a static
  leftover keeps its own and a removal only loses some;
- iptables-legacy has no handles: a hash of each rule's text, counters left out (the
  occurrence counted, so a duplicate rule is a mark of its own), and, since its tool
  reads the whole table anyway, the names of the per-service chains (an endpoint or a
  service that changed makes a chain of a new name). A rewrite that leaves the text as
  it was adds no mark; it does reset the rules' counters, so the packet counters summed
  over a chain going down while its rules stay the same counts as a write too (rules
  that matched no packet show nothing: see docs/monitoring.md);
- kube-ipvs0: its interface index and its addresses.
A write is an object with a mark it did not have at the previous check (an object that
appeared counts: all its marks are new), or a legacy chain whose counters went down.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping
from dataclasses import dataclass

PROXY = "kube-proxy"

# nat chains kube-proxy alone writes, in its iptables and IPVS modes (every release
# since 1.2; IPVS mode's nat KUBE-FIREWALL is not the kubelet's filter one).
NAT_CHAINS = ("KUBE-SERVICES", "KUBE-NODEPORTS", "KUBE-NODE-PORT", "KUBE-LOAD-BALANCER",
              "KUBE-FIREWALL")
# Its per-service and per-endpoint nat chains (KUBE-XLB-: before 1.24; KUBE-SVL-,
# KUBE-EXT-: from 1.24 on).
CHAIN_PREFIXES = ("KUBE-SVC-", "KUBE-SVL-", "KUBE-EXT-", "KUBE-FW-", "KUBE-SEP-",
                  "KUBE-XLB-")
SERVICE_CHAINS = "nat per-service chains (KUBE-SVC-*, KUBE-SEP-* ...)"
# The kubelet's (shared with kube-proxy, or its own): never evidence of a kube-proxy.
KUBELET_CHAINS = ("KUBE-MARK-MASQ", "KUBE-MARK-DROP", "KUBE-POSTROUTING",
                  "KUBE-KUBELET-CANARY", "KUBE-IPTABLES-HINT")
NFT_TABLE = "kube-proxy"
# Its base chains: every sync of the nftables mode flushes and refills each one
# (pkg/proxy/nftables/proxier.go, setupNFTables); names of 1.29 to 1.33.
NFT_BASE_CHAINS = ("filter-prerouting", "filter-prerouting-pre-dnat", "filter-input",
                   "filter-forward", "filter-output", "filter-output-post-dnat",
                   "nat-prerouting", "nat-output", "nat-postrouting")

IPVS_INTERFACE = "kube-ipvs0"

# The IPVS mode's other objects, which `kube-proxy --cleanup` removes (pkg/proxy/ipvs,
# 1.20 to 1.33: iptablesCleanupChains, ipsetInfo); read by ipvs/ownership.py and
# ipvs/handover.py (added for the IPVS switch, H3). Its IPv6 sets are named "KUBE-6-..."
# (cut to ipset's 31 characters): `ipvs_set_names`.
IPVS_NAT_CHAINS = ("KUBE-SERVICES", "KUBE-POSTROUTING", "KUBE-FIREWALL", "KUBE-NODE-PORT",
                   "KUBE-LOAD-BALANCER", "KUBE-MARK-MASQ")
IPVS_FILTER_CHAINS = ("KUBE-FORWARD", "KUBE-NODE-PORT", "KUBE-PROXY-FIREWALL",
                      "KUBE-SOURCE-RANGES-FIREWALL", "KUBE-IPVS-FILTER",
                      "KUBE-IPVS-OUT-FILTER")
IPVS_NODE_PORT_SETS = ("KUBE-NODE-PORT-TCP", "KUBE-NODE-PORT-LOCAL-TCP", "KUBE-NODE-PORT-UDP",
                       "KUBE-NODE-PORT-LOCAL-UDP", "KUBE-NODE-PORT-SCTP-HASH",
                       "KUBE-NODE-PORT-LOCAL-SCTP-HASH")
IPVS_SETS = ("KUBE-LOOP-BACK", "KUBE-CLUSTER-IP", "KUBE-EXTERNAL-IP", "KUBE-EXTERNAL-IP-LOCAL",
             "KUBE-LOAD-BALANCER", "KUBE-LOAD-BALANCER-LOCAL", "KUBE-LOAD-BALANCER-FW",
             "KUBE-LOAD-BALANCER-SOURCE-IP", "KUBE-LOAD-BALANCER-SOURCE-CIDR",
             *IPVS_NODE_PORT_SETS, "KUBE-HEALTH-CHECK-NODE-PORT", "KUBE-IPVS-IPS")


def ipvs_set_names() -> tuple[str, ...]:
    """Every ipset name kube-proxy's IPVS mode uses, IPv4's and IPv6's."""
    return (*IPVS_SETS, *(("KUBE-6-" + name.removeprefix("KUBE-"))[:31] for name in IPVS_SETS))


@dataclass(frozen=True, slots=True, order=True)
class Place:
    """One of another proxy's objects, as the log and /healthz name it."""

    proxy: str  # "kube-proxy"
    backend: str  # "iptables-nft", "iptables-legacy", "nftables", "ipvs"
    family: str  # "IPv4", "IPv6", or "" (an interface holds both)
    obj: str  # "nat chain KUBE-SERVICES", "table ip kube-proxy chain nat-output", ...

    def __str__(self) -> str:
        family = f" {self.family}" if self.family else ""
        return f"{self.backend}{family} {self.obj}"


@dataclass(frozen=True, slots=True)
class Marks:
    """What a write adds to (module docstring): handles, rule hashes or addresses; and,
    for iptables-legacy chains, their packet counters summed."""

    tokens: frozenset[Hashable]
    packets: int | None = None


Fingerprint = Mapping[Place, Marks]


def writes(before: Fingerprint, after: Fingerprint) -> list[Place]:
    """The objects written between two fingerprints: each with a mark it lacked
    before (new objects included), or a legacy chain whose counters went down while
    its rules stayed. Removals, whole or partial, are not writes."""
    return sorted(place for place, now in after.items() if _written(before.get(place), now))


def _written(then: Marks | None, now: Marks) -> bool:
    if then is None or not now.tokens <= then.tokens:
        return True
    return (now.tokens == then.tokens and now.packets is not None
            and then.packets is not None and now.packets < then.packets)


def counter_free(rule: str) -> str:
    """An `iptables-save -c` rule line without its leading `[packets:bytes] `."""
    if rule.startswith("["):
        return rule.split("] ", 1)[-1]
    return rule


def saved_marks(text: str) -> dict[str, Marks]:
    """kube-proxy's nat chains in `iptables-save -c -t nat` output: object -> marks.
    Each of NAT_CHAINS (its declaration is a mark, so an empty chain that appears is a
    write; a hash of each rule's text without counters, by occurrence; its rules'
    packets summed), and SERVICE_CHAINS: the per-service chains' names."""
    tokens: dict[str, set[Hashable]] = {}
    packets: dict[str, int] = {}
    seen: dict[tuple[str, str], int] = {}
    services: set[Hashable] = set()
    for line in text.splitlines():
        if line.startswith(":"):
            name = line[1:].split(" ", 1)[0]
            if name in NAT_CHAINS:
                tokens.setdefault(name, set()).add(("chain",))
                packets.setdefault(name, 0)
            elif name.startswith(CHAIN_PREFIXES):
                services.add(name)
            continue
        rule = counter_free(line)
        if not rule.startswith("-A "):
            continue
        name = rule[3:].split(" ", 1)[0]
        if name not in tokens:
            continue
        n = seen[name, rule] = seen.get((name, rule), 0) + 1
        tokens[name].add((hash(rule), n))
        if line.startswith("["):
            count = line[1:].split(":", 1)[0]
            packets[name] += int(count) if count.isdigit() else 0
    out = {f"nat chain {name}": Marks(frozenset(marks), packets[name])
           for name, marks in tokens.items()}
    if services:
        out[SERVICE_CHAINS] = Marks(frozenset(services))
    return out
