"""The aggregate of every service port's rendering (pure): which port owns each virtual
server, and reference counts for ipset entries and dummy-interface addresses.

Service ports share kernel objects: the ports of one service share its cluster IP on the
dummy interface, and a local endpoint behind two ports of the same number gives one
hairpin entry. Counting references lets a partial sync replace one port's rendering and
learn exactly which kernel objects appeared or disappeared, without walking the rest.

Two ports claiming the same virtual server (an externalIP equal to another service's
address and port) is a conflict: the port whose key sorts first wins, deterministically,
and the conflict is reported so the applier can log it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import TypeVar

from proxy.dataplane.ipvs.render import PortChange, PortRules, SetEntry, VirtualServer, VsKey
from proxy.model.types import IPAddress, ServicePortKey

T = TypeVar("T", bound=Hashable)


@dataclass(slots=True)
class Touched:
    """What one or more `RenderIndex.update` calls touched, for the applier: the virtual
    servers to diff again, the set entries and addresses that appeared or went, the ports
    written or removed."""

    virtual_servers: set[VsKey] = field(default_factory=set)  # re-diff these
    entries_added: set[SetEntry] = field(default_factory=set)
    entries_removed: set[SetEntry] = field(default_factory=set)
    addresses_added: set[IPAddress] = field(default_factory=set)
    addresses_removed: set[IPAddress] = field(default_factory=set)
    written: set[ServicePortKey] = field(default_factory=set)
    removed: set[ServicePortKey] = field(default_factory=set)


class RenderIndex:
    def __init__(self, ports: Mapping[ServicePortKey, PortRules] | None = None) -> None:
        self.ports: dict[ServicePortKey, PortRules] = {}
        self._claims: dict[VsKey, dict[ServicePortKey, VirtualServer]] = {}
        self._entries: Counter[SetEntry] = Counter()
        self._addresses: Counter[IPAddress] = Counter()
        if ports:
            touched = Touched()
            for key, rules in ports.items():
                self.update(key, rules, touched)

    def update(self, key: ServicePortKey, new: PortRules | None, touched: Touched) -> None:
        """Replace `key`'s rendering with `new` (None: the port is gone)."""
        old = self.ports.get(key)
        if old == new:
            return
        if old is not None:
            for vs in old.virtual_servers:
                claims = self._claims[vs.key]
                del claims[key]
                if not claims:
                    del self._claims[vs.key]
                touched.virtual_servers.add(vs.key)
            _release(self._entries, old.entries, touched.entries_removed, touched.entries_added)
            _release(self._addresses, old.addresses, touched.addresses_removed,
                     touched.addresses_added)
        if new is None:
            self.ports.pop(key, None)
            if old is not None:
                touched.removed.add(key)
            return
        self.ports[key] = new
        touched.written.add(key)
        touched.removed.discard(key)
        for vs in new.virtual_servers:
            self._claims.setdefault(vs.key, {})[key] = vs
            touched.virtual_servers.add(vs.key)
        _acquire(self._entries, new.entries, touched.entries_added, touched.entries_removed)
        _acquire(self._addresses, new.addresses, touched.addresses_added,
                 touched.addresses_removed)

    def update_endpoints(self, key: ServicePortKey, change: PortChange,
                         touched: Touched) -> None:
        """`update(key, change.rules, touched)` for a port rendered from its endpoint delta
        (render.render_change: the same virtual servers and addresses), in O(change):
        only the servers whose real servers changed are touched, only the entries that
        changed counted."""
        new = change.rules
        self.ports[key] = new
        touched.written.add(key)
        touched.removed.discard(key)
        for vs in new.virtual_servers:
            if vs.key in change.real_servers:
                self._claims[vs.key][key] = vs
                touched.virtual_servers.add(vs.key)
        _release(self._entries, change.entries_removed, touched.entries_removed,
                 touched.entries_added)
        _acquire(self._entries, change.entries_added, touched.entries_added,
                 touched.entries_removed)

    def virtual_server(self, vs_key: VsKey) -> tuple[ServicePortKey, VirtualServer] | None:
        """The winning claim on `vs_key`: (owner, virtual server), or None."""
        claims = self._claims.get(vs_key)
        if not claims:
            return None
        owner = min(claims)
        return owner, claims[owner]

    def virtual_servers(self) -> dict[VsKey, tuple[ServicePortKey, VirtualServer]]:
        out = {}
        for vs_key in self._claims:
            found = self.virtual_server(vs_key)
            if found is not None:
                out[vs_key] = found
        return out

    def conflicts(self, vs_keys: Iterable[VsKey]) -> dict[VsKey, tuple[ServicePortKey, ...]]:
        """Among `vs_keys`, those claimed by more than one port, with every claimant."""
        out = {}
        for vs_key in vs_keys:
            claims = self._claims.get(vs_key, {})
            if len(claims) > 1:
                out[vs_key] = tuple(sorted(claims))
        return out

    def contested(self) -> set[VsKey]:
        """The virtual servers more than one port claims (rare: none, as a rule)."""
        return {vs_key for vs_key, claims in self._claims.items() if len(claims) > 1}

    def entries(self) -> set[SetEntry]:
        return set(self._entries)

    def addresses(self) -> set[IPAddress]:
        return set(self._addresses)

    def address_count(self) -> int:
        return len(self._addresses)


def _acquire(counts: Counter[T], items: Iterable[T], added: set[T], removed: set[T]) -> None:
    for item in items:
        counts[item] += 1
        if counts[item] == 1:
            if item in removed:  # released earlier in the same update: no net change
                removed.discard(item)
            else:
                added.add(item)


def _release(counts: Counter[T], items: Iterable[T], removed: set[T], added: set[T]) -> None:
    for item in items:
        counts[item] -= 1
        if counts[item] == 0:
            del counts[item]
            if item in added:  # acquired earlier in the same update: no net change
                added.discard(item)
            else:
                removed.add(item)
