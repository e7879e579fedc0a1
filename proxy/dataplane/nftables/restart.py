"""A restart over our own tables (pure): the kernel is the state, the script is the diff.

Every port, and each table's fixed part (a base), writes beside its objects and in the
same transaction its element of its table's @fingerprints: 128 bits of digest over
all it writes (render.fingerprint, render.mark_element). An agent starting over tables
that hold our objects (a rollout, a crash) reads back the names of our chains, sets and
counters, the fingerprints, the bases' maps and, where an element of theirs may be
nobody's (`sets_needed`), the bases' sets (readback.py); renders every port as a full
sync would, keeping each in the state as it is rendered and its objects only if it is
written (`render_all`); and writes:

- a port or base whose fingerprint the kernel holds, with all its chains (and a port's
  sets and counters): nothing. Its rules, slot maps and affinity sets are what it
  would write;
- any other port (new, changed, edited by an endpoint delta since its fingerprint was
  written: transaction._apply_edit drops it) or base whole, as a full sync writes it:
  sets declared, chains declared, flushed and refilled, slot maps flushed and refilled;
- the bases' sets and maps (dispatch maps, cluster IPs, hairpin pairs, node addresses,
  fingerprints) brought to what the owners want, element by element, from what the
  kernel holds (a set not read back: the elements of what is written added);
- what nobody wants any more deleted, as full_lines does.

One transaction, so no packet sees a service missing, and its size is that of the
difference: at 10,000 services x 10 endpoints unchanged, nothing. What a restart
cannot see: a foreign edit inside a chain whose name and fingerprint stayed. The drift
watch covers a running agent, and the periodic full sync stays a full rewrite
(full_lines), which repairs it. A version whose layout differs renders other
fingerprints (or declares a set otherwise: the kernel refuses the `add`, and apply.py
replaces the tables whole), so it rewrites everything. Where nearly every port
differs (`rewrite_of`: another build that renders ports otherwise), it reads nothing
else back and writes every port again, each rendered as the script is read: over
bases as written (their fingerprints, chains and sets), a table a transaction, as the
periodic resync writes them (transaction.resync_lines; each table is whole when it
commits and the bases agree, so every service is served throughout, by the old
build's rules until its table's part and by the new ones after); over other bases, in
one transaction, as a first start writes them, every set flushed and the stale
deleted (transaction.rewrite_lines).
It assumes no other writer of our tables between the read-back and the commit: one
agent per node, as the shipped rollout (maxUnavailable: 1) keeps it.

Rendering every port is most of a restart's time. Where the kernel holds the bases as
written and most ports' input marks (marks.py: a digest of a port's input and of the
code, `kept_by_marks`), the restart renders only the other ports and writes them
(`restart_lines` without a sweep: nothing they do not claim is deleted, as it may be a
kept port's), against the bases' maps read back but the pick maps, of which it asks
only for what the other ports can have left (`picks_to_probe`: a `partial` Held, diffed
key by key); the data plane renders the kept ones after, a part at a time, and, if
something may be nobody's any more, sweeps (`sweep_lines` over the state every port is
then in: restart_steps.py).
"""

from __future__ import annotations

import enum
import heapq
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from proxy.dataplane.nftables.objects import Element, Key, Value, Verdict
from proxy.dataplane.nftables.readback import Held, key_parts
from proxy.dataplane.nftables.render import (
    FINGERPRINTS,
    PICK,
    PICKS,
    SERVICE_IPS,
    BaseObjects,
    PortObjects,
    mark_element,
    pick_map,
    table_family,
)
from proxy.dataplane.nftables.transaction import (
    Named,
    Script,
    TableState,
    element_groups,
    flush_maps,
    kept_state,
    objects_written,
    stale_statements,
)
from proxy.dataplane.nftables.wire import Statement, element_keys
from proxy.model.types import Family, ServicePortKey


@dataclass
class KernelTables:
    """What one family's tables of ours hold, read back: names, and the elements of the
    bases' sets and maps that were read ((table, set) -> Held; `sets_needed`)."""

    tables: set[str]
    chains: set[Named]
    sets: Mapping[Named, str]  # -> "set" | "map"
    counters: set[Named]
    elements: Mapping[Named, Held] = field(default_factory=dict)


