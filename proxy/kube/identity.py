"""Who an API object is, and which of its revision strings can be trusted, whatever the
server sent.

A real API server always sends `metadata` as an object with string `name`, `namespace`
(namespaced kinds), `uid` and `resourceVersion`. A broken or hostile one may send
`metadata: []`, a number for a name, a list for a resourceVersion. Nothing here raises
on such input: the reflector must go on listing and watching, and the decoder records
why the object was skipped. The reflector and ingest share these functions so that an
object is known under the same key on the way in and on the way out (a deletion found
by a relist must remove the skip record the object left).
"""

from __future__ import annotations

import hashlib
import re
import sys
from collections.abc import Mapping
from typing import Any

import orjson

ObjectKey = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped

# Names of objects that have none we can use: "?" and a hash of their content. No API
# name starts with "?" (DNS subdomains and labels start with an alphanumeric), so these
# never meet a real object's key.
UNKEYED_PREFIX = "?"

# A resourceVersion goes back to the server in a query (the watch's resume point) and is
# compared as an integer when it is one: only short printable ASCII is used. etcd's are
# decimal int64s (at most 19 digits); anything else a server sends is opaque to us.
_VERSION = re.compile(r"[\x21-\x7e]{1,256}")
_DECIMAL = re.compile(r"[0-9]{1,64}")


def key(obj: Any) -> ObjectKey | None:
    """(namespace, name) from metadata, or None when the object has no usable one:
    not an object, metadata not an object, a name that is missing or not a string, or
    a namespace that is not a string. A missing namespace is "" (as given: the decoder
    decides what that means for a namespaced kind)."""
    if not isinstance(obj, dict):
        return None
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        return None
    name, namespace = meta.get("name"), meta.get("namespace")
    if not isinstance(name, str) or not name:
        return None
    if namespace is None:
        namespace = ""
    if not isinstance(namespace, str):
        return None
    # Every object of a namespace shares its name (the keys of 100,000 objects held
    # as many copies).
    return sys.intern(namespace), name


def unkeyed_key(obj: Any) -> ObjectKey:
    """The key of an object `key()` refuses: ("", "?" + a hash of its content without
    its resourceVersion). The same content gets the same key at every list, so an odd
    object listed again changes nothing, and one the server stops listing is deleted
    like any other."""
    content = obj
    if isinstance(obj, dict) and isinstance(obj.get("metadata"), dict):
        content = {**obj, "metadata": {k: v for k, v in obj["metadata"].items()
                                       if k != "resourceVersion"}}
    try:
        data = orjson.dumps(content, option=orjson.OPT_SORT_KEYS)
    except (TypeError, orjson.JSONEncodeError):  # not from JSON: still a key, never a crash
        data = repr(content).encode("utf-8", "replace")
    return "", UNKEYED_PREFIX + hashlib.sha256(data).hexdigest()[:16]


def object_key(obj: Any) -> ObjectKey:
    found = key(obj)
    return found if found is not None else unkeyed_key(obj)


def version(value: Any) -> str:
    """A resourceVersion we can resume from and compare: "" for anything else."""
    return value if isinstance(value, str) and _VERSION.fullmatch(value) else ""


def decimal(value: str | None) -> int | None:
    """A version as an integer, if it is plain ASCII decimal ("²".isdigit() is true,
    and int("١٢") is 12: neither is a revision)."""
    return int(value) if value is not None and _DECIMAL.fullmatch(value) else None


def meta_version(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    return version(meta.get("resourceVersion")) if isinstance(meta, Mapping) else ""


def meta_uid(obj: Any) -> str:
    meta = obj.get("metadata") if isinstance(obj, Mapping) else None
    uid = meta.get("uid") if isinstance(meta, Mapping) else None
    # A uid is only compared for equality; a long one is cut, not trusted whole.
    return uid[:256] if isinstance(uid, str) else ""
