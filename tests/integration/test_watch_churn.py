"""Random churn interleaved with every fault, for many seeds (issue 3): 10 in the suite,
SLICEPROXY_CHURN_SEEDS=100 (say) by hand.

Per seed, the real agent (proxy/agent/app.py, in-process on its own uvloop thread, with
a recording data plane) watches the simulator through the real client library: its
three reflectors (Services; EndpointSlices, or legacy Endpoints every fourth seed; its
own Node) feed its model through the agent's own event handler and proxy/kube/ingest.py.
A schedule drawn from `random.Random(seed)` then creates, updates and deletes services,
slices, Endpoints and nodes (bursts of updates nobody may see, deletes followed by a
create under the same name, selector flips: a slice gaining the headless label, a node
other than ours) and interleaves every fault of the simulator:

  cut           every open watch ends, cleanly or by dropping the connection
  expire        history compacted, open streams end with an ERROR 410 event
  compact-away  watches held away, churn, compaction: the resume is answered 410
  fail-500      the next requests answer 500 (and the watches are cut to make requests)
  fail-429      the same with 429 and Retry-After
  latency       every request delayed for a while
  restart       the server stops, churn while it is down, it starts on the same port
  lose-storage  the server restarts empty: resourceVersions start from 1 again

Each fault is checked to have reached the client (a stream ended, a 410 or a 5xx
arrived, ...), so the test fails if the schedule stops exercising one. After about a
third of the writes, once the reflector of that kind has reached the write's revision
(polled), its view must already equal the simulator's: the reflector's resourceVersions,
the objects delivered and the model's caches fed by that kind. At the end, with
the faults stopped, it waits (polling, with a deadline) until the agent has converged and
then requires, exactly: every reflector knows the simulator's objects at their
resourceVersions; the last object delivered for each is the simulator's object, byte for
byte in content; the model's caches equal those of a model built from scratch from the
simulator's final objects; the resolved desired state, and what the data plane last
applied, equal that fresh model's. The stream of events itself must be clean: no ADDED
for a known object, no MODIFIED or DELETED for an unknown one, no event repeated, no
object going back in time.

One thing the schedule must respect, and why: after storage is lost, a client still
holds revisions of the old cluster. A watch resumed from one is answered with silence
until the new cluster's revisions pass it (the watch cache sends nothing older than the
start); the reflector's stall detector relists after two silent streams. If the new
cluster wrote past the old revision first, the client would receive the new cluster's
later events and could never learn of the earlier ones — no client can tell, client-go's
reflector included (the Kubernetes docs recommend restarting components after an etcd
restore for this reason). So until every reflector has relisted from the new cluster,
the schedule keeps the new cluster's revision below the lowest one the client holds,
and waits (polling) for the relist when it has no room left. The new cluster first gets
the first objects again, same names in the same order (as when the same manifests are
applied to a new cluster), other content: so names come back at the very
resourceVersions the client holds for the old objects (the reflector tells them apart
by uid). The own Node is among them: the agent keeps the last Node it saw when its Node
is deleted (on purpose, for topology), so it must exist again at the end.

Run with `-s` to see one line per seed and the totals.
"""

from __future__ import annotations

import asyncio
import functools
import os
import random
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

import pytest
import uvloop

from proxy.agent.app import Agent
from proxy.config.options import parse_args
from proxy.kube.ingest import EndpointsSource, apply_object
from proxy.kube.reflector import Reflector, ReflectorOptions, WatchEvent
from proxy.kube.resources import SERVICES
from proxy.model.tracker import ClusterModel
from proxy.model.types import (
    LABEL_HEADLESS,
    LABEL_HOSTNAME,
    LABEL_SERVICE_NAME,
    LABEL_SERVICE_PROXY_NAME,
    LABEL_ZONE,
)
from proxy.sim import SimServer
from tests.integration.agent_harness import FakeDataPlane
from tests.integration.watchkit import (
    GatedApi,
    LazyApi,
    ProbedApi,
    Recorder,
    Request,
    WireCounts,
    connect,
    eventually,
    identity,
    in_thread,
    run,
)
from tests.sim.client import wait_for

T = TypeVar("T")
Obj = dict[str, Any]
Key = tuple[str, str, str]  # (kind, namespace or "", name)

SEEDS = int(os.environ.get("SLICEPROXY_CHURN_SEEDS", "10"))
NODE = "node-a"
OTHER_NODE = "node-b"  # not ours: the Node watch's field selector must keep it out
PROXY_NAME = "sliceproxy"
# Both exist in every store, also in a new one after storage is lost.
NAMESPACES = ("default", "kube-public")
SERVICE_NAMES = tuple(f"svc-{i}" for i in range(5))
SLICE_NAMES = tuple(f"slice-{i}" for i in range(8))
# Small numbers on purpose: lists come in several pages, streams end by themselves
# (timeoutSeconds) every few seconds, a silent stream is noticed within a second.
OPTIONS = ReflectorOptions(page_size=4, min_watch_timeout=4, request_timeout=10,
                           stall_timeout=1.0, backoff_initial=0.05, backoff_max=0.5)
