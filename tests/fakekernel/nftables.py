"""A fake nf_tables: the nft script text the nftables mode writes, applied in memory as
one transaction (strictly: what the kernel would refuse raises), and a packet tracer
over the resulting tables.

`FakeNft` stands in for the mode's runner (`NftablesDataPlane(runner=FakeNft())`): it
takes each script's text, the `nft -f` syntax (tables, chains with hooks and
priorities, sets, maps and verdict maps, rules, elements; add, flush, delete), so it
does not depend on how the mode builds its objects. `trace` walks a new connection's
first packet through the base chains of its family's tables in hook and priority
order, as the kernel does:

- arriving: prerouting, then input (destination a node address, after DNAT) or
  forward and postrouting;
- sent by the node: output, postrouting.

At a hook, once a nat chain has translated the connection the later nat chains do not
run (nf_nat's rule). `numgen random` forks the trace, so every endpoint comes back
with its probability; `jhash` is computed as the kernel does (jhash.py) from the
packet's addresses and ports, so a hashed lookup takes one way. Any statement or
expression outside the subset the mode writes raises TraceError.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field, replace
from ipaddress import ip_address

from proxy.dataplane.base import GiveWay, offer_lock
from proxy.dataplane.nftables.objects import CounterRef, Key, Value
from proxy.dataplane.nftables.objects import Verdict as ElementVerdict
from proxy.dataplane.nftables.readback import Held, Keep, Unreadable
from proxy.dataplane.nftables.rule_refs import RuleRefs
from proxy.dataplane.nftables.transaction import Script
from proxy.dataplane.nftables.wire import stages, statement_lines
from proxy.model.types import Family
from tests.fakekernel.jhash import nft_jhash
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


class NftFakeError(Exception):
    """The fake kernel refused a script (the whole transaction is dropped)."""


_PRIORITY_NAMES = {"raw": -300, "mangle": -150, "dstnat": -100, "filter": 0,
                   "security": 50, "srcnat": 100}
_HOOK = re.compile(r"type (filter|nat) hook (\w+) priority ([^;]+); policy (accept|drop);")


def _priority(text: str) -> int:
    words = text.split()
    base = _PRIORITY_NAMES[words[0]] if words[0] in _PRIORITY_NAMES else int(words[0])
    if len(words) == 3 and words[1] in "+-":
        return base + int(words[2]) * (1 if words[1] == "+" else -1)
    if len(words) != 1:
        raise NftFakeError(f"priority {text!r}")
    return base


@dataclass
class Chain:
    rules: list[str] = field(default_factory=list)
    kind: str | None = None  # "nat" or "filter" for a base chain
    hook: str | None = None
    priority: int = 0


@dataclass
class NftSet:
    is_map: bool
    body: str
    elements: dict[tuple[str, ...], str] = field(default_factory=dict)


@dataclass
class NftTable:
    chains: dict[str, Chain] = field(default_factory=dict)
    sets: dict[str, NftSet] = field(default_factory=dict)
    counters: dict[str, int] = field(default_factory=dict)  # named counters: packets


def _part(text: str) -> str:
    """One part of an element key, spelled one way (addresses as ipaddress prints them)."""
    try:
        return str(ip_address(text))
    except ValueError:
        return text


def _key(text: str) -> tuple[str, ...]:
    return tuple(_part(p) for p in text.split(" . "))


def _elements(text: str) -> list[tuple[tuple[str, ...], str]]:
    """`{ k1 : v1, k2 }` -> [(key parts, value or "")]."""
    text = text.strip()
    if not (text.startswith("{") and text.endswith("}")):
        raise NftFakeError(f"elements {text!r}")
    out = []
    for item in text[1:-1].split(","):
        key, _, value = item.strip().partition(" : ")
        out.append((_key(key.strip()), value.strip()))
    return out


Tables = dict[tuple[str, str], NftTable]  # (family "ip"/"ip6", table name) -> table


class _Reader:
    """FakeNft's counter reader (counters.CounterReader): its tables, from any thread."""

    def __init__(self, nft: FakeNft) -> None:
        self._nft = nft

    def read(self, family: Family, keys: Iterable[tuple[str, str]],
             give_way: GiveWay = offer_lock) -> list[int | None]:
        return [self._nft.counter(family, table, name) for table, name in keys]

    def close(self) -> None:
        pass


