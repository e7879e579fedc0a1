"""One large service port, kept between resolutions so that a change costs O(change).

A service with tens of thousands of endpoints is changed one slice at a time. A
`PortIndex` keeps, for one service port in one family, every slice's entries, the
copies of each endpoint by (address, port), the merged and selected endpoints in
endpoint order, a `Census` of them and the `Verdicts` they were selected under. With n
endpoints, s slices and c endpoints listed by the slices that changed, a resolution:

1. Slices: finds the slice objects gone and new by a set difference of ids: O(s), a
   C-speed few microseconds for 500 slices. A slice rewritten under the same name keeps
   the entries of its endpoints that are equal to before (`slice_entries`' reuse): only
   the entries that differ are taken out of the copies and put in: O(c).
2. Merge: merges again only the endpoints those entries belong to (`merge_copies`, the
   same rule as `merge_port`, so conflicts keep their exact meaning). One whose merged
   endpoint equals the one before keeps its `MergedEndpoint` and `SelectedEndpoint`
   objects, and is no change.
3. Census: takes the changed endpoints out of the counts and puts them in again: O(c).
4. Selection: `decide` derives the topology and the `Verdicts` from the census: O(1).
   Verdicts unchanged: only the changed endpoints are selected again, O(c). Verdicts
   changed: every endpoint is selected again, O(n) in Python (~2 us each); an endpoint
   whose sets and reason stay keeps its object. They change only with an input of
   every endpoint's verdict, when many verdicts change anyway:
   - the topology mode: the first or last hint-less ready endpoint of a hinted
     service, this node or zone gaining its first or losing its last ready endpoint
     under a preference annotation, trafficDistribution or hints;
   - the cluster fallback: the last ready endpoint went, or the first came back;
   - for a port with a local set (a Local policy) only: this node's first ready
     endpoint came or its last went;
   - the service's traffic policies or external reachability, or this node's zone.
   A topology whose reason changes but whose mode does not (a count in the reason, as
   in "3 ready endpoint(s) in zone a") keeps the verdicts: O(c).
5. Places the changed endpoints in the sorted lists by bisection and C-speed
   insert/delete (one pass when more than REBUILD_OVER changed), and copies the list
   into the endpoints tuple: O(n) but in C (~0.2 ms at 50,000), only when something
   changed.

Also O(n): the first resolution, a port whose protocol changed (a new index), this
node's zone changing (the census is counted again). The tracker adds O(s) for listing
the service's slices. Each resolution reports exactly which `SelectedEndpoint`s left
and which arrived, the data planes' `EndpointDelta`. The result always equals
`merge_port` + `categorize` over all of the port's slices (a property test checks it
step by step, against a fresh model).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from operator import itemgetter

from proxy.model.merge import Entry, merge_copies, slice_entries
from proxy.model.selection import Census, NodeView, Verdicts, decide, select
from proxy.model.snapshot import Conflict, MergedEndpoint, SelectedEndpoint, Topology
from proxy.model.types import EndpointSlice, Family, Protocol, Service, ServicePort

_Key = tuple[bytes, int]  # (packed address, port): the endpoints' sort order (one family)
# More changed endpoints than this in one resolution are put into the sorted lists in
# one O(service) pass: each insert or delete moves the list's tail (~40 us at 50,000),
# so a rollout replacing every endpoint at once would otherwise cost O(service^2).
REBUILD_OVER = 256
# What a port's merged endpoints depend on besides the slices.
Tag = tuple[str, Protocol, Family]


@dataclass(frozen=True, slots=True)
class PortResolution:
    """A port's merged and selected endpoints, and how they differ from the previous
    resolution of the same `PortIndex` (everything added, the first time), which made
    the ResolvedServicePort whose token is `since` (None: unknown)."""

    endpoints: tuple[SelectedEndpoint, ...]
    topology: Topology
    uses_cluster: bool
    uses_local: bool
    conflicts: tuple[Conflict, ...]
    removed: tuple[SelectedEndpoint, ...]
    added: tuple[SelectedEndpoint, ...]
    since: object | None = None


class PortIndex:
    """The merged and selected endpoints of one large service port (see the module)."""

    __slots__ = ("_census", "_conflicts", "_copies", "_endpoints", "_keys", "_selected",
                 "_slices", "_verdicts", "base", "tag")

    def __init__(self, tag: Tag, node: NodeView) -> None:
        self.tag = tag
        # The token of the ResolvedServicePort made from the last resolution: the delta
        # of the next one is against exactly that (None: none made, or unknown).
        self.base: object | None = None
        self._slices: dict[int, tuple[EndpointSlice, tuple[Entry, ...]]] = {}
        # Every copy of each endpoint: one entry, or a list when several slices list it.
        self._copies: dict[_Key, Entry | list[Entry]] = {}
        self._keys: list[_Key] = []  # sorted
        self._selected: list[SelectedEndpoint] = []  # in the order of _keys
        self._endpoints: tuple[SelectedEndpoint, ...] = ()  # _selected, as last returned
        self._conflicts: dict[_Key, Conflict] = {}
        self._census = Census(node)
        self._verdicts: Verdicts | None = None

    def resolve(self, slices: Iterable[EndpointSlice], service: Service, port: ServicePort,
                node: NodeView) -> PortResolution:
        """The port's endpoints from `slices` (all of the service's, any family)."""
        since, self.base = self.base, None  # set again once this one has been made
        merged = self._merge(slices)
        if node != self._census.node:
            self._census = Census.of(self._selected, node)
        for old, new in merged.values():
            if old is not None:
                self._census.count(old, -1)
            if new is not None:
                self._census.count(new)
        topology, verdicts = decide(service, port, node, self.tag[2], self._census)
        removed, added = self._select(merged, verdicts)
        if removed or added:
            self._endpoints = tuple(self._selected)
        return PortResolution(self._endpoints, topology, verdicts.uses_cluster,
                              verdicts.uses_local, self._conflict_tuple(), removed, added,
                              since)

    def adopt(self, endpoints: tuple[SelectedEndpoint, ...]) -> None:
        """Hold `endpoints`, equal to those of the last resolution, as its objects: the
        next resolution's changes are then from them."""
        self._selected = list(endpoints)
        self._endpoints = endpoints

    # --- merge -----------------------------------------------------------------------

    def _merge(self, slices: Iterable[EndpointSlice]
               ) -> dict[_Key, tuple[SelectedEndpoint | None, MergedEndpoint | None]]:
        """Take the entries of the slices gone out of the copies, put those of the new
        ones in; key -> (its SelectedEndpoint before, its merged endpoint now) for each
        endpoint whose merged endpoint changed (None: absent)."""
        port_name, protocol, family = self.tag
        current = {id(sl): sl for sl in slices if sl.family is family}
        # An id in _slices is the object held there, alive: ids cannot be reused.
        gone = [self._slices.pop(i) for i in self._slices.keys() - current.keys()]
        # A slice rewritten keeps the entries of its unchanged endpoints (same objects):
        # they are neither taken out nor put in again.
        spare = {sl.name: {e[0]: e for e in entries} for sl, entries in gone}
        fresh: list[Entry] = []
        for ident in current.keys() - self._slices.keys():
            sl = current[ident]
            entries = slice_entries(sl, port_name, protocol, spare.get(sl.name))
            self._slices[ident] = (sl, entries)
            fresh.extend(entries)
        loading = not self._copies  # the first resolution: every endpoint is new
        touched = self._drop_and_add(gone, fresh)
        changed: dict[_Key, tuple[SelectedEndpoint | None, MergedEndpoint | None]] = {}
        copies = self._copies
        for key in sorted(copies if loading else touched):
            before = None if loading else self._selected_at(key)
            got = copies.get(key)
            # One copy, no conflict recorded: the common case, inline (50,000 at a load).
            if type(got) is tuple and (not self._conflicts or key not in self._conflicts):
                now: MergedEndpoint | None = got[3]
            else:
                now = self._merged_at(key)
            if before is not None and now is not None and now == before.endpoint:
                continue  # listed again as it was: the objects made before stay
            if before is not None or now is not None:
                changed[key] = (before, now)
        return changed

    def _drop_and_add(self, gone: list[tuple[EndpointSlice, tuple[Entry, ...]]],
                      fresh: list[Entry]) -> set[_Key]:
        """Take the entries of the slices `gone` out of the copies and put the `fresh`
        ones in, but for entries in both (kept by a rewritten slice); the keys touched."""
        kept = {id(e) for e in fresh} if gone else set()
        old = {id(e) for _, entries in gone for e in entries}
        touched: set[_Key] = set()
        for _, entries in gone:
            for entry in entries:
                if id(entry) not in kept:
                    self._drop_copy(entry)
                    touched.add(entry[0])
        for entry in fresh:
            if id(entry) not in old:
                self._add_copy(entry)
                touched.add(entry[0])
        return touched

    def _add_copy(self, entry: Entry) -> None:
        key = entry[0]
        got = self._copies.get(key)
        if got is None:
            self._copies[key] = entry
        elif isinstance(got, list):
            got.append(entry)
        else:
            self._copies[key] = [got, entry]

    def _drop_copy(self, entry: Entry) -> None:
        key = entry[0]
        got = self._copies[key]
        if not isinstance(got, list):
            del self._copies[key]
            return
        got.remove(entry)
        if len(got) == 1:
            self._copies[key] = got[0]

    def _merged_at(self, key: _Key) -> MergedEndpoint | None:
        """The one copy of the endpoint at `key` (None: no slice lists it), recording
        its conflict, if any."""
        got = self._copies.get(key)
        if got is None or not isinstance(got, list):
            self._conflicts.pop(key, None)
            return None if got is None else got[3]
        first = got[0][3]
        found: list[Conflict] = []
        merged = merge_copies(first.port, [(e[1], e[2]) for e in got], found)
        if found:
            self._conflicts[key] = found[0]
        else:
            self._conflicts.pop(key, None)
        return merged

    def _selected_at(self, key: _Key) -> SelectedEndpoint | None:
        i = bisect_left(self._keys, key)
        if i < len(self._keys) and self._keys[i] == key:
            return self._selected[i]
        return None

    def _conflict_tuple(self) -> tuple[Conflict, ...]:
        # Few, and only during a rebalance or a mistake: sorting them is cheap.
        return tuple(self._conflicts[k] for k in sorted(self._conflicts))

    # --- selection -------------------------------------------------------------------

    def _select(self, merged: dict[_Key, tuple[SelectedEndpoint | None, MergedEndpoint | None]],
                verdicts: Verdicts
                ) -> tuple[tuple[SelectedEndpoint, ...], tuple[SelectedEndpoint, ...]]:
        """Put the changed endpoints, selected under `verdicts`, into the sorted lists;
        select every other endpoint again if the verdicts changed. (removed, added)."""
        removed: list[SelectedEndpoint] = []
        added: list[SelectedEndpoint] = []
        placed: dict[_Key, SelectedEndpoint | None] = {}
        for key, (before, now) in merged.items():
            after = placed[key] = None if now is None else select(now, verdicts)
            if before is not None:
                removed.append(before)
            if after is not None:
                added.append(after)
        if not self._keys:  # `placed` is in key order, and holds no removal
            self._keys = list(placed)
            self._selected = added.copy()
        elif len(placed) > REBUILD_OVER:
            self._rebuild(placed)
        else:
            for key, after in placed.items():
                self._place(key, after)
        if verdicts != self._verdicts:
            if self._verdicts is not None:  # else all were selected just now
                self._select_all(verdicts, {id(s) for s in added}, removed, added)
            self._verdicts = verdicts
        return tuple(removed), tuple(added)

    def _place(self, key: _Key, after: SelectedEndpoint | None) -> None:
        """Put `after` at `key` in the sorted lists (None: take the key out)."""
        keys = self._keys
        i = bisect_left(keys, key)
        if i < len(keys) and keys[i] == key:
            if after is None:
                del keys[i]
                del self._selected[i]
            else:
                self._selected[i] = after
        elif after is not None:
            keys.insert(i, key)
            self._selected.insert(i, after)

    def _rebuild(self, placed: dict[_Key, SelectedEndpoint | None]) -> None:
        """`_place` for many keys at once: one pass over the lists and a sort that
        merges two sorted runs, instead of a memmove of the lists per key."""
        items = [(k, s) for k, s in zip(self._keys, self._selected, strict=True)
                 if k not in placed]
        # `placed` is in key order: the sort merges two sorted runs, O(n).
        items += [(k, s) for k, s in placed.items() if s is not None]
        items.sort(key=itemgetter(0))
        self._keys = [k for k, _ in items]
        self._selected = [s for _, s in items]

    def _select_all(self, verdicts: Verdicts, fresh: set[int],
                    removed: list[SelectedEndpoint], added: list[SelectedEndpoint]) -> None:
        """Select every endpoint not in `fresh` again; one whose sets and reason stay
        keeps its object (and is no change)."""
        selected = self._selected
        for i, old in enumerate(selected):
            if id(old) in fresh:
                continue
            new = select(old.endpoint, verdicts)
            if new.selected_for is not old.selected_for or new.reason != old.reason:
                selected[i] = new
                removed.append(old)
                added.append(new)


