"""API objects -> decode -> model -> every renderer, and checks that what comes out is
kernel input we are willing to send: the oracle for the hostile corpus and the fuzz tests.

The checks are written independently of the renderers (a grammar of the rules we emit,
not a call back into render.py), so a renderer that passes attacker text through fails
them. For iptables:

- the full restore text of each family replays through our iptables-restore model
  (`simulate.restore`: chains exist, quoting is balanced, every table commits);
- every line is printable ASCII; every token of every rule is either a word of the
  fixed vocabulary below or the value of an option we check: addresses and CIDRs
  canonical (and, for single hosts, unicast addresses a packet can go to), ports in
  1..65535, chain names ours, comments of safe characters within xt_comment's 255;
- no chain is shared by two service ports.

For IPVS: every virtual and real server has a usable canonical address, a port in
1..65535 and a known protocol, every ipset entry parses, each service port's virtual
servers are distinct (across ports and services, the IPVS index arbitrates).

Renderers: iptables and IPVS. nftables joins when proxy/dataplane/nftables/render.py
lands: add a `render_nftables(state)` and its checker next to the others, and call
both from `render_all` (the fuzz and corpus tests pick it up from there).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from itertools import pairwise
from typing import Any

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common import nfacct
from proxy.dataplane.common.context import context_for
from proxy.dataplane.iptables import render as ipt
from proxy.dataplane.iptables.ruleset import Wanted
from proxy.dataplane.ipvs import render as ipvs
from proxy.dataplane.xtables import simulate
from proxy.kube.ingest import EndpointsSource, apply_object
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.model.types import Family, ServicePortKey

NODE = "node-a"
NODE_IPS = (ip_address("198.18.0.1"), ip_address("fd00:18::1"))
OPTIONS = DataplaneOptions(NODE, cluster_cidrs=(ip_network("198.18.1.0/24"),
                                                ip_network("fd00:18:1::/64")))


@dataclass(slots=True)
class Rendered:
    """Everything the renderers made of one model state."""

    state: DesiredState
    # Per family: the full iptables-restore text and each port's readable lines.
    restore: dict[Family, str] = field(default_factory=dict)
    iptables: dict[Family, dict[ServicePortKey, ipt.PortRules]] = field(default_factory=dict)
    ipvs: dict[ServicePortKey, ipvs.PortRules] = field(default_factory=dict)

    def rule_text(self) -> str:
        """Every byte any renderer produced, for "this string never shows" checks."""
        parts = list(self.restore.values())
        parts += [line for ports in self.iptables.values() for r in ports.values()
                  for line in r.lines()]
        for r in self.ipvs.values():
            parts += [line for vs in r.virtual_servers for line in ipvs.describe_vs(vs)]
            parts += [e.entry for e in r.entries]
            parts += [str(a) for a in r.addresses]
        return "\n".join(parts)


def build_model(objects: Iterable[Any],
                source: EndpointsSource = EndpointsSource.ENDPOINT_SLICES) -> ClusterModel:
    model = ClusterModel(NODE)
    for obj in objects:
        apply_object(model, obj, source)
    return model


def render_all(state: DesiredState) -> Rendered:
    out = Rendered(state)
    for family in (Family.V4, Family.V6):
        ctx = context_for(family, OPTIONS, NODE_IPS)
        ports = {k: ipt.render_port(r, ctx) for k, r in state.ports.items()
                 if k.family is family}
        out.iptables[family] = ports
        out.restore[family] = Wanted(ipt.render_base(ctx), ports).full_restore({}).render()
    out.ipvs = ipvs.render_all(state, ipvs.IpvsContext.build(OPTIONS, NODE_IPS))
    # nftables: out.nftables = render_nftables(state) once its renderer exists.
    return out


def run(objects: Iterable[Any], source: EndpointsSource = EndpointsSource.ENDPOINT_SLICES
        ) -> tuple[ClusterModel, Rendered]:
    model = build_model(objects, source)
    return model, render_all(model.resolve(full=True))


def problems(rendered: Rendered) -> list[str]:
    """Everything wrong with what the renderers produced; [] when it is all valid."""
    found: list[str] = []
    for family, text in rendered.restore.items():
        found += restore_problems(text, family)
        found += chain_collisions(rendered.iptables[family])
    found += ipvs_problems(rendered.ipvs.values())
    return found


# --- addresses ---------------------------------------------------------------------------

_BROADCAST = IPv4Address("255.255.255.255")


def usable_host(text: str) -> str | None:
    """Why `text` is not a canonical unicast address a packet can be sent to, or None."""
    try:
        ip = ip_address(text)
    except ValueError:
        return f"{text!r} is not an address"
    if str(ip) != text:
        return f"{text!r} is not canonical"
    if isinstance(ip, IPv6Address) and (ip.scope_id or ip.ipv4_mapped):
        return f"{text!r} is zone-scoped or IPv4-mapped"
    if (ip.is_unspecified or ip.is_loopback or ip.is_link_local or ip.is_multicast
            or ip == _BROADCAST):
        return f"{text!r} is not a usable unicast address"
    return None


def network_problem(text: str, family: Family) -> str | None:
    try:
        net = ip_network(text, strict=True)
    except ValueError:
        return f"{text!r} is not a CIDR"
    if str(net) != text or net.version != family:
        return f"{text!r} is not canonical or of the wrong family"
    if net.prefixlen == net.max_prefixlen:
        return usable_host(str(net.network_address))
    return None


# --- iptables ----------------------------------------------------------------------------

# The fixed loopback ranges the NodePort catch-all excludes (`! -d`).
_CONSTANT_NETS = frozenset({"127.0.0.0/8", "::1/128"})
_OUR_CHAIN = re.compile(r"SPX-(?:SVC|SVL|EXT|FW|SEP)-[0-9A-F]{16}|SPX-[A-Z]+(?:-[A-Z]+)*")
_BUILTIN_TARGETS = frozenset({"ACCEPT", "DROP", "RETURN", "REJECT", "DNAT", "MASQUERADE",
                              "MARK"})
# xt_comment keeps 255 characters; ours are names, addresses and a few words.
# "?": what the renderer writes for a character it will not pass (render.quote).
_COMMENT = re.compile(r"[A-Za-z0-9 ._:/\[\];>?-]{1,255}")
_VOCABULARY = frozenset({
    "!", "-p", "tcp", "udp", "sctp", "--random-fully", "--rcheck", "--reap", "--rsource",
    "--set",
})
_MODULES = frozenset({"comment", "tcp", "udp", "sctp", "statistic", "recent", "mark",
                      "conntrack", "addrtype", "nfacct"})
_SIMPLE_VALUES = {
    "--mode": {"random"},
    "--ctstate": {"NEW", "RELATED,ESTABLISHED"},
    "--dst-type": {"LOCAL"},
    "--src-type": {"LOCAL"},
    "--reject-with": {"icmp-port-unreachable", "icmp6-port-unreachable"},
    "--mask": {"255.255.255.255", ":".join(["ffff"] * 8)},
    "--mark": {"0x4000/0x4000"},
    "--set-xmark": {"0x4000/0x4000", "0x4000/0x0"},
}


def _port(text: str) -> str | None:
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= 65535:
        return f"port {text!r}"
    return None


def _destination(text: str) -> str | None:
    m = re.fullmatch(r"\[([0-9a-f:]+)\]:([0-9]+)|([0-9.]+):([0-9]+)", text)
    if m is None:
        return f"--to-destination {text!r}"
    host, port = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
    return usable_host(host) or _port(port)


def _chain(text: str) -> str | None:
    if text in _BUILTIN_TARGETS or (len(text) <= 28 and _OUR_CHAIN.fullmatch(text)):
        return None
    return f"chain {text!r}"


def spec_problems(spec: str, family: Family) -> list[str]:
    """What is wrong with one rule spec (the part after `-A CHAIN`)."""
    try:
        tokens = shlex.split(spec)
    except ValueError as exc:
        return [f"{spec!r}: {exc}"]
    found: list[str] = []
    i = 0
    while i < len(tokens):
        word = tokens[i]
        if word in _VOCABULARY:
            i += 1
            continue
        if i + 1 >= len(tokens):
            found.append(f"{spec!r}: dangling {word!r}")
            break
        value = tokens[i + 1]
        why: str | None = f"unexpected {word!r}"
        if word in ("-d", "-s"):
            why = None if value in _CONSTANT_NETS else network_problem(value, family)
        elif word == "--to-destination":
            why = _destination(value)
        elif word == "--comment":
            why = None if _COMMENT.fullmatch(value) else f"comment {value!r}"
        elif word == "--dport":
            why = _port(value)
        elif word == "--seconds":
            ok = value.isascii() and value.isdigit() and 1 <= int(value) <= 86400
            why = None if ok else f"seconds {value!r}"
        elif word in ("-j", "-g", "--name"):
            why = _chain(value)
        elif word == "-m":
            why = None if value in _MODULES else f"module {value!r}"
        elif word == "--nfacct-name":
            why = None if nfacct.ours(value) else f"nfacct object {value!r}"
        elif word == "--probability":
            why = None if re.fullmatch(r"0\.[0-9]{11}", value) else f"probability {value!r}"
        elif word in _SIMPLE_VALUES:
            why = None if value in _SIMPLE_VALUES[word] else f"{word} {value!r}"
        if why is not None:
            found.append(f"{spec!r}: {why}")
        i += 2
    return found


def restore_problems(text: str, family: Family) -> list[str]:
    """One family's iptables-restore text: it replays, and every rule in it is valid."""
    found: list[str] = []
    if not text.isascii() or any(not (c.isprintable() or c == "\n") for c in text):
        found.append("restore text holds non-ASCII or control characters")
    try:
        simulate.restore({}, text)
    except (simulate.SimulationError, ValueError) as exc:
        found.append(f"iptables-restore would refuse it: {exc}")
    for line in text.splitlines():
        if line.startswith(("*", ":", "COMMIT", "-X ")):
            continue
        m = re.match(r"(-A|-D) (\S+) (.*)$|-I (\S+) [0-9]+ (.*)$", line)
        if m is None:
            found.append(f"unexpected line {line!r}")
            continue
        found += spec_problems(m.group(3) if m.group(1) else m.group(5), family)
    return found


