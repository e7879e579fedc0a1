"""The nftables data plane's input marks (what they are: marks.py) over time: those the
kernel lacks added when the agent is idle, a part at a time (`_write_marks`), and
another build's, which a restart that wrote nothing left in place
(restart_steps.py), deleted a part at a time while idle, or all of them before any
sync writes (`_delete_marks_aside`).

`NftablesDataPlane` (apply.py) has these as a mixin, `MarkSteps`, beside the restart's
steps; what they know of a family is its `NftFamily` (restart_steps.py).
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Protocol

from proxy.dataplane.base import ApplyError
from proxy.dataplane.nftables.expressions import Unencodable
from proxy.dataplane.nftables.marks import marks_for
from proxy.dataplane.nftables.objects import Key, Value
from proxy.dataplane.nftables.readback import key_parts
from proxy.dataplane.nftables.render import FINGERPRINTS, OUR_TABLES, table_family
from proxy.dataplane.nftables.restart import base_sets
from proxy.dataplane.nftables.restart_steps import NftFamily
from proxy.dataplane.nftables.runner import NftError, NftRunner
from proxy.dataplane.nftables.transaction import KeptPort, Script, element_groups
from proxy.model.types import Family

log = logging.getLogger("proxy.dataplane.nftables.apply")  # the mode's one logger
# Input marks per part (`_write_marks`), each ~9 ms of work at 100,000 services (all of
# them: 4.4 s), which is what a change arriving meanwhile waits at most: with parts of
# 1,000, the first changes after a start at 100,000 waited 43 and 47 ms.
MARKS_PER_PART = 200
# Another build's input marks deleted per part after a restart (`_delete_marks_aside`):
# what a change arriving meanwhile waits for at most. At 20,000 services, parts of 2,000
# took 21 ms (median; 38 ms at most), of 1,000 12 ms (42 ms), as long as a part above.
MARKS_ASIDE_PER_PART = 1_000


class _Plane(Protocol):
    """What the steps use of the data plane (apply.NftablesDataPlane)."""

    runner: NftRunner
    _families: dict[Family, NftFamily]

    def _run(self, fam: NftFamily, text: str | Script, full: bool) -> str: ...

    def _delete_marks_aside(self, fam: NftFamily, part: int | None) -> None: ...


class MarkSteps:
    """The input marks' steps, as methods of the data plane (`_Plane`)."""

    def _write_marks(self: _Plane, fam: NftFamily) -> None:
        """Input marks the kernel lacks (marks.py), for ports whose rules are what their
        input alone renders, when the agent is idle: MARKS_PER_PART ports per call and
        transaction, so that a change waits for one part at most; `fam.marks_todo`
        holds what is left for the next call. A part refused is logged, and the rest
        waits for the next interval: a restart renders the ports still without marks."""
        state, last, ctx = fam.kept, fam.last, fam.context
        if state is None or last is None or ctx is None:
            fam.marks_todo = []
            return
        if not fam.marks_todo:
            fam.marks_todo = [k for k, kept in state.ports.items() if _unmarked(kept)]
        part = fam.marks_todo[-MARKS_PER_PART:]
        del fam.marks_todo[-MARKS_PER_PART:]
        # A sync since the list was made may have changed or removed some of them.
        todo = [k for k in part if _unmarked(state.ports.get(k))]
        if not todo:
            return
        started = time.perf_counter()
        of = marks_for(ctx, state.shards).of
        new = {k: of(last.ports[k]) for k in todo}
        elements = [(state.ports[k].table, FINGERPRINTS, m, ()) for k, m in new.items()]
        try:
            self.runner.send(Script(functools.partial(element_groups, "add", elements),
                                    table_family(fam.family)), fam.family, OUR_TABLES)
        except (NftError, Unencodable) as exc:
            log.warning("could not add input marks; a restart will render those ports",
                        extra={"family": fam.family.label, "ports": len(new),
                               "error": str(exc)[-500:]})
            fam.marks_todo = []  # tried again at the next interval: one warning each
            return
        for key, mark in new.items():
            state.ports[key] = state.ports[key].with_mark(mark)
            state.owners.add((state.ports[key].table, FINGERPRINTS, mark), key, ())
        log.debug("input marks added", extra={
            "family": fam.family.label, "ports": len(new), "left": len(fam.marks_todo),
            "seconds": round(time.perf_counter() - started, 3)})
        fam.marks_added += len(new)
        if not fam.marks_todo:  # a restart now keeps every port unrendered
            log.log(logging.INFO - 2, "input marks added for every port", extra={  # -v 2
                "family": fam.family.label, "ports": fam.marks_added})
            fam.marks_added = 0

    def _delete_marks_aside(self: _Plane, fam: NftFamily, part: int | None) -> None:
        """`part` more of the marks a restart left (`fam.marks_aside`; all: None), in one
        transaction. A refusal (one deleted by hand) is logged, and leaves the next sync
        full (ApplyError), which deletes what nobody claims."""
        assert fam.state is not None
        types = {t: key for t, name, key, _is_map in base_sets(fam.state.bases)
                 if name == FINGERPRINTS}
        elements: list[tuple[str, str, Key, Value]] = []
        while fam.marks_aside and (part is None or len(elements) < part):
            table, raws = next(iter(fam.marks_aside.items()))
            take = len(raws) if part is None else min(len(raws), part - len(elements))
            elements += [(table, FINGERPRINTS, key_parts(fam.family, types[table], r), ())
                         for r in raws[-take:]]
            del raws[-take:]
            if not raws:
                del fam.marks_aside[table]
        try:
            self._run(fam, Script(functools.partial(element_groups, "delete", elements),
                                  table_family(fam.family)), False)
        except ApplyError:
            fam.marks_aside = {}
            raise
        if not fam.marks_aside:
            log.log(logging.INFO - 2, "another build's input marks deleted", extra={  # -v 2
                "family": fam.family.label})

    def _marks_aside_parts(self: _Plane) -> bool:
        """A part (MARKS_ASIDE_PER_PART) of each family's marks a restart left to delete;
        whether any is left after it."""
        for fam in self._families.values():
            if fam.marks_aside and fam.state is not None:
                self._delete_marks_aside(fam, MARKS_ASIDE_PER_PART)
            elif fam.state is None:
                fam.marks_aside = {}
        return any(fam.marks_aside for fam in self._families.values())


def _unmarked(kept: KeptPort | None) -> bool:
    """A kept port whose input mark the kernel lacks, which it may have."""
    return kept is not None and kept.from_input and not kept.input_mark
