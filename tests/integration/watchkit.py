"""Helpers for the watch-layer integration tests: the real client (KubeApi on the
`kubernetes` package's asyncio client, configured from the simulator's kubeconfig), a
wrapper that records and can hold requests, a strict event recorder, and polling with a
deadline."""

from __future__ import annotations

import asyncio
import subprocess
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import uvloop

from proxy.kube.client import Api, ClientOptions, KubeApi, Response
from proxy.kube.identity import ObjectKey
from proxy.kube.reflector import ReflectorOptions, WatchEvent
from proxy.netns_lab import poll
from proxy.sim import SimServer

T = TypeVar("T")
LOOPS = ("uvloop", "asyncio")

# Fast enough for tests, same code paths as production.
FAST = ReflectorOptions(page_size=3, min_watch_timeout=30, request_timeout=10,
                        stall_timeout=5, backoff_initial=0.05, backoff_max=0.5)


def run(main: Callable[[], Awaitable[T]], loop: str = "uvloop") -> T:
    """Run a test coroutine on a fresh loop of the given kind."""
    async def checked() -> T:
        running = asyncio.get_running_loop()
        assert isinstance(running, uvloop.Loop) == (loop == "uvloop"), type(running)
        return await main()

    if loop == "uvloop":
        return uvloop.run(checked())
    return asyncio.run(checked())


async def eventually(pred: Callable[[], bool], timeout: float = 15.0,
                     what: str = "condition", detail: Callable[[], object] | None = None) -> None:
    """Poll until pred() holds, failing after `timeout` seconds (never a bare sleep): the
    project's `eventually` with this tier's defaults."""
    await poll.eventually(pred, timeout, what, interval=0.01, detail=detail)


async def connect(sim: SimServer, tmp: Path) -> KubeApi:
    config = sim.write_kubeconfig(tmp / "kubeconfig")
    return await KubeApi.connect(ClientOptions(kubeconfig=str(config)))


async def in_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Simulator calls that block for long (restarts) must not stall the client's loop."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def sim_keys(sim: SimServer, plural: str) -> dict[ObjectKey, str]:
    """(namespace, name) -> resourceVersion of the simulator's objects of one type."""
    return {(str(o["metadata"].get("namespace") or ""), str(o["metadata"]["name"])):
            str(o["metadata"]["resourceVersion"]) for o in sim.state()[plural]}


def self_signed(tmp: Path) -> tuple[Path, Path]:
    """A throw-away certificate for 127.0.0.1 (the simulator's TLS), made by openssl."""
    cert, key = tmp / "sim.crt", tmp / "sim.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=sliceproxy-sim", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


# ---- a client wrapper that records and holds requests ------------------------------


@dataclass(frozen=True, slots=True)
class Request:
    at: float  # loop time when the request was made
    path: str
    query: Mapping[str, str]

    @property
    def watch(self) -> bool:
        return self.query.get("watch") == "1"


class _HeldResponse:
    def __init__(self, resp: Response, api: GatedApi) -> None:
        self._resp, self._api = resp, api
        self.status, self.headers = resp.status, resp.headers

    async def read(self) -> bytes:
        await self._api.reads.wait()
        return await self._resp.read()

    async def readany(self) -> bytes:
        await self._api.reads.wait()
        return await self._resp.readany()

    def close(self) -> None:
        self._resp.close()


class GatedApi:
    """The real client, plus: every request recorded; requests matching `hold_when` wait
    until `release()`; reading responses waits while `reads` is clear."""

    def __init__(self, inner: Api) -> None:
        self.inner = inner
        self.requests: list[Request] = []
        self.hold_when: Callable[[Request], bool] | None = None
        self.held: list[Request] = []
        self._released = asyncio.Event()
        self.reads = asyncio.Event()
        self.reads.set()

    @property
    def host(self) -> str:
        return self.inner.host

    def hold(self, when: Callable[[Request], bool]) -> None:
        self._released.clear()
        self.held.clear()
        self.hold_when = when

    def release(self) -> None:
        self.hold_when = None
        self._released.set()

    async def get(self, path: str, query: Mapping[str, str], timeout: float) -> Response:
        req = Request(asyncio.get_running_loop().time(), path, dict(query))
        self.requests.append(req)
        if self.hold_when is not None and self.hold_when(req):
            self.held.append(req)
            await self._released.wait()
        return _HeldResponse(await self.inner.get(path, query, timeout), self)

    async def close(self) -> None:
        await self.inner.close()

    def watches(self) -> list[Request]:
        return [r for r in self.requests if r.watch]

    def lists(self) -> list[Request]:
        return [r for r in self.requests if not r.watch]


# ---- a strict recorder of what the reflectors emit -----------------------------------


