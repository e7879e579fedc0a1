"""The HTTP face of the simulator: Kubernetes REST paths on aiohttp.

Paths: `/api/v1[/namespaces/NS]/PLURAL[/NAME[/status]]` and the same under
`/apis/GROUP/VERSION`, discovery documents, and `/_sim/...` for fault injection.
Every error is a `Status` body with the real server's code and reason.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import yaml
from aiohttp import web

from proxy.sim import discovery, errors, printing
from proxy.sim.errors import ApiError
from proxy.sim.faults import Faults
from proxy.sim.patch import apply_patch
from proxy.sim.resources import LATEST, NAMESPACES, ApiSurface, ResourceType
from proxy.sim.selectors import matcher, parse_field_selector, parse_label_selector
from proxy.sim.store import Obj, Store, copy
from proxy.sim.watch import Watch, WatchParams

log = logging.getLogger("proxy.sim.server")

JSON = "application/json"
DEFAULT_WATCH_TIMEOUT = 1800.0  # upstream: a random time in [minRequestTimeout, 2x)
# What upstream's system:public-info-viewer role lets anyone read.
PUBLIC_PATHS = ("/version", "/healthz", "/livez", "/readyz")


def _json(body: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type=JSON,
                        headers=headers)


def _error(exc: ApiError) -> web.Response:
    headers = dict(exc.headers)
    # As upstream's response writer: a Status with details.retryAfterSeconds also says so
    # in a Retry-After header, which is what clients read.
    retry = (exc.details or {}).get("retryAfterSeconds")
    if retry and "Retry-After" not in headers:
        headers["Retry-After"] = str(retry)
    return _json(exc.status(), exc.code, headers or None)


NOT_FOUND = ApiError(404, "NotFound", "the server could not find the requested resource", {})
UNAUTHORIZED = ApiError(401, "Unauthorized", "Unauthorized")


@dataclass(frozen=True, slots=True)
class Target:
    rt: ResourceType
    namespace: str | None
    name: str | None
    subresource: str | None


def parse_path(path: str, surface: ApiSurface = LATEST) -> Target | None:
    parts = [p for p in path.split("/") if p]
    if parts[:2] == ["api", "v1"]:
        group, version, rest = "", "v1", parts[2:]
    elif len(parts) >= 4 and parts[0] == "apis":
        group, version, rest = parts[1], parts[2], parts[3:]
    else:
        return None
    namespace = None
    if len(rest) >= 3 and rest[0] == "namespaces":
        inner = surface.by_path(group, rest[2])
        if inner is not None and inner.namespaced:
            namespace, rest = rest[1], rest[2:]
    if not rest or len(rest) > 3:
        return None
    rt = surface.by_path(group, rest[0])
    if rt is None or rt.version != version:
        return None
    name = rest[1] if len(rest) > 1 else None
    sub = rest[2] if len(rest) > 2 else None
    if sub is not None and (sub != "status" or not rt.status_subresource):
        return None
    if name is not None and rt.namespaced and namespace is None:
        return None  # a namespaced object needs its namespace in the path
    return Target(rt, namespace, name, sub)


def _flag(value: str | None) -> bool:
    return value is not None and value.lower() in ("1", "true")


def _list_body(rt: ResourceType, items: list[Obj], rv: int, token: str | None,
               remaining: int | None) -> dict[str, Any]:
    meta: dict[str, Any] = {"resourceVersion": str(rv)}
    if token:
        meta["continue"] = token
    if remaining is not None:
        meta["remainingItemCount"] = remaining
    # Items of a typed list carry no kind/apiVersion on the wire, as upstream.
    stripped = [{k: v for k, v in o.items() if k not in ("kind", "apiVersion")} for o in items]
    return {"kind": rt.list_kind, "apiVersion": rt.api_version, "metadata": meta,
            "items": stripped}


class SimApp:
    def __init__(self, store: Store, faults: Faults, *, bookmark_interval: float = 5.0,
                 watch_timeout: float = DEFAULT_WATCH_TIMEOUT,
                 surface: ApiSurface = LATEST) -> None:
        self.store = store
        self.surface = surface
        self.faults = faults
        self.bookmark_interval = bookmark_interval
        self.watch_timeout = watch_timeout
        self.watches: dict[Watch, asyncio.BaseTransport | None] = {}
        self.server_address = "127.0.0.1:0"
        # Set by the harness: restart the whole server (keep_state), from another thread.
        self.restart_hook: Callable[[bool], None] | None = None
        self.token: str | None = None  # bearer token every API request must carry

    def build(self) -> web.Application:
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._dispatch)
        return app

    # ---- faults the harness triggers --------------------------------------------

    def cut_watches(self, abrupt: bool = False) -> int:
        """End every open watch: cleanly (end of stream) or by dropping the connection."""
        count = len(self.watches)
        for watch, transport in list(self.watches.items()):
            if abrupt and transport is not None:
                transport.close()
            watch.cut()
        log.info("cut watches count=%d abrupt=%s", count, abrupt)
        return count

    def expire_watches(self) -> int:
        """End every open watch with an ERROR 410 Expired event: what a client sees when
        etcd compacts the revisions a watch still had to deliver."""
        count = len(self.watches)
        for watch in list(self.watches):
            watch.expire(errors.expired(
                f"too old resource version: {watch.params.resource_version or 0} "
                f"({self.store.compacted_rv})"))
        log.info("expired watches count=%d", count)
        return count

    # ---- plumbing ------------------------------------------------------------------

    @web.middleware
    async def _middleware(self, request: web.Request,
                          handler: Callable[[web.Request], Awaitable[web.StreamResponse]],
                          ) -> web.StreamResponse:
        started = time.monotonic()
        admin = request.path.startswith("/_sim/")
        try:
            if not admin and not self._authenticated(request):
                log.info("unauthenticated request method=%s path=%s", request.method,
                         request.path)
                return _error(UNAUTHORIZED)
            if not admin:
                if self.faults.latency:
                    await asyncio.sleep(self.faults.latency)
                failure = self.faults.next_failure()
                if failure is not None:
                    log.info("injected failure method=%s path=%s code=%d", request.method,
                             request.path, failure.code)
                    return _error(failure)
            resp = await handler(request)
        except ApiError as exc:
            resp = _error(exc)
        level = logging.INFO if request.method != "GET" or resp.status >= 400 else logging.DEBUG
        log.log(level, "request method=%s path=%s query=%s status=%d ms=%.1f rv=%d",
                request.method, request.path, request.query_string or "-", resp.status,
                (time.monotonic() - started) * 1000, self.store.rv)
        return resp

    def _authenticated(self, request: web.Request) -> bool:
        if self.token is None or request.path in PUBLIC_PATHS:
            return True
        scheme, _, value = request.headers.get("Authorization", "").partition(" ")
        return scheme.lower() == "bearer" and value.strip() == self.token

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        ctype = request.content_type
        if "protobuf" in ctype or "cbor" in ctype:
            raise errors.ApiError(415, "UnsupportedMediaType",
                                  f"the body of the request was in an unknown format - "
                                  f"accepted media types include: application/json, "
                                  f"application/yaml (got {ctype})")
        try:
            if "yaml" in ctype:
                return yaml.safe_load(raw)
            return orjson.loads(raw) if raw else None
        except (orjson.JSONDecodeError, yaml.YAMLError) as exc:
            raise errors.bad_request(f"error decoding request body: {exc}") from None

    async def _dispatch(self, request: web.Request) -> web.StreamResponse:
        path = request.path.rstrip("/") or "/"
        if path.startswith("/_sim/"):
            return await self._admin(request, path)
        if request.method == "GET":
            doc = self._discovery(path)
            if doc is not None:
                return _json(doc)
        target = parse_path(path, self.surface)
        if target is None:
            raise NOT_FOUND
        return await self._resource(request, target)

    def _discovery(self, path: str) -> Any:
        if path == "/version":
            return discovery.version(self.surface)
        if path in ("/healthz", "/livez", "/readyz"):
            return "ok"
        if path == "/api":
            return discovery.core_versions(self.server_address)
        if path == "/apis":
            return discovery.group_list(self.surface)
        if path == "/api/v1":
            return discovery.resource_list("", "v1", self.surface)
        parts = path.strip("/").split("/")
        if parts[0] == "apis" and len(parts) == 2:
            return discovery.group(parts[1], self.surface)
        if parts[0] == "apis" and len(parts) == 3:
            return discovery.resource_list(parts[1], parts[2], self.surface)
        return None

    # ---- resources -----------------------------------------------------------------

    def _check_verb(self, rt: ResourceType, verb: str) -> None:
        if verb not in rt.verbs:
            raise errors.method_not_allowed()

    async def _resource(self, request: web.Request, t: Target) -> web.StreamResponse:
        q = request.query
        method = request.method
        # Accept decides between the object and a Table (kubectl get), as upstream's
        # negotiation does before any handler work; a bad Accept is 406 first.
        table = printing.negotiate(request.headers.get("Accept")) if method == "GET" else None
        if t.name is None:
            if method == "GET":
                if _flag(q.get("watch")):
                    return await self._watch(request, t, table)
                return self._list(t, q, table)
            if method == "POST" and (t.namespace is not None or not t.rt.namespaced):
                body = await self._body(request)
                return _json(self.store.create(t.rt, t.namespace, body), 201)
            if method == "DELETE" and (t.namespace is not None or not t.rt.namespaced):
                self._check_verb(t.rt, "deletecollection")
                deleted = self.store.delete_collection(
                    t.rt, t.namespace, parse_label_selector(q.get("labelSelector")),
                    parse_field_selector(q.get("fieldSelector"), t.rt.kind))
                return _json(_list_body(t.rt, deleted, self.store.rv, None, None))
            raise errors.method_not_allowed()
        name = t.name
        if method == "GET":
            obj = self.store.get(t.rt, t.namespace, name)
            if table is not None:
                return _json(printing.object_table(
                    t.rt.kind, obj, version=table, level=self.surface.level,
                    include=printing.include_object(q.get("includeObject"))))
            return _json(obj)
        if method == "PUT":
            body = await self._body(request)
            obj, created = self.store.update(t.rt, t.namespace, name, body,
                                             subresource=t.subresource)
            return _json(obj, 201 if created else 200)
        if method == "PATCH":
            body = await self._body(request)
            current = copy(self.store.get(t.rt, t.namespace, name))
            patched = apply_patch(request.headers.get("Content-Type", ""), current, body)
            obj, _ = self.store.update(t.rt, t.namespace, name, patched,
                                       subresource=t.subresource)
            return _json(obj)
        if method == "DELETE" and t.subresource is None:
            return self._delete(t.rt, t.namespace, name, await self._body(request))
        raise errors.method_not_allowed()

    def _list(self, t: Target, q: Any, table: str | None = None) -> web.Response:
        limit_raw = q.get("limit") or "0"
        try:
            limit = max(int(limit_raw), 0)
        except ValueError:
            raise errors.bad_request(f"invalid limit: {limit_raw!r}") from None
        result = self.store.list_objects(
            t.rt, t.namespace,
            label=parse_label_selector(q.get("labelSelector")),
            field=parse_field_selector(q.get("fieldSelector"), t.rt.kind),
            limit=limit, continue_token=q.get("continue") or None,
            resource_version=q.get("resourceVersion"),
            resource_version_match=q.get("resourceVersionMatch") or None)
        body = _list_body(t.rt, result.items, result.resource_version,
                          result.continue_token, result.remaining)
        if table is not None:
            body = printing.table(t.rt.kind, result.items, body["metadata"], version=table,
                                include=printing.include_object(q.get("includeObject")),
                                level=self.surface.level)
        return _json(body)

    def _delete(self, rt: ResourceType, namespace: str | None, name: str,
                options: Any) -> web.Response:
        pre = options.get("preconditions") if isinstance(options, dict) else None
        pre = pre if isinstance(pre, dict) else {}
        obj = self.store.delete(rt, namespace, name, uid=pre.get("uid"),
                                resource_version=pre.get("resourceVersion"))
        if rt.returns_deleted_object or rt is NAMESPACES:
            return _json(obj)
        details: dict[str, Any] = {"name": name}
        if rt.group:
            details["group"] = rt.group
        details["kind"] = rt.plural
        details["uid"] = obj["metadata"].get("uid")
        return _json({"kind": "Status", "apiVersion": "v1", "metadata": {},
                      "status": "Success", "details": details})

    async def _watch(self, request: web.Request, t: Target,
                     table: str | None = None) -> web.StreamResponse:
        q = request.query
        # Table watches: each event's object becomes a one-row Table (upstream does this).
        rows = printing.WatchTables(t.rt.kind, table, printing.include_object(
            q.get("includeObject")), self.surface.level) if table is not None else None
        timeout = self.watch_timeout
        if q.get("timeoutSeconds"):
            try:
                timeout = float(int(q["timeoutSeconds"]))
            except ValueError:
                raise errors.bad_request("invalid timeoutSeconds") from None
        params = WatchParams(
            rt=t.rt, namespace=t.namespace,
            match=matcher(parse_label_selector(q.get("labelSelector")),
                          parse_field_selector(q.get("fieldSelector"), t.rt.kind)),
            resource_version=q.get("resourceVersion"),
            bookmarks=_flag(q.get("allowWatchBookmarks")),
            timeout=timeout,
            send_initial_events=_flag(q.get("sendInitialEvents")))
        watch = Watch(self.store, params, self.bookmark_interval)
        self.watches[watch] = request.transport
        resp = web.StreamResponse(status=200, headers={"Content-Type": JSON})
        resp.enable_chunked_encoding()
        started = time.monotonic()
        try:
            await resp.prepare(request)
            async for line in watch.lines():
                await resp.write(line if rows is None else rows.line(line))
                watch.sent += 1
            await resp.write_eof()
        except (ConnectionResetError, RuntimeError) as exc:
            log.debug("watch client gone path=%s err=%s", request.path, exc)
        finally:
            watch.close()
            self.watches.pop(watch, None)
            log.info("watch ended resource=%s namespace=%s rv=%s events=%d seconds=%.1f",
                     t.rt.plural, t.namespace or "*", params.resource_version or "-",
                     watch.sent, time.monotonic() - started)
        return resp

    # ---- /_sim admin ---------------------------------------------------------------

    async def _admin(self, request: web.Request, path: str) -> web.Response:
        q = request.query
        if path == "/_sim/state" and request.method == "GET":
            return _json({"resourceVersion": str(self.store.rv), "objects": self.store.dump()})
        if request.method != "POST":
            raise errors.method_not_allowed()
        if path == "/_sim/watches/cut":
            return _json({"cut": self.cut_watches(abrupt=_flag(q.get("abrupt")))})
        if path == "/_sim/watches/expire":
            return _json({"expired": self.expire_watches()})
        if path == "/_sim/restart":
            return await self._restart(request, keep_state=_flag(q.get("keepState", "true")))
        if path == "/_sim/compact":
            rv = int(q["rv"]) if q.get("rv") else None
            compacted = self.store.compact(rv)
            expired = self.expire_watches() if _flag(q.get("expireWatches")) else 0
            return _json({"compactedResourceVersion": str(compacted), "expired": expired})
        if path == "/_sim/fail":
            retry = int(q["retryAfter"]) if q.get("retryAfter") else None
            try:
                self.faults.fail_next(int(q.get("count", "1")), int(q.get("code", "500")), retry)
            except ValueError as exc:
                raise errors.bad_request(str(exc)) from None
            return _json({"failNext": self.faults.fail_remaining})
        if path == "/_sim/latency":
            self.faults.latency = float(q.get("seconds", "0"))
            return _json({"latency": self.faults.latency})
        if path == "/_sim/validate":
            self.store.validate = _flag(q.get("enabled", "true"))
            return _json({"validate": self.store.validate})
        raise NOT_FOUND

    async def _restart(self, request: web.Request, keep_state: bool) -> web.Response:
        hook = self.restart_hook
        if hook is None:
            raise ApiError(501, "NotImplemented", "this server cannot restart itself", {})
        # Answer first: the restart stops this very loop. The hook runs on a thread of its
        # own, which waits for this loop to shut down and starts a new one.
        resp = _json({"restarting": True, "keepState": keep_state})
        await resp.prepare(request)
        await resp.write_eof()
        threading.Thread(target=hook, args=(keep_state,), name="sim-restart",
                         daemon=True).start()
        return resp
