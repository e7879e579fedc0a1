"""python-iptables (`iptc`, libiptc) as the writer, for legacy hosts only: the applier
selected with `applier="iptc"`.

It executes the very restore text the data plane renders (our subset: chain
declarations, -A, -I N, -D, -X, COMMIT) through libiptc instead of the
iptables-restore binary, so rendering, partial syncs and their tests are shared.
Each table's changes are cached by libiptc and committed at COMMIT; any failure drops
the cache, so the table keeps its previous rules, as with iptables-restore. Reading
(`save`) still uses iptables-legacy-save.

Why it is not the default: libiptc, like legacy iptables-restore, replaces the whole
table on every commit, and building each rule through python-iptables costs Python
and ctypes work per attribute: see docs/speed.md's iptables table for the numbers. It
cannot program nf_tables at all.
"""

from __future__ import annotations

import shlex
import shutil
from typing import Any

from proxy.dataplane.xtables.restore_runner import (
    Backend,
    IptablesRunner,
    RestoreError,
    RestoreInput,
    lines_of,
)
from proxy.model.types import Family


def _iptc() -> Any:
    import iptc  # needs libiptc: only loaded when this applier is chosen

    return iptc


class IptcRunner(IptablesRunner):
    def __init__(self, family: Family, backend: Backend | None = None,
                 lock_wait: float = 5.0) -> None:
        if backend is Backend.NFT:
            raise ValueError("python-iptables programs legacy tables only")
        super().__init__(family, Backend.LEGACY, lock_wait)
        self.restore_cmd = "python-iptables"

    def available(self) -> bool:
        try:
            self._table("nat")
        except (ImportError, OSError, _iptc().IPTCError):
            return False
        return shutil.which(self.save_cmd) is not None

    def _table(self, name: str) -> Any:
        iptc = _iptc()
        table = (iptc.Table if self.family is Family.V4 else iptc.Table6)(name, autocommit=False)
        # Tables are per-process singletons whose handle (a netlink-less raw socket) was
        # opened in whichever namespace first asked: reopen it here, dropping nothing
        # (autocommit is off, so there is nothing pending to commit).
        table.refresh()
        return table

    def restore(self, text: RestoreInput, *, noflush: bool = True,
                counters: bool = False) -> None:
        if not noflush:
            raise ValueError("the iptc applier only edits (--noflush semantics)")
        iptc = _iptc()
        table: Any = None
        number, current = 0, None
        try:
            for line in lines_of(text):
                number, current = number + 1, line  # kept past the loop: the failing line
                if not line or line.startswith("#"):
                    continue
                if line.startswith("*"):
                    table = self._table(line[1:])
                elif line == "COMMIT":
                    table.commit()
                    table = None
                elif line.startswith(":"):
                    name = line[1:].split(" ", 1)[0]
                    if table.is_chain(name):
                        table.flush_entries(name)
                    else:
                        table.create_chain(name)
                else:
                    self._command(iptc, table, line)
        except (iptc.IPTCError, iptc.XTablesError, ValueError, AttributeError, TypeError,
                IndexError) as exc:
            if table is not None:
                table.refresh()  # drop whatever this table had cached
            raise RestoreError(f"python-iptables: line {number} failed: {exc}", number,
                               current) from exc

    def _command(self, iptc: Any, table: Any, line: str) -> None:
        op, chain_name, *rest = line.split(" ", 2)
        if op == "-X":
            table.delete_chain(chain_name)
            return
        spec = rest[0] if rest else ""
        chain = iptc.Chain(table, chain_name)
        if op == "-I":
            position, _, spec = spec.partition(" ")
            chain.insert_rule(self._rule(iptc, spec), int(position) - 1)
        elif op == "-A":
            chain.append_rule(self._rule(iptc, spec))
        elif op == "-D":
            chain.delete_rule(self._rule(iptc, spec))
        else:
            raise ValueError(f"unsupported command {op}")

    def _rule(self, iptc: Any, spec: str) -> Any:
        """One rule spec, as our renderer (or iptables-save) writes it, as an iptc.Rule."""
        rule = iptc.Rule() if self.family is Family.V4 else iptc.Rule6()
        tokens = shlex.split(spec)
        module: Any = None
        has_target = False
        negate = False
        i = 0
        while i < len(tokens):
            token = tokens[i]
            if token == "!":
                negate = True
                i += 1
                continue
            bang = "!" if negate else ""
            negate = False
            if token in ("-s", "-d", "-p", "-i", "-o"):
                field = {"-s": "src", "-d": "dst", "-p": "protocol", "-i": "in_interface",
                         "-o": "out_interface"}[token]
                setattr(rule, field, bang + tokens[i + 1])
                i += 2
            elif token == "-m":
                module = rule.create_match(tokens[i + 1])
                i += 2
            elif token in ("-j", "-g"):
                module = rule.create_target(tokens[i + 1], goto=token == "-g")
                has_target = True
                i += 2
            elif token.startswith("--") and module is not None:
                values: list[str] = []
                i += 1
                while i < len(tokens) and not tokens[i].startswith("-") and tokens[i] != "!":
                    values.append(tokens[i])
                    i += 1
                module.set_parameter(token[2:], bang + " ".join(values))
            else:
                raise ValueError(f"cannot translate {token!r} in {spec!r}")
        if not has_target:
            rule.create_target("")  # a rule that only counts (falls through)
        return rule