class FakeNft:
    """nf_tables in memory, behind the interface of the nftables mode's runner."""

    def __init__(self) -> None:
        self.tables: Tables = {}
        self.scripts: list[str] = []  # every script applied, in order
        self.dumped: list[tuple[str, str]] = []  # every set read back (elements), in order
        self.probed: list[tuple[str, str, int]] = []  # (table, set, keys asked) by `probe`
        self.rules_read: list[tuple[str, str]] = []  # every chain whose rules were read
        self.counter_dumps = 0  # dumps of every counter

    # --- the runner's interface ---------------------------------------------------------------

    def send(self, script: str | Script, family: Family, tables: Collection[str]) -> None:
        """As the runner: a script in parts, one transaction per part, in order (what
        parts were taken stay when a later one is refused)."""
        if isinstance(script, str) or not script.parts:
            self.run(script if isinstance(script, str) else script.text())
            return
        for part in stages(script.statements()):
            self.run("\n".join(line for st in part for line in statement_lines(st, script.ip))
                     + "\n")

    def run(self, text: str) -> None:
        """Apply `text` as one transaction: all of it, or (NftFakeError) none of it."""
        working = copy.deepcopy(self.tables)
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip() or line.lstrip().startswith("#"):
                continue
            try:
                _apply(working, line)
            except (NftFakeError, KeyError, ValueError) as exc:
                raise NftFakeError(f"line {number}: {exc}: {line}") from exc
        _check_references(working)
        self.tables = working
        self.scripts.append(text)

    def names(self, family: Family, tables: Collection[str]
              ) -> tuple[set[str], list[tuple[str, str]], dict[tuple[str, str], str]]:
        ip = "ip" if family is Family.V4 else "ip6"
        present = {t for (f, t) in self.tables if f == ip and t in tables}
        chains = [(t, c) for t in sorted(present) for c in self.tables[ip, t].chains]
        sets = {(t, s): "map" if v.is_map else "set" for t in sorted(present)
                for s, v in self.tables[ip, t].sets.items()}
        return present, chains, sets

    def counters(self, family: Family, tables: Collection[str]) -> dict[tuple[str, str], int]:
        ip = "ip" if family is Family.V4 else "ip6"
        self.counter_dumps += 1
        return {(t, n): v for (f, t), table in self.tables.items() if f == ip and t in tables
                for n, v in table.counters.items()}

    def counter(self, family: Family, table: str, name: str) -> int | None:
        """One named counter's packets, asked for by name (no dump); None if none."""
        held = self.tables.get(("ip" if family is Family.V4 else "ip6", table))
        return None if held is None else held.counters.get(name)

    def counter_reader(self) -> _Reader:
        return _Reader(self)

    def rule_refs(self, family: Family, chains: Iterable[tuple[str, str]]) -> RuleRefs:
        """What the rules of `chains` refer to (a missing chain skipped): the counters
        they count into, the addresses they DNAT to (None past a DNAT to a map's value),
        read from their text as the kernel's decoder reads their expressions."""
        ip = "ip" if family is Family.V4 else "ip6"
        found = RuleRefs()
        for table, chain in chains:
            self.rules_read.append((table, chain))
            held = self.tables.get((ip, table))
            for rule in held.chains[chain].rules if held and chain in held.chains else []:
                targets = [_DNAT_ADDRESS.fullmatch(t) for t in _DNAT_TARGET.findall(rule)]
                found.add(table, _COUNTER_REFERENCE.findall(rule),
                          None if None in targets else
                          [t[1] or t[2] for t in targets if t is not None])
        return found

    def elements(self, family: Family, table: str, set_name: str, types: Sequence[str],
                 is_map: bool, keep: Keep | None = None) -> Held:
        """The runner's read-back of one set: keys typed as `types` (ports as numbers),
        verdicts as objects.Verdict, () in a set; of a map, only what `keep` says."""
        found = self.tables["ip" if family is Family.V4 else "ip6", table].sets[set_name]
        self.dumped.append((table, set_name))
        out: dict[Key, Value] = {}
        for key, value in found.elements.items():
            if len(key) != len(types):
                raise Unreadable(f"{key} as {types}")
            parts = tuple(int(p) if t in ("inet_service", "integer") else p
                          for p, t in zip(key, types, strict=True))
            held = _held_value(value)
            if keep is None or not is_map or keep(parts, held):
                out[parts] = held
        return Held(decoded=out)

    def probe(self, family: Family, table: str, set_name: str, keys: Sequence[Key],
              types: Sequence[str] = (), is_map: bool = False) -> Held:
        """The runner's probe: which of `keys` the set holds, asked one by one, with
        their values in a map."""
        found = self.tables["ip" if family is Family.V4 else "ip6", table].sets[set_name]
        self.probed.append((table, set_name, len(keys)))
        held = {k: found.elements.get(tuple(str(p) for p in k)) for k in keys}
        return Held(decoded={k: _held_value(v) for k, v in held.items() if v is not None},
                    partial=True)

    def count(self, family: Family, table: str, name: str, packets: int = 1) -> None:
        """Packets counted into a named counter, as traffic through its rule would."""
        self.tables["ip" if family is Family.V4 else "ip6", table].counters[name] += packets

    def started_here(self, pid: int) -> bool:
        return True

    def close(self) -> None:
        pass

    # --- tracing ----------------------------------------------------------------------------------

    def trace(self, packet: Packet, node: Node,
              remembered: frozenset[str] = frozenset()) -> Trace:
        ip = "ip" if packet.destination.version == 4 else "ip6"
        tables = {t: v for (f, t), v in self.tables.items() if f == ip}
        return NftTracer(tables, node).trace(packet, remembered)