BOOKMARK_INTERVAL = 0.2
FAULTS = ("cut", "expire", "compact-away", "fail-500", "fail-429", "latency", "restart",
          "lose-storage")
WAIT = 30.0  # the deadline of every wait for one step (generous: a loaded machine)
CONVERGE = 90.0  # the deadline for the final convergence

# Totals over the seeds run in this session (printed by test_totals).
TOTALS: Counter[str] = Counter()
SEEDS_DONE: list[int] = []


# Synchronous polling with a deadline (the churn drives the simulator from this thread).
poll = functools.partial(wait_for, timeout=WAIT)


def _meta(obj: Obj) -> dict[str, Any]:
    meta = obj.get("metadata")
    return meta if isinstance(meta, dict) else {}


# ---- the agent, recording every event it is handed ------------------------------------


class RecordingAgent(Agent):
    """The real agent; its event handler also feeds the ledger."""

    ledger: Recorder

    def _on_event(self, ev: WatchEvent) -> None:
        self.ledger(ev)
        super()._on_event(ev)


class AgentRun:
    """The real agent on its own uvloop thread, through a probed real client."""

    def __init__(self, sim: SimServer, tmp: Path, source: EndpointsSource) -> None:
        kubeconfig = sim.write_kubeconfig(tmp / "kubeconfig")
        config = parse_args([
            "--kubeconfig", str(kubeconfig), "--hostname-override", NODE,
            "--healthz-bind-address", "127.0.0.1:0", "--metrics-bind-address", "127.0.0.1:0",
            "--min-sync-period", "50ms", "--service-proxy-name", PROXY_NAME,
            "--endpoints-source", source.value])
        self.source = source
        self.api = ProbedApi(LazyApi(kubeconfig))
        self.dataplane = FakeDataPlane()
        self.agent = RecordingAgent(config, dataplane_factory=lambda: self.dataplane,
                                    api_factory=lambda: self.api,
                                    reflector_options=OPTIONS, started_at=time.monotonic())
        self.agent.ledger = Recorder()
        self.loop = uvloop.new_event_loop()
        self.stop_event = asyncio.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="churn-agent", daemon=True)

    def _main(self) -> None:
        try:
            self.loop.run_until_complete(self.agent.run(self.stop_event))
        except BaseException as exc:
            self.error = exc

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop_event.set)
            self._thread.join(30)
        if not self._thread.is_alive():
            self.loop.close()

    def call(self, fn: Callable[[], T]) -> T:
        """fn() on the agent's loop, where the model and the reflectors live."""
        async def run() -> T:
            return fn()

        coro: Coroutine[Any, Any, T] = run()
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT)

    @property
    def ledger(self) -> Recorder:
        return self.agent.ledger

    @property
    def counts(self) -> WireCounts:
        return self.api.counts

    def reflectors(self) -> list[Reflector]:
        watch = self.agent.watch
        return list(watch.reflectors) if watch is not None else []

    def synced(self) -> bool:
        return self.call(lambda: self.agent.watch is not None and self.agent.watch.synced)

    def versions(self) -> dict[str, str | None]:
        """Kind -> the resourceVersion each reflector resumes from (None: listing)."""
        return self.call(lambda: {r.resource.kind: r.resource_version
                                  for r in self.reflectors()})

    def stats(self) -> Counter[str]:
        def collect() -> Counter[str]:
            out: Counter[str] = Counter()
            for r in self.reflectors():
                s = r.stats
                out.update(lists=s.lists, relists=s.relists, expired=s.expired,
                           watches=s.watches, watch_restarts=s.watch_restarts,
                           short_watches=s.short_watches, stalls=s.stalls, errors=s.errors,
                           events=s.events, bookmarks=s.bookmarks)
            return out

        return self.call(collect)


# ---- what the simulator holds, seen as the agent should see it ------------------------


def watched(state: dict[str, list[Obj]], source: EndpointsSource) -> dict[Key, Obj]:
    """The simulator's objects that the agent's watches select (kind, apiVersion set)."""
    out: dict[Key, Obj] = {}
    endpoints = "endpointslices" if source is EndpointsSource.ENDPOINT_SLICES else "endpoints"
    for plural in ("services", endpoints, "nodes"):
        for obj in state[plural]:
            meta = _meta(obj)
            labels = meta.get("labels") or {}
            if plural == "nodes" and meta.get("name") != NODE:
                continue  # fieldSelector=metadata.name=NODE
            if plural == endpoints and LABEL_HEADLESS in labels:
                continue  # labelSelector=!service.kubernetes.io/headless
            out[(str(obj["kind"]), str(meta.get("namespace") or ""), str(meta["name"]))] = obj
    return out


