"""Merging a service's slices into one endpoint list per service port, without duplicates.

The same endpoint (address and port) can be listed by several slices: while the
EndpointSlice controller rebalances, when a mirroring controller and a custom one both
write, or by mistake. Exactly one copy survives, chosen by this rule:

    the most available copy wins: ready beats not ready, then serving beats not serving,
    then not terminating beats terminating; among equally available copies, the one from
    the slice whose name sorts first wins (then node, zone and hints, so the choice is
    total).

The winner depends only on the set of copies, never on the order in which slices
arrived (upstream kube-proxy keeps whichever copy it saw first unless a later one is
not terminating). Preferring the more available copy means a transient duplicate from a
rebalance never takes a working endpoint out of service. Copies that disagree on
ready/serving/terminating/node/zone are reported as a `Conflict`.

A service with thousands of endpoints is usually changed one slice at a time: with a
`MergeMemo` (the tracker keeps one per large service port), the work done for each
unchanged slice object (reading its endpoints, building single-copy `MergedEndpoint`s)
is reused, and an unchanged endpoint comes out as the very object it was last time, so
comparing the new result with the old one, and selecting from it (`topology.categorize`
with its own memo), cost little. The result equals the one computed without a memo.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from operator import itemgetter

from proxy.model.snapshot import Conflict, MergedEndpoint
from proxy.model.types import (
    Endpoint,
    EndpointSlice,
    Family,
    IPAddress,
    Protocol,
    format_endpoint,
)

_CONFLICT_FIELDS = ("ready", "serving", "terminating", "node_name", "zone")


def _rank(slice_name: str, ep: Endpoint) -> tuple[object, ...]:
    """Smaller is better; total over every field that can differ between copies."""
    return (
        not ep.ready,
        not ep.serving,
        ep.terminating,
        slice_name,
        ep.node_name or "",
        ep.zone or "",
        ep.zone_hints,
        ep.node_hints,
    )

# One endpoint of one slice for one service port: (sort key (address as int, port),
# slice name, the endpoint, its MergedEndpoint as if it were the only copy).
_Entry = tuple[tuple[int, int], str, Endpoint, MergedEndpoint]
_by_key = itemgetter(0)


@dataclass(slots=True)
class MergeMemo:
    """What `merge_port` computed for each slice object, for the next call with the same
    port. Entries hold the slice itself, so an id can never name another object."""

    tag: tuple[str, Protocol, Family] | None = None
    slices: dict[int, tuple[EndpointSlice, tuple[_Entry, ...]]] = field(default_factory=dict)


def merge_port(
    slices: Iterable[EndpointSlice],
    port_name: str,
    protocol: Protocol,
    family: Family,
    memo: MergeMemo | None = None,
) -> tuple[tuple[MergedEndpoint, ...], tuple[Conflict, ...]]:
    """All endpoints of one service port in one family, de-duplicated and sorted.
    `memo`: reuse (and refresh) what an earlier call for the same port computed."""
    if memo is not None:
        return _merge_memo(slices, port_name, protocol, family, memo)
    copies: dict[tuple[IPAddress, int], list[tuple[str, Endpoint]]] = {}
    for sl in slices:
        if sl.family is not family:
            continue
        for sp in sl.ports:
            if sp.name != port_name or sp.protocol is not protocol:
                continue
            for ep in sl.endpoints:
                copies.setdefault((ep.address, sp.port), []).append((sl.name, ep))

    merged: list[MergedEndpoint] = []
    conflicts: list[Conflict] = []
    sources: dict[str, tuple[str]] = {}  # one (slice name,) per slice, not per endpoint
    for (address, port), found in sorted(copies.items(), key=lambda kv: (int(kv[0][0]), kv[0][1])):
        if len(found) == 1:
            slice_name, best = found[0]
            one = sources.get(slice_name) or sources.setdefault(slice_name, (slice_name,))
            merged.append(_as_merged(address, port, one, best))
        else:
            merged.append(_merge_copies(address, port, found, conflicts))
    return tuple(merged), tuple(conflicts)


def _as_merged(address: IPAddress, port: int, sources: tuple[str, ...], ep: Endpoint,
               ) -> MergedEndpoint:
    """The copy `ep` as the merged endpoint, listed by the slices `sources` (the only
    one, or several whose chosen copy it is)."""
    return MergedEndpoint(
        address=address, port=port, ready=ep.ready, serving=ep.serving,
        terminating=ep.terminating, node_name=ep.node_name, zone=ep.zone,
        zone_hints=ep.zone_hints, node_hints=ep.node_hints, sources=sources)


def _merge_copies(address: IPAddress, port: int, found: list[tuple[str, Endpoint]],
                  conflicts: list[Conflict]) -> MergedEndpoint:
    """The one copy of an endpoint that several (slice name, copy) list; a conflict is
    appended to `conflicts` when the copies disagree."""
    slice_name, best = min(found, key=lambda c: _rank(*c))
    sources = tuple(sorted({name for name, _ in found}))
    differing = tuple(
        f for f in _CONFLICT_FIELDS if len({getattr(ep, f) for _, ep in found}) > 1
    )
    conflict = bool(differing)
    if conflict:
        conflicts.append(Conflict(
            endpoint=format_endpoint(address, port),
            slices=sources,
            fields=tuple(f.replace("node_name", "node") for f in differing),
            chosen=slice_name,
        ))
    merged = _as_merged(address, port, sources, best)
    # Not an argument of _as_merged: that is the hot path, where there is no conflict.
    return replace(merged, conflict=True) if conflict else merged


def _slice_entries(sl: EndpointSlice, port_name: str, protocol: Protocol) -> tuple[_Entry, ...]:
    source = (sl.name,)
    out = [((int(ep.address), sp.port), sl.name, ep, _as_merged(ep.address, sp.port, source, ep))
           for sp in sl.ports if sp.name == port_name and sp.protocol is protocol
           for ep in sl.endpoints]
    out.sort(key=_by_key)
    return tuple(out)


def _merge_memo(slices: Iterable[EndpointSlice], port_name: str, protocol: Protocol,
                family: Family, memo: MergeMemo
                ) -> tuple[tuple[MergedEndpoint, ...], tuple[Conflict, ...]]:
    tag = (port_name, protocol, family)
    known = memo.slices if memo.tag == tag else {}
    kept: dict[int, tuple[EndpointSlice, tuple[_Entry, ...]]] = {}
    entries: list[_Entry] = []
    for sl in slices:
        if sl.family is not family:
            continue
        hit = known.get(id(sl))
        if hit is None or hit[0] is not sl:
            hit = (sl, _slice_entries(sl, port_name, protocol))
        kept[id(sl)] = hit
        entries.extend(hit[1])
    memo.tag, memo.slices = tag, kept
    # Each slice's entries are sorted already: this sort merges runs. Copies of one
    # endpoint end up next to each other (the choice among them is order-independent).
    entries.sort(key=_by_key)
    if len({e[0] for e in entries}) == len(entries):  # no endpoint listed twice
        return tuple(e[3] for e in entries), ()
    merged: list[MergedEndpoint] = []
    conflicts: list[Conflict] = []
    i, n = 0, len(entries)
    while i < n:
        key = entries[i][0]
        j = i + 1
        while j < n and entries[j][0] == key:
            j += 1
        if j == i + 1:
            merged.append(entries[i][3])
        else:
            first = entries[i][3]
            merged.append(_merge_copies(first.address, first.port,
                                        [(e[1], e[2]) for e in entries[i:j]], conflicts))
        i = j
    return tuple(merged), tuple(conflicts)
