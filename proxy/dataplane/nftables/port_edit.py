"""A large service port's change rendered from its endpoint delta alone (pure): O(change)
where `render_port` is O(service).

One endpoint flipping in a port of 50,000 made `render_port` spell, and the partial
script compare, 100,000 elements (a slot and a hairpin pair per endpoint): 430 ms of the
agent's time for the two or three elements that change. The model says which endpoints
changed (`ResolvedServicePort.endpoint_delta`); `render_edit` turns that into exactly
what `render_port` would change against the kept port (transaction.PortEdit):

- each policy chain balancing through a slot map (render.py): the endpoints gone leave
  their slots, and the slots are refilled as `assign_slots` refills them (an endpoint
  keeps its slot while it is below the new size; newcomers, and those beyond the end,
  take the free slots in ascending order, in the model's order: address, then port);
  the chain's one rule is rewritten when the size changes;
- each policy chain balancing by a hash (maglev, source-hash): Maglev's table of the new
  set, written only where a slot's endpoint changes (a removal of 1 of 10 rewrites about
  450 of 4,093 slots); a change of the table's size is rendered whole;
- the hairpin pair of each address whose use by the port starts or ends.

Everything else a port renders depends on its service, its context or on whether it
has endpoints at all; none of that changes while a slot-mapped path keeps at least
SLOT_MAP_MIN endpoints (the selected endpoints are all usable, so the port has some
before and after). Anything else (a cascade path touched, a path crossing the
threshold, a kept state that does not match the delta) returns None: the port is
rendered whole, as before.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Mapping
from ipaddress import ip_address

from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.common.naming import packed_text, port_name
from proxy.dataplane.nftables.objects import Chain, Key, Value
from proxy.dataplane.nftables.render import (
    HAIRPIN,
    HASHED,
    SLOT_MAP_MIN,
    SLOTS,
    TABLE,
    comment,
    hairpin_element,
    policy_first,
    port_chain,
    slot_chains,
    slot_value,
    table_family,
)
from proxy.dataplane.nftables.slot_tail import TAIL_PREFIX, main_size
from proxy.dataplane.nftables.transaction import ElementKey, KeptPort, PortEdit, SlotValues
from proxy.model.balancing import maglev_slots, ordered, table_size
from proxy.model.snapshot import (
    EndpointDelta,
    ResolvedServicePort,
    SelectedEndpoint,
)
from proxy.model.types import TrafficPolicy

Order = tuple[bytes, int]  # the model's order of endpoints: (packed address, port)


def render_edit(old: ResolvedServicePort, new: ResolvedServicePort, delta: EndpointDelta,
                ctx: RenderContext, kept: KeptPort) -> PortEdit | None:
    """What `render_port(new, ...)` changes against `kept` (rendered from `old`), or None
    when the port must be rendered whole (module docstring)."""
    if kept.element_dict is None:
        return None
    maps = dict(kept.slots)
    proto = new.port.protocol.value.lower()
    chains: list[Chain] = []
    removed: list[ElementKey] = []
    added: list[tuple[ElementKey, Value]] = []
    resized: list[tuple[str, int, tuple[tuple[int, Key], ...]]] = []
    for kind, uses in (("svc", new.uses_cluster), ("svl", new.uses_local)):
        if not uses:
            continue
        chain = port_chain(kind, new.key, proto)
        gone, come = _net_change(delta, local=kind == "svl")
        if not gone and not come:
            continue
        hashed = maps.get(HASHED + chain)
        if hashed is not None:
            changes = _rehash(hashed, gone, come)
            if changes is None:
                return None
            element = (kept.table, HASHED + chain)
            removed += [(*element, (slot,)) for slot, _ in changes]
            added += [((*element, (slot,)), value) for slot, value in changes]
            resized.append((HASHED + chain, len(hashed.values), changes))
            continue
        main = maps.get(SLOTS + chain)
        if main is None:
            return None
        path = PathSlots(main, maps.get(TAIL_PREFIX + chain))
        size = len(path) - len(gone) + len(come)
        if size < SLOT_MAP_MIN or not path.matches(gone, come):
            return None
        split = main_size(size, len(main.values))
        if (split < size) != (path.tail is not None):
            return None  # the tail chain comes or goes: rendered whole
        assigned = _refill(path, gone, come, size)
        out, into, maps_resized = _slot_changes(kept.table, chain, path, size, split,
                                                assigned)
        removed += out
        added += into
        resized += maps_resized
        if size != len(path):
            chains += _slot_chains(new, ctx, kind, chain, size, split)
    removed_pairs, added_pairs = _hairpin_changes(new, delta, kept.element_dict)
    return PortEdit(tuple(chains), (*removed, *removed_pairs),
                    (*added, *((k, ()) for k in added_pairs)), tuple(resized))


def _in_path(s: SelectedEndpoint, local: bool) -> bool:
    return s.in_local if local else s.in_cluster


def _value(ep: SelectedEndpoint) -> Key:
    return slot_value(packed_text(ep.packed), ep.port)


def _net_change(delta: EndpointDelta, local: bool) -> tuple[set[Key], dict[Key, Order]]:
    """The slot values one path loses and gains (with their order); an endpoint in both
    `removed` and `added` that stays in the path is neither."""
    gone = {_value(s) for s in delta.removed if _in_path(s, local)}
    come = {_value(s): (s.packed, s.port)
            for s in delta.added if _in_path(s, local)}
    stayed = gone & come.keys()
    for value in stayed:
        gone.discard(value)
        del come[value]
    return gone, come


class PathSlots:
    """A slot-mapped path's slots 0..n-1 as the kernel holds them: its main map's, then
    its tail's (slot_tail.py), without joining them (O(service))."""

    __slots__ = ("main", "tail")

    def __init__(self, main: SlotValues, tail: SlotValues | None) -> None:
        self.main, self.tail = main, tail

    def __len__(self) -> int:
        return len(self.main.values) + (len(self.tail.values) if self.tail else 0)

    def slot(self, value: Key) -> int | None:
        slot = self.main.slot_of.get(value)
        if slot is None and self.tail is not None:
            at = self.tail.slot_of.get(value)
            slot = None if at is None else len(self.main.values) + at
        return slot

    def value(self, slot: int) -> Key:
        split = len(self.main.values)
        if slot < split:
            return self.main.values[slot]
        assert self.tail is not None
        return self.tail.values[slot - split]

    def matches(self, gone: Iterable[Key], come: Iterable[Key]) -> bool:
        """The delta fits what the kernel holds: what leaves is there, what comes is not."""
        return all(self.slot(v) is not None for v in gone) \
            and not any(self.slot(v) is not None for v in come)


