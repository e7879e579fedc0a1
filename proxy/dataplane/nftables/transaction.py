"""nftables transactions (pure): what one family's tables hold (the main table and its
shards, render.py), and the script that moves them to the next desired state.

A full script rewrites everything we own in one transaction: every chain declared, then
flushed and refilled (so no rule can point at a chain not yet there), every shared set
and map flushed and refilled, and whatever our tables hold that nobody wants any more
deleted last (whole tables, when the shards were more). The first onto a family that
holds none of our tables (`first_lines`) comes in parts instead, each its own
transaction, none of them reachable by a packet before the last adds the hooked chains:
the kernel commits one part while the next is rendered and encoded. Affinity sets are declared,
never flushed: a resync keeps who goes where. Slot maps are flushed and refilled, as a
slot may hold another endpoint in the kernel than in the script.

A partial script touches only the service ports that changed: chains whose rules differ
are flushed and refilled, new ones added, gone ones deleted; elements are added and
deleted one by one. A port rendered from its endpoint delta comes as a `PortEdit` (what
changes, port_edit.py) and is applied to its kept state in place, in O(change). Elements
are shared (two ports of one service share their cluster IP in @cluster-ips, two
services an endpoint in @hairpin), so `TableState` counts their owners (`Owners`): an
element leaves the kernel with its last owner. Order inside a transaction: sets, new
chains, rules, element deletions, element additions, chain deletions, set deletions;
nothing is ever referenced before it exists or deleted while referenced.

While a restart's kept ports are still being added to the state, a part at a time
(restart_steps.py), the owners do not know every element the kernel holds for a port:
a partial script then defers the deletion of an element of the bases' sets (not maps)
nobody it knows wants (a kept port not yet added may own it too), and notes what it
deletes and writes (`Unfinished`), for the end of the restart.

`TableState` is updated while a script is built: if the kernel refuses the script, the
data plane drops the state and the next sync is a full one. It keeps of each port what a
later script needs (`KeptPort`): its chains' names with a digest of their rules, not the
rules (a third of the rendered text), which a change compares by digest.
"""

from __future__ import annotations

import functools
import itertools
import operator
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import islice
from typing import TypeVar, cast, overload

from proxy.dataplane.base import rules_digest
from proxy.dataplane.nftables.objects import (
    Chain,
    Command,
    Counter,
    Element,
    Key,
    Set,
    SlotMap,
    Table,
    Value,
    named,
)
from proxy.dataplane.nftables.render import (
    FINGERPRINTS,
    HAIRPIN,
    PICKS,
    TABLE,
    BaseObjects,
    Picked,
    PortObjects,
    element_table,
    hairpin_element,
    mark_element,
    shard_of,
    table_family,
)
from proxy.dataplane.nftables.wire import (
    COMMIT,
    Chains,
    Elements,
    Rules,
    Statement,
    statement_lines,
    statement_size,
)
from proxy.model.frozen import fast_init
from proxy.model.types import Family, IPAddress, ServicePortKey

# Elements per `add element` statement: one statement per element makes nft slower to
# parse; one per set makes error messages name a huge line.
ELEMENTS_PER_LINE = 500

# Lines per part of a first script (`first_lines`): parts of ~250 ports of 10
# endpoints kept the kernel's share of a 10,000-port start beside the encoding (1.65 s
# against 1.75 s for parts of 1,000 ports and 2.0 s in one transaction).
STAGE_LINES = 3_000
# ... and at least a line per CHAINS_PER_STAGE_LINE chains the tables hold after it: every
# commit visits every chain of the family (a one-element commit takes 13 ms beside
# 200,000), so with parts of a fixed size a start with a chain per port grows with its
# square. At 100,000 services x 10, a fifth of them with ClientIP affinity (220,000
# chains), the first sync took 84 s so, 58-65 s with this (bench/RESULTS.md).
CHAINS_PER_STAGE_LINE = 4

ElementKey = tuple[str, str, Key]  # (table, set or map, key)
Named = tuple[str, str]  # (table, chain or set)


class Owners:
    """Element -> the ports that want it, with their values; the kernel holds the
    smallest owner's value (`held`), which is also what every script leaves there.

    Most elements have one owner (a cluster IP, an endpoint's hairpin pair): that is the
    port alone for a set's element, a (port, value) pair for a map's, and a dict only
    once shared. A dict per element, and a second map of what the kernel held, were 5 KB
    of the 8 KB kept per service port at 10,000 services x 10 endpoints. A pick map's
    elements are kept per port (`_Picks`), @hairpin's by address (`_Pairs`). Kept per
    set, as a full script writes them (`sets`)."""

    __slots__ = ("_sets",)

    def __init__(self) -> None:
        # (table, set) -> key -> owners
        self._sets: dict[Named, dict[Key, _Owned] | _Picks | _Pairs] = {}

    def __len__(self) -> int:
        return sum(len(members) for members in self._sets.values())

    def add(self, element: ElementKey, port: ServicePortKey, value: Value) -> None:
        self._add(*element, port, value)

    def add_rendered(self, port: ServicePortKey, elements: Iterable[Element],
                     picked: Picked = ()) -> None:
        """`add` of each of `elements`, as a port (or base) rendered them: a set's
        elements one after the other (render's order), its members looked up once for
        them (element by element, a sixth of a first start's records). `picked`: the
        port's pick maps' elements among them, grouped (PortObjects.picked), then taken
        a group at a time."""
        for (table, set_name), run in itertools.groupby(elements, _element_set):
            members = self._members(table, set_name)
            if isinstance(members, dict):
                for e in run:
                    _add_owner(members, e.key, port, e.value)
            elif picked and isinstance(members, _Picks):
                for name, prefix, flat in picked:
                    if name == set_name:
                        members.add_group(prefix, port, flat)
            else:
                members.add_run(run, port)

    def _add(self, table: str, set_name: str, key: Key, port: ServicePortKey,
             value: Value) -> None:
        members = self._members(table, set_name)
        if isinstance(members, dict):
            _add_owner(members, key, port, value)
        else:
            members.add(key, port, value)

    def _members(self, table: str, set_name: str) -> dict[Key, _Owned] | _Picks | _Pairs:
        members = self._sets.get((table, set_name))
        if members is None:
            members = self._sets[table, set_name] = _Picks() if set_name.startswith(PICKS) \
                else _Pairs() if set_name == HAIRPIN else {}
        return members

    def remove(self, element: ElementKey, port: ServicePortKey) -> None:
        table, set_name, key = element
        members = self._sets.get((table, set_name))
        if isinstance(members, dict):
            _remove_owner(members, key, port)
        elif members is not None:
            members.remove(key, port)

    def held(self, element: ElementKey) -> Value | None:
        table, set_name, key = element
        members = self._sets.get((table, set_name))
        if members is None:
            return None
        if not isinstance(members, dict):
            return members.held(key)
        cur = members.get(key)
        return None if cur is None else _value(cur)

    def count(self, table: str, set_name: str) -> int:
        """How many elements of set `set_name` of `table` someone owns."""
        members = self._sets.get((table, set_name))
        return 0 if members is None else len(members)

    def unowned_pairs(self, table: str, set_name: str, addresses: set[str]) -> set[str]:
        """Of `addresses`, those whose pair (address, address) in set `set_name` of
        `table` (@hairpin) nobody owns: one set difference, not a lookup each."""
        members = self._sets.get((table, set_name))
        if isinstance(members, _Pairs):
            return addresses - members.by_address.keys()
        owned = members if isinstance(members, dict) else {}
        return {a for a in addresses if (a, a) not in owned}

    def sets(self) -> Iterator[tuple[str, str, Iterable[tuple[Key, Value]]]]:
        """(table, set, its elements as (key, held value)), set by set."""
        for (table, set_name), members in self._sets.items():
            if isinstance(members, dict):
                yield table, set_name, _held_values(members)
            elif isinstance(members, _Pairs):
                yield table, set_name, _PairItems(members)
            else:
                yield table, set_name, members.items()

    def items(self, table: str, set_name: str) -> Iterator[tuple[Key, Value]]:
        """One set's elements as (key, held value), as `sets` gives them."""
        members = self._sets.get((table, set_name))
        if members is None:
            return iter(())
        return _held_values(members) if isinstance(members, dict) else members.items()

    def elements(self) -> Iterator[tuple[ElementKey, Value]]:
        for table, set_name, members in self.sets():
            for key, value in members:
                yield (table, set_name, key), value