# A restart over another build's tables renders this many ports (the first in key
# order) to tell whether it rewrites them all (`rewrite_of`), over this many or more.
REWRITE_SAMPLE = 200
REWRITE_MIN_PORTS = 1_000


@dataclass
class RestartCounts:
    """What a restart script writes: ports kept as the kernel holds them, ports written,
    elements of the bases' sets deleted and added; and the marks it left to delete
    after (`marks_aside`)."""

    kept: int = 0
    written: int = 0
    deleted: int = 0
    added: int = 0
    aside: int = 0
    # Every table rewritten (`rewrite_of`): how many, and how.
    tables: int = 0
    rewrite: Rewrite | None = None


def base_sets(bases: Sequence[BaseObjects]) -> list[tuple[str, str, tuple[str, ...], bool]]:
    """(table, name, key types, whether a map) of each set and map the bases declare:
    what a restart reads back element by element."""
    return [(b.table, s.name, getattr(s, "key", ()), s.kind == "map")
            for b in bases for s in b.sets]


@dataclass
class RenderedAll:
    """A restart that renders every port (`render_all`), as far as the kernel's
    @fingerprints and names tell: the state every port is in once the script is applied,
    the ports the kernel does not hold as rendered (written; the others are let go as
    they are kept: holding them all put an upgrade's peak 450 MiB higher at 100,000
    services), which of the bases' and ports' fingerprints and input marks it holds, and
    the dispatch keys of the ports it holds as rendered."""

    state: TableState
    written: list[tuple[ServicePortKey, PortObjects]]
    held_marks: set[Key]
    intact: set[Key]

    @property
    def kept(self) -> int:
        """How many ports the kernel holds as rendered."""
        return len(self.state.ports) - len(self.written)


def render_all(bases: Sequence[BaseObjects], ports: Mapping[ServicePortKey, PortObjects],
               kernel: KernelTables) -> RenderedAll:
    """Every port of `ports` (which renders each as it is asked) kept in a state, in key
    order, against `kernel` with its names and @fingerprints read back: whether the
    kernel holds each as rendered (`_intact`) is known as it is rendered."""
    held = held_fingerprints(kernel)
    family = bases[0].family
    marks = _found(family, [b.fingerprint for b in bases], held) if held is not None else set()
    out = RenderedAll(TableState(family, tuple(bases)), [], marks, set())

    def written(p: PortObjects) -> bool:
        if held is not None:
            marks.update(_found(family, [m for m in (p.fingerprint, p.input_mark) if m],
                                held))
        if not _intact(p, kernel, marks):
            return True
        out.intact.update(e.key for e in p.elements if e.set == SERVICE_IPS)
        return False

    out.state, out.written = kept_state(bases, ports, written)
    return out


def sets_needed(rendered: RenderedAll, kernel: KernelTables) -> bool:
    """Whether the bases' sets (not maps: those are read, the pick maps by key) must be
    read back too, `kernel` holding the maps and @fingerprints: only if an element of
    theirs may be nobody's any more, that is if the kernel holds a fingerprint nobody
    writes now (a port gone or changed while no agent ran) or a port without one whose
    objects are there (edited by an endpoint delta). Otherwise every element they hold is wanted,
    and a restart adds those of the ports it writes (an `add` of one held changes
    nothing). 100,000 hairpin pairs cost the kernel 0.09 s to dump, the most of an
    unchanged restart's system time (a million, 70 s). After an upgrade, @fingerprints
    holds the input marks of another build too: then none is needed if every port is
    intact and nothing else is in the maps (`_all_intact`)."""
    marks = held_fingerprints(kernel)
    if marks is None:
        return True
    held = rendered.held_marks
    if len(marks) > len(held):
        return not _all_intact(rendered, kernel)
    return any(p.fingerprint not in held and any((p.table, c.name) in kernel.chains
                                                 for c in p.chains)
               for _key, p in rendered.written)


def _all_intact(rendered: RenderedAll, kernel: KernelTables) -> bool:
    """Whether the kernel holds every port as rendered (`_intact`) and, in the maps read
    whole, only elements a base or port writes, with their values: then no port went
    or changed while no agent ran (a port gone leaves its dispatch element), and what
    @fingerprints holds beyond is input marks of another build."""
    if rendered.written:
        return False
    owners = rendered.state.owners
    return all(owners.held((table, name, k)) == v
               for (table, name), h in kernel.elements.items()
               if kernel.sets.get((table, name)) == "map" and not h.partial
               for k, v in h.decoded.items())