def chain_collisions(ports: dict[ServicePortKey, ipt.PortRules]) -> list[str]:
    owners: dict[str, ServicePortKey] = {}
    found = []
    for key, rules in ports.items():
        for name, _ in rules.chains:
            other = owners.setdefault(name, key)
            if other != key:
                found.append(f"chain {name} is both {tuple(other)} and {tuple(key)}")
    return found


# --- IPVS -------------------------------------------------------------------------------

_SCHEDULERS = frozenset({"rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq",
                         "mh"})


def _ipset_entry(role: ipvs.SetRole, entry: str) -> str | None:
    parts = entry.split(",")
    shapes = {
        ipvs.SetRole.VIPS: 1, ipvs.SetRole.FIREWALL_ALLOW: 3, ipvs.SetRole.LOOPBACK: 3,
    }
    if len(parts) != shapes.get(role, 2):
        return f"ipset {role.value} entry {entry!r}"
    why = usable_host(parts[0])
    if why is None and len(parts) > 1:
        proto, _, port = parts[1].partition(":")
        why = None if proto in ("tcp", "udp", "sctp") else f"protocol in {entry!r}"
        why = why or _port(port)
    if why is None and role is ipvs.SetRole.LOOPBACK:
        why = usable_host(parts[2])
    if why is None and role is ipvs.SetRole.FIREWALL_ALLOW:
        family = Family.V4 if "." in parts[0] else Family.V6
        try:
            net = ip_network(parts[2], strict=True)
            why = None if str(net) == parts[2] and net.version == family else parts[2]
        except ValueError:
            why = f"source range {parts[2]!r}"
    return why


