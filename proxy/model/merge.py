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

A service with thousands of endpoints is usually changed one slice at a time: the
tracker keeps such ports in `incremental.PortIndex`, which merges again only the
endpoints a changed slice lists, with this module's `slice_entries` and `merge_copies`;
`merge_port` here is the whole merge, for small ports and as the reference.
"""

from __future__ import annotations

from collections.abc import Iterable

from proxy.model.snapshot import Conflict, MergedEndpoint
from proxy.model.types import (
    Endpoint,
    EndpointSlice,
    Family,
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

# One endpoint of one slice for one service port: (sort key (packed address, port),
# slice name, the endpoint, its MergedEndpoint as if it were the only copy).
Entry = tuple[tuple[bytes, int], str, Endpoint, MergedEndpoint]


def merge_port(
    slices: Iterable[EndpointSlice],
    port_name: str,
    protocol: Protocol,
    family: Family,
) -> tuple[tuple[MergedEndpoint, ...], tuple[Conflict, ...]]:
    """All endpoints of one service port in one family, de-duplicated and sorted."""
    listing = [(sl, sp.port) for sl in slices if sl.family is family
               for sp in sl.ports if sp.name == port_name and sp.protocol is protocol]
    if len(listing) == 1:
        alone = _one_listing(*listing[0])
        if alone is not None:
            return alone, ()
    copies: dict[tuple[bytes, int], list[tuple[str, Endpoint]]] = {}
    for sl, port in listing:
        for ep in sl.endpoints:
            copies.setdefault((ep.packed, port), []).append((sl.name, ep))

    merged: list[MergedEndpoint] = []
    conflicts: list[Conflict] = []
    sources: dict[str, tuple[str]] = {}  # one (slice name,) per slice, not per endpoint
    # One family: its packed addresses, of one length, sort as their numbers do.
    for (_, port), found in sorted(copies.items(), key=lambda kv: kv[0]):
        if len(found) == 1:
            slice_name, best = found[0]
            one = sources.get(slice_name) or sources.setdefault(slice_name, (slice_name,))
            merged.append(MergedEndpoint(best, port, one))
        else:
            merged.append(merge_copies(port, found, conflicts))
    return tuple(merged), tuple(conflicts)


def _one_listing(sl: EndpointSlice, port: int) -> tuple[MergedEndpoint, ...] | None:
    """`merge_port` where one slice lists the port (nearly every port) and no address
    twice: its endpoints sorted (by their packed addresses, of one length: as their
    numbers), each its own copy, without keying the copies. None where an address
    repeats."""
    eps = sl.endpoints
    numbers = [ep.packed for ep in eps]
    if len(set(numbers)) != len(numbers):
        return None
    source = (sl.name,)
    return tuple([MergedEndpoint(eps[i], port, source)
                  for i in sorted(range(len(eps)), key=numbers.__getitem__)])


def merge_copies(port: int, found: list[tuple[str, Endpoint]],
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
            endpoint=format_endpoint(best.address, port),
            slices=sources,
            fields=tuple(f.replace("node_name", "node") for f in differing),
            chosen=slice_name,
        ))
    return MergedEndpoint(best, port, sources, conflict)


def slice_entries(sl: EndpointSlice, port_name: str, protocol: Protocol,
                  reuse: dict[tuple[bytes, int], Entry] | None = None) -> tuple[Entry, ...]:
    """`sl`'s endpoints for one service port, each as if it were the only copy.
    `reuse`: entries of the slice that `sl` replaces (same name), by key; one whose
    endpoint is unchanged is taken (and popped) instead of making it again."""
    source = (sl.name,)
    out: list[Entry] = []
    for sp in sl.ports:
        if sp.name != port_name or sp.protocol is not protocol:
            continue
        for ep in sl.endpoints:
            key = (ep.packed, sp.port)
            old = reuse.pop(key, None) if reuse else None
            if old is not None and old[2] == ep:
                out.append(old)
            else:
                out.append((key, sl.name, ep, MergedEndpoint(ep, sp.port, source)))
    return tuple(out)