def picks_to_probe(kernel: KernelTables, kept: Collection[Key]
                   ) -> dict[Named, list[Key]]:
    """The elements of the pick maps a restart asks for one by one, rather than dump
    them (a million at 100,000 x 10: most of the restart's 16 s of reading back and a
    peak of 1.1 GiB): those of every picked port the dispatch maps read back (`kernel`)
    lead to, the slots 0..n-1 of its pick map, but not a destination in `kept` (cluster
    IP, protocol, port of the ports kept by their marks: they hold what they wrote).
    These are all a port written or gone can have left there: a picked port's elements
    and its dispatch element are written in one transaction. Every pick map the kernel
    has is in the answer, with no keys where none."""
    out: dict[Named, list[Key]] = {n: [] for n in kernel.sets if n[1].startswith(PICKS)}
    for (table, name), held in kernel.elements.items():
        if name != SERVICE_IPS:
            continue
        for key, value in held.decoded.items():
            if not isinstance(value, Verdict) or not value.chain.startswith(PICK) \
                    or not value.chain[len(PICK):].isdigit() or key in kept:
                continue  # (a `pick-` chain we never name: a foreign one)
            ip, proto, port = key
            n = int(value.chain[len(PICK):])
            keys = out.get((table, pick_map(str(proto), n)))
            if keys is not None:
                keys += [(ip, port, slot) for slot in range(n)]
    return out


def dispatch_keys(ports: Iterable[PortObjects]) -> set[Key]:
    """The keys of `ports`' elements in the dispatch maps (service-ips)."""
    return {e.key for p in ports for e in p.elements if e.set == SERVICE_IPS}


def restart_lines(bases: Sequence[BaseObjects], ports: Mapping[ServicePortKey, PortObjects],
                  kernel: KernelTables, sweep: bool = True,
                  made: tuple[TableState, list[tuple[ServicePortKey, PortObjects]]] | None = None
                  ) -> tuple[Script | str, TableState, RestartCounts]:
    """The transaction from what `kernel` holds to `bases` and `ports` (module
    docstring); the state the kernel holds once it is applied, as full_lines'. "" when
    it holds all of it already. Without `sweep`, `ports` are some of the ports only (the
    others kept by their input marks, `kept_by_marks`): what nobody here claims is not
    deleted (it may be theirs), and a map's element is deleted only to take another
    value here; the sweep comes once every port is rendered. `made`: kept_state's
    answer, where the caller made it already."""
    state, ordered = made or kept_state(bases, ports)
    held_marks = _held_marks(bases, ports.values(), kernel) or set()
    # A base whose fingerprint, chains and sets the kernel holds keeps them as they are
    # (at 64 shards, 6,000 sets declared again).
    bases_written = [b for b in bases if b.fingerprint not in held_marks
                     or any((b.table, c.name) not in kernel.chains for c in b.chains)
                     or any((b.table, s.name) not in kernel.sets for s in b.sets)]
    written = [p for _key, p in ordered if not _intact(p, kernel, held_marks)]
    deletes, adds = _element_diff(state, bases, kernel, (*(b.elements for b in bases_written),
                                                       *(p.elements for p in written)),
                                  sweep)
    counts = RestartCounts(len(ordered) - len(written), len(written), len(deletes), len(adds))
    stale = stale_statements(state, kernel.chains, kernel.sets, kernel.counters,
                             kernel.tables) if sweep else []
    if not (bases_written or written or deletes or adds or stale):
        return "", state, counts
    # The written ports' elements in their own maps (slots), after their flush; those in
    # the bases' sets and maps come with the element diff.
    shared = {(t, name) for t, name, _types, _is_map in base_sets(bases)}
    own = [e for p in written for e in p.elements if (e.table, e.set) not in shared]

    def make() -> Iterator[Statement]:
        yield from objects_written(bases_written, written, kernel.counters)
        for p in written:
            yield from flush_maps(p)
        yield from element_groups("delete", deletes)
        yield from element_groups("add", adds)
        yield from element_groups("add", own)
        yield from stale

    return Script(make, table_family(state.family)), state, counts


