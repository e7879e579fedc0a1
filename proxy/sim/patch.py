"""PATCH bodies: JSON merge patch (RFC 7386), JSON patch (RFC 6902) and a strategic merge
patch good enough for these types (lists with a merge key are merged by that key,
`$patch: delete|replace` honoured; every other list is replaced, as in a merge patch).
"""

from __future__ import annotations

import copy
from typing import Any

from proxy.sim import errors

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"

# Lists upstream marks `patchStrategy:"merge"`, by path, with their merge key.
MERGE_KEYS: dict[tuple[str, ...], str] = {
    ("spec", "ports"): "port",
    ("metadata", "ownerReferences"): "uid",
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
}


def merge_patch(target: Any, patch: Any) -> Any:
    if not isinstance(patch, dict):
        return patch
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    if not isinstance(patch, dict):
        return patch
    if patch.get("$patch") == "replace":
        return {k: v for k, v in patch.items() if k != "$patch"}
    if patch.get("$patch") == "delete":
        return None
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        sub = (*path, key)
        if value is None:
            out.pop(key, None)
        elif isinstance(value, list) and sub in MERGE_KEYS and isinstance(out.get(key), list):
            out[key] = _merge_list(out[key], value, MERGE_KEYS[sub], sub)
        else:
            merged = strategic_merge_patch(out.get(key), value, sub)
            if merged is None and isinstance(value, dict):
                out.pop(key, None)
            else:
                out[key] = merged
    return out


def _merge_list(current: list[Any], patch: list[Any], merge_key: str,
                path: tuple[str, ...]) -> list[Any]:
    out = list(current)
    for item in patch:
        if not isinstance(item, dict) or merge_key not in item:
            out.append(item)
            continue
        idx = next((i for i, have in enumerate(out)
                    if isinstance(have, dict) and have.get(merge_key) == item[merge_key]), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                out.pop(idx)
        elif idx is None:
            out.append({k: v for k, v in item.items() if k != "$patch"})
        else:
            out[idx] = strategic_merge_patch(out[idx], item, path)
    return out


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise errors.bad_request(f"JSON patch path must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _parent(doc: Any, parts: list[str], op: str) -> tuple[Any, str]:
    cur = doc
    for part in parts[:-1]:
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        elif isinstance(cur, list) and part.isdigit() and int(part) < len(cur):
            cur = cur[int(part)]
        else:
            raise errors.ApiError(422, "Invalid", f"{op} operation does not apply: doc is "
                                  f"missing path: /{'/'.join(parts)}")
    return cur, parts[-1]


def _get(doc: Any, path: str, op: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent, last = _parent(doc, parts, op)
    if isinstance(parent, dict) and last in parent:
        return parent[last]
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent[int(last)]
    raise errors.ApiError(422, "Invalid", f"{op} operation does not apply: doc is missing "
                          f"path: {path}")


def _remove(doc: Any, path: str, op: str) -> Any:
    parent, last = _parent(doc, _pointer(path), op)
    if isinstance(parent, dict) and last in parent:
        return parent.pop(last)
    if isinstance(parent, list) and last.isdigit() and int(last) < len(parent):
        return parent.pop(int(last))
    raise errors.ApiError(422, "Invalid", f"{op} operation does not apply: doc is missing "
                          f"path: {path}")


def _add(doc: Any, path: str, value: Any, op: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent, last = _parent(doc, parts, op)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            if op == "replace":
                parent[int(last)] = value
            else:
                parent.insert(int(last), value)
        else:
            raise errors.ApiError(422, "Invalid", f"{op} operation does not apply: index out "
                                  f"of range: {path}")
    else:
        raise errors.ApiError(422, "Invalid", f"{op} operation does not apply: doc is missing "
                              f"path: {path}")
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    if not isinstance(ops, list):
        raise errors.bad_request("json patch must be a list of operations")
    for raw in ops:
        if not isinstance(raw, dict) or not isinstance(raw.get("op"), str):
            raise errors.bad_request(f"invalid JSON patch operation: {raw!r}")
        op, path = raw["op"], str(raw.get("path", ""))
        if op == "add":
            doc = _add(doc, path, raw.get("value"), op)
        elif op == "remove":
            _remove(doc, path, op)
        elif op == "replace":
            _get(doc, path, op)
            doc = _add(doc, path, raw.get("value"), op)
        elif op == "move":
            value = _remove(doc, str(raw.get("from", "")), op)
            doc = _add(doc, path, value, op)
        elif op == "copy":
            doc = _add(doc, path, copy.deepcopy(_get(doc, str(raw.get("from", "")), op)), op)
        elif op == "test":
            if _get(doc, path, op) != raw.get("value"):
                raise errors.ApiError(422, "Invalid", f"testing value {path} failed: test "
                                      "failed")
        else:
            raise errors.bad_request(f"Unexpected kind: {op}")
    return doc


def apply_patch(content_type: str, current: Any, body: Any) -> Any:
    kind = content_type.split(";", maxsplit=1)[0].strip()
    if kind == MERGE_PATCH:
        return merge_patch(current, body)
    if kind == STRATEGIC_MERGE_PATCH:
        return strategic_merge_patch(current, body)
    if kind == JSON_PATCH:
        return json_patch(current, body)
    raise errors.unsupported_media_type(content_type)