_element_set = operator.itemgetter(0, 1)  # an Element's table and set


# One owner: the port (a set's element has no value), or (port, value); several: a dict.
_Owned = ServicePortKey | tuple[ServicePortKey, Value] | dict[ServicePortKey, Value]
_K = TypeVar("_K")  # what an element is kept by: its key, or part of it


def _held_values(members: dict[Key, _Owned]) -> Iterator[tuple[Key, Value]]:
    return ((key, _value(cur)) for key, cur in members.items())


def _add_owner(members: dict[_K, _Owned], key: _K, port: ServicePortKey,
               value: Value) -> None:
    owned = _owned(port, value)
    cur = members.setdefault(key, owned)  # most elements: their first owner
    if cur is owned:
        return
    one = _sole(cur)
    if one is not None and one[0] == port:
        members[key] = owned
    elif one is not None:
        members[key] = {one[0]: one[1], port: value}
    else:
        assert isinstance(cur, dict)
        cur[port] = value


def _remove_owner(members: dict[_K, _Owned], key: _K, port: ServicePortKey) -> None:
    cur = members.get(key)
    if cur is None:
        return
    one = _sole(cur)
    if one is not None:
        if one[0] == port:
            del members[key]
    else:
        assert isinstance(cur, dict)
        cur.pop(port, None)
        if len(cur) == 1:
            members[key] = _owned(*next(iter(cur.items())))


def _owned(port: ServicePortKey, value: Value) -> _Owned:
    return (port, value) if value else port


def _sole(cur: _Owned) -> tuple[ServicePortKey, Value] | None:
    if type(cur) is ServicePortKey:
        return cur, ()
    if isinstance(cur, dict):
        return None
    return cur  # type: ignore[return-value]


def _value(cur: _Owned) -> Value:
    if isinstance(cur, ServicePortKey):
        return ()
    if isinstance(cur, dict):
        return cur[min(cur)]
    return cur[1]


class _Pairs:
    """@hairpin's elements, each an endpoint's address twice (render.hairpin_element),
    kept by the address: the pair was a tuple of 56 bytes an endpoint. A key of another
    shape is kept whole (`other`)."""

    __slots__ = ("by_address", "other")

    def __init__(self) -> None:
        self.by_address: dict[object, _Owned] = {}  # address -> owners
        self.other: dict[object, _Owned] = {}  # key -> owners

    def __len__(self) -> int:
        return len(self.by_address) + len(self.other)

    def _where(self, key: Key) -> tuple[dict[object, _Owned], object]:
        """The dict `key` is kept in, and what by."""
        if len(key) == 2 and key[0] == key[1]:
            return self.by_address, key[0]
        return self.other, key

    def add(self, key: Key, port: ServicePortKey, value: Value) -> None:
        _add_owner(*self._where(key), port, value)

    def add_run(self, run: Iterable[Element], port: ServicePortKey) -> None:
        """`add` of each of a port's `run` of elements, an address's first owner (nearly
        every one) kept in line."""
        by_address = self.by_address
        for e in run:
            key = e.key
            if e.value or len(key) != 2 or key[0] != key[1] \
                    or by_address.setdefault(key[0], port) is not port:
                self.add(key, port, e.value)

    def remove(self, key: Key, port: ServicePortKey) -> None:
        _remove_owner(*self._where(key), port)

    def held(self, key: Key) -> Value | None:
        members, by = self._where(key)
        cur = members.get(by)
        return None if cur is None else _value(cur)

    def items(self) -> Iterator[tuple[Key, Value]]:
        for address, cur in self.by_address.items():
            yield hairpin_element(cast(str, address)), _value(cur)
        yield from _held_values(cast(dict[Key, _Owned], self.other))


class _PairItems:
    """@hairpin's elements as `Owners.sets` gives them: read as (key, held value) pairs,
    and cut into statements (`element_statements`) as runs of addresses whose pairs are
    made when the encoder reads them (`_Hairpins`): a part that refills @hairpin (a
    million pairs at 100,000 x 10, a restart's or a repair's) held its statements'
    pairs as two tuples each, 110 MiB of the agent's peak."""

    __slots__ = ("_members",)

    def __init__(self, members: _Pairs) -> None:
        self._members = members

    def __iter__(self) -> Iterator[tuple[Key, Value]]:
        return self._members.items()

    def runs(self, size: int) -> Iterator[Sequence[tuple[Key, Value]]]:
        """Its elements, `size` at a time, in `__iter__`'s order where every pair's
        value is () (a set's: always, in our tables)."""
        run: list[str] = []
        valued: list[tuple[Key, Value]] = []
        for address, cur in self._members.by_address.items():
            value = _value(cur)
            if value:
                valued.append((hairpin_element(cast(str, address)), value))
                continue
            run.append(cast(str, address))
            if len(run) == size:
                yield _Hairpins(run)
                run = []
        if run:
            yield _Hairpins(run)
        rest = itertools.chain(valued, _held_values(cast(dict[Key, _Owned],
                                                         self._members.other)))
        while chunk := list(islice(rest, size)):
            yield chunk


class _Hairpins(Sequence[tuple[Key, Value]]):
    """@hairpin's elements (each an address twice, no value: render.hairpin_element) of
    `addresses`, each pair made when read."""

    __slots__ = ("addresses",)

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses

    def __len__(self) -> int:
        return len(self.addresses)

    def __iter__(self) -> Iterator[tuple[Key, Value]]:
        return ((hairpin_element(a), ()) for a in self.addresses)

    @overload
    def __getitem__(self, i: int) -> tuple[Key, Value]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[Key, Value]]: ...

    def __getitem__(self, i: int | slice) -> tuple[Key, Value] | Sequence[tuple[Key, Value]]:
        if isinstance(i, slice):
            return _Hairpins(self.addresses[i])
        return hairpin_element(self.addresses[i]), ()