def sweep_lines(state: TableState, kernel: KernelTables, rewrite: Sequence[PortObjects] = ()
                ) -> tuple[Script | str, RestartCounts]:
    """Once every port is in `state` (a restart's kept ports added after its first
    sync, restart_steps.py): `rewrite` (ports of `state` the kernel lacks a chain of)
    written whole, what `kernel` holds that nobody in `state` claims deleted, and any
    element of the bases' sets it lacks added. "" when there is nothing."""
    deletes, adds = _element_diff(state, state.bases, kernel, (), sweep=True)
    stale = stale_statements(state, kernel.chains, kernel.sets, kernel.counters,
                             kernel.tables)
    counts = RestartCounts(len(state.ports) - len(rewrite), len(rewrite), len(deletes),
                           len(adds))
    if not (rewrite or deletes or adds or stale):
        return "", counts

    def make() -> Iterator[Statement]:
        yield from objects_written((), rewrite, kernel.counters)
        for p in rewrite:
            yield from flush_maps(p)
        yield from element_groups("delete", deletes)
        yield from element_groups("add", adds)
        # Every element of theirs: the view counts those of the bases' sets as held, as
        # their marks promised (an `add` of one the kernel holds changes nothing).
        yield from element_groups("add", (e for p in rewrite for e in p.elements))
        yield from stale

    return Script(make, table_family(state.family)), counts


def with_input_mark(p: PortObjects, mark: Key) -> PortObjects:
    """`p` with its input mark among its elements (marks.py): a restart renders every
    port from its input alone, so the mark it computed stands for what `p` writes."""
    return replace(p, elements=(*p.elements, mark_element(p.table, mark)),
                   input_mark=mark)


def kept_by_marks(bases: Sequence[BaseObjects], marks: Mapping[ServicePortKey, Key],
                  kernel: KernelTables) -> tuple[set[ServicePortKey], bool] | None:
    """The ports whose input marks (`marks`, marks.py) `kernel` holds (its names and
    @fingerprints read back): what they write is there, unrendered; and whether
    anything nobody claims may be there too (a sweep is due once every port is
    rendered): a port not kept, or more in @fingerprints than the bases' fingerprints
    and two per port (a port gone while no agent ran leaves its marks). None when the
    bases are not all there as `bases` write them, in exactly their tables: then every
    port is rendered."""
    held = held_fingerprints(kernel)
    if held is None or not _bases_as_written(bases, kernel, held):
        return None
    found = _found(bases[0].family, list(marks.values()), held)
    kept = {k for k, mark in marks.items() if mark in found}
    return kept, len(kept) < len(marks) or len(held) != len(bases) + 2 * len(marks)


def _bases_as_written(bases: Sequence[BaseObjects], kernel: KernelTables, held: Held) -> bool:
    """Whether `kernel` holds exactly the tables of `bases`, and each base as it writes
    it: its fingerprint (among `held`, @fingerprints read back), chains and sets."""
    if kernel.tables != {b.table for b in bases}:
        return False
    if any((b.table, c.name) not in kernel.chains for b in bases for c in b.chains) \
            or any((b.table, s.name) not in kernel.sets for b in bases for s in b.sets):
        return False
    return len(_found(bases[0].family, [b.fingerprint for b in bases], held)) == len(bases)


class Rewrite(enum.Enum):
    """How a restart writes every port again (`rewrite_of`)."""

    TABLES = "a table a transaction"  # transaction.resync_lines
    WHOLE = "one transaction"  # transaction.rewrite_lines