def fresh_model(objects: dict[Key, Obj], source: EndpointsSource) -> ClusterModel:
    """A model built from scratch from the simulator's final objects."""
    model = ClusterModel(NODE, PROXY_NAME)
    for key in sorted(objects):
        apply_object(model, objects[key], source)
    return model


def model_caches(model: ClusterModel) -> dict[str, object]:
    """Everything the model caches (its private dicts: the model offers no public view of
    them, and "nothing stale" includes slices no service uses yet)."""
    return {"services": model._services, "ignored": model._ignored,
            "sources": model._sources, "by_service": model._by_service,
            "decode_skips": model._decode_skips, "node": model.node,
            "node_view": model.node_view, "skipped": model.skipped()}


# The model's caches that only one kind of object feeds.
CACHES_OF = {"Service": ("services", "ignored"), "EndpointSlice": ("sources", "by_service"),
             "Endpoints": ("sources", "by_service"), "Node": ("node", "node_view")}


def differences(run: AgentRun, expected: dict[Key, Obj]) -> list[str]:
    """How the agent differs from `expected` (empty: converged). On the agent's loop."""
    fresh = fresh_model(expected, run.source)
    want_state = dict(fresh.resolve().ports)

    def compare() -> list[str]:
        out = _cache_differences(run, expected, fresh, None)
        model = run.agent.model
        if model.dirty:
            out.append(f"{len(model.dirty)} service ports still dirty")
        if dict(model.state.ports) != want_state:
            out.append(f"resolved state differs: {_dict_diff(dict(model.state.ports), want_state)}")
        applied = run.dataplane.applied
        if applied is None or dict(applied.ports) != want_state:
            out.append("the data plane's last applied state differs")
        return out

    return run.call(compare)


def checkpoint(run: AgentRun, expected: dict[Key, Obj], kind: str,
               rv: int) -> list[str] | None:
    """How the agent's view of one kind differs from `expected`, once its reflector has
    everything up to revision `rv` (None: not yet). Nothing is written meanwhile, so at
    that point its caches must hold exactly the simulator's objects of that kind."""
    fresh = fresh_model(expected, run.source)

    def compare() -> list[str] | None:
        version = next(r.resource_version for r in run.reflectors() if r.resource.kind == kind)
        if version is None or int(version) < rv:
            return None
        return _cache_differences(run, expected, fresh, kind)

    return run.call(compare)


def _cache_differences(run: AgentRun, expected: dict[Key, Obj], fresh: ClusterModel,
                       kind: str | None) -> list[str]:
    """Reflectors, delivered objects and model caches against `expected` and a model
    built from it (only those of `kind` if given). On the agent's loop."""
    out: list[str] = []
    for r in run.reflectors():
        if kind is not None and r.resource.kind != kind:
            continue
        want = {(k[1], k[2]): identity(o)[1] for k, o in expected.items()
                if k[0] == r.resource.kind}
        if dict(r.known) != want:
            out.append(f"{r.resource.kind} reflector knows {_dict_diff(dict(r.known), want)}")
    got = {k: o for k, o in run.ledger.objects.items() if kind is None or k[0] == kind}
    want_objects = {k: o for k, o in expected.items() if kind is None or k[0] == kind}
    if got != want_objects:
        out.append(f"delivered objects differ: {_dict_diff(got, want_objects)}")
    mine, theirs = model_caches(run.agent.model), model_caches(fresh)
    names = CACHES_OF[kind] if kind is not None else tuple(mine)
    out.extend(f"model cache {name} differs: {_dict_diff(mine[name], theirs[name])}"
               for name in names if mine[name] != theirs[name])
    return out


def _dict_diff(got: object, want: object) -> str:
    if not isinstance(got, dict) or not isinstance(want, dict):
        return f"{got!r} != {want!r}"[:600]
    extra = sorted(str(k) for k in got.keys() - want.keys())
    missing = sorted(str(k) for k in want.keys() - got.keys())
    changed = sorted(str(k) for k in got.keys() & want.keys() if got[k] != want[k])
    return f"stale={extra} missing={missing} changed={changed}"[:600]


# ---- random objects -------------------------------------------------------------------


SERVICE_PORTS = (("http", 80, "TCP"), ("dns", 53, "UDP"), ("https", 443, "TCP"),
                 ("sig", 9000, "SCTP"))
