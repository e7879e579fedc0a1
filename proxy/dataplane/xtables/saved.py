"""iptables-save text read, iptables-restore text written (pure): the one parser and the
one writer every mode uses for x_tables (the iptables mode's rules, the IPVS mode's few
fixed chains, the clean-up of either), as upstream keeps pkg/util/iptables apart from
its proxiers.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from proxy.dataplane import modes

# Every chain sliceproxy writes, in any mode, begins with this (the IPVS mode's with
# "SPX-IPVS-"); nothing else is ever ours.
PREFIX = modes.CHAIN_PREFIX


class Table(enum.Enum):
    NAT = "nat"
    FILTER = "filter"


TABLE_ORDER = (Table.NAT, Table.FILTER)  # nat first: see `IptablesDataPlane._apply`
BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})

# Parsed iptables-save output: table -> chain -> rule specs (without "-A CHAIN ").
Saved = dict[Table, dict[str, list[str]]]

_TARGET = re.compile(r"(?:^| )-[jg] (\S+)")


def ours(chain: str) -> bool:
    """Whether a chain is sliceproxy's (any mode's)."""
    return chain.startswith(PREFIX)


def target_of(spec: str) -> str | None:
    found = _TARGET.findall(spec)
    return found[-1] if found else None


def parse_save(text: str | Iterable[str], our_rules: bool = True) -> Saved:
    """The tables, chains (built-in ones included) and rules of iptables-save output.

    `our_rules=False` skips the rules inside our own chains (their names are kept):
    a full sync rewrites those anyway, and at 10,000 services they are 100,000 lines.
    """
    saved: Saved = {}
    chains: dict[str, list[str]] | None = None
    skip = f"-A {PREFIX}"
    for line in text.splitlines() if isinstance(text, str) else text:
        if line.startswith("*"):
            try:
                table = Table(line[1:].strip())
            except ValueError:
                chains = None  # mangle, raw, security: never ours
                continue
            chains = saved.setdefault(table, {})
        elif chains is None or not line or line[0] == "#" or line == "COMMIT":
            continue
        elif line.startswith(":"):
            chains.setdefault(line[1:].split(" ", 1)[0], [])
        elif line.startswith("-A "):
            if not our_rules and line.startswith(skip):
                continue
            _, chain, *rest = line.split(" ", 2)
            chains.setdefault(chain, []).append(rest[0] if rest else "")
    return saved


@dataclass
class RestoreText:
    """iptables-restore input being built, one section per table. A chain's rules are
    kept as the specs they were rendered as, and made into "-A" lines only as the text
    is written (`lines`): at 10,000 services the whole text is 46 MB."""

    declare: dict[Table, list[str]] = field(default_factory=lambda: {t: [] for t in TABLE_ORDER})
    edits: dict[Table, list[str]] = field(default_factory=lambda: {t: [] for t in TABLE_ORDER})
    rules: dict[Table, list[tuple[str, Sequence[str]]]] = field(
        default_factory=lambda: {t: [] for t in TABLE_ORDER})
    delete: dict[Table, list[str]] = field(default_factory=lambda: {t: [] for t in TABLE_ORDER})

    def write_chain(self, table: Table, chain: str, specs: Sequence[str]) -> None:
        """Declaring a chain creates it, or flushes it if it exists."""
        self.declare[table].append(f":{chain} - [0:0]")
        if specs:
            self.rules[table].append((chain, specs))

    def remove_chain(self, table: Table, chain: str) -> None:
        # Flushed first (declared), deleted last: by then nothing refers to it.
        self.declare[table].append(f":{chain} - [0:0]")
        self.delete[table].append(f"-X {chain}")

    def _tables(self) -> list[Table]:
        # A chain's rules come with its declaration: those three say whether a table has any.
        return [t for t in TABLE_ORDER if self.declare[t] or self.edits[t] or self.delete[t]]

    def operations(self) -> int:
        return sum(len(self.declare[t]) + len(self.edits[t]) + len(self.delete[t])
                   + sum(len(specs) for _, specs in self.rules[t]) for t in TABLE_ORDER)

    def line_count(self) -> int:
        """Lines of the text: the operations, and each table's header and COMMIT."""
        return self.operations() + 2 * len(self._tables())

    def lines(self) -> Iterator[str]:
        """The text's lines, made one at a time."""
        for table in self._tables():
            yield f"*{table.value}"
            yield from self.declare[table]
            yield from self.edits[table]
            for chain, specs in self.rules[table]:
                head = f"-A {chain} "
                for spec in specs:
                    yield head + spec
            yield from self.delete[table]
            yield "COMMIT"

    def render(self) -> str:
        """The text whole; "" when there is nothing to do."""
        return "".join(f"{line}\n" for line in self.lines())


def cleanup_restore(kernel: Saved, owned: Callable[[str], bool] = ours) -> RestoreText:
    """Remove every chain `owned` names (by default every chain of ours) and every rule
    elsewhere that jumps to one; nothing else. The IPVS mode, removing the iptables
    mode's leftovers, owns all `SPX-` chains but its own `SPX-IPVS-` ones."""
    text = RestoreText()
    for table in TABLE_ORDER:
        for chain, specs in kernel.get(table, {}).items():
            if owned(chain):
                text.remove_chain(table, chain)
            else:
                text.edits[table].extend(
                    f"-D {chain} {s}" for s in specs if owned(target_of(s) or ""))
    return text