def endpoint_changes(old: Sequence[SelectedEndpoint], new: Sequence[SelectedEndpoint]
                     ) -> tuple[tuple[SelectedEndpoint, ...], tuple[SelectedEndpoint, ...]]:
    """(removed, added) from `old` to `new` by equality: for small ports, whose
    resolution keeps no index (O(len(old) + len(new)))."""
    if len(old) == len(new):
        aligned = _changed_in_place(old, new)
        if aligned is not None:
            return aligned
    before = {(s.packed, s.port): s for s in old}
    after = {(s.packed, s.port): s for s in new}
    removed = tuple(s for k, s in before.items() if after.get(k) != s)
    added = tuple(s for k, s in after.items() if before.get(k) != s)
    return removed, added


def _changed_in_place(old: Sequence[SelectedEndpoint], new: Sequence[SelectedEndpoint]
                      ) -> tuple[tuple[SelectedEndpoint, ...], tuple[SelectedEndpoint, ...]] | None:
    """The changes when the same endpoints are at the same places (conditions or
    selection changed, as in most updates): a walk, no hashing. None when they are not."""
    removed: list[SelectedEndpoint] = []
    added: list[SelectedEndpoint] = []
    for was, now in zip(old, new, strict=True):
        if was == now:
            continue
        if was.port != now.port or was.packed != now.packed:
            return None
        removed.append(was)
        added.append(now)
    return tuple(removed), tuple(added)