class _Picks:
    """One pick map's elements (key: cluster IP, port, slot; render.pick_map). The model
    gives a destination to one port (tracker.ClusterModel._arbitrate), so each has one
    owner: kept per (cluster IP, port) as [owner, address of slot 0, its port, address
    of slot 1, ...] (None: no element): a value is an endpoint (address, port), kept
    flat, as its tuple was 56 bytes an endpoint. Another port's claim while one holds
    the (cluster IP, port) (a destination moving between ports within one script), or a
    value of another shape, is kept in `shared`, as any other set's elements; a key is
    in one of the two."""

    __slots__ = ("by_port", "shared")

    def __init__(self) -> None:
        self.by_port: dict[Key, list[object]] = {}
        self.shared: dict[Key, _Owned] = {}

    def __len__(self) -> int:
        return len(self.shared) + sum((len(e) - 1) // 2 - e.count(None) // 2
                                      for e in self.by_port.values())

    def add(self, key: Key, port: ServicePortKey, value: Value) -> None:
        if key in self.shared:
            _add_owner(self.shared, key, port, value)
            return
        prefix, at = key[:-1], 2 * cast(int, key[-1]) + 1
        entry = self.by_port.get(prefix)
        pair = type(value) is tuple and len(value) == 2
        if entry is None and pair:
            entry = self.by_port[prefix] = [port]
        elif entry is None or entry[0] != port or not pair:
            if entry is not None and at < len(entry) and entry[at] is not None:
                # the holder's, shared now
                self.shared[key] = (cast(ServicePortKey, entry[0]),
                                    cast(Value, (entry[at], entry[at + 1])))
                self._clear(prefix, entry, at)
            _add_owner(self.shared, key, port, value)
            return
        if at >= len(entry):
            entry.extend([None] * (at + 2 - len(entry)))
        entry[at], entry[at + 1] = cast(tuple[object, object], value)

    def add_group(self, prefix: Key, port: ServicePortKey, flat: tuple[object, ...]) -> None:
        """`add` of a port's elements of one (cluster IP, port) `prefix`, slots 0, 1, ...
        holding `flat`'s values (address, port, address, ...): one entry where nothing
        else holds the prefix or is shared."""
        if not self.shared and prefix not in self.by_port:
            self.by_port[prefix] = [port, *flat]
            return
        for slot, at in enumerate(range(0, len(flat), 2)):
            self.add((*prefix, slot), port, cast(Value, (flat[at], flat[at + 1])))

    def add_run(self, run: Iterable[Element], port: ServicePortKey) -> None:
        """`add` of each of a port's `run` of elements: where an entry of its own has
        every slot below the next element's (render._pick writes slots 0, 1, ... in
        order), the value is appended in line."""
        entry: list[object] | None = None
        prefix: Key = ()
        for e in run:
            key, value = e.key, e.value
            if entry is not None and key[:-1] == prefix and key[-1] == len(entry) // 2 \
                    and type(value) is tuple and len(value) == 2 and not self.shared:
                entry += value
                continue
            self.add(key, port, value)
            prefix = key[:-1]
            entry = self.by_port.get(prefix)
            if entry is not None and entry[0] != port:
                entry = None  # another's: element by element

    def remove(self, key: Key, port: ServicePortKey) -> None:
        if key in self.shared:
            _remove_owner(self.shared, key, port)
            return
        prefix, at = key[:-1], 2 * cast(int, key[-1]) + 1
        entry = self.by_port.get(prefix)
        if entry is not None and entry[0] == port and at < len(entry):
            self._clear(prefix, entry, at)

    def _clear(self, prefix: Key, entry: list[object], at: int) -> None:
        entry[at] = entry[at + 1] = None
        while len(entry) > 1 and entry[-2] is None:
            del entry[-2:]
        if len(entry) == 1:
            del self.by_port[prefix]

    def held(self, key: Key) -> Value | None:
        cur = self.shared.get(key)
        if cur is not None:
            return _value(cur)
        entry = self.by_port.get(key[:-1])
        at = 2 * cast(int, key[-1]) + 1
        if entry is None or at >= len(entry) or entry[at] is None:
            return None
        return cast(Value, (entry[at], entry[at + 1]))

    def items(self) -> Iterator[tuple[Key, Value]]:
        for prefix, entry in self.by_port.items():
            for slot, value in enumerate(pairs(entry[1:])):
                if value[0] is not None:
                    yield (*prefix, slot), value
        for key, cur in self.shared.items():
            yield key, _value(cur)


def pairs(flat: Sequence[object]) -> list[Value]:
    """Pick values kept flat (address, port, address, port, ...) as (address, port)s."""
    return cast(list[Value], list(zip(flat[0::2], flat[1::2], strict=True)))


class SlotValues:
    """One slot map as the kernel holds it: its values in slot order, and each value's
    slot, so that an endpoint delta (port_edit.py) finds an endpoint's slot in O(1). In
    a hash map (Maglev's table) a value fills many slots: only `values` is used."""

    __slots__ = ("slot_of", "values")

    def __init__(self, values: Sequence[Key]) -> None:
        self.values = list(values)
        self.slot_of = dict(zip(self.values, range(len(self.values)), strict=True))


@fast_init
@dataclass(frozen=True, slots=True)
class KeptPort:
    """What the kernel holds of one port, as a later script needs it. The rules' text
    is not kept (at 10,000 services x 10 endpoints it was 21 of the 36 MiB kept of the
    rendered ports); the debug dump renders them again from the last snapshot."""

    table: str
    chains: tuple[tuple[str, int], ...]  # (name, rules_digest(rules)), in write order
    # Its elements as rendered (PortObjects.elements), flat: table, set, key, value of
    # each in turn (`flat_elements`), the least memory for the many small ports (an
    # Element each was 1.2 of the 13.7 KB a service held at 100,000 services x 10) ...
    rendered: tuple[object, ...]
    sets: tuple[Set | SlotMap, ...]
    slots: tuple[tuple[str, SlotValues], ...]  # by slot map, from PortObjects.slots
    # ... while a port with slot maps (SLOT_MAP_MIN endpoints or more) keeps a dict
    # instead, which an endpoint delta edits in place (`apply_edit`): O(change), where
    # new tuples would be O(service).
    element_dict: dict[ElementKey, Value] | None = None
    # Its named counters, in its table, with what each counts (PortObjects.counters).
    counters: tuple[tuple[str, tuple[IPAddress, int] | None], ...] = ()
    # Its element of @fingerprints while the kernel holds exactly what it stands for; ()
    # once an endpoint delta edited the port (`_apply_edit`), as a new one would cost
    # O(service): a restart then writes the port anew (restart.py). Its input mark
    # (marks.py) likewise, and it is no longer `from_input`.
    fingerprint: Key = ()
    input_mark: Key = ()
    from_input: bool = True
    # A picked port's elements of its pick maps, out of `rendered` (PortObjects.picked),
    # 0.2 KB where an element each was 1 KB at 10 endpoints; its hairpin elements are
    # its values' addresses.
    picked: Picked = ()

    @classmethod
    def of(cls, p: PortObjects, elements: dict[ElementKey, Value] | None = None) -> KeptPort:
        """`elements`: element_map(p) if the caller made it, then kept as it is for a
        port with slot maps (the caller's fresh dict)."""
        chains = cls.chain_digests(p)
        counters = p.counters
        if not p.slots:
            return cls(p.table, chains, flat_elements(p.elements), p.sets, (), None, counters,
                       p.fingerprint, p.input_mark, p.from_input)
        if p.slots[0][0].startswith(PICKS):
            # Its pick maps' elements, and its hairpin elements (their values' addresses,
            # render._pick), are `picked`, as render_port grouped them.
            return cls(p.table, chains, flat_elements(unpicked(p.elements)), p.sets, (),
                       None, counters, p.fingerprint, p.input_mark, p.from_input, p.picked)
        return cls(p.table, chains, (), p.sets,
                   tuple((name, SlotValues(values)) for name, values in p.slots),
                   element_map(p) if elements is None else elements, counters,
                   p.fingerprint, p.input_mark, p.from_input)

    @staticmethod
    def chain_digests(p: PortObjects) -> tuple[tuple[str, int], ...]:
        """What a kept port keeps of `p`'s chains (`chains`)."""
        return tuple((c.name, rules_digest(c.rules)) for c in p.chains)

    def with_mark(self, mark: Key) -> KeptPort:
        """This port once the kernel holds its input mark `mark` too (marks.py)."""
        element = mark_element(self.table, mark)
        rendered = self.rendered
        if self.element_dict is not None:
            self.element_dict[self.table, FINGERPRINTS, mark] = ()
        else:
            rendered = (*rendered, *element)
        # Positional, in field order: dataclasses.replace was half of adding 100,000 marks.
        return KeptPort(self.table, self.chains, rendered, self.sets, self.slots,
                        self.element_dict, self.counters, self.fingerprint, mark,
                        self.from_input, self.picked)

    def elements(self) -> Mapping[ElementKey, Value]:
        """Read-only: the kept dict itself for a port with slot maps."""
        if self.element_dict is not None:
            return self.element_dict
        r = self.rendered
        out = cast(dict[ElementKey, Value],
                   {(table, set_name, key): value for table, set_name, key, value
                    in zip(r[0::4], r[1::4], r[2::4], r[3::4], strict=True)})
        for name, prefix, flat in self.picked:
            out.update(((self.table, name, (*prefix, slot)), value)
                       for slot, value in enumerate(pairs(flat)))
            hairpins = element_table(HAIRPIN, self.table)
            out.update(((hairpins, HAIRPIN, hairpin_element(cast(str, address))), ())
                       for address in flat[0::2])
        return out