def _held_value(value: str) -> Value:
    """An element's value as the runner reads it back: a counter map's name, a pick map's
    address . port, a verdict, or () in a set."""
    verb, _, chain = value.partition(" ")
    if value.startswith('"'):  # a counter map's
        return CounterRef(value.strip('"'))
    if " . " in value:  # a pick map's address . port
        address, port = value.split(" . ")
        return (address, int(port))
    return ElementVerdict(verb, chain) if value else ()


def _apply(tables: Tables, line: str) -> None:
    words = line.split(" ", 4)
    if len(words) < 4:
        raise NftFakeError("too short")
    verb, what, ip, name = words[:4]
    rest = words[4] if len(words) > 4 else ""
    if ip not in ("ip", "ip6"):
        raise NftFakeError(f"family {ip}")
    if what == "table":
        if rest:
            raise NftFakeError("table options")
        if verb == "add":
            tables.setdefault((ip, name), NftTable())
        elif verb == "delete":
            del tables[ip, name]
        else:
            raise NftFakeError(f"{verb} table")
        return
    table = tables.get((ip, name))
    if table is None:
        raise NftFakeError(f"no table {ip} {name}")
    obj, _, tail = rest.partition(" ")
    if what == "chain":
        _chain_command(table, verb, obj, tail)
    elif what == "rule":
        if verb != "add" or not tail:
            raise NftFakeError(f"{verb} rule")
        table.chains[obj].rules.append(tail)
    elif what in ("set", "map"):
        _set_command(table, verb, what == "map", obj, tail)
    elif what == "element":
        _element_command(table, verb, obj, tail)
    elif what == "counter" and verb == "add":
        table.counters.setdefault(obj, 0)  # one that exists keeps its count
    elif what == "counter" and verb == "delete":
        del table.counters[obj]
    else:
        raise NftFakeError(f"{verb} {what}")