SLICE_PORTS = (("http", 8080, "TCP"), ("dns", 5353, "UDP"), ("https", 8443, "TCP"),
               ("sig", 9000, "SCTP"))


def _pick(rng: random.Random, pool: tuple[T, ...], low: int = 1) -> list[T]:
    return rng.sample(pool, rng.randint(low, len(pool)))


def _address(rng: random.Random, namespace: str) -> str:
    # A small pool per namespace: the same endpoint shows up in several slices.
    return f"10.{NAMESPACES.index(namespace)}.0.{rng.randint(1, 10)}"


def make_service(rng: random.Random, namespace: str, name: str, gen: int) -> Obj:
    ports = [{"name": n, "port": p, "protocol": proto} for n, p, proto in
             sorted(_pick(rng, SERVICE_PORTS))]
    spec: dict[str, Any] = {"ports": ports, "selector": {"app": name}}
    shape = rng.random()
    if shape < 0.08:
        spec["clusterIP"] = "None"  # headless: ignored by the model
    elif shape < 0.3:
        spec["type"] = "NodePort"
        spec["externalTrafficPolicy"] = rng.choice(["Cluster", "Local"])
    if rng.random() < 0.3:
        spec["internalTrafficPolicy"] = "Local"
    if rng.random() < 0.2:
        spec["sessionAffinity"] = "ClientIP"
    if rng.random() < 0.2:
        spec["trafficDistribution"] = "PreferClose"
    labels = {"app": name}
    if rng.random() < 0.2:
        labels[LABEL_SERVICE_PROXY_NAME] = rng.choice(["other", PROXY_NAME])
    annotations = {"churn/gen": str(gen)}
    if rng.random() < 0.2:
        annotations["service.kubernetes.io/topology-mode"] = "Auto"
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "annotations": annotations},
            "spec": spec}


def change_service(rng: random.Random, obj: Obj, gen: int) -> None:
    spec, meta = obj["spec"], obj["metadata"]
    meta.setdefault("annotations", {})["churn/gen"] = str(gen)  # always a real change
    what = rng.randrange(5)
    if what == 0:
        spec["ports"] = [{"name": n, "port": p, "protocol": proto} for n, p, proto in
                         sorted(_pick(rng, SERVICE_PORTS))]
    elif what == 1:
        labels = meta.setdefault("labels", {})
        if LABEL_SERVICE_PROXY_NAME in labels:
            del labels[LABEL_SERVICE_PROXY_NAME]
        else:
            labels[LABEL_SERVICE_PROXY_NAME] = rng.choice(["other", PROXY_NAME])
    elif what == 2:
        spec["internalTrafficPolicy"] = rng.choice(["Cluster", "Local"])
    elif what == 3 and spec.get("clusterIP") != "None":
        if spec.get("type") == "NodePort":
            spec["type"] = "ClusterIP"
            spec.pop("externalTrafficPolicy", None)
            for port in spec["ports"]:
                port.pop("nodePort", None)
        else:
            spec["type"] = "NodePort"
            spec["externalTrafficPolicy"] = rng.choice(["Cluster", "Local"])
    elif what == 4:
        spec["sessionAffinity"] = rng.choice(["None", "ClientIP"])
        spec.pop("sessionAffinityConfig", None)


def _endpoint(rng: random.Random, namespace: str) -> Obj:
    out: Obj = {"addresses": [_address(rng, namespace)]}
    cond = {c: v for c in ("ready", "serving", "terminating")
            if (v := rng.choice([True, False, None])) is not None}
    out["conditions"] = cond
    if (node := rng.choice([NODE, OTHER_NODE, None])) is not None:
        out["nodeName"] = node
    if (zone := rng.choice(["zone-a", "zone-b", None])) is not None:
        out["zone"] = zone
    if rng.random() < 0.3:
        out["hints"] = {"forZones": [{"name": rng.choice(["zone-a", "zone-b"])}]}
    return out


def make_slice(rng: random.Random, namespace: str, name: str, gen: int) -> Obj:
    labels = {LABEL_SERVICE_NAME: rng.choice(SERVICE_NAMES),
              "endpointslice.kubernetes.io/managed-by": "churn"}
    if rng.random() < 0.1:
        labels[LABEL_HEADLESS] = ""
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "annotations": {"churn/gen": str(gen)}},
            "addressType": "IPv4",
            "endpoints": [_endpoint(rng, namespace) for _ in range(rng.randint(0, 4))],
            "ports": [{"name": n, "port": p, "protocol": proto}
                      for n, p, proto in _pick(rng, SLICE_PORTS, 0)]}