def ipvs_problems(all_rules: Iterable[ipvs.PortRules]) -> list[str]:
    found: list[str] = []
    for rules in all_rules:
        seen: set[ipvs.VsKey] = set()
        for vs in rules.virtual_servers:
            k = vs.key
            if k in seen:
                found.append(f"{rules.key}: virtual server {k} twice in one service port")
            seen.add(k)
            why = usable_host(str(k.address)) or _port(str(k.port))
            if vs.scheduler not in _SCHEDULERS or not 0 <= vs.timeout <= 86400:
                why = why or f"scheduler {vs.scheduler!r} / timeout {vs.timeout}"
            for rs in vs.real_servers:
                why = why or usable_host(str(rs.address)) or _port(str(rs.port))
            if why:
                found.append(f"{rules.key}: {why}")
        for addr in rules.addresses:
            why = usable_host(str(addr))
            if why:
                found.append(f"{rules.key}: dummy address {why}")
        for e in rules.entries:
            why = _ipset_entry(e.role, e.entry)
            if why:
                found.append(f"{rules.key}: {why}")
    return found


def addresses_in_save(text: str) -> list[str]:
    """Problems with the addresses in `iptables-save` output (the e2e's kernel view)."""
    found: list[str] = []
    for line in text.splitlines():
        if "SPX-" not in line or not line.startswith("-A "):
            continue
        tokens = line.split()
        for word, value in pairwise(tokens):
            why = None
            if word in ("-d", "-s") and value not in _CONSTANT_NETS:
                family = Family.V6 if ":" in value else Family.V4
                why = network_problem(value, family)
            elif word == "--to-destination":
                why = _destination(value)
            if why:
                found.append(f"{line!r}: {why}")
    return found


def reasons(model: ClusterModel) -> dict[str, int]:
    """How many of each skip reason the model records (every one, beyond what it keeps)."""
    out: dict[str, int] = {}
    for (_, reason), n in model.skip_counts().items():
        out[reason] = out.get(reason, 0) + n
    return out


def first_problems(found: Sequence[str], limit: int = 5) -> str:
    more = f"\n... and {len(found) - limit} more" if len(found) > limit else ""
    return "\n".join(found[:limit]) + more