def flat_elements(elements: Sequence[Element]) -> tuple[object, ...]:
    """`elements` as one tuple, each element's four fields in turn (KeptPort.rendered)."""
    return tuple(itertools.chain.from_iterable(elements))


def unpicked(elements: Iterable[Element]) -> list[Element]:
    """A picked port's elements but its pick maps' and @hairpin's (what KeptPort.picked
    stands for), a set's run at a time: a run left unread is skipped without a step of
    Python an element."""
    rest: list[Element] = []
    for (_table, set_name), run in itertools.groupby(elements, _element_set):
        if set_name != HAIRPIN and not set_name.startswith(PICKS):
            rest += run
    return rest


def kept_slots(kept: KeptPort | None) -> dict[str, Sequence[Key]]:
    """What the kernel's slot maps hold of a port (map -> endpoints in slot order):
    what render_port needs to keep each endpoint where it is (a picked port's: its pick
    maps')."""
    if kept is None:
        return {}
    if kept.slots:
        return {name: m.values for name, m in kept.slots}
    return {name: pairs(flat) for name, _prefix, flat in kept.picked}


@dataclass(frozen=True, slots=True)
class PortEdit:
    """One port's change rendered from its endpoint delta alone (port_edit.py), to apply to
    the KeptPort it was rendered against: what a whole render would change, and
    nothing it would not."""

    chains: tuple[Chain, ...]  # chains to rewrite
    removed: tuple[ElementKey, ...]  # elements it gives up (or whose value changes)
    added: tuple[tuple[ElementKey, Value], ...]  # elements it takes (or their new value)
    # Per slot map: (name, its new size, (slot, value) for each slot that changes).
    slots: tuple[tuple[str, int, tuple[tuple[int, Key], ...]], ...] = ()


def element_map(p: PortObjects) -> dict[ElementKey, Value]:
    return {(e.table, e.set, e.key): e.value for e in p.elements}


@dataclass
class Unfinished:
    """While a restart's kept ports are not all in a TableState (module docstring).

    The owners then do not know every element the kernel holds: a kept port not made
    yet may own one of the bases' sets' (`shared`: a cluster IP, a hairpin pair), so a
    partial script deletes none of those; and, when a port went while no agent ran, the
    bases' maps may hold its elements, as the restart read them (`read`: maps only; a
    map's key is one port's, and its value may name a chain or counter the same script
    deletes, so those are replaced or deleted as usual); and such a port's chains and
    sets may be there (`names`), whose rules and elements a port that takes its name
    flushes. What the kernel holds of each element a partial script touched since is
    `kernel` (None: not there); the chains, sets and counters it deleted, `gone`."""

    shared: frozenset[Named]  # the bases' sets (not maps)
    names: frozenset[Named] = frozenset()  # the chains and sets the restart read back
    read: Mapping[Named, Mapping[Key, Value]] = field(default_factory=dict)
    kernel: dict[ElementKey, Value | None] = field(default_factory=dict)
    gone: set[Named] = field(default_factory=set)

    def held(self, element: ElementKey, known: Value | None) -> Value | None:
        """What the kernel holds of `element`, `known` being what the owners say."""
        if element in self.kernel:
            return self.kernel[element]
        if known is not None:
            return known
        read = self.read.get((element[0], element[1]))
        return None if read is None else read.get(element[2])


@dataclass
class TableState:
    """What one family's tables hold, as far as we know."""

    family: Family
    bases: tuple[BaseObjects, ...]  # the main table's fixed part, then each shard's
    ports: dict[ServicePortKey, KeptPort] = field(default_factory=dict)
    owners: Owners = field(default_factory=Owners)
    unfinished: Unfinished | None = None

    @property
    def shards(self) -> int:
        return len(self.bases) - 1

    def tables(self) -> set[str]:
        return {b.table for b in self.bases}

    def claimed_chains(self) -> Iterator[Named]:
        """The chains the bases and ports write, one at a time (`unclaimed`)."""
        for b in self.bases:
            for c in b.chains:
                yield b.table, c.name
        for p in self.ports.values():
            for name, _ in p.chains:
                yield p.table, name

    def claimed_counters(self) -> Iterator[Named]:
        for p in self.ports.values():
            for name, _ in p.counters:
                yield p.table, name

    def claimed_sets(self) -> Iterator[Named]:
        for b in self.bases:
            for s in b.sets:
                yield b.table, s.name
        for p in self.ports.values():
            for ps in p.sets:
                yield p.table, ps.name

    def chain_names(self) -> set[Named]:
        return set(self.claimed_chains())

    def counter_names(self) -> set[Named]:
        return set(self.claimed_counters())

    def set_names(self) -> set[Named]:
        return set(self.claimed_sets())


def unclaimed(held: Iterable[Named], claimed: Iterable[Named],
              tables: Collection[str] | None = None) -> list[Named]:
    """The names in `held` (of `tables`, if given) not in `claimed`, sorted: `held`
    copied and each claimed name struck out as it is made, never a set of every claimed
    one (the 200,000 chain names of 100,000 services were ~20 MiB at a restart's peak)."""
    left = {n for n in held if tables is None or n[0] in tables}
    for name in claimed:
        left.discard(name)
    return sorted(left)


# The bases' own elements (NodePort addresses) are owned by this pseudo port, which sorts
# before every real one.
BASE_OWNER = ServicePortKey("", "", "", Family.V4)


def element_groups(verb: str, elements: Iterable[tuple[str, str, Key, Value]]
                   ) -> Iterator[Elements]:
    """`add|delete element` statements for `elements` (objects.Element's fields),
    grouped per set."""
    by_set: dict[Named, list[tuple[Key, Value]]] = {}
    for table, set_name, key, value in elements:
        by_set.setdefault((table, set_name), []).append((key, value))
    for (table, set_name), pairs in by_set.items():
        yield from element_statements(verb, table, set_name, pairs)