def change_slice(rng: random.Random, obj: Obj, gen: int) -> None:
    meta = obj["metadata"]
    meta.setdefault("annotations", {})["churn/gen"] = str(gen)
    labels = meta.setdefault("labels", {})
    what = rng.randrange(5)
    if what == 0:
        obj["endpoints"] = [_endpoint(rng, meta["namespace"])
                            for _ in range(rng.randint(0, 4))]
    elif what == 1 and obj.get("endpoints"):
        ep = rng.choice(obj["endpoints"])
        ep["conditions"]["ready"] = not ep["conditions"].get("ready", True)
    elif what == 2:
        labels[LABEL_SERVICE_NAME] = rng.choice(SERVICE_NAMES)  # moves to another service
    elif what == 3:
        if LABEL_HEADLESS in labels:  # the watch sees it appear or disappear
            del labels[LABEL_HEADLESS]
        else:
            labels[LABEL_HEADLESS] = ""
    # what == 4 (or nothing to flip): only the annotation, which the model ignores


def make_endpoints(rng: random.Random, namespace: str, name: str, gen: int) -> Obj:
    subsets = []
    for _ in range(rng.randint(0, 2)):
        ports = [{"name": n, "port": p, "protocol": proto}
                 for n, p, proto in _pick(rng, SLICE_PORTS)]
        ready = [{"ip": _address(rng, namespace), "nodeName": rng.choice([NODE, OTHER_NODE])}
                 for _ in range(rng.randint(0, 3))]
        not_ready = [{"ip": _address(rng, namespace)} for _ in range(rng.randint(0, 2))]
        if not ready and not not_ready:
            ready = [{"ip": _address(rng, namespace)}]
        subset: Obj = {"ports": ports}
        if ready:
            subset["addresses"] = ready
        if not_ready:
            subset["notReadyAddresses"] = not_ready
        subsets.append(subset)
    labels = {"app": name}
    if rng.random() < 0.1:
        labels[LABEL_HEADLESS] = ""
    return {"apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": name, "namespace": namespace, "labels": labels,
                         "annotations": {"churn/gen": str(gen)}},
            "subsets": subsets}


def make_node(rng: random.Random, name: str, gen: int) -> Obj:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "annotations": {"churn/gen": str(gen)},
                         "labels": {LABEL_HOSTNAME: name,
                                    LABEL_ZONE: rng.choice(["zone-a", "zone-b"])}}}


API_VERSIONS = {"Service": "v1", "EndpointSlice": "discovery.k8s.io/v1", "Endpoints": "v1",
                "Node": "v1"}


# ---- the schedule ---------------------------------------------------------------------


