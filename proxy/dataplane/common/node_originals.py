"""What the node held before sliceproxy changed its settings, and what giving it back means
(pure; the file is node_files.py's, the writes node_setup.py's).

The `--init-only` step notes, for each setting it changes, the node's own value the first
time (`original`) and what it wrote last (`ours`). A later run that changes the setting
again keeps the first `original`: it is what the node had before sliceproxy came. A
setting the step finds already as kube-proxy sets it (a node switched from kube-proxy,
which set it first) is not changed, so not noted: nothing is given back for it.

`--restore-node-settings` (uninstall) writes `original` back only where the node still
holds `ours`: a value someone set since (an operator, the next service proxy) is theirs.
"""

from __future__ import annotations

import enum
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

VERSION = 1


@dataclass(frozen=True, slots=True)
class Noted:
    original: int  # the node's value before sliceproxy first changed it
    ours: int  # what sliceproxy wrote last


Record = dict[str, Noted]  # setting path (node_settings.Setting.path) -> what was noted


def noted(record: Mapping[str, Noted], changes: Iterable[tuple[str, int, int]]) -> Record:
    """`record` with each (path, before, written) change added: a path seen before keeps
    its first original and takes the new value as ours."""
    out = dict(record)
    for path, before, written in changes:
        first = out.get(path)
        out[path] = Noted(before if first is None else first.original, written)
    return out


class Action(enum.Enum):
    RESTORE = "restore"  # the node holds ours: write the original back
    CHANGED_SINCE = "changed since"  # someone else's value now: left alone
    GONE = "gone"  # no such file (its module unloaded: the kernel's default again)
    UNCHANGED = "unchanged"  # ours was the original after all: nothing to write


@dataclass(frozen=True, slots=True)
class Step:
    path: str
    noted: Noted
    current: int | None
    action: Action


def restoration(record: Mapping[str, Noted], current: Mapping[str, int | None]
                ) -> list[Step]:
    """What to do for each noted setting, given what the node holds now; in the reverse of
    the order they were noted (the table size after its hash size, as it went up)."""
    out = []
    for path, n in reversed(list(record.items())):
        now = current.get(path)
        if now is None:
            action = Action.GONE
        elif now != n.ours:
            action = Action.CHANGED_SINCE
        elif now == n.original:
            action = Action.UNCHANGED
        else:
            action = Action.RESTORE
        out.append(Step(path, n, now, action))
    return out


def dumps(record: Mapping[str, Noted]) -> str:
    return json.dumps({"version": VERSION, "settings": {
        path: {"original": n.original, "ours": n.ours} for path, n in record.items()}},
        indent=1) + "\n"


def loads(text: str) -> Record:
    """ValueError when the text is not a record this version wrote."""
    try:
        doc = json.loads(text)
        if doc.get("version") != VERSION:
            raise ValueError(f"version {doc.get('version')!r}, not {VERSION}")
        return {str(path): Noted(int(v["original"]), int(v["ours"]))
                for path, v in doc["settings"].items()}
    except (AttributeError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise ValueError(f"not a node settings record: {exc}") from None