def _chain_command(table: NftTable, verb: str, name: str, body: str) -> None:
    if verb == "add":
        chain = Chain()
        if body:
            found = _HOOK.fullmatch(body.strip().removeprefix("{").removesuffix("}").strip())
            if found is None or found[4] != "accept":
                raise NftFakeError(f"chain body {body!r}")
            chain = Chain([], found[1], found[2], _priority(found[3]))
        old = table.chains.get(name)
        if old is None:
            table.chains[name] = chain
        elif (old.kind, old.hook, old.priority) != (chain.kind, chain.hook, chain.priority) \
                and body:
            raise NftFakeError(f"chain {name} redefined")
    elif verb == "flush":
        table.chains[name].rules.clear()
    elif verb == "delete":
        if table.chains[name].rules:
            raise NftFakeError(f"chain {name} not empty")
        del table.chains[name]
    else:
        raise NftFakeError(f"{verb} chain")


def _set_command(table: NftTable, verb: str, is_map: bool, name: str, body: str) -> None:
    if verb == "add":
        body = body.strip().removeprefix("{").removesuffix("}").strip()
        if is_map != (" : " in body):
            raise NftFakeError(f"{'map' if is_map else 'set'} {name} body {body!r}")
        old = table.sets.get(name)
        if old is None:
            table.sets[name] = NftSet(is_map, body)
        elif (old.is_map, old.body) != (is_map, body):
            raise NftFakeError(f"set {name} redefined")
        return
    found = table.sets[name]
    if found.is_map != is_map:
        raise NftFakeError(f"{name} is not a {'map' if is_map else 'set'}")
    if verb == "flush":
        found.elements.clear()
    elif verb == "delete":
        del table.sets[name]
    else:
        raise NftFakeError(f"{verb} set")


def _element_command(table: NftTable, verb: str, name: str, text: str) -> None:
    found = table.sets[name]
    for key, value in _elements(text):
        if verb == "add":
            if found.is_map != bool(value):
                raise NftFakeError(f"element {key} of {name}: value {value!r}")
            if found.elements.get(key, value) != value:
                raise NftFakeError(f"element {key} of {name} exists with another value")
            found.elements[key] = value
        elif verb == "delete":
            if value:
                raise NftFakeError("delete element with a value")
            del found.elements[key]
        else:
            raise NftFakeError(f"{verb} element")


_REFERENCE = re.compile(r"(?:^| )(?:jump|goto) (\S+)")
_SET_REFERENCE = re.compile(r"@([\w-]+)")
_COUNTER_REFERENCE = re.compile(r'counter name "([^"]+)"')
# `dnat [ip|ip6] to <target>`: an address:port (IPv6 bracketed), or a map's value.
_DNAT_TARGET = re.compile(r"\bdnat (?:ip6? )?to (\S+)")
_DNAT_ADDRESS = re.compile(r"\[([0-9a-f:.]+)\]:\d+|([0-9.]+):\d+")


def _check_references(tables: Tables) -> None:
    """What nf_tables checks at commit: every jump, goto and @set names an object of
    the same table."""
    for (ip, name), table in tables.items():
        texts = [r for c in table.chains.values() for r in c.rules]
        texts += [v for s in table.sets.values() if s.is_map for v in s.elements.values()]
        for text in texts:
            for chain in _REFERENCE.findall(text):
                if chain not in table.chains:
                    raise NftFakeError(f"{ip} {name}: no chain {chain} for: {text}")
            for set_name in _SET_REFERENCE.findall(text):
                if set_name not in table.sets:
                    raise NftFakeError(f"{ip} {name}: no set {set_name} for: {text}")
            for counter in _COUNTER_REFERENCE.findall(text):
                if counter not in table.counters:
                    raise NftFakeError(f"{ip} {name}: no counter {counter} for: {text}")
        for set_name, found in table.sets.items():  # a counter map's values
            for value in found.elements.values():
                if value.startswith('"') and value.strip('"') not in table.counters:
                    raise NftFakeError(f"{ip} {name}: no counter {value} in {set_name}")


# --- the tracer -----------------------------------------------------------------------------------


RETURN, NEXT = "return", ""  # fell off / returned; the rule did not end the chain
_FINAL = frozenset({"accept", "drop", "reject"})
_COMMENT = re.compile(r' comment "[^"]*"$')
_SELECTORS = {("ip", "saddr"), ("ip6", "saddr"), ("ip", "daddr"), ("ip6", "daddr"),
              ("meta", "l4proto"), ("th", "dport"), ("tcp", "dport"), ("udp", "dport"),
              ("sctp", "dport")}


