"""The simulator's storage: objects, one global resourceVersion, the event history that
watches resume from, and compaction.

Like etcd behind the API server: every write gets the next integer revision; the history
keeps (type, object, previous object) per revision so a watch can resume after any
retained revision and a paged list can be served as of its first page's revision.
Compaction drops history; resuming or continuing from before it is `410 Expired`.

Single-threaded by design: all calls come from the server's event loop (the test harness
hops onto it), so there are no locks. Stored objects are never mutated after commit;
readers get copies.
"""

from __future__ import annotations

import base64
import binascii
import logging
import secrets
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, TypeVar, cast

import orjson

from proxy.sim import errors, strategy, v1beta1
from proxy.sim.allocators import DEFAULT_V4_RANGE, DEFAULT_V6_RANGE, Allocators
from proxy.sim.errors import ApiError
from proxy.sim.resources import LATEST, NAMESPACES, SERVICES, ApiSurface, ResourceType
from proxy.sim.selectors import FieldSelector, LabelSelector, matcher
from proxy.sim.validation import validate

log = logging.getLogger("proxy.sim.store")

Obj = dict[str, Any]
T = TypeVar("T")

ADDED, MODIFIED, DELETED = "ADDED", "MODIFIED", "DELETED"
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public", "kube-node-lease")

EXPIRED_LIST = "The resourceVersion for the provided list is too old."
INCONSISTENT_CONTINUE = (
    "The provided continue parameter is too old to display a consistent list result. You "
    "can start a new list without the continue parameter, or use the continue token in this "
    "response to retrieve the remainder of the results. Continuing with the provided token "
    "results in an inconsistent list - objects that were created, modified, or deleted "
    "between the time the first chunk was returned and now may show up in the list."
)


def copy(obj: T) -> T:
    """Deep copy of JSON data (orjson round trip: several times faster than deepcopy)."""
    return cast(T, orjson.loads(orjson.dumps(obj)))


def now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def key_of(rt: ResourceType, namespace: str | None, name: str) -> str:
    return f"{namespace}/{name}" if rt.namespaced else name


def _with_rv(obj: Obj, rv: int) -> Obj:
    out = dict(obj)
    out["metadata"] = {**obj["metadata"], "resourceVersion": str(rv)}
    return out


@dataclass(frozen=True, slots=True)
class Event:
    type: str  # ADDED, MODIFIED, DELETED
    rv: int
    rt: ResourceType
    key: str
    obj: Obj  # the new state; for DELETED the last state, stamped with the delete's rv
    prev: Obj | None  # the state before (None for ADDED)

    @property
    def namespace(self) -> str:
        return str(self.obj["metadata"].get("namespace") or "")


@dataclass(slots=True)
class ListResult:
    items: list[Obj]
    resource_version: int
    continue_token: str | None
    remaining: int | None