def element_statements(verb: str, table: str, set_name: str,
                       pairs: Iterable[tuple[Key, Value]]) -> Iterator[Elements]:
    """`add|delete element` statements for the (key, value) pairs of one set."""
    if isinstance(pairs, _PairItems):
        yield from (Elements(verb, table, set_name, run)
                    for run in pairs.runs(ELEMENTS_PER_LINE))
        return
    pairs = iter(pairs)
    while chunk := list(islice(pairs, ELEMENTS_PER_LINE)):
        yield Elements(verb, table, set_name, chunk)


class Script:
    """A script, made statement by statement each time it is read: a full one is never
    held whole (at 10,000 services x 10 endpoints its 17.8 MB of text sat beside the
    43 MB netlink batch encoded from it, at the agent's peak). The encoder reads its
    statements (`statements()`: objects' commands, and statements standing for many
    lines, wire.Rules, which it encodes without spelling them); `lines()` spells them,
    `text()` joins them for nft (the fallback), and `line(n)` finds one line for an
    error message. They are the same every time (made from the TableState and the
    objects it holds, unchanged; a partial script's, from their list)."""

    def __init__(self, make: Callable[[], Iterator[Statement]], ip: str,
                 parts: bool = False) -> None:
        self._make = make
        self.ip = ip  # "ip" or "ip6": the family the statements are spelled in
        # Its parts (cut at wire.COMMIT) may be committed one by one (`first_lines`).
        self.parts = parts
        self.count: int | None = None  # lines, once read through

    def statements(self) -> Iterator[Statement]:
        n = 0
        for statement in self._make():
            n += statement_size(statement)
            yield statement
        self.count = n

    def lines(self) -> Iterator[str]:
        for statement in self.statements():
            yield from statement_lines(statement, self.ip)

    def text(self) -> str:
        return "\n".join(self.lines()) + "\n"

    def line(self, number: int) -> str:
        """Line `number` (from 1), "" past the end."""
        n = 0
        for statement in self._make():
            size = statement_size(statement)
            if 0 < number <= n + size:
                return next(islice(statement_lines(statement, self.ip), number - n - 1, None))
            n += size
        return ""


def full_script(bases: Sequence[BaseObjects], ports: Mapping[ServicePortKey, PortObjects],
                kernel_chains: Iterable[Named] = (),
                kernel_sets: Mapping[Named, str] | None = None,
                kernel_tables: Iterable[str] = (),
                kernel_counters: Iterable[Named] = ()) -> tuple[str, TableState]:
    """`full_lines` as one text."""
    script, state = full_lines(bases, ports, kernel_chains, kernel_sets, kernel_tables,
                               kernel_counters)
    return script.text(), state


def full_lines(bases: Sequence[BaseObjects], ports: Mapping[ServicePortKey, PortObjects],
               kernel_chains: Iterable[Named] = (),
               kernel_sets: Mapping[Named, str] | None = None,
               kernel_tables: Iterable[str] = (),
               kernel_counters: Iterable[Named] = ()) -> tuple[Script, TableState]:
    """Everything we own, in one transaction. `kernel_chains`, `kernel_sets` ((table,
    name) -> "set" or "map"), `kernel_tables` and `kernel_counters` are what our tables
    hold now (read back): what nobody wants any more is deleted. Counters the kernel
    lacks are added, and none is ever flushed: each keeps its count. The state is made
    now, the script's lines when read."""
    state, ordered = kept_state(bases, ports)
    held = set(kernel_counters)
    stale = stale_statements(state, kernel_chains, kernel_sets or {}, held, kernel_tables)
    return Script(lambda: _rewrite(state, ordered, held, stale, None),
                  table_family(state.family)), state


def resync_lines(bases: Sequence[BaseObjects],
                 ports: Mapping[ServicePortKey, Callable[[], PortObjects]],
                 kernel_chains: Iterable[Named], kernel_sets: Mapping[Named, str],
                 kernel_counters: Iterable[Named]) -> tuple[Script, TableState]:
    """`full_lines` over exactly the tables of `bases` (the periodic resync, a repair:
    the shard count unchanged, so no port moves to another table), one table per part
    (`COMMIT` between them), each committed on its own: nothing of ours jumps or refers
    from one table to another, so each part is whole when it goes live. The shards
    come first, each port rendered as its table's part is read (`ports`: key -> its
    render), and the main table last, with every port's elements there. So neither the
    kernel's batch (~400 MB at 100,000 services x 10 endpoints) nor every port's
    objects are ever held whole. The state is filled as the script is read: read it
    through first."""
    state = _own_bases(TableState(bases[0].family, tuple(bases)))
    shards = len(bases) - 1
    by_table: dict[str, list[ServicePortKey]] = {}
    for key in sorted(ports):
        by_table.setdefault(shard_of(key, shards), []).append(key)
    held = set(kernel_counters)
    kernel: dict[str, tuple[list[Named], dict[Named, str], list[Named]]] = {
        b.table: ([], {}, []) for b in bases}
    for c in kernel_chains:
        if c[0] in kernel:
            kernel[c[0]][0].append(c)
    for k, kind in kernel_sets.items():
        if k[0] in kernel:
            kernel[k[0]][1][k] = kind
    for c in held:
        if c[0] in kernel:
            kernel[c[0]][2].append(c)

    def make() -> Iterator[Statement]:
        for i, base in enumerate((*bases[1:], bases[0])):
            if i:
                yield COMMIT
            ordered = []
            for key in by_table.get(base.table, ()):
                p = ports[key]()
                state.ports[key] = KeptPort.of(p)
                state.owners.add_rendered(key, p.elements, p.picked)
                ordered.append((key, p))
            view = TableState(state.family, (base,))  # this table's names, for its stale
            view.ports.update((key, state.ports[key]) for key, _ in ordered)
            chains, sets, counters = kernel[base.table]
            stale = stale_statements(view, chains, sets, counters, (base.table,))
            yield from _rewrite(state, ordered, held, stale, base.table)

    return Script(make, table_family(state.family), parts=True), state


def table_lines(state: TableState, ordered: Sequence[tuple[ServicePortKey, PortObjects]],
                table: str, held: Collection[Named] = (), stale: Sequence[Command] = (),
                unflushed: Collection[str] = (), mains: Collection[str] = ()) -> Script:
    """`table` written whole again from `state`, in one transaction, as a full script
    writes it (the resync a table at a time, resync_steps.py): its chains flushed and
    their rules written (`ordered`: its ports, rendered as `state` keeps them), its sets
    and its ports' slot maps flushed and refilled from `state`'s owners, then `stale`
    (what nobody wants, in any table). The main table's sets named in `unflushed` are
    neither flushed nor refilled but for the bases' own elements: a shard's part adds
    its ports' elements of them (`mains`), with the values `state` holds. `state` is not
    changed."""

    def make() -> Iterator[Statement]:
        yield from _rewrite(state, ordered, held, (), table, unflushed)
        yield from _added(state, _mains(state, ordered, unflushed, mains))
        yield from stale

    return Script(make, table_family(state.family))


def _mains(state: TableState, ordered: Sequence[tuple[ServicePortKey, PortObjects]],
           unflushed: Collection[str], mains: Collection[str]) -> Iterator[Element]:
    """The elements of the main table's sets that a resync's part adds to (table_lines):
    the bases' own of `unflushed`, and `ordered`'s ports' of `mains`."""
    for b in state.bases:
        yield from (e for e in b.elements if e.table == TABLE and e.set in unflushed)
    for _key, p in ordered:
        yield from (e for e in p.elements if e.table == TABLE and e.set in mains)