def rewrite_of(bases: Sequence[BaseObjects], ports: Mapping[ServicePortKey, PortObjects],
               kernel: KernelTables) -> Rewrite | None:
    """How a restart over `kernel` (its names and @fingerprints read back) rewrites every
    port, rather than write the diff (None): where it would write nearly every port
    again (another build that renders ports otherwise), for which the diff would read
    back the bases' maps and @hairpin (a million pairs: 70 s at 100,000 services) and
    hold every port it writes until its transaction (2.1 GiB there).

    TABLES where the kernel holds exactly the bases' tables, each base as written
    (`_bases_as_written`): then what the tables agree on between them (a packet's marks,
    which table dispatches) is this version's, so each table may go live on its own,
    its ports in the other layout until their table's part, none missing. WHOLE
    otherwise: one transaction, as a first start writes it with every set flushed and
    the stale deleted, reading nothing back.

    Only for REWRITE_MIN_PORTS ports or more (fewer take a fraction of a second in one
    transaction), of which the first REWRITE_SAMPLE in key order (`ports` renders each
    as it is asked) are three in four or more not held as rendered. A sample wrong the
    other way (the first ports changed while no agent ran, the rest not) costs a
    rewrite, which is what a periodic resync does anyway."""
    held = held_fingerprints(kernel)
    if len(ports) < REWRITE_MIN_PORTS or held is None:
        return None
    first = [ports[k] for k in heapq.nsmallest(REWRITE_SAMPLE, ports)]
    marks = _found(bases[0].family,
                   [m for p in first for m in (p.fingerprint, p.input_mark) if m], held)
    written = sum(1 for p in first if not _intact(p, kernel, marks))
    if 4 * written < 3 * len(first):
        return None
    return Rewrite.TABLES if _bases_as_written(bases, kernel, held) else Rewrite.WHOLE


def marks_aside(state: TableState, kernel: KernelTables) -> dict[str, list[bytes]]:
    """The elements of each @fingerprints read back (`kernel`, as laid out: `raw`) that
    nobody in `state` claims, taken out of what was read, so that a restart's diff
    leaves them; table -> their keys. For a restart that writes nothing, over maps that
    hold what the ports want (restart_steps.py): these are another build's input marks,
    true of what the kernel holds as long as nothing is written, and deleted after, a
    part at a time, rather than in its transaction."""
    aside: dict[str, list[bytes]] = {}
    for (table, name), held in kernel.elements.items():
        if name != FINGERPRINTS or held.partial:
            continue
        nobodys = [k for k in held.decoded if state.owners.held((table, name, k)) is None]
        for k in nobodys:
            del held.decoded[k]
        raws = element_keys(state.family, nobodys)
        if held.raw:
            owned = _owned_raws(state, table, name)
            raws += [r for r in held.raw if r not in owned]
            held.raw.difference_update(raws)
        if raws:
            aside[table] = raws
    return aside


def marks_back(aside: Mapping[str, list[bytes]], kernel: KernelTables) -> None:
    """`marks_aside`'s elements put back among what was read."""
    for table, raws in aside.items():
        kernel.elements[table, FINGERPRINTS].raw.update(raws)


def _element_diff(state: TableState, bases: Sequence[BaseObjects], kernel: KernelTables,
                  fresh_elements: Iterable[Iterable[Element]], sweep: bool = True
                  ) -> tuple[list[tuple[str, str, Key, Value]], list[tuple[str, str, Key, Value]]]:
    """The elements of the bases' sets and maps to delete and to add: what the owners in
    `state` want against what `kernel` holds, or, for a set not read back
    (`sets_needed`), the elements of what is written (`fresh_elements`). Without
    `sweep`, only what the owners want another value of is deleted."""
    types = {(t, name): key for t, name, key, _is_map in base_sets(bases)}
    owners = state.owners
    fresh: dict[Named, list[tuple[Key, Value]]] = {}
    for objects in fresh_elements:
        for e in objects:
            fresh.setdefault((e.table, e.set), []).append((e.key, e.value))
    deletes: list[tuple[str, str, Key, Value]] = []
    adds: list[tuple[str, str, Key, Value]] = []
    for (table, set_name), key_types in sorted(types.items()):
        held = kernel.elements.get((table, set_name))
        if held is None and (table, set_name) in kernel.sets:  # not read: `sets_needed`
            adds += [(table, set_name, k, v) for k, v in fresh.get((table, set_name), ())]
            continue
        if held is None:
            held = Held()
        if held.partial:
            d, a = _partial_diff(state, key_types, (table, set_name), held,
                                 fresh.get((table, set_name), ()), sweep)
            deletes += d
            adds += a
            continue
        # Each held element looked up in the owners, and theirs read in place: a copy of
        # what they want of every set (@hairpin's million pairs, never read back, among
        # them) was 110 MiB of an upgrade's peak at 100,000 x 10. A map's element whose
        # value changes is deleted (by its key) and added again.
        deletes += [(table, set_name, k, ()) for k, v in held.decoded.items()
                    if _unwanted(owners.held((table, set_name, k)), v, sweep)]
        present: set[Key] = set()
        if held.raw:
            raws = _owned_raws(state, table, set_name)
            present = {raws[r] for r in held.raw if r in raws}
            deletes += [(table, set_name, key_parts(state.family, key_types, r), ())
                        for r in held.raw if r not in raws and sweep]
        adds += [(table, set_name, k, v) for k, v in owners.items(table, set_name)
                 if k not in present and held.decoded.get(k) != v]
    return deletes, adds