def encode_continue(rv: int, start: str) -> str:
    raw = orjson.dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start})
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_continue(token: str) -> tuple[int, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        data = orjson.loads(raw)
        if not isinstance(data, dict) or data.get("v") != "meta.k8s.io/v1":
            raise ValueError("incorrect encoded start resourceVersion (version meta.k8s.io/v1 "
                             "required)")
        rv, start = data.get("rv"), data.get("start")
        if not isinstance(rv, int) or rv == 0 or not isinstance(start, str) or not start:
            raise ValueError("incorrect encoded start resourceVersion (version meta.k8s.io/v1 "
                             "required)")
        return rv, start
    except (ValueError, binascii.Error, orjson.JSONDecodeError) as exc:
        raise errors.bad_request(f"invalid continue token: continue key is not valid: "
                                 f"{exc}") from None


def parse_rv(value: str, what: str = "resource version") -> int:
    try:
        rv = int(value)
        if rv < 0:
            raise ValueError
        return rv
    except ValueError:
        raise errors.bad_request(f'invalid {what}: strconv.ParseUint: parsing "{value}": '
                                 "invalid syntax") from None


Subscriber = Callable[[Event], None]


class Store:
    def __init__(self, *, validate: bool = True, history_limit: int = 100_000,
                 service_cidr: str = DEFAULT_V4_RANGE, service_cidr_v6: str = DEFAULT_V6_RANGE,
                 node_port_range: tuple[int, int] = (30000, 32767),
                 surface: ApiSurface = LATEST, watch_cache: bool = True) -> None:
        self.validate = validate
        # A real API server answers `resourceVersion=0` lists from its watch cache, whole
        # (`limit` ignored, no continue token); with --watch-cache=false they go to etcd,
        # which pages them. Both exist; the default is the default.
        self.watch_cache = watch_cache
        self.surface = surface
        self.history_limit = history_limit
        self.rv = 0
        self.compacted_rv = 0  # history at or below this revision is gone
        self._objects: dict[str, dict[str, Obj]] = {rt.plural: {} for rt in surface.types}
        self._history: deque[Event] = deque()
        self._subscribers: list[Subscriber] = []
        self.alloc = Allocators(service_cidr, service_cidr_v6, node_port_range)
        for ns in DEFAULT_NAMESPACES:
            self.create(NAMESPACES, None, {"metadata": {"name": ns}})

    # ---- reading -------------------------------------------------------------------

    def get(self, rt: ResourceType, namespace: str | None, name: str) -> Obj:
        obj = self._objects[rt.plural].get(key_of(rt, namespace, name))
        if obj is None:
            raise errors.not_found(rt, name)
        return obj

    def items(self, rt: ResourceType) -> Iterator[Obj]:
        return iter(self._objects[rt.plural].values())

    def state_at(self, rt: ResourceType, rv: int) -> dict[str, Obj]:
        """The objects of one type as they were at revision `rv` (undoing later events)."""
        if rv < self.compacted_rv:
            raise errors.expired(EXPIRED_LIST)
        state = dict(self._objects[rt.plural])
        for ev in reversed(self._history):
            if ev.rv <= rv:
                break
            if ev.rt is not rt:
                continue
            if ev.prev is None:
                state.pop(ev.key, None)
            else:
                state[ev.key] = ev.prev
        return state

    def list_objects(self, rt: ResourceType, namespace: str | None, *,
             label: LabelSelector = (), field: FieldSelector = (), limit: int = 0,
             continue_token: str | None = None, resource_version: str | None = None,
             resource_version_match: str | None = None) -> ListResult:
        """A list with the API's resourceVersion semantics.

        No rv / "0" / NotOlderThan: the current state (we are never behind). Exact (or a
        non-zero rv with a limit, the legacy paging rule): the state at that revision.
        A continue token lists as of the first page's revision. "0" with the watch cache
        on is served whole, `limit` ignored (v1.20's cacher: it cannot continue a list).
        """
        start = ""
        if continue_token:
            if resource_version not in (None, "", "0"):
                raise errors.bad_request(
                    "specifying resource version is not allowed when using continue")
            token_rv, start = decode_continue(continue_token)
            if token_rv == -1:  # the "inconsistent" token handed out with a 410
                state, list_rv = self._objects[rt.plural], self.rv
            elif token_rv < self.compacted_rv:
                raise errors.expired(INCONSISTENT_CONTINUE, encode_continue(-1, start))
            else:
                state, list_rv = self.state_at(rt, token_rv), token_rv
        else:
            want = parse_rv(resource_version) if resource_version else 0
            if resource_version_match not in (None, "", "Exact", "NotOlderThan"):
                raise errors.bad_request(
                    f'resourceVersionMatch: Unsupported value: "{resource_version_match}": '
                    'supported values: "Exact", "NotOlderThan"')
            if resource_version_match and not resource_version:
                raise errors.bad_request("resourceVersionMatch is forbidden unless "
                                         "resourceVersion is provided")
            exact = resource_version_match == "Exact" or (
                not resource_version_match and limit > 0 and want > 0)
            if want > self.rv:
                raise errors.too_large_resource_version(want, self.rv)
            if resource_version == "0" and not exact and self.watch_cache:
                limit = 0
            if exact:
                state, list_rv = self.state_at(rt, want), want
            else:
                state, list_rv = self._objects[rt.plural], self.rv
        match = matcher(label, field)
        prefix = f"{namespace}/" if rt.namespaced and namespace else ""
        keys = sorted(k for k in state if k.startswith(prefix) and k >= start)
        items: list[Obj] = []
        next_token: str | None = None
        remaining: int | None = None
        for i, key in enumerate(keys):
            obj = state[key]
            if not match(obj):
                continue
            if limit and len(items) == limit:
                next_token = encode_continue(list_rv, keys[i - 1] + "\x00")
                if not label and not field:
                    remaining = len(keys) - i
                break
            items.append(obj)
        return ListResult(items, list_rv, next_token, remaining)

    def events_since(self, rt: ResourceType, rv: int) -> list[Event]:
        """Retained events of one type after `rv`; 410 (as a Status) if compacted away."""
        if rv < self.compacted_rv:
            raise errors.expired(f"too old resource version: {rv} ({self.compacted_rv})")
        out: list[Event] = []
        for ev in reversed(self._history):
            if ev.rv <= rv:
                break
            if ev.rt is rt:
                out.append(ev)
        out.reverse()
        return out

    def subscribe(self, fn: Subscriber) -> Callable[[], None]:
        self._subscribers.append(fn)
        return lambda: self._subscribers.remove(fn) if fn in self._subscribers else None

    # ---- writing -------------------------------------------------------------------

    def _commit(self, rt: ResourceType, key: str, kind: str, obj: Obj | None,
                prev: Obj | None, allocate: bool = True) -> Obj:
        self.rv += 1
        objects = self._objects[rt.plural]
        if kind == DELETED:
            assert prev is not None
            stored = _with_rv(prev, self.rv)
            del objects[key]
        else:
            assert obj is not None
            if isinstance(obj.get("metadata"), dict):  # not so in insert_unvalidated's
                obj["metadata"]["resourceVersion"] = str(self.rv)
            stored = obj
            objects[key] = stored
        if rt is SERVICES and allocate:
            self.alloc.observe(prev, None if kind == DELETED else stored)
        ev = Event(kind, self.rv, rt, key, stored, prev)
        self._history.append(ev)
        while len(self._history) > self.history_limit:
            self.compacted_rv = self._history.popleft().rv
        for fn in list(self._subscribers):
            try:
                fn(ev)
            except Exception:  # a broken watcher must not fail the write
                log.exception("watch subscriber failed")
        return stored

    def _check_namespace(self, rt: ResourceType, namespace: str | None, name: str) -> None:
        if not rt.namespaced:
            return
        ns = self._objects[NAMESPACES.plural].get(namespace or "")
        if ns is None:
            raise errors.namespace_not_found(namespace or "")
        if ns["metadata"].get("deletionTimestamp"):
            raise errors.namespace_terminating(rt, name, namespace or "")

    def _normalise(self, rt: ResourceType, namespace: str | None, obj: Any) -> Obj:
        if not isinstance(obj, dict):
            raise errors.bad_request(f"the body of the request must be a {rt.kind} object")
        raw: Obj = copy(obj)
        kind, api_version = raw.get("kind"), raw.get("apiVersion")
        if (kind or api_version) and (kind, api_version) != (rt.kind, rt.api_version):
            raise errors.bad_request(
                f"the API version in the data ({api_version}) does not match the expected "
                f"API version ({rt.api_version})" if api_version != rt.api_version else
                f'{kind} in version "{rt.version}" cannot be handled as a {rt.kind}')
        # kind and apiVersion first, as upstream serialises them
        out: Obj = {"kind": rt.kind, "apiVersion": rt.api_version}
        out.update((k, v) for k, v in raw.items() if k not in ("kind", "apiVersion"))
        meta = out.get("metadata")
        if meta is None:
            meta = out["metadata"] = {}
        if not isinstance(meta, dict):
            raise errors.bad_request(f'{rt.kind} in version "{rt.version}" cannot be handled '
                                     "as a " + rt.kind + ": metadata must be an object")
        if rt.namespaced:
            if meta.get("namespace") and namespace and meta["namespace"] != namespace:
                raise errors.bad_request("the namespace of the provided object does not "
                                         "match the namespace sent on the request")
            meta["namespace"] = namespace or meta.get("namespace") or "default"
        else:
            meta.pop("namespace", None)
        return out

    def _validate(self, rt: ResourceType, obj: Obj) -> None:
        if not self.validate:
            return
        causes = validate(rt, obj)
        if causes:
            raise errors.invalid(rt, str(obj["metadata"].get("name") or ""), causes)

    def create(self, rt: ResourceType, namespace: str | None, obj: Any) -> Obj:
        obj = self._normalise(rt, namespace, obj)
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            alphabet = "bcdfghjklmnpqrstvwxz2456789"
            meta["name"] = str(meta["generateName"]) + "".join(
                secrets.choice(alphabet) for _ in range(5))
        name = str(meta.get("name") or "")
        if name:
            self._check_namespace(rt, meta.get("namespace"), name)
        strategy.prepare_create(rt, obj)
        self._validate(rt, obj)
        key = key_of(rt, meta.get("namespace"), name)
        if key in self._objects[rt.plural]:
            raise errors.already_exists(rt, name)
        if rt is SERVICES:
            causes = strategy.allocate_service(obj, None, self.alloc)
            if causes:
                raise errors.invalid(rt, name, causes)
        meta.pop("resourceVersion", None)
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now()
        return self._commit(rt, key, ADDED, obj, None)

    def update(self, rt: ResourceType, namespace: str | None, name: str, obj: Any, *,
               subresource: str | None = None) -> tuple[Obj, bool]:
        """PUT semantics. Returns (stored object, created)."""
        obj = self._normalise(rt, namespace, obj)
        meta = obj["metadata"]
        if meta.get("name") and meta["name"] != name:
            raise errors.bad_request(f"the name of the object ({meta['name']}) does not match "
                                     f"the name on the URL ({name})")
        meta["name"] = name
        key = key_of(rt, namespace, name)
        old = self._objects[rt.plural].get(key)
        if old is None:
            if rt.create_on_update and subresource is None:
                return self.create(rt, namespace, obj), True
            raise errors.not_found(rt, name)
        want_rv = meta.get("resourceVersion")
        if want_rv and want_rv != old["metadata"]["resourceVersion"]:
            raise errors.conflict(rt, name, errors.OBJECT_MODIFIED)
        if subresource == "status":
            obj = strategy.prepare_status_update(obj, old)
        else:
            strategy.prepare_update(rt, obj, old)
        self._validate(rt, obj)
        if rt is SERVICES and subresource is None:
            causes = strategy.allocate_service(obj, old, self.alloc)
            if causes:
                raise errors.invalid(rt, name, causes)
        if _same(obj, old):  # a no-op write keeps the revision, like upstream
            return old, False
        return self._commit(rt, key, MODIFIED, obj, old), False

    def insert_unvalidated(self, rt: ResourceType, obj: Obj, key_name: str | None = None) -> Obj:
        """Store `obj` exactly as given and tell watchers (ADDED, or MODIFIED if its key
        exists): no normalisation, defaulting, validation, namespace check or allocation.

        Test-only. It exists to simulate a lying API server, one that serves objects a
        real one would refuse (bad names, addresses, ports, sizes), so tests can show
        that clients do not trust what they are served. `obj` needs a `metadata` object
        with a string `name`, the store's key (and `namespace` for namespaced types,
        "default" if absent); nothing else is looked at. Do not update or delete such
        an object through the ordinary calls: they assume it was validated.
        `key_name`: the key of an object whose metadata is not an object (it is stored
        under "default" and served as given, without a resourceVersion).
        """
        obj = copy(obj)
        meta = obj["metadata"] if key_name is None else {}
        namespace = str(meta.get("namespace") or "default") if rt.namespaced else None
        key = key_of(rt, namespace, key_name if key_name is not None else str(meta["name"]))
        prev = self._objects[rt.plural].get(key)
        return self._commit(rt, key, MODIFIED if prev else ADDED, obj, prev, allocate=False)

    def delete(self, rt: ResourceType, namespace: str | None, name: str, *,
               uid: str | None = None, resource_version: str | None = None) -> Obj:
        """Delete one object; returns its last state (namespaces: the terminating object)."""
        key = key_of(rt, namespace, name)
        old = self._objects[rt.plural].get(key)
        if old is None:
            raise errors.not_found(rt, name)
        old_meta = old["metadata"]
        if uid and uid != old_meta.get("uid"):
            raise errors.conflict(rt, name, f"Precondition failed: UID in precondition: {uid}, "
                                            f"UID in object meta: {old_meta.get('uid')}")
        if resource_version and resource_version != old_meta.get("resourceVersion"):
            raise errors.conflict(
                rt, name, f"Precondition failed: ResourceVersion in precondition: "
                          f"{resource_version}, ResourceVersion in object meta: "
                          f"{old_meta.get('resourceVersion')}")
        if rt is NAMESPACES:
            return self._delete_namespace(name, old)
        return self._commit(rt, key, DELETED, None, old)

    def _delete_namespace(self, name: str, old: Obj) -> Obj:
        if name in strategy.IMMORTAL_NAMESPACES:
            raise ApiError(403, "Forbidden", f'namespaces "{name}" is forbidden: this '
                           "namespace may not be deleted", {"name": name, "kind": "namespaces"})
        if old["metadata"].get("deletionTimestamp"):
            return old
        # Upstream marks the namespace Terminating and its controller empties and removes
        # it later; here the "controller" runs at once, so the answer is the terminating
        # object and by the time a client looks again it is gone.
        terminating = copy(old)
        terminating["metadata"]["deletionTimestamp"] = now()
        terminating["status"] = {"phase": "Terminating"}
        answer = self._commit(NAMESPACES, name, MODIFIED, terminating, old)
        for rt in self.surface.types:
            if not rt.namespaced:
                continue
            for key in sorted(k for k in self._objects[rt.plural] if k.startswith(name + "/")):
                self._commit(rt, key, DELETED, None, self._objects[rt.plural][key])
        self._commit(NAMESPACES, name, DELETED, None, answer)
        return answer

    def delete_collection(self, rt: ResourceType, namespace: str | None,
                          label: LabelSelector = (), field: FieldSelector = ()) -> list[Obj]:
        victims = self.list_objects(rt, namespace, label=label, field=field).items
        return [self.delete(rt, o["metadata"].get("namespace"), str(o["metadata"]["name"]))
                for o in victims]

    # ---- maintenance ---------------------------------------------------------------

    def compact(self, rv: int | None = None) -> int:
        """Drop history up to `rv` (default: all of it). Returns the new compacted rv."""
        target = self.rv if rv is None else min(rv, self.rv)
        while self._history and self._history[0].rv <= target:
            self._history.popleft()
        self.compacted_rv = max(self.compacted_rv, target)
        log.info("compacted history rv=%d retained=%d", self.compacted_rv, len(self._history))
        return self.compacted_rv

    def dump(self) -> dict[str, list[Obj]]:
        """Every stored object by resource (copies), e.g. to compare with an agent cache."""
        return {rt.plural: copy(sorted(self._objects[rt.plural].values(),
                                       key=lambda o: key_of(rt, o["metadata"].get("namespace"),
                                                            o["metadata"]["name"])))
                for rt in self.surface.types}

    def load(self, objects: Iterable[Any], *, create_namespaces: bool = True) -> list[Obj]:
        """Create objects from manifests; missing namespaces are created for convenience.
        At API level 1.20, discovery.k8s.io/v1 slices are converted to v1beta1 first."""
        out = []
        for obj in objects:
            if (self.surface.by_kind("discovery.k8s.io/v1", "EndpointSlice") is None
                    and isinstance(obj, dict) and obj.get("kind") == "EndpointSlice"
                    and obj.get("apiVersion") == "discovery.k8s.io/v1"):
                obj = v1beta1.from_v1(obj)
            rt = type_of(obj, self.surface)
            ns = None
            if rt.namespaced:
                ns = str((obj.get("metadata") or {}).get("namespace") or "default")
                if create_namespaces and ns not in self._objects[NAMESPACES.plural]:
                    self.create(NAMESPACES, None, {"metadata": {"name": ns}})
            out.append(self.create(rt, ns, obj))
        return out


def type_of(obj: Any, surface: ApiSurface = LATEST) -> ResourceType:
    if not isinstance(obj, dict):
        raise errors.bad_request("not an object")
    rt = surface.by_kind(str(obj.get("apiVersion")), str(obj.get("kind")))
    if rt is None:
        raise errors.bad_request(f"the simulator does not serve {obj.get('apiVersion')}/"
                                 f"{obj.get('kind')}")
    return rt


def _same(new: Obj, old: Obj) -> bool:
    strip = ("resourceVersion",)
    a = {**new, "metadata": {k: v for k, v in new["metadata"].items() if k not in strip}}
    b = {**old, "metadata": {k: v for k, v in old["metadata"].items() if k not in strip}}
    return a == b