def _added(state: TableState, elements: Iterable[Element]) -> Iterator[Elements]:
    """`add element` statements for `elements`, set by set, each with the value `state`
    holds for it (one it no longer holds is left out)."""
    by_set: dict[tuple[str, str], list[tuple[Key, Value]]] = {}
    for e in elements:
        value = state.owners.held((e.table, e.set, e.key))
        if value is not None:
            by_set.setdefault((e.table, e.set), []).append((e.key, value))
    for (table, set_name), pairs in by_set.items():
        yield from element_statements("add", table, set_name, pairs)


def _rewrite(state: TableState, ordered: Sequence[tuple[ServicePortKey, PortObjects]],
             held: Collection[Named], stale: Sequence[Command], table: str | None,
             unflushed: Collection[str] = ()) -> Iterator[Statement]:
    """`full_lines`' statements for `table` (None: every table): everything declared,
    every chain flushed and its rules written, every set flushed and filled (but the
    main table's sets named in `unflushed`: neither), then what nobody wants deleted."""
    bases = [b for b in state.bases if table in (None, b.table)]
    ports = [p for _key, p in ordered if table in (None, p.table)]
    yield from objects_written(bases, ports, held)
    for b in bases:
        for s in b.sets:
            if s.name not in unflushed:
                yield Command("flush", b.table, s)
    for p in ports:  # slot maps too (affinity sets keep who goes where)
        yield from flush_maps(p)
    for set_table, set_name, pairs in state.owners.sets():
        if table in (None, set_table) and not (set_table == TABLE and set_name in unflushed):
            yield from element_statements("add", set_table, set_name, pairs)
    yield from (c for c in stale if table in (None, c.table))


def kept_state(bases: Sequence[BaseObjects], ports: Mapping[ServicePortKey, PortObjects],
               keep: Callable[[PortObjects], bool] | None = None
               ) -> tuple[TableState, list[tuple[ServicePortKey, PortObjects]]]:
    """What the kernel holds once `bases` and `ports` are all there (a full or restart
    script's state, made before its lines), and the ports in key order: those `keep`
    says, if given, each port being read (a mapping that renders it when asked) and
    asked once, in key order, so that the others are let go as soon as they are kept."""
    state = TableState(bases[0].family, tuple(bases))
    ordered = []
    for key in sorted(ports):
        p = ports[key]
        state.ports[key] = KeptPort.of(p)
        state.owners.add_rendered(key, p.elements, p.picked)
        if keep is None or keep(p):
            ordered.append((key, p))
    _own_bases(state)
    return state, ordered


def base_state(bases: Sequence[BaseObjects]) -> TableState:
    """The state of `bases` alone (a restart's whose ports are made later)."""
    return _own_bases(TableState(bases[0].family, tuple(bases)))


def _own_bases(state: TableState) -> TableState:
    """The bases' elements, owned by BASE_OWNER (after the ports': the order a full
    script writes them in)."""
    for b in state.bases:
        state.owners.add_rendered(BASE_OWNER, b.elements)
    return state


def objects_written(bases: Sequence[BaseObjects], ports: Sequence[PortObjects],
                    held_counters: Collection[Named]) -> Iterator[Statement]:
    """`bases` and `ports` written whole but for their elements: declared (`declarations`),
    their chains added, and every chain flushed and its rules written (the ports' rules
    read while this lives)."""
    yield from declarations(bases, ports, held_counters)
    for b in bases:
        for c in b.chains:
            yield Command("add", b.table, c)
    yield Chains([(p.table, p.chains) for p in ports])
    yield Rules([(b.table, b.chains) for b in bases])
    yield Rules([(p.table, p.chains) for p in ports])


def declarations(bases: Sequence[BaseObjects], ports: Iterable[PortObjects],
                 held_counters: Collection[Named]) -> Iterator[Command]:
    """The tables of `bases` and their sets declared, then `ports`' sets and those of
    their counters the kernel lacks (not in `held_counters`: an `add` of one it holds
    would change nothing but the script's length)."""
    for b in bases:
        yield Command("add", b.table, Table(b.table))
    for b in bases:
        for s in b.sets:
            yield Command("add", b.table, s)
    for p in ports:
        for s in p.sets:
            yield Command("add", p.table, s)
        yield from (c for c in counter_commands("add", p)
                    if (p.table, c.object.name) not in held_counters)


def stale_statements(state: TableState, kernel_chains: Iterable[Named],
                     kernel_sets: Mapping[Named, str], kernel_counters: Collection[Named],
                     kernel_tables: Iterable[str]) -> list[Command]:
    """What our tables hold (`kernel_*`, read back; sets -> "set" or "map") that
    nobody in `state` wants any more, deleted, last in a script: chains flushed before
    any is deleted (one may jump to another), then sets, counters, and whole tables
    (shards no longer used: there were more at the last start)."""
    wanted = state.tables()
    chains = unclaimed(kernel_chains, state.claimed_chains(), wanted)
    sets = unclaimed(kernel_sets, state.claimed_sets(), wanted)
    counters = unclaimed(kernel_counters, state.claimed_counters(), wanted)
    return [*(Command("flush", t, Chain(name)) for t, name in chains),
            *(Command("delete", t, Chain(name)) for t, name in chains),
            *(Command("delete", t, named(kernel_sets[t, name], name)) for t, name in sets),
            *(Command("delete", t, Counter(name)) for t, name in counters),
            *(Command("delete", t, Table(t)) for t in sorted(set(kernel_tables) - wanted))]


def replace_lines(bases: Sequence[BaseObjects], ports: Mapping[ServicePortKey, PortObjects],
                  kernel_tables: Iterable[str]) -> Script:
    """`full_lines` onto nothing, with our tables as the kernel holds them (`kernel_tables`)
    deleted first, in the same one transaction: for tables `full_lines` cannot take over
    as they are, written by another version of the agent (a set or map of another type,
    a hooked chain at another priority: nf_tables refuses to redefine those). Packets
    see the old tables until the commit and the new ones after it; established
    connections keep their NAT; affinity sets start empty. The state is `full_lines`'."""
    script, _state = full_lines(bases, ports)
    ip = script.ip

    def make() -> Iterator[Statement]:
        for table in sorted(kernel_tables):
            yield Command("delete", table, Table(table))
        yield from script.statements()

    return Script(make, ip)


def first_lines(bases: Sequence[BaseObjects],
                ports: Mapping[ServicePortKey, Callable[[], PortObjects]],
                stage_lines: int = STAGE_LINES) -> tuple[Script, TableState]:
    """Everything we own, onto a family that holds none of our tables yet: the full
    script in parts (`COMMIT` between them) that may each be committed on its own, so
    the kernel takes one part while the next is rendered and encoded. Nothing is live
    before the last part: the first declares the tables, every set, and the bases'
    regular chains; then the service ports, rendered as the script is read (`ports`:
    key -> its render), a part per `stage_lines` lines or so (more once the tables
    hold many chains: CHAINS_PER_STAGE_LINE): their sets, chains, rules and elements,
    which only chains and maps of ours reach; the last adds what packets enter by,
    the hooked chains, and the bases' rules, atomically. Read again (nft's fallback
    text, an error's line), the same statements, which nft applies as one transaction
    over what the kernel took of them: chains flushed before their rules, elements
    added again (the same values), sets and chains declared with `add`.

    A map element is written once, with its first claimant's value: the ports come
    in key order after the bases, so that is the smallest owner's, the value the
    kernel holds (`Owners`). The state is filled as the script is read: read it
    through first."""
    state = TableState(bases[0].family, tuple(bases))
    make = functools.partial(_everything, state, ports, stage_lines, None)
    return Script(make, table_family(state.family), parts=True), state


