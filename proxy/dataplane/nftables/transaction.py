"""nftables transactions (pure): what one family's table holds, and the script that moves
it to the next desired state.

A full script rewrites everything we own in one transaction: every chain declared, then
flushed and refilled (so no rule can point at a chain not yet there), every shared set
and map flushed and refilled, and whatever our table holds that nobody wants any more
deleted last. Affinity sets are declared, never flushed: a resync keeps who goes where.

A partial script touches only the service ports that changed: chains whose rules differ
are flushed and refilled, new ones added, gone ones deleted; elements are added and
deleted one by one. Elements are shared (two ports of one service share their cluster
IP in @cluster-ips, two services an endpoint in @hairpin), so `TableState` counts their
owners: an element leaves the kernel with its last owner. Order inside a transaction:
sets, new chains, rules, element deletions, element additions, chain deletions, set deletions;
nothing is ever referenced before it exists or deleted while referenced.

`TableState` is updated while a script is built: if the kernel refuses the script, the
data plane drops the state and the next sync is a full one.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from proxy.dataplane.nftables.render import (
    TABLE,
    BaseObjects,
    PortObjects,
    table_family,
)
from proxy.model.types import Family, ServicePortKey

# Elements per `add element` statement: one statement per element makes nft slower to
# parse; one per set makes error messages name a huge line.
ELEMENTS_PER_LINE = 500

ElementKey = tuple[str, str]  # (set or map, key)


@dataclass
class TableState:
    """What one family's table holds, as far as we know."""

    family: Family
    base: BaseObjects
    ports: dict[ServicePortKey, PortObjects] = field(default_factory=dict)
    # Element -> {owning port: value}; the kernel holds the smallest owner's value.
    owners: dict[ElementKey, dict[ServicePortKey, str]] = field(default_factory=dict)
    kernel: dict[ElementKey, str] = field(default_factory=dict)

    @property
    def table(self) -> str:
        return f"{table_family(self.family)} {TABLE}"

    def chain_names(self) -> set[str]:
        names = {name for name, _body, _rules in self.base.chains}
        names.update(name for p in self.ports.values() for name, _ in p.chains)
        return names

    def set_names(self) -> set[str]:
        names = {name for name, _ in self.base.sets}
        names.update(name for p in self.ports.values() for name, _ in p.sets)
        return names


def _is_map(body: str) -> bool:
    return " : " in body


def _declare_set(table: str, name: str, body: str) -> str:
    return f"add {'map' if _is_map(body) else 'set'} {table} {name} {{ {body} }}"


def _element_lines(verb: str, table: str, items: Iterable[tuple[str, str]]) -> list[str]:
    """`add|delete element` lines for (set, element text), grouped per set."""
    by_set: dict[str, list[str]] = {}
    for set_name, text in items:
        by_set.setdefault(set_name, []).append(text)
    out = []
    for set_name, texts in by_set.items():
        for i in range(0, len(texts), ELEMENTS_PER_LINE):
            chunk = ", ".join(texts[i:i + ELEMENTS_PER_LINE])
            out.append(f"{verb} element {table} {set_name} {{ {chunk} }}")
    return out


def _text(key: ElementKey, value: str) -> str:
    return f"{key[1]} : {value}" if value else key[1]


