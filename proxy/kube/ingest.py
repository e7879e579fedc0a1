"""Feeding API objects into the model: decode, remember what was skipped, apply.

The watch layer and `explain` both go through here, so an object means the same thing
whichever way it arrived. An object that no longer decodes is treated as gone (its
skip record says why): stale rules for an object we can no longer read would be a
guess, and the record makes the removal visible.

Whatever is skipped is logged once, when an object's records change (not again when
the same object comes back at a relist): one line per object, however much of it was
bad, naming the first problem and the count per reason.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from proxy.kube import identity
from proxy.kube.decode import (
    Decoded,
    decode_endpoint_slice,
    decode_endpoints,
    decode_node,
    decode_service,
)
from proxy.model import skips as why
from proxy.model.skips import Skip
from proxy.model.tracker import ClusterModel

log = logging.getLogger(__name__)

T = TypeVar("T")


class EndpointsSource(enum.Enum):
    ENDPOINT_SLICES = "endpointslices"
    ENDPOINTS = "endpoints"


KINDS = ("Service", "EndpointSlice", "Endpoints", "Node")


def _name(obj: dict[str, Any]) -> tuple[str, str]:
    """The key the object is kept and recorded under. One without a usable name gets the
    reflector's key for it (identity.py), so that its deletion, found by a relist,
    removes its skip record."""
    found = identity.key(obj)
    if found is None:
        return identity.unkeyed_key(obj)
    return found[0] or "default", found[1]


def _record(model: ClusterModel, kind: str, namespace: str, name: str,
            skips: Sequence[Skip]) -> None:
    if model.set_skips(kind, namespace, name, skips) and skips:
        counts = Counter(s.reason for s in skips)
        log.warning("input skipped", extra={
            "kind": kind, "object": f"{namespace}/{name}", "first": str(skips[0]),
            "skipped": ", ".join(f"{r} x{n}" for r, n in sorted(counts.items()))})


def apply_object(
    model: ClusterModel, obj: Any, source: EndpointsSource = EndpointsSource.ENDPOINT_SLICES
) -> bool:
    """Apply an added or modified object. False when its kind is not one we consume."""
    if not isinstance(obj, dict):
        _record(model, "?", "", "", [Skip("?", "", "", why.MALFORMED, "not an object")])
        return False
    kind = obj.get("kind")
    namespace, name = _name(obj)
    if kind == "Service":
        _replace(model, kind, namespace, name, decode_service(obj),
                 model.apply_service, model.delete_service)
    elif kind == "EndpointSlice" and source is EndpointsSource.ENDPOINT_SLICES:
        _replace(model, kind, namespace, name, decode_endpoint_slice(obj),
                 model.apply_slice, model.delete_slice)
    elif kind == "Endpoints" and source is EndpointsSource.ENDPOINTS:
        slices, skips = decode_endpoints(obj)
        _record(model, kind, namespace, name, skips)
        model.apply_endpoints(namespace, name, slices or ())
    elif kind == "Node":
        node, skips = decode_node(obj)
        _record(model, kind, "", _name(obj)[1], skips)
        if node is not None:
            model.set_node(node)
    else:
        return False
    return True


def _replace(model: ClusterModel, kind: str, namespace: str, name: str,
             decoded: Decoded[T], apply: Callable[[T], None],
             delete: Callable[[str, str], None]) -> None:
    """Record what decoding skipped, then apply the object, or delete it when it did not
    decode (module docstring)."""
    value, skips = decoded
    _record(model, kind, namespace, name, skips)
    if value is None:
        delete(namespace, name)
    else:
        apply(value)


def delete_object(model: ClusterModel, kind: str, namespace: str, name: str) -> None:
    model.set_skips(kind, namespace, name, ())
    if kind == "Service":
        model.delete_service(namespace, name)
    elif kind == "EndpointSlice":
        model.delete_slice(namespace, name)
    elif kind == "Endpoints":
        model.delete_endpoints(namespace, name)
