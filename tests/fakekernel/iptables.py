"""A packet tracer over iptables rules: where the first packet of a connection goes
through the chains the iptables mode wrote.

The rules are the simulated kernel's (proxy/dataplane/xtables/simulate.py, the pure
model of `iptables-restore --noflush`): write them with `SimulatedRunner`s (or
`IptablesKernel.restore`), then `trace`. The walk is the kernel's for a new connection:

- arriving: nat PREROUTING, then the routing decision on the (DNATed) destination:
  a node address -> filter INPUT (delivered), else filter FORWARD, nat POSTROUTING;
- sent by the node: nat OUTPUT, filter OUTPUT, nat POSTROUTING.

Every match the iptables renderer writes is evaluated (addresses and CIDRs with `!`,
`-p`, `--dport`, addrtype, comment, nfacct, statistic, recent, mark, conntrack state); a
`statistic` rule forks the trace, so every endpoint comes back with its probability.
Anything else raises TraceError: the tracer never guesses.
"""

from __future__ import annotations

import functools
import shlex
from dataclasses import dataclass, replace

from proxy.dataplane.xtables.saved import BUILTIN_CHAINS, Saved, Table
from proxy.dataplane.xtables.simulate import restore
from tests.fakekernel.packet import (
    Node,
    Outcome,
    Packet,
    Trace,
    TraceError,
    Verdict,
    Walk,
    address_in,
)

# How a chain (or a rule's target) ended: fell through/returned, or a final verdict.
RETURN = "RETURN"
TERMINAL = frozenset({"ACCEPT", "DROP", "REJECT"})


@dataclass(frozen=True, slots=True)
class _Rule:
    """One rule spec, parsed: its matches as (negated, option, value) in order, the
    random pick (if any), and its target with the target's options."""

    text: str
    matches: tuple[tuple[bool, str, str], ...]
    probability: float | None
    recent_set: str | None
    target: str | None
    goto: bool
    options: tuple[tuple[str, str], ...]


_MODULES = frozenset({"comment", "tcp", "udp", "sctp", "addrtype", "statistic", "recent",
                      "mark", "conntrack", "nfacct"})
_TARGET_OPTIONS = {"--to-destination", "--set-xmark", "--reject-with"}
_FLAGS = frozenset({"--rcheck", "--reap", "--rsource", "--set"})


@functools.lru_cache(maxsize=4096)
def parse_rule(spec: str) -> _Rule:
    words = shlex.split(spec)
    matches: list[tuple[bool, str, str]] = []
    probability: float | None = None
    recent_set: str | None = None
    target: str | None = None
    goto = False
    options: list[tuple[str, str]] = []
    recent: dict[str, str] = {}
    i, negate = 0, False
    while i < len(words):
        word = words[i]
        if word == "!":
            negate = True
            i += 1
            continue
        if word == "-m":
            if words[i + 1] not in _MODULES:
                raise TraceError(f"unknown match module {words[i + 1]!r} in: {spec}")
            i += 2
            continue
        if word in ("-j", "-g"):
            target, goto = words[i + 1], word == "-g"
            i += 2
            continue
        if word in _FLAGS:
            recent[word] = ""
            i += 1
            continue
        if word == "--random-fully" and target == "MASQUERADE":
            i += 1
            continue
        value = words[i + 1] if i + 1 < len(words) else ""
        if word == "--probability":
            probability = float(value)
        elif (word == "--mode" and value == "random") or word in ("--comment",
                                                                   "--nfacct-name"):
            pass  # always match (nfacct counts: what the trace's path shows)
        elif word in ("--name", "--seconds", "--mask"):
            recent[word] = value
        elif word in _TARGET_OPTIONS:
            options.append((word, value))
        elif word in ("-s", "-d", "-p", "--dport", "--dst-type", "--src-type", "--mark",
                      "--ctstate"):
            matches.append((negate, word, value))
        else:
            raise TraceError(f"unknown option {word!r} in: {spec}")
        negate = False
        i += 2
    if recent:
        _check_recent(recent, spec)
        if "--set" in recent:
            recent_set = recent["--name"]
        else:
            matches.append((False, "--rcheck", recent["--name"]))
    return _Rule(spec, tuple(matches), probability, recent_set, target, goto, tuple(options))


def _check_recent(options: dict[str, str], spec: str) -> None:
    """`recent` the way the renderer writes it: per source address, whole address."""
    if "--rsource" not in options or "--name" not in options or \
            options.get("--mask") not in ("255.255.255.255", ":".join(["ffff"] * 8)):
        raise TraceError(f"recent match not modelled: {spec}")
    if "--set" not in options and ("--rcheck" not in options or "--seconds" not in options):
        raise TraceError(f"recent match not modelled: {spec}")


def _mark(value: str) -> tuple[int, int]:
    bits, _, mask = value.partition("/")
    return int(bits, 16), int(mask or "0xffffffff", 16)