class NftTracer:
    """Traces packets through one family's `tables` on a node with `node`'s addresses."""

    def __init__(self, tables: dict[str, NftTable], node: Node) -> None:
        self.tables = tables
        self.node = node
        self.path: list[str] = []

    def trace(self, packet: Packet, remembered: frozenset[str] = frozenset()) -> Trace:
        states = [Walk(packet, remembered=remembered)]
        outcomes: list[Outcome] = []
        states, ended = self._hook("output" if packet.local else "prerouting", states)
        outcomes += ended
        for st in states:
            if packet.local:
                rest = ["postrouting"]
            elif self.node.is_local(st.destination):
                rest = ["input"]
            else:
                rest = ["forward", "postrouting"]
            going = [st]
            for hook in rest:
                going, ended = self._hook(hook, going)
                outcomes += ended
            outcomes += [s.outcome(Verdict.ACCEPT) for s in going]
        return Trace(tuple(outcomes), tuple(self.path))

    def _hook(self, hook: str, states: list[Walk]) -> tuple[list[Walk], list[Outcome]]:
        """Every base chain at `hook`, by priority: the states that go on, and the
        outcomes of those dropped or rejected here. Chains of equal priority run in
        table order (the kernel's order between them is its own; the mode's shard
        tables never both take one packet)."""
        chains = sorted((c.priority, t, n) for t, table in self.tables.items()
                        for n, c in table.chains.items() if c.hook == hook)
        ended: list[Outcome] = []
        for _priority, t, name in chains:
            chain = self.tables[t].chains[name]
            going: list[Walk] = []
            for st in states:
                if chain.kind == "nat" and self._translated(hook, st):
                    going.append(st)  # nf_nat runs no more nat chains once it translated
                    continue
                for s, flow in self._chain(t, name, st):
                    if flow in ("drop", "reject"):
                        ended.append(s.outcome(Verdict(flow)))
                    else:
                        going.append(s)
            states = going
        return states, ended

    @staticmethod
    def _translated(hook: str, st: Walk) -> bool:
        if hook in ("prerouting", "output"):
            return st.endpoint is not None
        return st.masquerade

    def _chain(self, table: str, name: str, st: Walk, start: int = 0
               ) -> list[tuple[Walk, str]]:
        chain = self.tables[table].chains.get(name)
        if chain is None:
            raise TraceError(f"no chain {table} {name}")
        for i in range(start, len(chain.rules)):
            words = _COMMENT.sub("", chain.rules[i]).split()
            results = self._eval(table, words, 0, st)
            if len(results) == 1 and results[0][1] == NEXT and results[0][0] == st:
                continue  # did not match, changed nothing
            self.path.append(f"{table} {name}: {chain.rules[i]}")
            out: list[tuple[Walk, str]] = []
            for s, flow in results:
                out += self._chain(table, name, s, i + 1) if flow == NEXT else [(s, flow)]
            return out
        return [(st, RETURN)]

    def _verdict(self, table: str, words: list[str], st: Walk) -> list[tuple[Walk, str]]:
        verb = words[0]
        if verb in _FINAL or verb == RETURN:
            return [(st, verb)]
        if verb in ("jump", "goto") and len(words) == 2:
            out: list[tuple[Walk, str]] = []
            for s, flow in self._chain(table, words[1], st):
                if flow == RETURN:
                    out.append((s, RETURN if verb == "goto" else NEXT))
                else:
                    out.append((s, flow))
            return out
        raise TraceError(f"verdict not modelled: {' '.join(words)}")

    def _eval(self, table: str, words: list[str], i: int, st: Walk
              ) -> list[tuple[Walk, str]]:
        """Expressions and statements of one rule from word `i`: (state, flow) each way."""
        if i >= len(words):
            return [(st, NEXT)]
        w = words[i]
        pair = (w, words[i + 1]) if i + 1 < len(words) else (w, "")
        if pair == ("ct", "state"):
            if words[i + 2] != "new":
                raise TraceError(f"ct state {words[i + 2]}")
            return self._eval(table, words, i + 3, st)
        if pair == ("ct", "status"):
            if words[i + 2] != "dnat":
                raise TraceError(f"ct status {words[i + 2]}")
            return self._eval(table, words, i + 3, st) if st.endpoint else [(st, NEXT)]
        if pair in _SELECTORS:
            return self._selector(table, words, i, st)
        if pair in (("fib", "saddr"), ("fib", "daddr")):
            if words[i + 2:i + 4] != ["type", "local"]:
                raise TraceError(f"fib {' '.join(words[i:i + 4])}")
            ip = st.packet.source if pair[1] == "saddr" else st.destination
            return self._eval(table, words, i + 4, st) if self.node.is_local(ip) \
                else [(st, NEXT)]
        if pair == ("meta", "mark"):
            return self._mark(table, words, i, st)
        if pair == ("counter", "name") and words[i + 2].startswith('"'):  # decides nothing
            return self._eval(table, words, i + 3, replace(
                st, counted=(*st.counted, words[i + 2].strip('"'))))
        if pair == ("counter", "name"):  # `counter name <key> map @<counter map>`
            end = words.index("map", i)
            found = self._set(table, words[end + 1].removeprefix("@")).elements.get(
                self._key(words[i + 2:end], st))
            if found is None:  # a failed lookup ends the rule, not the chain
                return [(st, NEXT)]
            return self._eval(table, words, end + 2, replace(
                st, counted=(*st.counted, found.strip('"'))))
        if pair == ("numgen", "random"):
            return self._numgen(table, words, i, st)
        if w == "jhash":
            return self._jhash_vmap(table, words[i + 1:], st)
        if w == "dnat":
            return self._dnat(table, words, i, st)
        if w == "masquerade":
            if words[i + 1:] not in ([], ["fully-random"]):
                raise TraceError(f"masquerade {' '.join(words[i + 1:])}")
            return [(replace(st, masquerade=True), "accept")]
        if w == "update":
            name = words[i + 1].removeprefix("@")
            family = "ip" if st.packet.source.version == 4 else "ip6"
            if words[i + 2:i + 6] != ["{", family, "saddr", "}"]:
                raise TraceError(f"update {' '.join(words[i:])}")
            self._set(table, name)
            return self._eval(table, words, i + 6,
                              replace(st, remembered=st.remembered | {name}))
        if w in _FINAL or w in ("jump", "goto", RETURN):
            return self._verdict(table, words[i:], st)
        raise TraceError(f"expression not modelled: {' '.join(words[i:])}")

    def _value(self, selector: tuple[str, str], st: Walk) -> str:
        what = selector[1]
        if what == "saddr":
            return str(st.packet.source)
        if what == "daddr":
            return str(st.destination)
        if what == "l4proto":
            return st.packet.protocol
        return str(st.dport)

    def _selector(self, table: str, words: list[str], i: int, st: Walk
                  ) -> list[tuple[Walk, str]]:
        """`sel [. sel ...]` then a comparison, a set lookup or a verdict-map lookup."""
        selectors = [(words[i], words[i + 1])]
        i += 2
        while i < len(words) and words[i] == ".":
            selectors.append((words[i + 1], words[i + 2]))
            i += 3
        for sel in selectors:
            if sel not in _SELECTORS:
                raise TraceError(f"selector {sel} not modelled")
        key = tuple(self._value(s, st) for s in selectors)
        for sel in selectors:
            if sel[0] in ("tcp", "udp", "sctp") and st.packet.protocol != sel[0]:
                return [(st, NEXT)]  # `tcp dport` matches tcp packets only
        op = words[i]
        if op == "vmap":
            verdict = self._set(table, words[i + 1].removeprefix("@")).elements.get(key)
            if verdict is None:
                return [(st, NEXT)]
            return self._verdict(table, verdict.split(), st)
        if op.startswith("@"):
            found = self._set(table, op[1:])
            hit = key in found.elements
            if "dynamic" in found.body:  # filled by `update` (affinity): by the source
                hit = selectors[0][1] == "saddr" and len(key) == 1 and op[1:] in st.remembered
            return self._eval(table, words, i + 1, st) if hit else [(st, NEXT)]
        negate = op == "!="
        value = words[i + 1] if negate else op
        if len(key) != 1:
            raise TraceError(f"comparison of a concatenation: {' '.join(words)}")
        if selectors[0][1] in ("saddr", "daddr"):
            hit = address_in(ip_address(key[0]), value)
        else:
            hit = key[0] == value
        if hit == negate:
            return [(st, NEXT)]
        return self._eval(table, words, i + (2 if negate else 1), st)

    def _set(self, table: str, name: str) -> NftSet:
        found = self.tables[table].sets.get(name)
        if found is None:
            raise TraceError(f"no set {table} {name}")
        return found

    def _mark(self, table: str, words: list[str], i: int, st: Walk
              ) -> list[tuple[Walk, str]]:
        tail = words[i + 2:i + 7]
        if tail[:3] == ["set", "meta", "mark"] and tail[3] in ("|", "^"):
            bits = int(tail[4], 16)
            mark = st.mark | bits if tail[3] == "|" else st.mark ^ bits
            return self._eval(table, words, i + 7, replace(st, mark=mark))
        if len(tail) >= 4 and tail[0] == "&" and tail[2] == "==":
            if st.mark & int(tail[1], 16) != int(tail[3], 16):
                return [(st, NEXT)]
            return self._eval(table, words, i + 6, st)
        raise TraceError(f"meta mark {' '.join(tail)}")

    def _numgen(self, table: str, words: list[str], i: int, st: Walk
                ) -> list[tuple[Walk, str]]:
        """`numgen random mod K V` (a match: 1 in K) or `numgen random mod K < T` (T in
        K)."""
        if words[i + 2] != "mod":
            raise TraceError(f"numgen {' '.join(words[i:])}")
        k = int(words[i + 3])
        if words[i + 4] == "<":
            hits, i = min(max(int(words[i + 5]), 0), k), i + 1
        else:
            value = int(words[i + 4])
            hits = 1 if 0 <= value < k else 0
        if not hits:
            return [(st, NEXT)]
        p = st.probability
        hit = self._eval(table, words, i + 5, replace(st, probability=p * hits / k))
        if hits == k:
            return hit
        return [*hit, (replace(st, probability=p * (k - hits) / k), NEXT)]

    def _dnat(self, table: str, words: list[str], i: int, st: Walk
              ) -> list[tuple[Walk, str]]:
        """`dnat to A:P`, or `dnat ip to numgen random mod N map @slots` (one in N each)."""
        if st.endpoint is not None:
            raise TraceError("DNAT twice")
        rest = words[i + 1:]
        if len(rest) == 2 and rest[0] == "to":
            return [(replace(st, endpoint=rest[1]), "accept")]
        if len(rest) == 8 and rest[0] in ("ip", "ip6") and rest[1:5] == ["to", "numgen",
                                                                         "random", "mod"] \
                and rest[6] == "map":
            slots = self._set(table, rest[7].removeprefix("@")).elements
            return _uniform(st, int(rest[5]), lambda slot: slots.get((str(slot),)))
        if rest[0] in ("ip", "ip6") and rest[1:3] == ["to", rest[0]] and "numgen" in rest:
            return self._dnat_pick(table, rest[2:], st)
        if rest[0] in ("ip", "ip6") and rest[1:3] == ["to", "jhash"]:
            return self._dnat_hashed(table, rest[3:], st)
        raise TraceError(f"dnat {' '.join(rest)}")

    def _key(self, words: list[str], st: Walk) -> tuple[str, ...]:
        """The packet's key for the concatenation `words` (`ip daddr . th dport`)."""
        selectors = [tuple(sel.split()) for sel in " ".join(words).split(" . ")]
        if any(len(sel) != 2 or sel not in _SELECTORS for sel in selectors):
            raise TraceError(f"key {' '.join(words)}")
        return tuple(self._value((sel[0], sel[1]), st) for sel in selectors)

    def _dnat_pick(self, table: str, words: list[str], st: Walk) -> list[tuple[Walk, str]]:
        """`<key> . numgen random mod N map @pick`: one in N each, the endpoint the key
        and that pick hold."""
        at = words.index("numgen")
        if words[at - 1] != "." or words[at + 1:at + 3] != ["random", "mod"] \
                or words[at + 4] != "map" or len(words) != at + 6:
            raise TraceError(f"dnat to {' '.join(words)}")
        key = self._key(words[:at - 1], st)
        picks = self._set(table, words[at + 5].removeprefix("@")).elements
        return _uniform(st, int(words[at + 3]), lambda slot: picks.get((*key, str(slot))))

    def _dnat_hashed(self, table: str, words: list[str], st: Walk
                     ) -> list[tuple[Walk, str]]:
        """`dnat ip to jhash <fields> mod M seed S map @slots`: the slot the kernel's
        jhash gives this packet, and the endpoint that slot holds."""
        value = self._hashed_lookup(table, words, "map", st)
        if value is None:
            return [(st, NEXT)]  # a failed lookup ends the rule, not the chain
        return [(replace(st, endpoint=_endpoint(value)), "accept")]

    def _jhash_vmap(self, table: str, words: list[str], st: Walk
                    ) -> list[tuple[Walk, str]]:
        """`jhash <fields> mod M seed S vmap @slots`: the verdict of the slot the kernel's
        jhash gives this packet (none: the rule ends, not the chain)."""
        verdict = self._hashed_lookup(table, words, "vmap", st)
        if verdict is None:
            return [(st, NEXT)]
        return self._verdict(table, verdict.split(), st)

    def _hashed_lookup(self, table: str, words: list[str], how: str, st: Walk) -> str | None:
        """`<fields> mod M seed S map|vmap @slots`: what the slot the kernel's
        jhash gives this packet holds, if anything."""
        mod = words.index("mod")
        if words[mod + 2] != "seed" or words[mod + 4] != how or len(words) != mod + 6:
            raise TraceError(f"jhash {' '.join(words)}")
        slot = self.hashed(words[:mod], int(words[mod + 1]), int(words[mod + 3], 0), st)
        found: str | None = self._set(table, words[mod + 5].removeprefix("@")).elements.get(
            (str(slot),))
        return found

    def hashed(self, fields: list[str], modulus: int, seed: int, st: Walk) -> int:
        """`jhash <fields> mod <modulus> seed <seed>` of this packet (fields such as
        `ip saddr . tcp sport`)."""
        values: list[bytes] = []
        for sel in " ".join(fields).split(" . "):
            match sel.split():
                case ["ip" | "ip6", "saddr"]:
                    values.append(st.packet.source.packed)
                case ["ip" | "ip6", "daddr"]:
                    values.append(st.destination.packed)
                case ["tcp" | "udp" | "sctp" as proto, "sport"] if proto == st.packet.protocol:
                    values.append(st.packet.sport.to_bytes(2, "big"))
                case ["tcp" | "udp" | "sctp" as proto, "dport"] if proto == st.packet.protocol:
                    values.append(st.dport.to_bytes(2, "big"))
                case _:
                    raise TraceError(f"jhash of {sel!r} ({st.packet.protocol})")
        return nft_jhash(values, modulus, seed)


def _endpoint(value: str) -> str:
    """A map's `address . port` as a DNAT target is spelled (brackets for IPv6)."""
    address, port = value.split(" . ")
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _uniform(st: Walk, n: int, value_of: Callable[[int], str | None]
             ) -> list[tuple[Walk, str]]:
    """`numgen random mod n` looked up in a map (`value_of` its slot): one way in n to each
    slot's endpoint; a slot the map lacks ends the rule, not the chain."""
    out: list[tuple[Walk, str]] = []
    for slot in range(n):
        s = replace(st, probability=st.probability / n)
        value = value_of(slot)
        out.append((s, NEXT) if value is None else (replace(s, endpoint=_endpoint(value)),
                                                     "accept"))
    return out
