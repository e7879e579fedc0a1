"""iptables rendering (pure): a resolved service port -> its chains and dispatch entries.

The shape is upstream kube-proxy's (pkg/proxy/iptables/proxier.go), renamed to our own
prefix so sliceproxy never touches kube-proxy's or a CNI's chains:

    nat   PREROUTING/OUTPUT -> SPX-SERVICES   one entry per cluster/external/LB IP:port
          SPX-SERVICES (last rule)          -> SPX-NODEPORTS   one entry per NodePort
          SPX-SVC-<hash>  the Cluster-policy endpoints, `statistic` 1/n, 1/(n-1), ...
          SPX-SVL-<hash>  the Local-policy endpoints (same shape, local ones only)
          SPX-EXT-<hash>  external traffic (NodePort, externalIP, LB IP) -> policy chain
          SPX-FW-<hash>   loadBalancerSourceRanges in front of SPX-EXT
          SPX-SEP-<hash>  one per endpoint: hairpin masquerade mark, DNAT
          SPX-MARK-MASQ / SPX-POSTROUTING   mark, then MASQUERADE marked packets
    filter SPX-SERVICES / SPX-EXTERNAL-SERVICES   REJECT (no endpoints) or DROP (Local
          policy, no local endpoint) for traffic no nat rule captured; SPX-FIREWALL drops
          LB traffic the source ranges refused; SPX-FORWARD accepts marked and established
          traffic; SPX-NODEPORTS accepts health-check node ports.

Every rule is written exactly as `iptables-save` prints it back (both back ends print
the same), so what we think we applied can be compared with the kernel line by line.

External traffic with policy Local goes SPX-EXT -> SPX-SVL, except traffic from pods
(the family's --cluster-cidr) and from the node itself (masqueraded), which is
short-circuited to SPX-SVC whatever the policies, as upstream: the model keeps a
cluster set for every externally reachable port, even with both policies Local.

Differences from upstream, on purpose (docs/upstream-differences.md says why):
- `--cluster-cidr` may list several CIDRs per family, and all of them are pod traffic
  (upstream accepts one per family). With several, off-cluster cluster-IP traffic is
  masqueraded through SPX-MASQ-UNLESS-POD (RETURN for each CIDR, then the mark); with
  one, the rules are upstream's (`! -s CIDR ... -j MARK-MASQ`).
- NodePorts on loopback addresses are never served (upstream's --iptables-localhost-
  nodeports=false).
- LB source ranges admit the node's own traffic to its LB IPs when they contain any
  address of the node (upstream: its one primary node IP).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from proxy.dataplane.common import nfacct
from proxy.dataplane.common.context import RenderContext, cluster_ip_masquerade
from proxy.dataplane.common.naming import (
    MASQ_BIT,
    address_text,
    chain_lines,
    name_hash,
    packed_text,
    port_name,
)
from proxy.dataplane.common.paths import PortPlan, plan, sorted_nets
from proxy.dataplane.common.traffic import per_endpoint
from proxy.dataplane.modes import IPTABLES
from proxy.dataplane.xtables.saved import PREFIX, Table
from proxy.model.snapshot import ResolvedServicePort, SelectedEndpoint
from proxy.model.types import (
    DEFAULT_AFFINITY_TIMEOUT,
    Family,
    IPAddress,
    IPNetwork,
    ServicePortKey,
)

SERVICES = IPTABLES.markers.marker_chain  # declared with the mode: leftovers probe for it
_PREFIX = IPTABLES.markers.chain_prefix
NODEPORTS = f"{_PREFIX}NODEPORTS"
EXTERNAL_SERVICES = f"{_PREFIX}EXTERNAL-SERVICES"
FIREWALL = f"{_PREFIX}FIREWALL"
FORWARD = f"{_PREFIX}FORWARD"
POSTROUTING = f"{_PREFIX}POSTROUTING"
MARK_MASQ = f"{_PREFIX}MARK-MASQ"
# Marks for masquerade unless the source is in a cluster CIDR (only with several CIDRs
# in a family: one fits in the rule itself, as upstream writes it).
MASQ_UNLESS_POD = f"{_PREFIX}MASQ-UNLESS-POD"
MASQ_MARK = f"{MASQ_BIT:#x}"


# (table, chain, rule spec): one rule in a chain shared by all service ports.
Entry = tuple[Table, str, str]

# Chains whose rules come from many service ports, and their table.
DISPATCH_CHAINS: tuple[tuple[Table, str], ...] = (
    (Table.NAT, SERVICES),
    (Table.NAT, NODEPORTS),
    (Table.FILTER, SERVICES),
    (Table.FILTER, EXTERNAL_SERVICES),
    (Table.FILTER, FIREWALL),
    (Table.FILTER, NODEPORTS),
)


@dataclass(frozen=True, slots=True)
class PortCounters:
    """The nfacct objects (common/nfacct.py) counting one service port's new
    connections: `port`, matched at the top of its policy chains (every connection it
    sends to an endpoint passes one, once), and, where counted per endpoint,
    (name, address, port) of each endpoint's, matched in its SEP chain. A port's object
    exists as long as the port does, its endpoints' as long as they are in its slices,
    whether a rule matches them now or not (no endpoints, not ready): a count is not
    reset by an endpoint flapping."""

    port: str
    endpoints: tuple[tuple[str, IPAddress, int], ...] | None = None

    def names(self) -> tuple[str, ...]:
        return (self.port, *(name for name, _, _ in self.endpoints or ()))


@dataclass(frozen=True, slots=True)
class PortRules:
    """Everything one service port (in one family) contributes."""

    key: ServicePortKey
    # nat chains owned by this port alone, in write order: (name, rule specs).
    chains: tuple[tuple[str, tuple[str, ...]], ...]
    # Its rules in the shared dispatch chains, in order.
    entries: tuple[Entry, ...]
    # The nfacct objects its rules match (created before they are written).
    counters: PortCounters | None = None

    def lines(self) -> list[str]:
        """Readable, copy-pasteable lines (`-t nat -A CHAIN spec`) for the debug dump."""
        out = [f"-t {table.value} -A {chain} {spec}" for table, chain, spec in self.entries]
        return [*out, *chain_lines(self.chains, "-t nat -N", "-t nat -A")]


@dataclass(frozen=True, slots=True)
class BaseRules:
    """What does not depend on any service: fixed chains, jumps from built-in chains,
    and the entries that must end a dispatch chain (the NodePort catch-all)."""

    family: Family
    # Fixed-content chains: (table, name, rules). Dispatch chains are declared here too
    # (with no rules of their own) so a full sync creates them even when empty.
    chains: tuple[tuple[Table, str, tuple[str, ...]], ...]
    # Rules in built-in chains jumping to ours: (table, built-in chain, spec), in order.
    jumps: tuple[Entry, ...]
    # Entries that follow every service entry of their dispatch chain.
    tail: tuple[Entry, ...]


# --- names and small helpers ---------------------------------------------------------------


def port_chain(kind: str, key: ServicePortKey, protocol: str) -> str:
    """Stable across restarts: a hash of what the chain is for, never of its content."""
    return f"{PREFIX}{kind}-{name_hash(port_name(key), protocol)}"


def endpoint_chain(key: ServicePortKey, protocol: str, endpoint: str) -> str:
    return f"{PREFIX}SEP-{name_hash(port_name(key), protocol, endpoint)}"


def _digit(key: ServicePortKey) -> str:
    return "4" if key.family is Family.V4 else "6"


def port_counter(key: ServicePortKey, protocol: str) -> str:
    """The nfacct object counting a service port (per family: objects are not)."""
    return nfacct.object_name("p", _digit(key), name_hash(port_name(key), protocol,
                                                           key.family.label))


def endpoint_counter(key: ServicePortKey, protocol: str, endpoint: str) -> str:
    """The nfacct object counting one endpoint (`endpoint_text`) of a service port."""
    return nfacct.object_name("e", _digit(key), name_hash(port_name(key), protocol,
                                                           key.family.label, endpoint))


def counting(name: str) -> str:
    """A rule with no target that counts into nfacct object `name`, spelt as
    iptables-save prints it back (two spaces: libxt_nfacct's own). No comment: with no
    target of its own, a `-j` in a service's name would read as the rule's target."""
    return f"-m nfacct --nfacct-name  {name}"


_NO_QUOTE = frozenset("_-0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
# What may stand in restore text as it is: printable ASCII. iptables-restore reads a line
# break as the end of the rule (the rest becomes rules of its own), NUL as the end of
# the string, and counts bytes where we count characters.
_UNSAFE = re.compile(r"[^\x20-\x7e]")
# xt_comment holds 256 bytes with the terminating NUL; a longer comment makes
# iptables-restore refuse the whole transaction.
COMMENT_MAX = 255


def quote(text: str) -> str:
    """A string as iptables-save writes it (xtables_save_string), after replacing every
    character outside printable ASCII with "?". The decoder refuses names holding one,
    but rules must be safe whatever reaches them: replaced, not refused, so one bad name
    costs its comment's accuracy, never the sync (chain names are hashes of the real
    text, so replacement makes no two ports share a chain)."""
    if text and set(text) <= _NO_QUOTE:
        return text
    text = _safe(text)
    escaped = text.replace("\\", "\\\\").replace('"', '\\"').replace("'", "\\'")
    return f'"{escaped}"'


def comment(text: str) -> str:
    """`-m comment` with `text`, cut to what xt_comment holds (after quote() made it
    ASCII, characters are bytes)."""
    return f"-m comment --comment {quote(_safe(text)[:COMMENT_MAX])}"


def _safe(text: str) -> str:
    # The common case (every name the decoder lets through) costs two C-level scans.
    return text if text.isascii() and text.isprintable() else _UNSAFE.sub("?", text)


def probability(n: int) -> str:
    """1/n as upstream writes it ("%0.10f"), then as the kernel stores and prints it
    (a 31-bit fraction, "%.11f")."""
    stored = round(float(f"{1.0 / n:.10f}") * 0x80000000)
    return f"{stored / 0x80000000:.11f}"


_text = address_text


def _cidr(ip: IPAddress | bytes, ctx: RenderContext) -> str:
    """`ip` (an address, or an endpoint's packed one) as a host CIDR."""
    text = packed_text(ip) if isinstance(ip, bytes) else _text(ip)
    return f"{text}{ctx.host_mask}"


def _dedupe(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(dict.fromkeys(items))


# --- the fixed part --------------------------------------------------------------------------


def render_base(ctx: RenderContext) -> BaseRules:
    nat_postrouting = (
        f"-m mark ! --mark {MASQ_MARK}/{MASQ_MARK} -j RETURN",
        # Clear the bit so a packet re-entering netfilter (e.g. over a tunnel) is not
        # masqueraded twice.
        f"-j MARK --set-xmark {MASQ_MARK}/0x0",
        f"{comment('sliceproxy service traffic requiring SNAT')} -j MASQUERADE --random-fully",
    )
    forward = (
        f"{comment('sliceproxy forwarding rules')} -m mark --mark {MASQ_MARK}/{MASQ_MARK} "
        "-j ACCEPT",
        f"{comment('sliceproxy forwarding conntrack rule')} "
        "-m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT",
    )
    chains: list[tuple[Table, str, tuple[str, ...]]] = [
        (Table.NAT, SERVICES, ()),
        (Table.NAT, NODEPORTS, ()),
        (Table.NAT, MARK_MASQ, (f"-j MARK --set-xmark {MASQ_MARK}/{MASQ_MARK}",)),
        (Table.NAT, POSTROUTING, nat_postrouting),
        (Table.FILTER, SERVICES, ()),
        (Table.FILTER, EXTERNAL_SERVICES, ()),
        (Table.FILTER, FIREWALL, ()),
        (Table.FILTER, NODEPORTS, ()),
        (Table.FILTER, FORWARD, forward),
    ]
    if len(ctx.local_cidrs) > 1 and not ctx.masquerade_all:
        chains.append((Table.NAT, MASQ_UNLESS_POD, (
            *(f"-s {c} -j RETURN" for c in ctx.local_cidrs), f"-j {MARK_MASQ}")))
    new = "-m conntrack --ctstate NEW"
    portals = comment("sliceproxy service portals")
    external = comment("sliceproxy externally-visible service portals")
    firewall = comment("sliceproxy load balancer firewall")
    jumps: tuple[Entry, ...] = (
        (Table.NAT, "PREROUTING", f"{portals} -j {SERVICES}"),
        (Table.NAT, "OUTPUT", f"{portals} -j {SERVICES}"),
        (Table.NAT, "POSTROUTING", f"{comment('sliceproxy postrouting rules')} -j {POSTROUTING}"),
        (Table.FILTER, "INPUT", f"{new} {firewall} -j {FIREWALL}"),
        (Table.FILTER, "INPUT", f"{comment('sliceproxy health check service ports')} "
                                f"-j {NODEPORTS}"),
        (Table.FILTER, "INPUT", f"{new} {external} -j {EXTERNAL_SERVICES}"),
        (Table.FILTER, "FORWARD", f"{new} {firewall} -j {FIREWALL}"),
        (Table.FILTER, "FORWARD", f"{comment('sliceproxy forwarding rules')} -j {FORWARD}"),
        (Table.FILTER, "FORWARD", f"{new} {portals} -j {SERVICES}"),
        (Table.FILTER, "FORWARD", f"{new} {external} -j {EXTERNAL_SERVICES}"),
        (Table.FILTER, "OUTPUT", f"{new} {firewall} -j {FIREWALL}"),
        (Table.FILTER, "OUTPUT", f"{new} {portals} -j {SERVICES}"),
    )
    last = comment("sliceproxy service nodeports; NOTE: this must be the last rule in this chain")
    if ctx.nodeport_ips is None:
        loopback = "127.0.0.0/8" if ctx.family is Family.V4 else "::1/128"
        tail: tuple[Entry, ...] = (
            (Table.NAT, SERVICES, f"! -d {loopback} {last} -m addrtype --dst-type LOCAL "
                                  f"-j {NODEPORTS}"),)
    else:
        tail = tuple((Table.NAT, SERVICES, f"-d {_cidr(ip, ctx)} {last} -j {NODEPORTS}")
                     for ip in sorted(set(ctx.nodeport_ips)))
    return BaseRules(ctx.family, tuple(chains), jumps, tail)


# --- one service port ------------------------------------------------------------------------


def render_port(rsp: ResolvedServicePort, ctx: RenderContext,
                counted: bool = True) -> PortRules:
    """The chains and dispatch entries of one service port (upstream's per-service loop).
    Counted per endpoint as the service's annotation says, else the node's
    --traffic-per-endpoint (`ctx`; common/traffic.py); `counted=False`: no counting rules
    (a kernel without nfacct)."""
    key = rsp.key
    name = port_name(key)
    proto = rsp.port.protocol.value.lower()
    p = plan(rsp, lambda kind: port_chain(kind.upper(), key, proto))
    entries = _dispatch_entries(rsp, p, ctx, name, proto)
    chains: list[tuple[str, tuple[str, ...]]] = []
    if p.ext:
        chains.append((p.ext, _external_rules(name, ctx, p.external_local, p.svc,
                                              p.external_policy)))
    if p.fw and p.ext:
        chains.append((p.fw, _firewall_rules(name, ctx, p.ranges, p.lb_ips, p.ext)))
    affinity = rsp.service.affinity_timeout
    # Each endpoint's text and chain name, computed once (hashing is most of the cost),
    # by the endpoint object's id: the cluster and local sets hold the same objects, and
    # hashing a SelectedEndpoint (every field, the address in Python) for each endpoint
    # cost a tenth of rendering a large service.
    seps: dict[int, tuple[str, str]] = {}
    by_text: dict[str, SelectedEndpoint] = {}
    for ep in (*p.cluster_eps, *p.local_eps):
        if id(ep) not in seps:
            text = endpoint_text(ep)
            seps[id(ep)] = (text, endpoint_chain(key, proto, text))
            by_text.setdefault(text, ep)
    counters, by_endpoint = _counters(rsp, proto,
                                      per_endpoint(rsp.service, ctx.traffic_per_endpoint))
    label = comment(name)
    # Counted first: the cluster-IP masquerade rules go next in the internal chain.
    count = (counting(counters.port),) if counted else ()
    if not counted:
        by_endpoint = {}
    masq = _cluster_masquerade(rsp, ctx, name, proto) if p.internal else ()
    for chain, eps in ((p.svc, p.cluster_eps), (p.svl, p.local_eps)):
        if chain:
            first = count + (masq if chain == p.internal else ())
            chains.append((chain, first + _balance(name, eps, seps, affinity, ctx)))
    for text in sorted(by_text):
        ep = by_text[text]
        rules = _endpoint_rules(label, proto, ep, text, seps[id(ep)][1],
                                affinity is not None, ctx)
        if text in by_endpoint:
            rules = (counting(by_endpoint[text]), *rules)
        chains.append((seps[id(ep)][1], rules))
    return PortRules(key, tuple(chains), tuple(dict.fromkeys(entries)),
                     counters if counted else None)


def _counters(rsp: ResolvedServicePort, proto: str, each_endpoint: bool
              ) -> tuple[PortCounters, dict[str, str]]:
    """The port's nfacct objects: its own; each merged endpoint's where counted per
    endpoint (every endpoint of its slices, used now or not), also by endpoint text."""
    port = port_counter(rsp.key, proto)
    if not each_endpoint:
        return PortCounters(port), {}
    by_text = {endpoint_text(s): s for s in rsp.endpoints}
    names = {text: endpoint_counter(rsp.key, proto, text) for text in by_text}
    eps = tuple((names[text], ep.address, ep.port) for text, ep in by_text.items())
    return PortCounters(port, eps), names


def _dispatch_entries(rsp: ResolvedServicePort, p: PortPlan, ctx: RenderContext, name: str,
                      proto: str) -> list[Entry]:
    """The port's rules in the shared dispatch chains: each address (and the NodePort)
    to its chain, or to what happens when nothing serves it; the health-check port."""
    sp = rsp.port
    pmatch, dport = f"-p {proto}", f"-m {proto} --dport {sp.port}"
    if not p.has_endpoints:
        unserved = "REJECT --reject-with " + (
            "icmp-port-unreachable" if rsp.key.family is Family.V4 else "icmp6-port-unreachable")
        why = f"{name} has no endpoints"
    else:
        unserved, why = "DROP", f"{name} has no local endpoints"
    entries: list[Entry] = []
    for ip in rsp.cluster_ips:
        dest = f"-d {_cidr(ip, ctx)} {pmatch}"
        if p.internal:
            entries.append((Table.NAT, SERVICES,
                            f"{dest} {comment(f'{name} cluster IP')} {dport} -j {p.internal}"))
        else:
            entries.append((Table.FILTER, SERVICES,
                            f"{dest} {comment(why)} {dport} -j {unserved}"))
    external_unserved = not p.external_policy or not p.has_endpoints
    for ips, label, target in ((p.external_ips, "external IP", p.ext),
                               (p.lb_ips, "loadbalancer IP", p.fw or p.ext)):
        for ip in ips:
            dest = f"-d {_cidr(ip, ctx)} {pmatch}"
            if target:
                entries.append((Table.NAT, SERVICES,
                                f"{dest} {comment(f'{name} {label}')} {dport} -j {target}"))
            if external_unserved:
                entries.append((Table.FILTER, EXTERNAL_SERVICES,
                                f"{dest} {comment(why)} {dport} -j {unserved}"))
    if p.fw:
        refused = f"{name} traffic not accepted by {p.fw}"
        entries.extend((Table.FILTER, FIREWALL,
                        f"-d {_cidr(ip, ctx)} {pmatch} {comment(refused)} {dport} -j DROP")
                       for ip in p.lb_ips)
    if sp.node_port:
        nport = f"-m {proto} --dport {sp.node_port}"
        if p.ext:
            entries.append((Table.NAT, NODEPORTS,
                            f"{pmatch} {comment(name)} {nport} -j {p.ext}"))
        if external_unserved:
            entries.append((Table.FILTER, EXTERNAL_SERVICES,
                            f"{pmatch} {comment(why)} -m addrtype --dst-type LOCAL "
                            f"{nport} -j {unserved}"))
    if rsp.service.health_check_node_port:
        entries.append((Table.FILTER, NODEPORTS,
                        f"-p tcp {comment(f'{name} health check node port')} "
                        f"-m tcp --dport {rsp.service.health_check_node_port} -j ACCEPT"))
    return entries


def _cluster_masquerade(rsp: ResolvedServicePort, ctx: RenderContext, name: str,
                        proto: str) -> tuple[str, ...]:
    """Off-cluster clients of a cluster IP (a static route to the service range via any
    node) may be answered from another node: the rules that mark them for masquerade."""
    masq = cluster_ip_masquerade(ctx, lambda pods: f"! -s {pods} ", MASQ_UNLESS_POD, MARK_MASQ)
    if masq is None:
        return ()
    source, target = masq
    return tuple(f"{source}-d {_cidr(ip, ctx)} -p {proto} {comment(f'{name} cluster IP')} "
                 f"-m {proto} --dport {rsp.port.port} -j {target}" for ip in rsp.cluster_ips)


def _external_rules(name: str, ctx: RenderContext, external_local: bool, svc_chain: str | None,
                    policy_chain: str | None) -> tuple[str, ...]:
    rules: list[str] = []
    if not external_local:
        # Endpoints may be on other nodes: masquerade so replies come back through us.
        rules.append(f"{comment(f'masquerade traffic for {name} external destinations')} "
                     f"-j {MARK_MASQ}")
    else:
        # Pods going to an external address act as if they went out and came back in:
        # neither traffic policy applies (upstream's short-circuit). svc_chain is None
        # only when no endpoint is usable anywhere, and then there is no EXT chain.
        if svc_chain:
            rules.extend(f"-s {c} {comment(f'pod traffic for {name} external destinations')} "
                         f"-j {svc_chain}" for c in ctx.local_cidrs)
        # The node itself is the source: its address is local, so masquerade.
        rules.append(f"{comment(f'masquerade LOCAL traffic for {name} external destinations')} "
                     f"-m addrtype --src-type LOCAL -j {MARK_MASQ}")
        if svc_chain:
            rules.append(f"{comment(f'route LOCAL traffic for {name} external destinations')} "
                         f"-m addrtype --src-type LOCAL -j {svc_chain}")
    if policy_chain:
        rules.append(f"-j {policy_chain}")
    return tuple(rules)


def _firewall_rules(name: str, ctx: RenderContext, ranges: Sequence[IPNetwork],
                    lb_ips: Sequence[IPAddress], ext_chain: str) -> tuple[str, ...]:
    label = comment(f"{name} loadbalancer IP")
    rules = [f"-s {r} {label} -j {ext_chain}" for r in sorted_nets(ranges)]
    # A node sending to its own LB IP (often a local address) comes from that IP.
    if any(ip in r for r in ranges for ip in ctx.node_ips):
        rules.extend(f"-s {_cidr(ip, ctx)} {label} -j {ext_chain}" for ip in lb_ips)
    rules.append(comment(f"other traffic to {name} will be dropped by {FIREWALL}"))
    return _dedupe(rules)


def _balance(name: str, eps: Sequence[SelectedEndpoint],
             seps: Mapping[int, tuple[str, str]], affinity: int | None,
             ctx: RenderContext) -> tuple[str, ...]:
    """Affinity checks first, then one `statistic` jump per endpoint: endpoint i (of n)
    is taken with probability 1/(n-i) among what is left, the last one always."""
    ordered = sorted(eps, key=lambda ep: (ep.packed, ep.port))
    targets = [seps[id(ep)] for ep in ordered]
    arrow = _arrow_comment(name)
    labels = [arrow(text) for text, _ in targets]
    rules: list[str] = []
    if affinity is not None:
        seconds = affinity or DEFAULT_AFFINITY_TIMEOUT
        rules.extend(
            f"{label} -m recent --rcheck --seconds {seconds} --reap "
            f"--name {chain} {_recent_mask(ctx)} -j {chain}"
            for label, (_, chain) in zip(labels, targets, strict=True))
    n = len(targets)
    for i, (label, (_, chain)) in enumerate(zip(labels, targets, strict=True)):
        pick = ""
        if i < n - 1:
            pick = f" -m statistic --mode random --probability {probability(n - i)}"
        rules.append(f"{label}{pick} -j {chain}")
    return tuple(rules)


def _arrow_comment(name: str) -> Callable[[str], str]:
    """`text -> comment(f"{name} -> {text}")` for endpoint texts, computing the part
    from `name` once. An endpoint text (`ip:port`, `[ip6]:port`) is printable ASCII
    without quotes or backslashes, so, short of the length limit, quoting the whole
    comment is quoting `name` and appending the text (tests pin this against comment)."""
    safe = _safe(name)
    head = safe.replace("\\", "\\\\").replace('"', '\\"').replace("'", "\\'")
    room = COMMENT_MAX - len(safe) - len(" -> ")

    def label(text: str) -> str:
        if len(text) > room or not _PLAIN_ENDPOINT.fullmatch(text):
            return comment(f"{name} -> {text}")
        return f'-m comment --comment "{head} -> {text}"'
    return label


# What an endpoint text is made of (endpoint_text): quote() leaves it as it is.
_PLAIN_ENDPOINT = re.compile(r"[0-9A-Za-z.:\[\]]+")


def endpoint_text(ep: SelectedEndpoint) -> str:
    packed = ep.packed
    if len(packed) == 16:
        return f"[{packed_text(packed)}]:{ep.port}"
    return f"{packed_text(packed)}:{ep.port}"


def _recent_mask(ctx: RenderContext) -> str:
    mask = "255.255.255.255" if ctx.family is Family.V4 else ":".join(["ffff"] * 8)
    return f"--mask {mask} --rsource"


def _endpoint_rules(label: str, proto: str, ep: SelectedEndpoint, text: str, chain: str,
                    affinity: bool, ctx: RenderContext) -> tuple[str, ...]:
    """`label`: the service port's comment (`comment(port_name)`), made once per port."""
    recent = f" -m recent --set --name {chain} {_recent_mask(ctx)}" if affinity else ""
    return (
        # A pod reaching itself through the service: masquerade so the reply comes back
        # through the node instead of straight to itself.
        f"-s {_cidr(ep.packed, ctx)} {label} -j {MARK_MASQ}",
        f"-p {proto} {label}{recent} -m {proto} -j DNAT --to-destination {text}",
    )