class IptablesTracer:
    """Traces packets through `kernel` (one family's tables) on a node whose own
    addresses are `node`'s."""

    def __init__(self, kernel: Saved, node: Node) -> None:
        self.kernel = kernel
        self.node = node
        self._path: list[str] = []

    def trace(self, packet: Packet, remembered: frozenset[str] = frozenset()) -> Trace:
        """Every way `packet` (the first of its connection) ends; `remembered`: the
        affinity records its source already has (an earlier outcome's)."""
        self._path = []
        start = Walk(packet, remembered=remembered)
        outcomes: list[Outcome] = []
        first = "OUTPUT" if packet.local else "PREROUTING"
        for st, _flow in self._chain(Table.NAT, first, start):
            outcomes.extend(self._after_nat(st))
        return Trace(tuple(outcomes), tuple(self._path))

    def _after_nat(self, st: Walk) -> list[Outcome]:
        if st.packet.local:
            hook = "OUTPUT"
        else:
            hook = "INPUT" if self.node.is_local(st.destination) else "FORWARD"
        out: list[Outcome] = []
        for s, flow in self._chain(Table.FILTER, hook, st):
            if flow in ("DROP", "REJECT"):
                out.append(s.outcome(Verdict(flow.lower())))
            elif hook == "INPUT":
                out.append(s.outcome(Verdict.ACCEPT))
            else:
                out += [p.outcome(Verdict.ACCEPT)
                        for p, _f in self._chain(Table.NAT, "POSTROUTING", s)]
        return out

    # --- chains and rules ---------------------------------------------------------------

    def _chain(self, table: Table, chain: str, st: Walk, start: int = 0
               ) -> list[tuple[Walk, str]]:
        """(state, how the chain ended) for each way through `chain` from rule `start`."""
        rules = self.kernel.get(table, {}).get(chain)
        if rules is None and chain in BUILTIN_CHAINS:
            rules = []  # a table nobody wrote: its built-in chains are empty
        if rules is None:
            raise TraceError(f"{table.value} chain {chain} does not exist")
        for i in range(start, len(rules)):
            rule = parse_rule(rules[i])
            taken = self._matches(rule, st)
            if taken is None:
                continue
            out: list[tuple[Walk, str]] = []
            hit, missed = taken
            if missed is not None:
                out += self._chain(table, chain, missed, i + 1)
            self._path.append(f"{table.value} {chain}: {rule.text}")
            for s, flow in self._target(table, rule, hit):
                out += self._chain(table, chain, s, i + 1) if flow == "" else [(s, flow)]
            return out
        return [(st, RETURN)]

    def _matches(self, rule: _Rule, st: Walk) -> tuple[Walk, Walk | None] | None:
        """None if `rule` does not match; else the state that took it and, for a random
        pick, the state that did not (each with its probability)."""
        if not all(self._match(negate, option, value, st) != negate
                   for negate, option, value in rule.matches):
            return None
        hit = st
        if rule.recent_set is not None:
            hit = replace(hit, remembered=hit.remembered | {rule.recent_set})
        if rule.probability is None:
            return hit, None
        p = rule.probability
        return (replace(hit, probability=st.probability * p),
                replace(st, probability=st.probability * (1 - p)))

    def _match(self, negate: bool, option: str, value: str, st: Walk) -> bool:
        packet = st.packet
        if option == "-s":
            return address_in(packet.source, value)
        if option == "-d":
            return address_in(st.destination, value)
        if option == "-p":
            return packet.protocol == value
        if option == "--dport":
            return packet.port == int(value)
        if option in ("--dst-type", "--src-type"):
            if value != "LOCAL":
                raise TraceError(f"addrtype {value} not modelled")
            ip = packet.source if option == "--src-type" else st.destination
            return self.node.is_local(ip)
        if option == "--mark":
            bits, mask = _mark(value)
            return st.mark & mask == bits
        if option == "--ctstate":
            return "NEW" in value.split(",")  # every traced packet opens its connection
        if option == "--rcheck":
            return value in st.remembered
        raise TraceError(f"match {option} not modelled")

    def _target(self, table: Table, rule: _Rule, st: Walk) -> list[tuple[Walk, str]]:
        """What `rule`'s target does: (state, "" to go on with the next rule, RETURN,
        or a final verdict) for each way."""
        target, options = rule.target, dict(rule.options)
        if target is None:
            return [(st, "")]
        if target in TERMINAL:
            if target == "REJECT" and table is not Table.FILTER:
                raise TraceError("REJECT outside the filter table")
            return [(st, target)]
        if target == RETURN:
            return [(st, RETURN)]
        if target == "MARK":
            bits, mask = _mark(options["--set-xmark"])
            return [(replace(st, mark=(st.mark & ~mask) ^ bits), "")]
        if target == "DNAT":
            if st.endpoint is not None:
                raise TraceError("DNAT twice")
            return [(replace(st, endpoint=options["--to-destination"]), "ACCEPT")]
        if target == "MASQUERADE":
            return [(replace(st, masquerade=True), "ACCEPT")]
        out: list[tuple[Walk, str]] = []
        for s, flow in self._chain(table, target, st):
            if flow != RETURN:
                out.append((s, flow))
            else:
                out.append((s, RETURN if rule.goto else ""))
        return out


class IptablesKernel:
    """One family's tables, written by restore text, and traced."""

    def __init__(self, node: Node, kernel: Saved | None = None) -> None:
        self.tables: Saved = kernel if kernel is not None else {}
        self.node = node

    def restore(self, text: str) -> None:
        restore(self.tables, text)

    def trace(self, packet: Packet, remembered: frozenset[str] = frozenset()) -> Trace:
        return IptablesTracer(self.tables, self.node).trace(packet, remembered)
