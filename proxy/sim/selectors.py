"""Label and field selectors with the apimachinery grammar and matching rules.

Label: `a=b`, `a==b`, `a!=b`, `a in (x,y)`, `a notin (x,y)`, `a`, `!a`, `a>1`, `a<1`, comma
separated (all must hold). As upstream, `!=` and `notin` also match objects without the key.
Field: `metadata.name` and `metadata.namespace` with `=`, `==`, `!=`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from proxy.sim.errors import ApiError, bad_request

_KEY = re.compile(r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                  r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if not present:
            return False
        try:  # gt / lt compare integers; a non-integer label never matches
            have, want = int(str(value)), int(self.values[0])
        except ValueError:
            return False
        return have > want if self.op == "gt" else have < want


LabelSelector = tuple[Requirement, ...]


def _parse_error(text: str, why: str) -> ApiError:
    return bad_request(f"unable to parse requirement: {why} (in labelSelector {text!r})")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    parts.append("".join(cur))
    return parts


_SET_RE = re.compile(r"^(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<vals>[^()]*)\)$")
_EQ_RE = re.compile(r"^(?P<key>[^=!<>\s]+)\s*(?P<op>==|!=|=|>|<)\s*(?P<val>\S*)$")


def parse_label_selector(text: str | None) -> LabelSelector:
    if not text or not text.strip():
        return ()
    reqs: list[Requirement] = []
    for raw in _split_top(text):
        part = raw.strip()
        if not part:
            raise _parse_error(text, "found '', expected: identifier")
        if m := _SET_RE.match(part):
            key = m["key"]
            vals = tuple(v.strip() for v in m["vals"].split(",")) if m["vals"].strip() else ()
            if not vals:
                raise _parse_error(text, f"for 'in', 'notin' operators, values set can't be "
                                         f"empty (key {key!r})")
            req = Requirement(key, m["op"], vals)
        elif m := _EQ_RE.match(part):
            op = {"==": "=", "=": "=", "!=": "!=", ">": "gt", "<": "lt"}[m["op"]]
            val = m["val"]
            if op in ("gt", "lt") and not re.fullmatch(r"-?\d+", val):
                raise _parse_error(text, f"for 'Gt', 'Lt' operators, the value must be an "
                                         f"integer (key {m['key']!r})")
            req = Requirement(m["key"], op, (val,))
        elif part.startswith("!"):
            req = Requirement(part[1:].strip(), "!")
        elif re.fullmatch(r"\S+", part):
            req = Requirement(part, "exists")
        else:
            raise _parse_error(text, f"can't understand {part!r}")
        if not _KEY.match(req.key) or len(req.key.rsplit("/", 1)[-1]) > 63:
            raise _parse_error(text, f"invalid label key {req.key!r}")
        for v in req.values:
            if req.op not in ("gt", "lt") and (len(v) > 63 or not _VALUE.match(v)):
                raise _parse_error(text, f"invalid label value: {v!r}")
        reqs.append(req)
    return tuple(reqs)


def labels_match(selector: LabelSelector, obj: Mapping[str, Any]) -> bool:
    if not selector:
        return True
    meta = obj.get("metadata") or {}
    labels = meta.get("labels") or {}
    return all(r.matches(labels) for r in selector)


FIELDS = ("metadata.name", "metadata.namespace")
# Kinds with field-label conversions of their own (upstream AddFieldLabelConversionFunc)
# accept more fields, and word a refusal differently from the generic one.
OWN_FIELDS: dict[str, tuple[str, ...]] = {
    "Node": ("spec.unschedulable",),
    "Namespace": ("status.phase",),
}


@dataclass(frozen=True, slots=True)
class FieldRequirement:
    field: str
    equal: bool
    value: str


FieldSelector = tuple[FieldRequirement, ...]


def _unescape(value: str) -> str:
    return re.sub(r"\\(.)", r"\1", value)


def parse_field_selector(text: str | None, kind: str | None = None) -> FieldSelector:
    """`kind` decides which fields exist beyond metadata.name/namespace."""
    if not text or not text.strip():
        return ()
    out: list[FieldRequirement] = []
    for part in re.split(r"(?<!\\),", text):
        part = part.strip()
        m = re.match(r"^([^=!]+?)\s*(==|!=|=)\s*(.*)$", part)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{part}'")
        name, op, value = m.group(1).strip(), m.group(2), _unescape(m.group(3).strip())
        if name not in FIELDS + OWN_FIELDS.get(kind or "", ()):
            if kind in OWN_FIELDS:
                raise bad_request(f"field label not supported: {name}")
            raise bad_request(f'"{name}" is not a known field selector: only '
                              '"metadata.name", "metadata.namespace"')
        out.append(FieldRequirement(name, op != "!=", value))
    return tuple(out)


def fields_match(selector: FieldSelector, obj: Mapping[str, Any]) -> bool:
    if not selector:
        return True
    meta = obj.get("metadata") or {}
    spec, status = obj.get("spec") or {}, obj.get("status") or {}
    values = {"metadata.name": meta.get("name") or "", "metadata.namespace":
              meta.get("namespace") or "",
              "spec.unschedulable": "true" if spec.get("unschedulable") else "false",
              "status.phase": str(status.get("phase") or "")}
    return all((values[r.field] == r.value) == r.equal for r in selector)


def matcher(label: LabelSelector, field: FieldSelector) -> Callable[[Mapping[str, Any]], bool]:
    def match(obj: Mapping[str, Any]) -> bool:
        return labels_match(label, obj) and fields_match(field, obj)

    return match