def rewrite_lines(bases: Sequence[BaseObjects],
                  ports: Mapping[ServicePortKey, Callable[[], PortObjects]],
                  kernel_chains: Iterable[Named], kernel_sets: Mapping[Named, str],
                  kernel_counters: Iterable[Named], kernel_tables: Iterable[str]
                  ) -> tuple[Script, TableState]:
    """`first_lines`' statements over tables another build wrote (names read back:
    `kernel_*`), in one transaction: each of the bases' sets flushed as it is declared,
    and what nobody wants deleted last (stale_statements). A restart over tables whose
    ports nearly all render otherwise, and whose bases do too (restart.rewrite_of):
    `full_lines`' transaction, but each port rendered as the script is read and let go
    once encoded, never all held (the kernel's batch is, until the commit). The state
    is filled as the script is read: read it through first."""
    state = TableState(bases[0].family, tuple(bases))
    over = (list(kernel_chains), dict(kernel_sets), set(kernel_counters), list(kernel_tables))
    make = functools.partial(_everything, state, ports, STAGE_LINES, over)
    return Script(make, table_family(state.family)), state


def _everything(state: TableState, ports: Mapping[ServicePortKey, Callable[[], PortObjects]],
                stage_lines: int,
                over: tuple[list[Named], dict[Named, str], set[Named], list[str]] | None
                ) -> Iterator[Statement]:
    """`first_lines`' statements (`over` None), or `rewrite_lines`': over what the
    kernel holds (its chains, sets, counters and tables), with no COMMIT, every base
    set flushed, and the stale deleted last."""
    sent: set[ElementKey] = set()  # map elements written
    for b in state.bases:
        yield Command("add", b.table, Table(b.table))
    for b in state.bases:
        for s in b.sets:
            yield Command("add", b.table, s)
            if over is not None:
                yield Command("flush", b.table, s)
    for b in state.bases:
        for c in b.chains:
            if c.hook is None:
                yield Command("add", b.table, c)
        state.owners.add_rendered(BASE_OWNER, b.elements)
    # The bases' fingerprints with their rules, in the last part (restart.py).
    yield from _fresh_elements(sent, (e for b in state.bases for e in b.elements
                                      if e.set != FINGERPRINTS))
    if over is None:
        yield COMMIT
    keys = sorted(ports)
    part: list[PortObjects] = []
    size = 0
    chains = sum(len(b.chains) for b in state.bases)
    for n, key in enumerate(keys, 1):
        p = ports[key]()
        state.ports[key] = KeptPort.of(p)
        state.owners.add_rendered(key, p.elements, p.picked)
        part.append(p)
        # Its chains and rules, and its elements (a picked port has nothing else).
        size += len(p.elements) + sum(len(c.rules) + 1 for c in p.chains)
        chains += len(p.chains)
        if size < max(stage_lines, chains // CHAINS_PER_STAGE_LINE) and n < len(keys):
            continue
        yield from _ports_part(part, sent)
        if over is None:
            yield COMMIT
        part, size = [], 0
    for b in state.bases:
        for c in b.chains:
            if c.hook is not None:
                yield Command("add", b.table, c)
    yield Rules([(b.table, b.chains) for b in state.bases])
    yield from _fresh_elements(sent, (e for b in state.bases for e in b.elements
                                      if e.set == FINGERPRINTS))
    if over is not None:
        yield from stale_statements(state, *over)


def _ports_part(part: Sequence[PortObjects], sent: set[ElementKey]) -> Iterator[Statement]:
    """One part of a first script (`first_lines`): its ports' sets, chains, rules and
    elements (`_fresh_elements`)."""
    for p in part:
        for s in p.sets:
            yield Command("add", p.table, s)
        yield from counter_commands("add", p)
    yield Chains([(p.table, p.chains) for p in part])
    yield Rules([(p.table, p.chains) for p in part])
    for p in part:
        yield from flush_maps(p)
    yield from _fresh_elements(sent, (e for p in part for e in p.elements))


def _fresh_elements(sent: set[ElementKey], elements: Iterable[Element]) -> Iterator[Elements]:
    """A part's elements, each once; a map's only where no part wrote it (`sent`, which
    this updates; a set's element again is harmless: no value to differ), grouped per
    set. Kept per set by key (a set's equal elements are one: their value is (); a map's
    key is written once), the elements coming a set's run at a time (render's order):
    an Element's hash, and grouping element by element, were a tenth of a first start."""
    by_set: dict[Named, dict[Key, Value]] = {}
    for table_set, run in itertools.groupby(elements, _element_set):
        members = by_set.get(table_set)
        if members is None:
            members = by_set[table_set] = {}
        if table_set[1].startswith(PICKS):
            # A pick map's key holds its port's cluster IP and port: one owner, one part.
            for e in run:
                members.setdefault(e.key, e.value)
            continue
        for e in run:
            if e.value:
                element = (e.table, e.set, e.key)
                if element in sent:
                    continue
                sent.add(element)
            members.setdefault(e.key, e.value)
    for (table, set_name), members in by_set.items():
        yield from element_statements("add", table, set_name, members.items())


def counter_commands(verb: str, p: PortObjects) -> Iterator[Command]:
    for name, _ in p.counters:
        yield Command(verb, p.table, Counter(name))


def flush_maps(p: PortObjects) -> Iterator[Command]:
    """A port's maps (slot maps) emptied, to be filled again; its sets (affinity) keep
    what they hold."""
    for s in p.sets:
        if s.kind == "map":
            yield Command("flush", p.table, s)


def partial_script(state: TableState,
                   updates: Mapping[ServicePortKey, PortObjects | PortEdit | None]) -> str:
    """`partial_lines` as one text ("" when the kernel has nothing to change)."""
    script = partial_lines(state, updates)
    return script.text() if script is not None else ""


def partial_lines(state: TableState,
                  updates: Mapping[ServicePortKey, PortObjects | PortEdit | None]
                  ) -> Script | None:
    """The transaction from `state` to `state` with `updates` (None: the port is gone; a
    PortEdit: its endpoint delta against the port in `state`); updates `state` to what
    the kernel holds once the script is applied. None when the kernel has nothing to
    change."""
    add_sets: list[Statement] = []
    add_chains: list[Statement] = []
    write_chains: list[Statement] = []
    gone_chains: list[Named] = []
    gone_sets: list[tuple[str, Set | SlotMap]] = []  # (table, set)
    gone_counters: list[Named] = []
    # What the kernel held of each element this script touches, before it did.
    held_before: dict[ElementKey, Value | None] = {}
    for key in sorted(updates):
        new = updates[key]
        old = state.ports.get(key)
        if isinstance(new, PortEdit):
            assert old is not None, "an edit needs the port it was rendered against"
            write_chains += _apply_edit(state, key, old, new, held_before)
            continue
        old_chains = {(old.table, n): d for n, d in old.chains} if old else {}
        new_chains = {(new.table, c.name): c for c in new.chains} if new else {}
        old_sets = {(old.table, s.name): s for s in old.sets} if old else {}
        new_sets = {(new.table, s.name): s for s in new.sets} if new else {}
        add_sets += [Command("add", t, s) for (t, n), s in new_sets.items()
                     if old_sets.get((t, n)) != s]
        # A port new to `state` may find its names held by a port gone while no agent
        # ran (Unfinished.names): their rules and elements go first.
        left = state.unfinished.names if state.unfinished is not None and not old \
            else frozenset()
        add_sets += [Command("flush", t, s) for (t, n), s in new_sets.items() if (t, n) in left]
        old_counters = {(old.table, n) for n, _ in old.counters} if old else set()
        new_counters = {(new.table, n) for n, _ in new.counters} if new else set()
        add_sets += [Command("add", t, Counter(n)) for t, n in sorted(new_counters - old_counters)]
        gone_counters += sorted(old_counters - new_counters)
        for (t, name), chain in new_chains.items():
            before = old_chains.get((t, name))
            if before == rules_digest(chain.rules):
                continue
            if before is None:  # declared before any rule, which may jump to it
                add_chains.append(Chains.one(t, name))
            write_chains.append(Rules.one(t, chain, flush=before is not None
                                          or (t, name) in left))
        gone_chains += [c for c in old_chains if c not in new_chains]
        gone_sets += [(t, s) for (t, n), s in old_sets.items() if (t, n) not in new_sets]
        old_el = old.elements() if old else {}
        new_el = element_map(new) if new else {}
        for k, v in old_el.items():
            if new_el.get(k) != v:
                _retire(state, key, k, held_before)
        for k, v in new_el.items():
            if old_el.get(k) != v:
                _claim(state, key, k, v, held_before)
        if new is None:
            state.ports.pop(key, None)
        else:
            state.ports[key] = KeptPort.of(new, new_el)
    if state.unfinished is not None:
        state.unfinished.gone.update((*gone_chains, *((t, s.name) for t, s in gone_sets),
                                      *gone_counters))
    statements = add_sets + add_chains + write_chains
    statements += _element_changes(state, held_before)
    statements += [Command("flush", t, Chain(name)) for t, name in gone_chains]
    statements += [Command("delete", t, Chain(name)) for t, name in gone_chains]
    statements += [Command("delete", t, s) for t, s in gone_sets]
    statements += [Command("delete", t, Counter(n)) for t, n in gone_counters]
    if not statements:
        return None
    return Script(functools.partial(iter, statements), table_family(state.family))


def _element_changes(state: TableState, held_before: Mapping[ElementKey, Value | None]
                     ) -> list[Elements]:
    """What a partial script changes of the elements it touched: deletions, then
    additions, of those the kernel holds otherwise (another value, or none) than the
    owners now want. While the state is unfinished, a deletion of a bases' set's
    element nobody known wants waits (`Unfinished`)."""
    changes: list[tuple[ElementKey, Value | None, Value | None]] = []
    unfinished = state.unfinished
    for k in sorted(held_before):
        held, wanted = held_before[k], state.owners.held(k)
        if unfinished is not None:
            if held is not None and wanted is None and (k[0], k[1]) in unfinished.shared:
                unfinished.kernel[k] = held  # deleted once every port is in
                continue
            unfinished.kernel[k] = wanted
        changes.append((k, held, wanted))
    return _brought_to_wanted(changes)


def _brought_to_wanted(changes: Iterable[tuple[ElementKey, Value | None, Value | None]]
                       ) -> list[Elements]:
    """Elements from what the kernel holds (a value, or None: not there) to what is
    wanted: deletions, then additions, of those that differ."""
    deletes: list[tuple[str, str, Key, Value]] = []
    adds: list[tuple[str, str, Key, Value]] = []
    for k, held, wanted in changes:
        if held == wanted:
            continue
        if held is not None:
            deletes.append((*k, ()))  # a map element is deleted by its key alone
        if wanted is not None:
            adds.append((*k, wanted))
    return [*element_groups("delete", deletes), *element_groups("add", adds)]


def deferred_lines(state: TableState) -> Script | None:
    """Once every kept port is in `state`: each element its partial scripts touched
    brought to what the owners want (those scripts held back the deletions of the bases'
    sets' elements, `Unfinished`). None when nothing is left to do."""
    assert state.unfinished is not None
    statements = _brought_to_wanted((k, held, state.owners.held(k))
                                    for k, held in sorted(state.unfinished.kernel.items()))
    if not statements:
        return None
    return Script(functools.partial(iter, statements), table_family(state.family))


def _retire(state: TableState, key: ServicePortKey, element: ElementKey,
            held_before: dict[ElementKey, Value | None]) -> None:
    """`key` no longer wants `element` (or not with the value it had)."""
    if element not in held_before:
        held_before[element] = _held(state, element)
    state.owners.remove(element, key)


def _claim(state: TableState, key: ServicePortKey, element: ElementKey, value: Value,
           held_before: dict[ElementKey, Value | None]) -> None:
    if element not in held_before:
        held_before[element] = _held(state, element)
    state.owners.add(element, key, value)


def _held(state: TableState, element: ElementKey) -> Value | None:
    """What the kernel holds of `element` before the script being built."""
    known = state.owners.held(element)
    return known if state.unfinished is None else state.unfinished.held(element, known)


def _apply_edit(state: TableState, key: ServicePortKey, old: KeptPort, edit: PortEdit,
                held_before: dict[ElementKey, Value | None]) -> list[Statement]:
    """Apply `edit` to the port's kept state (its element dict and slot maps, in place)
    and to the owners; the statements that rewrite its chains. O(edit)."""
    kept = old.element_dict
    assert kept is not None, "edits are for ports with slot maps"
    for k in edit.removed:
        _retire(state, key, k, held_before)
        del kept[k]
    for k, v in edit.added:
        _claim(state, key, k, v, held_before)
        kept[k] = v
    maps = dict(old.slots)
    changed = bool(edit.removed or edit.added)
    for name, size, assigned in edit.slots:
        changed = changed or bool(assigned) or size != len(maps[name].values)
        _resize(maps[name], size, assigned)
    digests = dict(old.chains)
    rewrites: list[Statement] = []
    for chain in edit.chains:
        digest = rules_digest(chain.rules)
        if digests[chain.name] == digest:
            continue
        digests[chain.name] = digest
        rewrites.append(Rules.one(old.table, chain))
    if (old.fingerprint or old.input_mark) and (changed or rewrites):
        # No longer what the kernel holds, nor what the input alone renders.
        for mark in (old.fingerprint, old.input_mark):
            if mark:
                _retire(state, key, (old.table, FINGERPRINTS, mark), held_before)
                del kept[old.table, FINGERPRINTS, mark]
        old = state.ports[key] = replace(old, fingerprint=(), input_mark=(),
                                         from_input=False)
    if rewrites:
        state.ports[key] = replace(old, chains=tuple(digests.items()))
    return rewrites


def _resize(slots: SlotValues, size: int, assigned: Iterable[tuple[int, Key]]) -> None:
    """The slot map at `size` slots with `assigned` values put in their slots; values
    gone from it, and those moved, leave their old slots first."""
    values, slot_of = slots.values, slots.slot_of
    for value in values[size:]:
        del slot_of[value]
    del values[size:]
    values.extend([()] * (size - len(values)))
    for slot, value in assigned:
        if slot_of.get(values[slot]) == slot:
            del slot_of[values[slot]]
        values[slot] = value
        slot_of[value] = slot