@dataclass
class Recorder:
    """Applies events to a dict, like a cache would, and notes every event that could
    only come from a reflector bug: an ADDED for a known object, a MODIFIED or DELETED
    for an unknown one, a MODIFIED that changes nothing, an object going back in time.
    Objects are told apart by uid as well as resourceVersion: after a storage loss a new
    object may come back at an old one's resourceVersion."""

    objects: dict[tuple[str, str, str], dict[str, Any]] = field(default_factory=dict)
    events: list[WatchEvent] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)

    def __call__(self, ev: WatchEvent) -> None:
        self.events.append(ev)
        key = (ev.resource.kind, ev.namespace, ev.name)
        known = self.objects.get(key)
        if ev.type == "ADDED" and known is not None:
            self.violations.append(f"ADDED for known {key}")
        elif ev.type != "ADDED" and known is None:
            self.violations.append(f"{ev.type} for unknown {key}")
        elif known is not None and ev.obj is not None:
            (uid, rv), (old_uid, old_rv) = identity(ev.obj), identity(known)
            if ev.type == "MODIFIED" and (uid, rv) == (old_uid, old_rv):
                self.violations.append(f"MODIFIED without a change {key} rv={rv}")
            elif uid == old_uid and rv.isdigit() and old_rv.isdigit() and int(rv) < int(old_rv):
                self.violations.append(f"{ev.type} {key} went back from rv {old_rv} to {rv}")
        if ev.type == "DELETED":
            self.objects.pop(key, None)
        else:
            assert ev.obj is not None
            self.objects[key] = ev.obj

    def keys(self, kind: str) -> dict[ObjectKey, str]:
        return {(ns, name): identity(obj)[1] for (k, ns, name), obj in self.objects.items()
                if k == kind}

    def names(self, start: int = 0) -> list[tuple[str, str]]:
        return [(e.type, e.name) for e in self.events[start:]]

    def counts(self) -> Counter[str]:
        """How many events of each type."""
        return Counter(e.type for e in self.events)


def identity(obj: Mapping[str, Any]) -> tuple[str, str]:
    """(uid, resourceVersion) of an object."""
    meta = obj.get("metadata") or {}
    return str(meta.get("uid") or ""), str(meta.get("resourceVersion") or "")


# ---- a lazily connected client that also counts what came over the wire --------------


class LazyApi:
    """The real client, connected on first use: for the agent's synchronous
    `api_factory`, which is called on the agent's own loop."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig
        self._api: KubeApi | None = None

    @property
    def host(self) -> str:
        return self._api.host if self._api is not None else ""

    async def get(self, path: str, query: Mapping[str, str], timeout: float) -> Response:
        if self._api is None:
            self._api = await KubeApi.connect(ClientOptions(kubeconfig=str(self.kubeconfig)))
        return await self._api.get(path, query, timeout)

    async def close(self) -> None:
        if self._api is not None:
            await self._api.close()


@dataclass
class WireCounts:
    """What the server answered, as the client saw it."""

    statuses: dict[int, int] = field(default_factory=dict)  # status -> responses
    failed: int = 0  # requests that got no answer at all (connection refused, reset)
    stream_ends: int = 0  # watch streams that ended (cleanly, by error, or cut)
    # ERROR 410 Gone as the first thing on a watch stream (a resume from a compacted
    # revision, answered at the request) and after other events or bookmarks (an open
    # stream the server expired).
    gone_at_start: int = 0
    gone_mid_stream: int = 0


_ERROR_LINE = b'{"type":"ERROR"'


class _ProbedResponse:
    def __init__(self, resp: Response, counts: WireCounts, watch: bool) -> None:
        self._resp, self._counts = resp, counts
        self._watch = watch and resp.status == 200  # a stream, not an error answer
        self.status, self.headers = resp.status, resp.headers
        self._seen = 0  # bytes of the body read so far
        self._tail = b""  # the end of the previous chunk: a marker may straddle two
        self._ended = False

    async def read(self) -> bytes:
        return await self._resp.read()

    async def readany(self) -> bytes:
        try:
            chunk = await self._resp.readany()
        except BaseException:
            self._end()
            raise
        if not chunk:
            self._end()
        elif self._watch:
            window = self._tail + chunk
            at = window.find(_ERROR_LINE)
            if at >= 0 and b'"code":410' in window[at:]:
                if self._seen - len(self._tail) + at == 0:
                    self._counts.gone_at_start += 1
                else:
                    self._counts.gone_mid_stream += 1
                self._tail = b""
            else:
                self._tail = window[-len(_ERROR_LINE):]
            self._seen += len(chunk)
        return chunk

    def _end(self) -> None:
        if self._watch and not self._ended:
            self._ended = True
            self._counts.stream_ends += 1

    def close(self) -> None:
        self._end()
        self._resp.close()


class ProbedApi(GatedApi):
    """`GatedApi` that also counts statuses, failed requests, watch stream ends and
    where a 410 Gone arrived (`counts`)."""

    def __init__(self, inner: Api) -> None:
        super().__init__(inner)
        self.counts = WireCounts()

    async def get(self, path: str, query: Mapping[str, str], timeout: float) -> Response:
        try:
            resp = await super().get(path, query, timeout)
        except asyncio.CancelledError:
            raise
        except Exception:
            self.counts.failed += 1
            raise
        self.counts.statuses[resp.status] = self.counts.statuses.get(resp.status, 0) + 1
        return _ProbedResponse(resp, self.counts, query.get("watch") == "1")
