"""What we have in the kernel for one family, and the iptables-restore text to change it
(pure: no kernel access).

`Wanted` is our rules for one family as just rendered (the fixed part, `BaseRules`, and
each service port's `PortRules`); a `Ruleset` is the record of them as last applied,
each port kept as `KeptRules` (its own chains as digests, not text).

- `Wanted.full_restore` writes every chain we own from scratch (each declared chain is
  flushed and refilled in the same transaction), deletes our chains the kernel still
  holds but we no longer want, and repairs the jumps from the built-in chains;
  `full_restore_batches` is the same in several transactions, for nf_tables (whose
  restore time grows with the square of the chains in one);
- `Ruleset.partial_restore` rewrites only the chains of changed service ports whose
  content changed, deletes the chains they no longer need, and edits the shared
  dispatch chains entry by entry (`-D` by rule spec, `-I` at a computed position), so
  the result is rule for rule what a full sync would have written.

Dispatch-chain order. In every shared chain, entries are grouped by service port in key
order, each port's entries in render order, and the "tail" entries (the NodePort
catch-all) last. `_order` keeps, per chain, one owner key per entry in kernel order, so
the position of a port's block is a binary search.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from proxy.dataplane.base import rules_digest
from proxy.dataplane.iptables.render import (
    DISPATCH_CHAINS,
    BaseRules,
    Entry,
    PortRules,
)
from proxy.dataplane.xtables.saved import (
    BUILTIN_CHAINS,
    TABLE_ORDER,
    RestoreText,
    Saved,
    Table,
    ours,
    target_of,
)
from proxy.model.types import ServicePortKey

# Owner of a dispatch entry, sorted: service ports by key, then the tail.
Owner = tuple[int, str, str, str]
TAIL: Owner = (1, "", "", "")


def owner(key: ServicePortKey) -> Owner:
    return (0, key.namespace, key.name, key.port)


@dataclass(frozen=True, slots=True)
class KeptRules:
    """What the kernel holds of one service port, as later restores need it: its
    dispatch entries whole (a `-D` names the rule) and its own chains as name, digest
    and length. Their text is not kept (at 10,000 services x 10 endpoints it was 55 of
    the 70 MiB kept); the debug dump renders it again from the last snapshot."""

    chains: tuple[tuple[str, int, int], ...]  # (name, rules_digest(specs), len(specs))
    entries: tuple[Entry, ...]

    @classmethod
    def of(cls, rules: PortRules) -> KeptRules:
        return cls(tuple((name, rules_digest(specs), len(specs)) for name, specs in rules.chains),
                   rules.entries)


def _shared_chains(base: BaseRules, ports: Mapping[ServicePortKey, KeptRules | PortRules]
                   ) -> dict[tuple[Table, str], list[str]]:
    """Our fixed and dispatch chains and their rules, in kernel order."""
    out = {(table, name): list(rules) for table, name, rules in base.chains}
    for key in sorted(ports):
        for table, chain, spec in ports[key].entries:
            out[(table, chain)].append(spec)
    for table, chain, spec in base.tail:
        out[(table, chain)].append(spec)
    return out


class Ruleset:
    """Our rules for one family, as last applied: the fixed part whole, and each
    service port as `KeptRules`."""

    __slots__ = ("_order", "base", "ports")

    def __init__(self, base: BaseRules, ports: Mapping[ServicePortKey, KeptRules]) -> None:
        self.base = base
        self.ports: dict[ServicePortKey, KeptRules] = dict(ports)
        self._order = self._build_order()

    def _build_order(self) -> dict[tuple[Table, str], list[Owner]]:
        order: dict[tuple[Table, str], list[Owner]] = {tc: [] for tc in DISPATCH_CHAINS}
        for key in sorted(self.ports):
            mine = owner(key)
            for table, chain, _ in self.ports[key].entries:
                order[(table, chain)].append(mine)
        for table, chain, _ in self.base.tail:
            order[(table, chain)].append(TAIL)
        return order

    # --- what the kernel should hold --------------------------------------------------------

    def lengths(self) -> dict[tuple[Table, str], int]:
        """Every chain we own and how many rules it holds."""
        out = {tc: len(rules) for tc, rules in _shared_chains(self.base, self.ports).items()}
        for kept in self.ports.values():
            for name, _digest, count in kept.chains:
                out[(Table.NAT, name)] = count
        return out

    def digests(self) -> dict[tuple[Table, str], int]:
        """Every chain we own and `rules_digest` of its rules: equal to the digests of
        the kernel's copy when iptables-save spells every rule as we wrote it."""
        out = {tc: rules_digest(rules)
               for tc, rules in _shared_chains(self.base, self.ports).items()}
        for kept in self.ports.values():
            for name, digest, _count in kept.chains:
                out[(Table.NAT, name)] = digest
        return out

    def rule_count(self) -> int:
        return sum(self.lengths().values()) + len(self.base.jumps)

    # --- drift ------------------------------------------------------------------------------

    def differences(self, kernel: Saved, limit: int = 5) -> list[str]:
        """How the kernel's copy of our rules (`parse_save` with our rules) differs from
        this ruleset: chains missing or of another length, chains of ours nobody wants,
        jumps from the built-in chains missing or out of order. [] when they agree.

        Counts, not text: iptables-save prints a rule in its own canonical form, which
        need not be the text we wrote, and what a foreign process does (flush a table or
        a chain, delete one, reload a firewall) always changes a count. At most `limit`
        differences are described, then how many more there were."""
        found: list[str] = []
        wanted = self.lengths()
        for (table, chain), count in wanted.items():
            have = kernel.get(table, {}).get(chain)
            if have is None:
                found.append(f"{table.value} chain {chain} is missing")
            elif len(have) != count:
                found.append(f"{table.value} chain {chain} holds {len(have)} rules, "
                             f"we wrote {count}")
        for table in TABLE_ORDER:
            found += [f"{table.value} chain {chain} is not in our rules"
                      for chain in kernel.get(table, {})
                      if ours(chain) and (table, chain) not in wanted]
        jumps: dict[tuple[Table, str], list[str | None]] = {}
        for table, chain, spec in self.base.jumps:
            jumps.setdefault((table, chain), []).append(target_of(spec))
        for (table, chain), targets in jumps.items():
            present = [t for t in map(target_of, kernel.get(table, {}).get(chain, []))
                       if ours(t or "")]
            if present != targets:
                found.append(f"{table.value} {chain} jumps to {present or 'none of ours'}, "
                             f"we wrote {targets}")
        if len(found) > limit:
            found = [*found[:limit], f"and {len(found) - limit} more"]
        return found

    # --- partial sync -----------------------------------------------------------------------

    def partial_restore(
        self, updates: Mapping[ServicePortKey, PortRules | None]
    ) -> tuple[RestoreText, Ruleset]:
        """The edits that turn this ruleset into this ruleset plus `updates` (None =
        removed), and the resulting ruleset. `self` is left as it was."""
        text = RestoreText()
        ports = dict(self.ports)
        order = {tc: list(owners) for tc, owners in self._order.items()}
        for key in sorted(updates):
            old, new = self.ports.get(key), updates[key]
            kept = KeptRules.of(new) if new is not None else None
            if old == kept:
                continue
            self._edit_chains(old, new, text)
            self._edit_entries(key, old, kept, order, text)
            if kept is None:
                ports.pop(key, None)
            else:
                ports[key] = kept
        result = Ruleset.__new__(Ruleset)
        result.base, result.ports, result._order = self.base, ports, order
        return text, result

    @staticmethod
    def _edit_chains(old: KeptRules | None, new: PortRules | None, text: RestoreText) -> None:
        before = {name: (digest, count) for name, digest, count in old.chains} if old else {}
        after = dict(new.chains) if new else {}
        for name, specs in after.items():
            if before.get(name) != (rules_digest(specs), len(specs)):
                text.write_chain(Table.NAT, name, specs)
        for name in before:
            if name not in after:
                text.remove_chain(Table.NAT, name)

    @staticmethod
    def _edit_entries(key: ServicePortKey, old: KeptRules | None, new: KeptRules | None,
                      order: dict[tuple[Table, str], list[Owner]], text: RestoreText) -> None:
        mine = owner(key)
        for table, chain in DISPATCH_CHAINS:
            before = _specs(old, table, chain)
            after = _specs(new, table, chain)
            if before == after:
                continue
            owners = order[(table, chain)]
            start = bisect_left(owners, mine)
            keep = set(before) & set(after)
            if [s for s in before if s in keep] != [s for s in after if s in keep]:
                keep = set()  # kept entries changed order: replace the whole block
            edits = text.edits[table]
            edits.extend(f"-D {chain} {s}" for s in before if s not in keep)
            # Inserting in block order: everything ahead of entry j is in place by then.
            edits.extend(f"-I {chain} {start + j + 1} {s}"
                         for j, s in enumerate(after) if s not in keep)
            owners[start:start + len(before)] = [mine] * len(after)


