"""The iptables rules and ipset commands of the IPVS data plane (pure text).

IPVS load-balances; iptables does the few things IPVS cannot, with a FIXED set of rules
per family that depends only on the options (cluster CIDRs, --masquerade-all). Per-service
data lives in ipsets (`render.SetRole`), so a service change never touches iptables.
The layout follows upstream's IPVS proxier (KUBE-SERVICES, KUBE-MARK-MASQ,
KUBE-POSTROUTING, KUBE-LOAD-BALANCER-FW, KUBE-IPVS-FILTER, KUBE-FORWARD) under our own
prefix, so it never collides with kube-proxy or a CNI:

    nat PREROUTING, OUTPUT -> SPX-IPVS-SERVICES     mark what must be masqueraded
    nat POSTROUTING        -> SPX-IPVS-POSTROUTING  masquerade marked and hairpin traffic
    filter INPUT           -> SPX-IPVS-INPUT        Local-policy drops (from outside
                                                    only, for external addresses), source
                                                    ranges, no stray ports on service
                                                    addresses
    filter FORWARD         -> SPX-IPVS-FORWARD      accept marked and established traffic

IPVS picks packets up on the local-in hook after filter INPUT, so drops there happen
before IPVS schedules a connection.

Only a connection's first packet traverses the nat table, and a TCP connection's first
packet is a SYN, unless conntrack began tracking the connection after it was made: our
first rules switch conntrack on where no rule needed it until then (kube-proxy stopped
before its first sync wrote its iptables rules; the IPVS table alone does not use it).
Such a connection's endpoint knows it by the addresses it already has, so it is neither
marked nor masqueraded (MIDSTREAM): masqueraded, its next segment would reach the
endpoint from the node's address and be answered with a reset.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.naming import MASQ_BIT
from proxy.dataplane.ipvs.render import SET_TYPES, SetEntry, SetRole, set_name
from proxy.dataplane.modes import IPVS
from proxy.dataplane.xtables.saved import Saved, Table, cleanup_restore
from proxy.model.types import Family

# Declared with the mode (modes.py), where another mode's leftovers' probe reads them.
CHAIN_PREFIX = IPVS.markers.chain_prefix
SERVICES_CHAIN = IPVS.markers.marker_chain
CLUSTER_IP_CHAIN = f"{CHAIN_PREFIX}CLUSTER-IP"
MARK_MASQ_CHAIN = f"{CHAIN_PREFIX}MARK-MASQ"
POSTROUTING_CHAIN = f"{CHAIN_PREFIX}POSTROUTING"
INPUT_CHAIN = f"{CHAIN_PREFIX}INPUT"
INSIDE_ONLY_CHAIN = f"{CHAIN_PREFIX}INSIDE-ONLY"
SOURCE_RANGES_CHAIN = f"{CHAIN_PREFIX}SOURCE-RANGES"
FORWARD_CHAIN = f"{CHAIN_PREFIX}FORWARD"

# A packet either proxy (or a mode of ours) marked is masqueraded by whichever
# POSTROUTING chain sees it first.
MASQ_MARK = f"{MASQ_BIT:#x}"

# A TCP connection conntrack first saw after its SYN (module docstring): first in the
# chains that mark and masquerade.
MIDSTREAM = "-p tcp ! --syn -j RETURN"

# Sets are created with room to grow; `create -exist` must repeat the same parameters.
SET_MAXELEM = 262144


@dataclass(frozen=True, slots=True)
class Jump:
    """A rule in a built-in chain sending traffic into one of ours."""

    table: str
    chain: str  # built-in
    target: str  # ours
    comment: str

    def spec(self) -> str:
        return f'-m comment --comment "{self.comment}" -j {self.target}'


JUMPS = (
    Jump("nat", "PREROUTING", SERVICES_CHAIN, "sliceproxy ipvs services"),
    Jump("nat", "OUTPUT", SERVICES_CHAIN, "sliceproxy ipvs services"),
    Jump("nat", "POSTROUTING", POSTROUTING_CHAIN, "sliceproxy ipvs postrouting"),
    Jump("filter", "INPUT", INPUT_CHAIN, "sliceproxy ipvs input"),
    Jump("filter", "FORWARD", FORWARD_CHAIN, "sliceproxy ipvs forward"),
)

CHAINS = {
    "nat": (SERVICES_CHAIN, CLUSTER_IP_CHAIN, MARK_MASQ_CHAIN, POSTROUTING_CHAIN),
    "filter": (INPUT_CHAIN, INSIDE_ONLY_CHAIN, SOURCE_RANGES_CHAIN, FORWARD_CHAIN),
}


def _loopback(family: Family) -> str:
    return "127.0.0.0/8" if family is Family.V4 else "::1/128"


def iptables_rules(family: Family, options: DataplaneOptions) -> dict[str, list[str]]:
    """The rules of our chains, per table, in iptables-restore syntax (no jumps)."""

    def match(role: SetRole, flags: str, negate: bool = False) -> str:
        bang = "! " if negate else ""
        return f"-m set {bang}--match-set {set_name(role, family)} {flags}"

    cidrs = [c for c in options.cluster_cidrs if Family.of(c) is family]
    nat = [f"-A {SERVICES_CHAIN} {MIDSTREAM}",
           f"-A {SERVICES_CHAIN} -s {_loopback(family)} -j RETURN"]
    cluster = match(SetRole.CLUSTER_IP, "dst,dst")
    if options.masquerade_all:
        nat.append(f"-A {SERVICES_CHAIN} {cluster} -j {MARK_MASQ_CHAIN}")
    elif cidrs:
        # Off-cluster sources may be answered through another node: masquerade them.
        nat.append(f"-A {SERVICES_CHAIN} {cluster} -j {CLUSTER_IP_CHAIN}")
        nat.extend(f"-A {CLUSTER_IP_CHAIN} -s {c} -j RETURN" for c in cidrs)
        nat.append(f"-A {CLUSTER_IP_CHAIN} -j {MARK_MASQ_CHAIN}")
    else:
        # Without a cluster CIDR we cannot tell pods from the outside; as upstream, at least
        # masquerade the node's own connections, which leave with a service address as
        # their source (the address sits on our dummy interface).
        nat.append(f"-A {SERVICES_CHAIN} {match(SetRole.CLUSTER_IP, 'src,dst')} "
                   f"-j {MARK_MASQ_CHAIN}")
    nat += [
        f"-A {SERVICES_CHAIN} {match(SetRole.EXTERNAL_MASQ, 'dst,dst')} -j {MARK_MASQ_CHAIN}",
        # The node's own connections to an external address that only pods and the node
        # may use go to endpoints on other nodes; their source may be the address itself
        # (it sits on our dummy interface), so replies would not come back: masquerade.
        f"-A {SERVICES_CHAIN} {match(SetRole.INSIDE_ONLY, 'dst,dst')} "
        f"-m addrtype --src-type LOCAL -j {MARK_MASQ_CHAIN}",
        f"-A {MARK_MASQ_CHAIN} -j MARK --or-mark {MASQ_MARK}",
        f"-A {POSTROUTING_CHAIN} {MIDSTREAM}",
        f"-A {POSTROUTING_CHAIN} {match(SetRole.LOOPBACK, 'dst,dst,src')} -j MASQUERADE",
        f"-A {POSTROUTING_CHAIN} -m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN",
        # Clear the mark so a packet that re-enters the stack is not masqueraded twice.
        f"-A {POSTROUTING_CHAIN} -j MARK --xor-mark {MASQ_MARK}",
        f"-A {POSTROUTING_CHAIN} -j MASQUERADE --random-fully",
    ]
    # External addresses with policy Local and no local endpoint: pods (the cluster
    # CIDRs) and the node itself pass, as upstream short-circuits them; without a
    # cluster CIDR pods cannot be told from the outside and are dropped, as upstream.
    inside = [f"-A {INSIDE_ONLY_CHAIN} -s {c} -j RETURN" for c in cidrs]
    inside += [f"-A {INSIDE_ONLY_CHAIN} -m addrtype --src-type LOCAL -j RETURN",
               f"-A {INSIDE_ONLY_CHAIN} -j DROP"]
    filt = [
        f"-A {INPUT_CHAIN} {match(SetRole.DROP, 'dst,dst')} -j DROP",
        f"-A {INPUT_CHAIN} {match(SetRole.INSIDE_ONLY, 'dst,dst')} -j {INSIDE_ONLY_CHAIN}",
        f"-A {INPUT_CHAIN} {match(SetRole.FIREWALL, 'dst,dst')} -j {SOURCE_RANGES_CHAIN}",
        # A service address answers only on its service ports (upstream KUBE-IPVS-FILTER):
        # the host's own listeners must not be reachable through it.
        f"-A {INPUT_CHAIN} -m conntrack --ctstate NEW {match(SetRole.VIPS, 'dst')} "
        f"{match(SetRole.SERVICES, 'dst,dst', negate=True)} -j REJECT",
        f"-A {SOURCE_RANGES_CHAIN} {match(SetRole.FIREWALL_ALLOW, 'dst,dst,src')} -j RETURN",
        f"-A {SOURCE_RANGES_CHAIN} -j DROP",
        *inside,
        # For hosts whose FORWARD policy is DROP (upstream KUBE-FORWARD): IPVS replies
        # are forwarded back to clients.
        f"-A {FORWARD_CHAIN} -m mark --mark {MASQ_MARK}/{MASQ_MARK} -j ACCEPT",
        f"-A {FORWARD_CHAIN} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    ]
    return {"nat": nat, "filter": filt}


def restore_text(family: Family, options: DataplaneOptions, saved: Saved) -> str:
    """iptables-restore --noflush input: (re)write our chains, add missing jumps.

    `saved` is the family's tables as they are now (`parse_save`), to tell which jumps
    already exist (a jump in a built-in chain cannot be flushed, only added once).
    Declaring our chains flushes them in --noflush mode; built-in chains are untouched.
    """
    rules = iptables_rules(family, options)
    out = []
    for table in ("nat", "filter"):
        out.append(f"*{table}")
        out.extend(f":{chain} - [0:0]" for chain in CHAINS[table])
        for jump in JUMPS:
            if jump.table == table and not has_jump(saved, jump):
                out.append(f"-I {jump.chain} 1 {jump.spec()}")
        out.extend(rules[table])
        out.append("COMMIT")
    return "\n".join(out) + "\n"


def has_jump(saved: Saved, jump: Jump) -> bool:
    specs = saved.get(Table(jump.table), {}).get(jump.chain, [])
    return any(spec.split()[-2:] == ["-j", jump.target] for spec in specs)


def differences(family: Family, options: DataplaneOptions, saved: Saved,
                limit: int = 5) -> list[str]:
    """How our chains and jumps in `saved` (one family's tables, `parse_save`) differ
    from what `restore_text` writes: a chain missing or holding another number of rules,
    a jump from a built-in chain missing. [] when they agree. Counts, not text, as the
    iptables plane's check (`Ruleset.differences`): iptables-save prints rules in its
    own canonical form, and whatever a foreign process does to our rules (flush a table
    or chain, delete one, reload a firewall) changes a count."""
    found: list[str] = []
    rules = iptables_rules(family, options)
    for table, chains in CHAINS.items():
        held = saved.get(Table(table), {})
        wanted: dict[str, int] = dict.fromkeys(chains, 0)
        for line in rules[table]:
            chain = line.split(maxsplit=2)[1]
            wanted[chain] = wanted.get(chain, 0) + 1
        for chain, count in wanted.items():
            if chain not in held:
                found.append(f"{table} chain {chain} is missing")
            elif len(held[chain]) != count:
                found.append(f"{table} chain {chain} holds {len(held[chain])} rules, "
                             f"we wrote {count}")
        found += [f"{table} {jump.chain} has no jump to {jump.target}" for jump in JUMPS
                  if jump.table == table and not has_jump(saved, jump)]
    if len(found) > limit:
        found = [*found[:limit], f"and {len(found) - limit} more"]
    return found


def cleanup_text(saved: Saved) -> str:
    """iptables-restore --noflush input removing our chains and the jumps to them (the
    shared x_tables clean-up, limited to this mode's chains); "" if there are none."""
    return cleanup_restore(saved, lambda chain: chain.startswith(CHAIN_PREFIX)).render()


# --- ipsets ----------------------------------------------------------------------------


def _create(name: str, role: SetRole, family: Family) -> str:
    inet = "inet" if family is Family.V4 else "inet6"
    return f"create {name} {SET_TYPES[role]} family {inet} maxelem {SET_MAXELEM} -exist"


def ipset_replace(families: Iterable[Family], entries: Iterable[SetEntry]) -> str:
    """`ipset restore` input that makes every set of ours hold exactly `entries`: each set
    is filled under a temporary name and swapped in, so it changes atomically."""
    by_set: dict[tuple[SetRole, Family], list[str]] = {}
    for e in entries:
        by_set.setdefault((e.role, e.family), []).append(e.entry)
    out = []
    for family in families:
        for role in SetRole:
            name = set_name(role, family)
            tmp = f"{name}-T"
            out += [_create(name, role, family), _create(tmp, role, family), f"flush {tmp}"]
            out += [f"add {tmp} {entry}" for entry in sorted(by_set.get((role, family), ()))]
            out += [f"swap {tmp} {name}", f"destroy {tmp}"]
    return "\n".join(out) + "\n"


def ipset_update(added: Iterable[SetEntry], removed: Iterable[SetEntry]) -> str:
    """`ipset restore` input adding and removing single entries (a partial sync)."""
    out = [f"add {set_name(e.role, e.family)} {e.entry} -exist"
           for e in sorted(added, key=_entry_order)]
    out += [f"del {set_name(e.role, e.family)} {e.entry} -exist"
            for e in sorted(removed, key=_entry_order)]
    return "\n".join(out) + "\n" if out else ""


def _entry_order(e: SetEntry) -> tuple[str, int, str]:
    return (e.role.value, e.family.value, e.entry)


def parse_ipset_save(text: str) -> dict[str, list[str]]:
    """`ipset save` output -> set name -> entries as ipset spells them."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0] == "create":
            out.setdefault(parts[1], [])
        elif len(parts) >= 3 and parts[0] == "add":
            out.setdefault(parts[1], []).append(parts[2])
    return out
