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
"""

from __future__ import annotations

from collections.abc import Iterable

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


def merge_port(
    slices: Iterable[EndpointSlice],
    port_name: str,
    protocol: Protocol,
    family: Family,
) -> tuple[tuple[MergedEndpoint, ...], tuple[Conflict, ...]]:
    """All endpoints of one service port in one family, de-duplicated and sorted."""
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
    for (address, port), found in sorted(copies.items(), key=lambda kv: (int(kv[0][0]), kv[0][1])):
        if len(found) == 1:
            slice_name, best = found[0]
            sources: tuple[str, ...] = (slice_name,)
            conflict = False
        else:
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
        merged.append(MergedEndpoint(
            address=address,
            port=port,
            ready=best.ready,
            serving=best.serving,
            terminating=best.terminating,
            node_name=best.node_name,
            zone=best.zone,
            zone_hints=best.zone_hints,
            node_hints=best.node_hints,
            sources=sources,
            conflict=conflict,
        ))
    return tuple(merged), tuple(conflicts)