def full_script(base: BaseObjects, ports: Mapping[ServicePortKey, PortObjects],
                kernel_chains: Iterable[str] = (), kernel_sets: Mapping[str, str] | None = None,
                ) -> tuple[str, TableState]:
    """Everything we own, in one transaction. `kernel_chains` and `kernel_sets` (name ->
    "set" or "map") are what our table holds now (read back): what nobody wants any
    more is deleted."""
    state = TableState(base.family, base)
    t = state.table
    lines = [f"add table {t}"]
    lines += [_declare_set(t, name, body) for name, body in base.sets]
    chains: list[tuple[str, str, tuple[str, ...]]] = list(base.chains)
    for key in sorted(ports):
        p = ports[key]
        state.ports[key] = p
        lines += [_declare_set(t, name, body) for name, body in p.sets]
        chains += [(name, "", rules) for name, rules in p.chains]
        for e in p.elements:
            state.owners.setdefault((e.set, e.key), {})[key] = e.value
    for name, body, _rules in chains:
        lines.append(f"add chain {t} {name}" + (f" {{ {body} }}" if body else ""))
    for name, _body, rules in chains:
        lines.append(f"flush chain {t} {name}")
        lines += [f"add rule {t} {name} {rule}" for rule in rules]
    for name, body in base.sets:
        lines.append(f"flush {'map' if _is_map(body) else 'set'} {t} {name}")
    for e in base.elements:
        state.owners.setdefault((e.set, e.key), {})[_BASE] = e.value
    for k, owners in state.owners.items():
        state.kernel[k] = owners[min(owners)]
    lines += _element_lines("add", t, ((k[0], _text(k, v)) for k, v in state.kernel.items()))
    stale_chains = sorted(set(kernel_chains) - state.chain_names())
    lines += [f"flush chain {t} {name}" for name in stale_chains]
    lines += [f"delete chain {t} {name}" for name in stale_chains]
    kernel_sets = kernel_sets or {}
    stale_sets = sorted(set(kernel_sets) - state.set_names())
    lines += [f"delete {kernel_sets[name]} {t} {name}" for name in stale_sets]
    return "\n".join(lines) + "\n", state


# The base's own elements (NodePort addresses) are owned by this pseudo port, which sorts
# before every real one.
_BASE = ServicePortKey("", "", "", Family.V4)


def partial_script(state: TableState,
                   updates: Mapping[ServicePortKey, PortObjects | None]) -> str:
    """The transaction from `state` to `state` with `updates` (None: the port is gone);
    updates `state` to what the kernel holds once the script is applied. "" when the
    kernel has nothing to change."""
    t = state.table
    add_sets: list[str] = []
    add_chains: list[str] = []
    write_chains: list[str] = []
    gone_chains: list[str] = []
    gone_sets: list[str] = []
    touched: set[ElementKey] = set()
    for key in sorted(updates):
        new = updates[key]
        old = state.ports.get(key)
        old_chains = dict(old.chains) if old else {}
        new_chains = dict(new.chains) if new else {}
        old_sets = dict(old.sets) if old else {}
        new_sets = dict(new.sets) if new else {}
        add_sets += [_declare_set(t, n, b) for n, b in new_sets.items() if old_sets.get(n) != b]
        for name, rules in new_chains.items():
            before = old_chains.get(name)
            if before == rules:
                continue
            if before is None:  # declared before any rule, which may jump to it
                add_chains.append(f"add chain {t} {name}")
            else:
                write_chains.append(f"flush chain {t} {name}")
            write_chains += [f"add rule {t} {name} {rule}" for rule in rules]
        gone_chains += [n for n in old_chains if n not in new_chains]
        gone_sets += [n for n in old_sets if n not in new_sets]
        old_el = {(e.set, e.key): e.value for e in old.elements} if old else {}
        new_el = {(e.set, e.key): e.value for e in new.elements} if new else {}
        for k, v in old_el.items():
            if new_el.get(k) != v:
                owners = state.owners.get(k, {})
                owners.pop(key, None)
                if not owners:
                    state.owners.pop(k, None)
                touched.add(k)
        for k, v in new_el.items():
            if old_el.get(k) != v:
                state.owners.setdefault(k, {})[key] = v
                touched.add(k)
        if new is None:
            state.ports.pop(key, None)
        else:
            state.ports[key] = new
    deletes: list[tuple[str, str]] = []
    adds: list[tuple[str, str]] = []
    for k in sorted(touched):
        held = state.kernel.get(k)
        claims = state.owners.get(k)
        wanted = claims[min(claims)] if claims else None
        if held == wanted:
            continue
        if held is not None:
            deletes.append((k[0], k[1]))  # a map element is deleted by its key alone
            del state.kernel[k]
        if wanted is not None:
            adds.append((k[0], _text(k, wanted)))
            state.kernel[k] = wanted
    lines = add_sets + add_chains + write_chains
    lines += _element_lines("delete", t, deletes)
    lines += _element_lines("add", t, adds)
    lines += [f"flush chain {t} {name}" for name in gone_chains]
    lines += [f"delete chain {t} {name}" for name in gone_chains]
    lines += [f"delete set {t} {name}" for name in gone_sets]
    return "\n".join(lines) + "\n" if lines else ""

