"""`SimServer`: the simulator on a background thread with its own event loop, for tests
and the demo. Direct methods act on the store without HTTP (hopping onto the loop when it
runs); fault methods cut watches, compact, fail or slow requests, and restart.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import logging
import ssl
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import yaml
from aiohttp import web

from proxy.sim.faults import Faults
from proxy.sim.resources import ResourceType, api_surface
from proxy.sim.server import SimApp
from proxy.sim.store import Obj, Store, copy, type_of

log = logging.getLogger("proxy.sim")
T = TypeVar("T")


def kubeconfig(server: str, namespace: str = "default", *, ca_pem: bytes | None = None,
               token: str | None = None) -> dict[str, Any]:
    cluster: dict[str, Any] = {"server": server}
    if ca_pem is not None:
        cluster["certificate-authority-data"] = base64.b64encode(ca_pem).decode()
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "sim", "cluster": cluster}],
        "users": [{"name": "sim", "user": {"token": token} if token else {}}],
        "contexts": [{"name": "sim", "context": {"cluster": "sim", "user": "sim",
                                                 "namespace": namespace}}],
        "current-context": "sim",
    }


class SimServer:
    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, objects: Iterable[Any] = (),
                 validate: bool = True, bookmark_interval: float = 5.0,
                 history_limit: int = 100_000, service_cidr: str = "198.18.128.0/17",
                 service_cidr_v6: str = "fd00:198:18::/112", api_level: str | None = None,
                 tls_cert: str | Path | None = None, tls_key: str | Path | None = None,
                 token: str | None = None, watch_cache: bool = True) -> None:
        """`api_level` "1.20" serves EndpointSlices as discovery.k8s.io/v1beta1 only, like
        a v1.20 API server; the default is the latest level (v1). `tls_cert`/`tls_key`
        (PEM files) serve HTTPS, as real API servers only do; `token` makes every request
        but discovery's /version and health checks need `Authorization: Bearer TOKEN`.
        `watch_cache=False` imitates `--watch-cache=false`: `resourceVersion=0` lists
        are paged like any other (see Store)."""
        self.host, self.port = host, port
        if (tls_cert is None) != (tls_key is None):
            raise ValueError("tls_cert and tls_key go together")
        self.tls_cert = Path(tls_cert) if tls_cert is not None else None
        self.tls_key = Path(tls_key) if tls_key is not None else None
        self.token = token
        self.surface = api_surface(api_level)
        self._store_options: dict[str, Any] = {
            "validate": validate, "history_limit": history_limit,
            "service_cidr": service_cidr, "service_cidr_v6": service_cidr_v6,
            "surface": self.surface, "watch_cache": watch_cache}
        self.store = Store(**self._store_options)
        self.store.load(objects)
        self.faults = Faults()
        self.bookmark_interval = bookmark_interval
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None
        self._app: SimApp | None = None
        self.starts = 0  # how many times the server started (restarts are observable)

    # ---- lifecycle -----------------------------------------------------------------

    @property
    def url(self) -> str:
        scheme = "https" if self.tls_cert is not None else "http"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{scheme}://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._loop is not None

    def start(self) -> str:
        if self._loop is not None:
            return self.url
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=loop.run_forever, name="sim-server", daemon=True)
        thread.start()
        self._loop, self._thread = loop, thread
        try:
            asyncio.run_coroutine_threadsafe(self._start(), loop).result(timeout=30)
        except BaseException:
            self._shutdown_loop()
            raise
        self.starts += 1
        log.info("sim listening url=%s rv=%d", self.url, self.store.rv)
        return self.url

    async def _start(self) -> None:
        self._app = SimApp(self.store, self.faults, bookmark_interval=self.bookmark_interval,
                           surface=self.surface)
        self._app.restart_hook = self._restart_from_admin
        self._app.token = self.token
        runner = web.AppRunner(self._app.build(), access_log=None, shutdown_timeout=1.0)
        await runner.setup()
        ssl_context = None
        if self.tls_cert is not None and self.tls_key is not None:
            ssl_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
            ssl_context.load_cert_chain(self.tls_cert, self.tls_key)
        site = web.TCPSite(runner, self.host, self.port, ssl_context=ssl_context)
        await site.start()
        self._runner = runner
        self.port = int(runner.addresses[0][1])
        self._app.server_address = f"{self.host}:{self.port}"

    def stop(self) -> None:
        loop = self._loop
        if loop is None:
            return
        asyncio.run_coroutine_threadsafe(self._stop(), loop).result(timeout=30)
        self._shutdown_loop()
        log.info("sim stopped url=%s", self.url)

    async def _stop(self) -> None:
        if self._app is not None:
            self._app.cut_watches(abrupt=True)
        if self._runner is not None:
            await self._runner.cleanup()
        self._runner = self._app = None

    def _shutdown_loop(self) -> None:
        loop, thread = self._loop, self._thread
        self._loop = self._thread = None
        if loop is not None:
            loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=10)
        if loop is not None:
            loop.close()

    def restart(self, keep_state: bool = True) -> str:
        """Stop and start again on the same port; optionally with an empty store (a new
        cluster: resourceVersions start over, so clients' old ones are meaningless)."""
        self.stop()
        if not keep_state:
            self.store = Store(**self._store_options)
        return self.start()

    def _restart_from_admin(self, keep_state: bool) -> None:
        try:
            self.restart(keep_state)
        except Exception:  # on a daemon thread: nobody else would see it
            log.exception("restart requested through /_sim/restart failed")

    def __enter__(self) -> SimServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: str | Path) -> Path:
        out = Path(path)
        ca = self.tls_cert.read_bytes() if self.tls_cert is not None else None
        out.write_text(yaml.safe_dump(kubeconfig(self.url, ca_pem=ca, token=self.token)),
                       encoding="utf-8")
        return out

    # ---- running things on the loop --------------------------------------------------

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run fn on the server's loop thread (or here when stopped) and return its result."""
        loop = self._loop
        if loop is None or threading.current_thread() is self._thread:
            return fn(*args, **kwargs)
        fut: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as exc:
                fut.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return fut.result(timeout=30)

    # ---- objects without HTTP ------------------------------------------------------

    def _where(self, obj: Obj) -> tuple[ResourceType, str | None, str]:
        rt = type_of(obj, self.surface)
        meta = obj.get("metadata") or {}
        ns = str(meta.get("namespace") or "default") if rt.namespaced else None
        return rt, ns, str(meta.get("name") or "")

    def create(self, obj: Obj) -> Obj:
        rt, ns, _ = self._where(obj)
        return copy(self.call(self.store.create, rt, ns, obj))

    def update(self, obj: Obj, subresource: str | None = None) -> Obj:
        rt, ns, name = self._where(obj)
        stored, _ = self.call(self.store.update, rt, ns, name, obj, subresource=subresource)
        return copy(stored)

    def update_status(self, obj: Obj) -> Obj:
        return self.update(obj, subresource="status")

    def apply(self, obj: Obj) -> Obj:
        """Create, or overwrite unconditionally if it exists (handy in tests)."""
        rt, ns, name = self._where(obj)

        def run() -> Obj:
            try:
                self.store.get(rt, ns, name)
            except Exception:
                return self.store.create(rt, ns, obj)
            body = copy(obj)
            body.setdefault("metadata", {}).pop("resourceVersion", None)
            return self.store.update(rt, ns, name, body)[0]

        return copy(self.call(run))

    def _type(self, api_version: str, kind: str) -> ResourceType:
        rt = self.surface.by_kind(api_version, kind)
        if rt is None:
            raise KeyError(f"API level {self.surface.level} does not serve {api_version} {kind}")
        return rt

    def delete(self, api_version: str, kind: str, name: str,
               namespace: str | None = "default") -> Obj:
        rt = self._type(api_version, kind)
        ns = namespace if rt.namespaced else None
        return copy(self.call(self.store.delete, rt, ns, name))

    def get(self, api_version: str, kind: str, name: str,
            namespace: str | None = "default") -> Obj:
        rt = self._type(api_version, kind)
        ns = namespace if rt.namespaced else None
        return copy(self.call(self.store.get, rt, ns, name))

    def load(self, objects: Iterable[Any]) -> list[Obj]:
        return copy(self.call(self.store.load, list(objects)))

    def state(self) -> dict[str, list[Obj]]:
        """Every object by resource plural, for "agent cache equals simulator" checks."""
        return self.call(self.store.dump)

    @property
    def resource_version(self) -> int:
        return self.call(lambda: self.store.rv)

    # ---- faults --------------------------------------------------------------------

    def cut_watches(self, abrupt: bool = False) -> int:
        app = self._app
        return self.call(app.cut_watches, abrupt) if app is not None else 0

    def expire_watches(self) -> int:
        """End every open watch with an ERROR 410 Expired event."""
        app = self._app
        return self.call(app.expire_watches) if app is not None else 0

    def open_watches(self) -> int:
        app = self._app
        return self.call(lambda: len(app.watches)) if app is not None else 0

    def compact(self, rv: int | None = None) -> int:
        return self.call(self.store.compact, rv)

    def fail_next(self, count: int, code: int = 500, retry_after: int | None = None) -> None:
        self.call(self.faults.fail_next, count, code, retry_after)

    def set_latency(self, seconds: float) -> None:
        def run() -> None:
            self.faults.latency = seconds

        self.call(run)

    def set_validate(self, enabled: bool) -> None:
        def run() -> None:
            self.store.validate = enabled

        self.call(run)