def _specs(rules: KeptRules | None, table: Table, chain: str) -> list[str]:
    if rules is None:
        return []
    return [spec for t, c, spec in rules.entries if t is table and c == chain]


class Wanted:
    """Our rules for one family as just rendered, text and all: what a full sync
    writes, and once written, the `Ruleset` to keep (`kept`)."""

    __slots__ = ("base", "ports")

    def __init__(self, base: BaseRules, ports: Mapping[ServicePortKey, PortRules]) -> None:
        self.base = base
        self.ports: dict[ServicePortKey, PortRules] = dict(ports)

    def kept(self) -> Ruleset:
        return Ruleset(self.base, {k: KeptRules.of(r) for k, r in self.ports.items()})

    def chains(self) -> dict[tuple[Table, str], Sequence[str]]:
        """Every chain of ours and its rules, in kernel order (a port's own chains are
        its tuples, not copies: 110,000 of them at 10,000 services)."""
        out: dict[tuple[Table, str], Sequence[str]] = dict(_shared_chains(self.base,
                                                                          self.ports))
        for key in sorted(self.ports):
            for name, specs in self.ports[key].chains:
                out[(Table.NAT, name)] = specs
        return out

    def full_restore(self, kernel: Saved,
                     written: frozenset[str] = frozenset()) -> RestoreText:
        """Make the kernel hold exactly these rules, whatever of ours it holds now.
        `written`: nat chains of service ports already written by earlier batches."""
        text = RestoreText()
        wanted = self.chains()
        for (table, chain), specs in wanted.items():
            if table is Table.NAT and chain in written:
                continue
            text.write_chain(table, chain, specs)
        for table in TABLE_ORDER:
            for chain in kernel.get(table, {}):
                if ours(chain) and (table, chain) not in wanted:
                    text.remove_chain(table, chain)
        self._repair_jumps(kernel, text)
        return text

    def full_restore_batches(self, kernel: Saved, max_chains: int) -> list[RestoreText]:
        """`full_restore` as several restores, each declaring about `max_chains` chains at
        most: iptables-nft-restore's time grows with the square of the chains one
        transaction declares (10,000 services: 256 s in one restore; in batches of 1,000
        services, seconds). The first batches write the service ports' own chains, a
        port's chains always together: a new chain is not referenced yet, and a
        rewritten one changes its service at once, as a partial sync would. The last
        batch is the rest of `full_restore`: fixed and dispatch chains, stale chains,
        jumps. Each restore is atomic; in between, every service is old or new, never
        half of each."""
        groups: list[list[tuple[str, tuple[str, ...]]]] = [[]]
        for key in sorted(self.ports):
            chains = self.ports[key].chains
            if chains and groups[-1] and len(groups[-1]) + len(chains) > max_chains:
                groups.append([])
            groups[-1].extend(chains)
        if len(groups) == 1:
            return [self.full_restore(kernel)]
        batches: list[RestoreText] = []
        for group in groups:
            text = RestoreText()
            if not batches:
                # Our fixed chains that service chains jump to must exist first; created
                # empty here (declaring one that exists would flush it), filled last.
                for table, chain, _ in self.base.chains:
                    if chain not in kernel.get(table, {}):
                        text.declare[table].append(f":{chain} - [0:0]")
            for name, specs in group:
                text.write_chain(Table.NAT, name, specs)
            batches.append(text)
        written = frozenset(name for group in groups for name, _ in group)
        batches.append(self.full_restore(kernel, written))
        return batches

    def _repair_jumps(self, kernel: Saved, text: RestoreText) -> None:
        """Our jumps from each built-in chain, each once and in order, or redo them."""
        wanted: dict[tuple[Table, str], list[str]] = {}
        for table, chain, spec in self.base.jumps:
            wanted.setdefault((table, chain), []).append(spec)
        for table in TABLE_ORDER:
            for chain in kernel.get(table, {}):
                if chain in BUILTIN_CHAINS:
                    wanted.setdefault((table, chain), [])
        for (table, chain), specs in wanted.items():
            present = [s for s in kernel.get(table, {}).get(chain, [])
                       if ours(target_of(s) or "")]
            if present == specs:
                continue
            text.edits[table].extend(f"-D {chain} {s}" for s in present)
            # Prepended, as upstream, so a later default-deny rule cannot shadow them.
            text.edits[table].extend(f"-I {chain} 1 {s}" for s in reversed(specs))