class Churn:
    """Random writes and faults against the simulator, for one seed."""

    def __init__(self, sim: SimServer, run: AgentRun, rng: random.Random) -> None:
        self.sim, self.run, self.rng = sim, run, rng
        self.present: set[Key] = set()  # what the test has written and not deleted
        self.baseline: list[Key] = []  # the first objects, in the order they were made
        self.gen = 0
        self.writes: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self.observed: Counter[str] = Counter()
        self.latency_left = 0  # ops until the latency fault ends
        self.checkpoints = 0  # settled writes after which the caches were compared
        # Storage loss: until every reflector has relisted from the new cluster, the
        # new cluster's revision must stay below `floor` (see the module docstring).
        self.loss_pending = False
        self.floor = 0

    # --- writes ----------------------------------------------------------------------

    def _next_gen(self) -> int:
        self.gen += 1
        return self.gen

    def _build(self, kind: str, namespace: str, name: str) -> Obj:
        gen = self._next_gen()
        if kind == "Service":
            return make_service(self.rng, namespace, name, gen)
        if kind == "EndpointSlice":
            return make_slice(self.rng, namespace, name, gen)
        if kind == "Endpoints":
            return make_endpoints(self.rng, namespace, name, gen)
        return make_node(self.rng, name, gen)

    def _gate(self) -> None:
        """Before a write: room below `floor` while a storage loss is not yet healed."""
        if not self.loss_pending:
            return
        if self._healed():
            self.loss_pending = False
            self.observed["lose-storage"] += 1
        elif self.sim.resource_version + 1 >= self.floor:
            self.heal()

    def heal(self) -> None:
        """Wait until every reflector has relisted from the new cluster."""
        if self.loss_pending:
            poll(self._healed, "every reflector to relist from the new cluster",
                 detail=lambda: (self.run.versions(), self.sim.resource_version))
            self.loss_pending = False
            self.observed["lose-storage"] += 1

    def _healed(self) -> bool:
        rv = self.sim.resource_version
        versions = self.run.versions().values()
        return all(v is not None and int(v) <= rv for v in versions)

    def create(self, kind: str, namespace: str, name: str) -> None:
        self._gate()
        self.sim.create(self._build(kind, namespace, name))
        self.present.add((kind, namespace, name))
        self.writes["create"] += 1

    def update(self, kind: str, namespace: str, name: str) -> None:
        self._gate()
        obj = self.sim.get(API_VERSIONS[kind], kind, name, namespace or None)
        gen = self._next_gen()
        if kind == "Service":
            change_service(self.rng, obj, gen)
        elif kind == "EndpointSlice":
            change_slice(self.rng, obj, gen)
        elif kind == "Endpoints":
            fresh = make_endpoints(self.rng, namespace, name, gen)
            obj["subsets"], obj["metadata"]["labels"] = fresh["subsets"], fresh["metadata"][
                "labels"]
            obj["metadata"]["annotations"] = fresh["metadata"]["annotations"]
        else:
            obj["metadata"]["labels"][LABEL_ZONE] = self.rng.choice(["zone-a", "zone-b"])
            obj["metadata"]["annotations"] = {"churn/gen": str(gen)}
        self.sim.update(obj)
        self.writes["update"] += 1

    def delete(self, kind: str, namespace: str, name: str) -> None:
        self._gate()
        self.sim.delete(API_VERSIONS[kind], kind, name, namespace or None)
        self.present.discard((kind, namespace, name))
        self.writes["delete"] += 1

    def random_key(self) -> Key:
        r = self.rng.random()
        ns = self.rng.choice(NAMESPACES)
        if r < 0.3:
            return ("Service", ns, self.rng.choice(SERVICE_NAMES))
        if r < 0.65:
            return ("EndpointSlice", ns, self.rng.choice(SLICE_NAMES))
        if r < 0.85:
            return ("Endpoints", ns, self.rng.choice(SERVICE_NAMES))
        return ("Node", "", NODE if r < 0.95 else OTHER_NODE)

    def op(self) -> Key:
        """One random write (or a few: a burst, a delete and a create again)."""
        key = self.random_key()
        if key not in self.present:
            self.create(*key)
            return key
        r = self.rng.random()
        if r < 0.55 or key == ("Node", "", NODE):
            self.update(*key)
        elif r < 0.7:
            for _ in range(self.rng.randint(2, 4)):  # intermediate versions may go unseen
                self.update(*key)
            self.writes["burst"] += 1
        elif r < 0.88:
            self.delete(*key)
        else:
            self.delete(*key)
            self.create(*key)  # the same name, a different object
            self.writes["recreate"] += 1
        return key

    def away_churn(self) -> None:
        """Writes nobody watches: updates, a delete and a create again, and an object
        that lives and dies unseen."""
        for _ in range(self.rng.randint(1, 4)):
            self.op()
        key = self.random_key()
        if key == ("Node", "", NODE):
            return
        if key in self.present:
            self.delete(*key)
            self.create(*key)
            self.writes["recreate"] += 1
        else:
            self.create(*key)
            self.delete(*key)
            self.writes["ghost"] += 1

    def settle(self, key: Key) -> None:
        """Sometimes, let the agent catch up with the write just made."""
        if not self.sim.running or self.loss_pending:
            return
        if key[0] not in self.run.versions():
            return  # EndpointSlices while the agent reads Endpoints, or the reverse
        target = self.sim.resource_version
        expected = watched(self.sim.state(), self.run.source)
        found: list[list[str]] = []

        def caught_up() -> bool:
            problems = checkpoint(self.run, expected, key[0], target)
            if problems is not None:
                found.append(problems)
            return problems is not None

        poll(caught_up, f"the {key[0]} reflector at rv {target}", detail=self.run.versions)
        assert found[-1] == [], f"at rv {target}, {key[0]}: {found[-1]}"
        self.checkpoints += 1

    # --- faults ----------------------------------------------------------------------

    def watching(self) -> None:
        poll(lambda: self.sim.open_watches() >= 1, "an open watch",
             detail=lambda: (self.run.versions(), self.run.counts))

    def cut(self, abrupt: bool = False) -> None:
        """Cut the open watches: at least one (a stream may end by itself meanwhile)."""
        poll(lambda: self.sim.cut_watches(abrupt) >= 1, "a watch to cut")

    def fault(self, kind: str) -> None:
        counts = self.run.counts
        self.injected[kind] += 1
        if kind == "lose-storage":
            self.lose_storage()
            return
        if kind in ("compact-away", "restart"):
            # Their writes while nobody can watch would wait for a relist that cannot
            # come while the watches are away.
            self.heal()
        self.watching()
        if kind == "cut":
            before = counts.stream_ends
            self.cut(abrupt=self.rng.random() < 0.5)
            poll(lambda: counts.stream_ends > before, "a stream to end")
        elif kind == "expire":
            before = counts.gone_mid_stream + counts.gone_at_start
            self.sim.compact()
            # Bounded retries: a stream reaching its timeoutSeconds at that very moment
            # ends without sending the ERROR.
            for attempt in range(5):
                poll(lambda: self.sim.expire_watches() >= 1, "a watch to expire")
                try:
                    poll(lambda: counts.gone_mid_stream + counts.gone_at_start > before,
                         "an ERROR 410 on an open stream", timeout=5.0)
                    break
                except AssertionError:
                    if attempt == 4:
                        raise
        elif kind == "compact-away":
            before = counts.gone_at_start
            self.run.call(lambda: self.run.api.hold(_is_watch))
            self.cut()
            self.away_churn()
            self.sim.compact()
            self.run.call(self.run.api.release)
            poll(lambda: counts.gone_at_start > before, "a resume answered 410 Gone")
        elif kind in ("fail-500", "fail-429"):
            code = int(kind[-3:])
            before = counts.statuses.get(code, 0)
            self.sim.fail_next(self.rng.randint(1, 3), code, 1 if code == 429 else None)
            self.cut()  # requests to fail
            poll(lambda: counts.statuses.get(code, 0) > before, f"a {code} answer")
        elif kind == "latency":
            before = len(self.run.api.requests)
            self.sim.set_latency(self.rng.choice([0.05, 0.1, 0.2, 0.4]))
            self.latency_left = self.rng.randint(3, 12)
            self.cut()  # requests to delay
            poll(lambda: len(self.run.api.requests) > before, "a delayed request")
        elif kind == "restart":
            before = counts.stream_ends + counts.failed
            self.sim.stop()
            self.away_churn()  # written while the server is down
            self.sim.start()
            poll(lambda: counts.stream_ends + counts.failed > before,
                 "the client to notice the restart")
        else:
            raise AssertionError(f"unknown fault {kind}")
        self.observed[kind] += 1

    def lose_storage(self) -> None:
        versions = self.run.versions().values()
        # The lowest revision the client may hold: a listing reflector (None) may hold a
        # continue token of any revision, so then no room at all until healed.
        lowest = (min(int(v) for v in versions if v is not None)
                  if all(v is not None for v in versions) else 0)
        self.floor = min(self.floor, lowest) if self.loss_pending else lowest
        self.sim.restart(keep_state=False)
        self.present.clear()
        self.loss_pending = True
        if self.sim.resource_version >= self.floor:
            self.floor = 0  # a tiny old cluster: nothing may be written until healed
        # The new cluster gets the same manifests applied in the same order (with other
        # content): the same names come back at the same small resourceVersions.
        for key in self.baseline:
            self.create(*key)

    def tick(self) -> None:
        if self.latency_left:
            self.latency_left -= 1
            if not self.latency_left:
                self.sim.set_latency(0)

    def finish(self) -> None:
        """Faults stop, a storage loss heals."""
        self.sim.call(self.sim.faults.clear)
        self.latency_left = 0
        self.heal()