def _owned_raws(state: TableState, table: str, name: str) -> dict[bytes, Key]:
    """The keys the owners in `state` want in set `name` of `table`, by their bytes as
    the kernel lays them out (Held.raw)."""
    wanted = [k for k, _v in state.owners.items(table, name)]
    return dict(zip(element_keys(state.family, wanted), wanted, strict=True))


def _unwanted(wanted: Value | None, held: Value, sweep: bool) -> bool:
    """Whether an element the kernel holds as `held` goes, the owners wanting `wanted`
    of it (None: nobody): deleted where nobody wants it (at a sweep) or where it is
    wanted with another value."""
    return (sweep and wanted is None) or (wanted is not None and wanted != held)


def _partial_diff(state: TableState, key_types: tuple[str, ...], name: Named, held: Held,
                  fresh: Iterable[tuple[Key, Value]], sweep: bool
                  ) -> tuple[list[tuple[str, str, Key, Value]], list[tuple[str, str, Key, Value]]]:
    """`_element_diff` of a set or map of which only some keys were asked for (`held`
    partial: nothing is known of the others, which are what their owners wrote): those
    held, each looked up in the owners (a pick map holds a million at 100,000 x 10),
    deleted where nobody wants them (`sweep`) or wants another value, which is added
    again; and `fresh` elements added unless held as they are."""
    table, set_name = name
    got = dict(held.decoded)
    got.update((key_parts(state.family, key_types, r), ()) for r in held.raw)
    deletes: list[tuple[str, str, Key, Value]] = []
    adds: dict[Key, Value] = {}
    for k, v in got.items():
        wanted = state.owners.held((table, set_name, k))
        if not _unwanted(wanted, v, sweep):
            continue
        deletes.append((table, set_name, k, ()))
        if wanted is not None:
            adds[k] = wanted
    adds.update((k, v) for k, v in fresh if got.get(k) != v)
    return deletes, [(table, set_name, k, v) for k, v in adds.items()]


def _held_marks(bases: Sequence[BaseObjects], ports: Iterable[PortObjects],
                kernel: KernelTables) -> set[Key] | None:
    """Which of the bases' and `ports`' fingerprints the kernel holds; None when
    @fingerprints was not read back (not there: a version without it)."""
    held = held_fingerprints(kernel)
    if held is None:
        return None
    keys = [*(b.fingerprint for b in bases),
            *(m for p in ports for m in (p.fingerprint, p.input_mark) if m)]
    return _found(bases[0].family, keys, held)


def held_fingerprints(kernel: KernelTables) -> Held | None:
    """What every table's @fingerprints holds, read back (render.mark_element), as one:
    a digest names its table, so where it lies does not matter (what a version that
    kept them all in the main table wrote is found too); None when none was read."""
    found = [h for (_table, name), h in kernel.elements.items() if name == FINGERPRINTS]
    if not found:
        return None
    if len(found) == 1:
        return found[0]
    return Held({k: v for h in found for k, v in h.decoded.items()},
                {r for h in found for r in h.raw})


def _found(family: Family, keys: Sequence[Key], held: Held) -> set[Key]:
    """Which of `keys` (of @fingerprints) `held` holds."""
    found = {k for k in keys if k in held.decoded}
    if held.raw:
        raws = element_keys(family, keys)
        found.update(k for k, r in zip(keys, raws, strict=True) if r in held.raw)
    return found


def _intact(p: PortObjects, kernel: KernelTables, held_marks: set[Key]) -> bool:
    """Whether the kernel holds `p` as rendered: its fingerprint, and every object it
    names (a chain deleted by hand leaves the fingerprint behind)."""
    if p.fingerprint not in held_marks:
        return False
    t = p.table
    return all((t, c.name) in kernel.chains for c in p.chains) \
        and all((t, s.name) in kernel.sets for s in p.sets) \
        and all((t, name) in kernel.counters for name, _ in p.counters)