def _refill(slots: PathSlots, gone: set[Key], come: Mapping[Key, Order],
            size: int) -> dict[int, Key]:
    """slot -> value for every slot whose value changes when the path goes to `size`
    slots: `assign_slots` for only the values that move."""
    n = len(slots)
    slot_of = {v: slots.slot(v) for v in gone}
    free = sorted([*(s for s in slot_of.values() if s is not None and s < size),
                   *range(n, size)])
    # Values beyond the new end move too: back into the free slots, in the model's order.
    beyond = [v for v in map(slots.value, range(size, n)) if v not in gone]
    homeless = sorted([*come.items(), *((v, _order_of(v)) for v in beyond)],
                      key=lambda item: item[1])
    return {slot: value for (value, _), slot in zip(homeless, free, strict=True)}


def _slot_changes(table: str, chain: str, slots: PathSlots, size: int, split: int,
                  assigned: Mapping[int, Key]
                  ) -> tuple[list[ElementKey], list[tuple[ElementKey, Value]],
                             list[tuple[str, int, tuple[tuple[int, Key], ...]]]]:
    """The elements out and in, and each map's resize (PortEdit.slots), for a path going
    from `slots` to `size` slots split at `split`, with `assigned` refilled: O(change),
    and O(TAIL_MAX) more when the split moves (the tail's every key moves with it)."""
    n, before = len(slots), len(slots.main.values)
    touched = {*assigned, *range(size, n)}
    if split != before:
        touched.update(range(min(split, before), max(size, n)))
    main, tail = SLOTS + chain, TAIL_PREFIX + chain

    def key(slot: int, at: int) -> ElementKey:
        return (table, main, (slot,)) if slot < at else (table, tail, (slot - at,))

    old = {key(s, before): slots.value(s) for s in sorted(touched) if s < n}
    new = {key(s, split): assigned[s] if s in assigned else slots.value(s)
           for s in sorted(touched) if s < size}
    out = [k for k, v in old.items() if new.get(k) != v]
    into: list[tuple[ElementKey, Value]] = []
    changed: dict[str, list[tuple[int, Key]]] = {main: [], tail: []}
    for k, v in new.items():
        if old.get(k) != v:
            into.append((k, v))
            changed[k[1]].append((int(k[2][0]), v))
    resized = [(main, split, tuple(changed[main]))]
    if split < size:
        resized.append((tail, size - split, tuple(changed[tail])))
    return out, into, resized


