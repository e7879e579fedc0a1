"""A pure model of `iptables-restore --noflush` for the commands we emit, to check
restore text without a kernel (property tests, dry runs).

It is strict where the kernel is: a rule may only jump to a chain that exists, `-D`
needs an identical rule, `-I` a position inside the chain, `-X` an empty chain nobody
jumps to; each table commits at its COMMIT line, or not at all.
"""

from __future__ import annotations

import copy
import shlex
from collections.abc import Iterator

from proxy.dataplane.xtables.restore_runner import Backend, RestoreError, RestoreInput, whole
from proxy.dataplane.xtables.saved import BUILTIN_CHAINS, Saved, Table, target_of
from proxy.model.types import Family

STANDARD_TARGETS = frozenset({
    "ACCEPT", "DROP", "RETURN", "REJECT", "DNAT", "SNAT", "MASQUERADE", "MARK", "LOG",
})


class SimulationError(Exception):
    def __init__(self, line: int, text: str, why: str) -> None:
        super().__init__(f"line {line}: {why}: {text}")
        self.line = line
        self.text = text


def restore(kernel: Saved, text: str) -> None:
    """Apply `text` to `kernel` in place, table by table, as iptables-restore would."""
    working: dict[str, list[str]] | None = None
    table: Table | None = None
    for number, line in enumerate(text.splitlines(), 1):
        if not line or line.startswith("#"):
            continue
        if line.startswith("*"):
            table = Table(line[1:])
            working = copy.deepcopy(kernel.get(table, {}))
            for chain in BUILTIN_CHAINS:
                if chain in _builtins(table):
                    working.setdefault(chain, [])
            continue
        if working is None or table is None:
            raise SimulationError(number, line, "outside a table")
        if line == "COMMIT":
            kernel[table] = working
            working, table = None, None
            continue
        _command(working, number, line)
    if working is not None:
        raise SimulationError(0, "", "missing COMMIT")


def _builtins(table: Table) -> frozenset[str]:
    if table is Table.NAT:
        return frozenset({"PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"})
    return frozenset({"INPUT", "FORWARD", "OUTPUT"})


def _command(chains: dict[str, list[str]], number: int, line: str) -> None:
    def fail(why: str) -> SimulationError:
        return SimulationError(number, line, why)

    if line.startswith(":"):
        chains[line[1:].split(" ", 1)[0]] = []
        return
    op, chain, *rest = line.split(" ", 2)
    if chain not in chains:
        raise fail(f"no chain {chain}")
    spec = rest[0] if rest else ""
    if op == "-X":
        if chains[chain] or chain in BUILTIN_CHAINS:
            raise fail("chain not empty or built in")
        if any(target_of(s) == chain for rules in chains.values() for s in rules):
            raise fail("chain still referenced")
        del chains[chain]
        return
    if op == "-I":
        position, _, spec = spec.partition(" ")
        index = int(position) - 1
        if not 0 <= index <= len(chains[chain]):
            raise fail("index of insertion too big")
    target = target_of(spec)
    if target is not None and target not in STANDARD_TARGETS and target not in chains:
        raise fail(f"no chain/target {target}")
    shlex.split(spec)  # quoting must be balanced
    if op == "-A":
        chains[chain].append(spec)
    elif op == "-I":
        chains[chain].insert(index, spec)
    elif op == "-D":
        try:
            chains[chain].remove(spec)
        except ValueError:
            raise fail("no such rule") from None
    else:
        raise fail(f"unsupported command {op}")


def save_text(kernel: Saved) -> str:
    """`kernel` printed the way iptables-save prints it (chains sorted, as legacy does)."""
    out: list[str] = []
    for table in sorted(kernel, key=lambda t: t.value):
        out.append(f"*{table.value}")
        chains = kernel[table]
        builtin = sorted(c for c in chains if c in BUILTIN_CHAINS)
        out.extend(f":{c} ACCEPT [0:0]" for c in builtin)
        out.extend(f":{c} - [0:0]" for c in sorted(c for c in chains if c not in BUILTIN_CHAINS))
        out.extend(f"-A {c} {spec}" for c in [*builtin, *sorted(set(chains) - set(builtin))]
                   for spec in chains[c])
        out.append("COMMIT")
    return "\n".join(out) + "\n"


class SimulatedRunner:
    """An `IptablesRunner` stand-in over a simulated kernel: for property tests and dry
    runs. `fail_on` makes any restore containing that text fail, as a refused line would."""

    def __init__(self, family: Family, kernel: Saved | None = None,
                 backend: Backend = Backend.LEGACY) -> None:
        self.family = family
        self.backend = backend
        self.kernel: Saved = kernel if kernel is not None else {}
        self.restore_cmd = f"simulated-{family.label}-restore"
        self.save_cmd = f"simulated-{family.label}-save"
        self.fail_on: str | None = None
        self.restores: list[str] = []

    def restore(self, script: RestoreInput, *, noflush: bool = True,
                counters: bool = False) -> None:
        text = whole(script)
        self.restores.append(text)
        if self.fail_on is not None and self.fail_on in text:
            line = next(i for i, t in enumerate(text.splitlines(), 1) if self.fail_on in t)
            raise RestoreError("simulated refusal", line, text.splitlines()[line - 1])
        try:
            restore(self.kernel, text)
        except SimulationError as exc:
            raise RestoreError(str(exc), exc.line, exc.text) from exc

    def save(self, table: str | None = None) -> str:
        if table is None:
            return save_text(self.kernel)
        return save_text({t: c for t, c in self.kernel.items() if t.value == table})

    def save_lines(self) -> Iterator[str]:
        yield from self.save().splitlines()

    def available(self) -> bool:
        return True