def _is_watch(req: Request) -> bool:
    return req.watch


def baseline(rng: random.Random) -> list[Obj]:
    objects: list[Obj] = [make_node(rng, NODE, 0), make_node(rng, OTHER_NODE, 0)]
    for ns in NAMESPACES:
        for name in SERVICE_NAMES[:3]:
            objects.append(make_service(rng, ns, name, 0))
            objects.append(make_endpoints(rng, ns, name, 0))
        objects.extend(make_slice(rng, ns, name, 0) for name in SLICE_NAMES[:4])
    return objects


def _key_of(obj: Obj) -> Key:
    meta = _meta(obj)
    return (str(obj["kind"]), str(meta.get("namespace") or ""), str(meta["name"]))


@pytest.fixture
def sim() -> Iterator[SimServer]:
    server = SimServer(bookmark_interval=BOOKMARK_INTERVAL)
    try:
        yield server
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SEEDS))
def test_churn_with_every_fault(sim: SimServer, tmp_path: Path, seed: int) -> None:
    began = time.monotonic()
    rng = random.Random(seed)
    source = (EndpointsSource.ENDPOINTS if seed % 4 == 3
              else EndpointsSource.ENDPOINT_SLICES)
    initial = baseline(rng)
    sim.load(initial)
    sim.start()
    agent = AgentRun(sim, tmp_path, source)
    agent.start()
    try:
        poll(agent.synced, "the agent's first lists", detail=lambda: agent.error)
        churn = Churn(sim, agent, rng)
        churn.baseline = [_key_of(o) for o in initial]
        churn.present.update(churn.baseline)
        churn.floor = min(int(v or 0) for v in agent.versions().values())
        # The schedule: every fault at least once, a few more at random, at random
        # places among the writes.
        faults = [*FAULTS, *(rng.choice(FAULTS[:-1]) for _ in range(rng.randint(0, 3)))]
        rng.shuffle(faults)
        steps = rng.randint(60, 90)
        at = dict(zip(sorted(rng.sample(range(steps), len(faults))), faults, strict=True))
        for step in range(steps):
            key = churn.op()
            churn.tick()
            if step in at:
                churn.fault(at[step])
            elif rng.random() < 0.3:
                churn.settle(key)
        churn.finish()

        def converged() -> bool:
            return not differences(agent, watched(sim.state(), source))

        poll(converged, "the agent to equal the simulator", timeout=CONVERGE,
             detail=lambda: differences(agent, watched(sim.state(), source)))
        ledger = agent.ledger
        assert agent.call(lambda: list(ledger.violations)) == []
        assert agent.error is None
        stats = agent.stats()
    finally:
        agent.stop()
    missing = [f for f in FAULTS if not churn.observed[f]]
    assert not missing, f"faults injected but never seen by the client: {missing}"
    counts = agent.counts
    numbers = Counter({
        "seeds": 1, "writes": sum(churn.writes[k] for k in ("create", "update", "delete")),
        "checkpoints": churn.checkpoints,
        "events": stats["events"], "relists": stats["relists"], "expired": stats["expired"],
        "stalls": stats["stalls"], "errors": stats["errors"],
        "short_watches": stats["short_watches"], "watch_restarts": stats["watch_restarts"],
        "bookmarks": stats["bookmarks"], "410_at_start": counts.gone_at_start,
        "410_mid_stream": counts.gone_mid_stream, "500": counts.statuses.get(500, 0),
        "429": counts.statuses.get(429, 0), "refused": counts.failed,
        **{f"fault:{k}": v for k, v in churn.injected.items()},
        **{f"write:{k}": v for k, v in churn.writes.items()},
    })
    # Every kind of event reached the agent, and the relists came (410 Gone, stalls).
    assert all(ledger.counts()[t] for t in ("ADDED", "MODIFIED", "DELETED")), \
        ledger.counts()
    assert stats["relists"] >= 1 and stats["expired"] >= 1
    TOTALS.update(numbers)
    SEEDS_DONE.append(seed)
    print(f"seed={seed} source={source.value} {_line(numbers)} "
          f"seconds={time.monotonic() - began:.1f}")