def _rehash(kept: SlotValues, gone: set[Key], come: Mapping[Key, Order]
            ) -> tuple[tuple[int, Key], ...] | None:
    """(slot, value) for every slot of a hash map whose endpoint changes: Maglev's table
    of the new set (a function of the set alone, so what render_port builds), against
    the kept one. None when the table changes size (the rule holds it: rendered whole),
    loses its last endpoint, or does not match the delta."""
    before = set(kept.values)
    if not gone <= before or not come.keys().isdisjoint(before):
        return None
    after = (before - gone) | come.keys()
    size = len(kept.values)
    if not after or table_size(len(after)) != size:
        return None
    value_of = {(ip_address(address), int(port)): (address, port) for address, port in after}
    backends = ordered(value_of)
    values = [value_of[b] for b in backends]
    return tuple((slot, values[i]) for slot, (i, old) in enumerate(zip(
        maglev_slots(backends, size), kept.values, strict=True)) if values[i] != old)


def _order_of(value: Key) -> Order:
    """A kept slot's (address, port) in the model's order: the address packed."""
    address, port = value
    return ip_address(address).packed, int(port)


def _slot_chains(rsp: ResolvedServicePort, ctx: RenderContext, kind: str, chain: str,
                 size: int, split: int) -> list[Chain]:
    """A slot-mapped path's chains, as render_port writes them (render.slot_chains)."""
    ip, proto = table_family(rsp.key.family), rsp.port.protocol.value.lower()
    internal = "svl" if rsp.service.internal_traffic_policy is TrafficPolicy.LOCAL else "svc"
    first = policy_first(rsp, ctx, kind == internal)
    return slot_chains(ip, proto, chain, first, size, split, comment(port_name(rsp.key)))


def _hairpin_changes(new: ResolvedServicePort, delta: EndpointDelta,
                     kept: Mapping[ElementKey, Value]) -> tuple[list[ElementKey],
                                                              list[ElementKey]]:
    """Hairpin pairs of the delta's addresses that the port stops and starts wanting: it
    wants one while some endpoint at that address is in a path it uses."""
    removed: list[ElementKey] = []
    added: list[ElementKey] = []
    addresses = {s.packed for s in (*delta.removed, *delta.added)}
    for address in sorted(addresses):
        element = (TABLE, HAIRPIN, hairpin_element(packed_text(address)))
        had, wants = element in kept, _address_used(new, address)
        if had and not wants:
            removed.append(element)
        elif wants and not had:
            added.append(element)
    return removed, added


def _address_used(rsp: ResolvedServicePort, packed: bytes) -> bool:
    """Some endpoint at `packed` (an address) is in a path the port uses: a binary search
    of its endpoints, sorted by address then port (the model's merge)."""
    eps = rsp.endpoints
    i = bisect_left(eps, packed, key=lambda s: s.packed)
    while i < len(eps) and eps[i].packed == packed:
        s = eps[i]
        if (s.in_cluster and rsp.uses_cluster) or (s.in_local and rsp.uses_local):
            return True
        i += 1
    return False