def _line(numbers: Counter[str]) -> str:
    faults = ",".join(f"{k[6:]}={v}" for k, v in sorted(numbers.items())
                      if k.startswith("fault:"))
    plain = " ".join(f"{k}={v}" for k, v in numbers.items()
                     if not k.startswith(("fault:", "write:")))
    return f"{plain} faults[{faults}]"


def test_a_name_back_at_the_same_resource_version_after_storage_loss(tmp_path: Path) -> None:
    """What the churn found: a new cluster counts revisions from 1 again, so the same
    manifest applied again gets the very resourceVersion the client holds for the old
    object. The relist must still deliver the new object (its uid differs)."""
    with SimServer(bookmark_interval=BOOKMARK_INTERVAL) as sim:
        old = sim.create(make_service(random.Random(1), "default", "a", 1))

        async def main() -> None:
            ledger = Recorder()
            api = GatedApi(await connect(sim, tmp_path))
            reflector = Reflector(api, SERVICES, ledger, replace(OPTIONS, stall_timeout=0.5))
            task = asyncio.create_task(reflector.run())
            try:
                await eventually(lambda: reflector.synced.is_set() and sim.open_watches() == 1,
                                 what="listed and watching")
                api.hold(lambda _: True)  # no relist before the object is back
                await in_thread(sim.restart, False)
                new = sim.create(make_service(random.Random(2), "default", "a", 2))
                api.release()
                assert identity(new)[1] == identity(old)[1]
                assert identity(new)[0] != identity(old)[0]
                await eventually(lambda: ledger.objects.get(("Service", "default", "a")) == new,
                                 what="the new object delivered",
                                 detail=lambda: (reflector.stats, ledger.counts()))
                assert reflector.stats.relists >= 1 and ledger.violations == []
                assert ledger.counts() == Counter(ADDED=1, MODIFIED=1)
            finally:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                await api.close()

        run(main)


def test_totals() -> None:
    """The numbers over every seed run in this session (after the seeds, in file order)."""
    if len(SEEDS_DONE) < SEEDS:
        pytest.skip(f"only {len(SEEDS_DONE)} of {SEEDS} seeds ran in this session")
    print(f"totals: {_line(TOTALS)}")
    for kind in FAULTS:
        assert TOTALS[f"fault:{kind}"] >= SEEDS
    # The storage-loss path through the stall detector ran (not only relists by 410).
    assert TOTALS["stalls"] >= 2 and TOTALS["relists"] >= SEEDS

