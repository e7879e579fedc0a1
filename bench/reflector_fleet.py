"""What N agents' watch layers cost one API server ("many nodes, one API server").

    sudo .venv/bin/python -m bench.reflector_fleet --server real --agents 100 500 1000 \\
        --first-list cache consistent --json out.json
    sudo .venv/bin/python -m bench.reflector_fleet --server sim --agents 100
    sudo .venv/bin/python -m bench.reflector_fleet            # --size small: CI-sized

Each agent is what one node runs of sliceproxy's watch layer: `proxy/kube/watch.py`'s
ClusterWatch (Services; EndpointSlices without headless ones; its own Node by field
selector), with its own client (`KubeApi`: its own aiohttp session, TLS handshakes and
connections) and a handler that only counts events. The agents run in worker processes
(`--workers`, an asyncio loop each); against the real server they run in a network
namespace of their own, linked to the control plane's over a veth (the control plane of
tests/realcp: kube-apiserver and etcd v1.20.2); against the simulator (`python -m
proxy.sim`, its own process) on the host's loopback.

The cluster is preloaded: `--services` Services (no selector: no controller touches
them) with one EndpointSlice each of `--endpoints` ready endpoints (written by this
bench under a manager of its own, so the real EndpointSlice controller leaves them
alone), and one Node per agent. For each (first-list mode, N):

1. the API server is restarted (a fresh watch cache and a fresh baseline; etcd keeps
   its data), the workers are started and make their clients;
2. *start*: every agent is started at the same moment; until every agent's three
   reflectors have listed (time to all synced);
3. *churn*: `--changes` EndpointSlice writes (one endpoint's readiness flipped) at
   `--rate` per second; until every agent has received every change.

Measured per phase, from /proc: the API server's and etcd's CPU seconds and RSS (sampled
every 0.2 s: the peak; VmHWM too), the workers' CPU; from the clients: the bytes of
response bodies each agent read (lists and watch streams, after TLS and chunked
decoding; a wrapper around the `Api` object), events received. A measurement, never a
pass/fail on time; `run()` is the core, tests/realcp/test_fleet_bench.py and
tests/integration/test_fleet_bench_sim.py run it tiny.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import http.client
import json
import os
import platform
import resource
import secrets
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from ipaddress import IPv4Network
from pathlib import Path
from typing import IO, Any, NoReturn

from bench.common import ROOT, cpu_seconds, status_mib
from proxy.kube.client import Api, Response
from proxy.kube.reflector import WatchEvent
from proxy.kube.watch import ClusterWatch

POD_NET = IPv4Network("198.19.0.0/16")  # endpoint addresses: never sent traffic
NAMESPACE = "fleet"
MANAGER = "sliceproxy-bench.example.com"  # the EndpointSlice controller leaves these alone
SAMPLE_EVERY = 0.2  # seconds between /proc samples of the servers' RSS
SIZES: dict[str, dict[str, Any]] = {
    "small": {"agents": (5,), "services": 20, "endpoints": 3, "changes": 5, "rate": 5.0},
    "full": {"agents": (100, 500, 1000), "services": 1000, "endpoints": 10,
             "changes": 50, "rate": 5.0},
}
Obj = dict[str, Any]


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class Settings:
    server: str = "real"  # "real" (kube-apiserver v1.20.2) or "sim"
    agents: tuple[int, ...] = (5,)
    first_lists: tuple[str, ...] = ("cache",)  # "cache" (resourceVersion=0), "consistent"
    services: int = 20
    endpoints: int = 3  # per service (one EndpointSlice each)
    changes: int = 5
    rate: float = 5.0  # changes per second
    workers: int = 1
    parallel: int = 16  # concurrent writes while preloading
    deadline: float = 600.0  # per phase

    def check(self) -> None:
        if self.server not in ("real", "sim"):
            raise ValueError("server: real or sim")
        if not self.agents or min(self.agents) < 1 or self.services < 1 or \
                self.endpoints < 1 or self.changes < 1 or self.rate <= 0 or self.workers < 1:
            raise ValueError("agents, services, endpoints, changes, rate, workers: positive")
        if self.services * self.endpoints > POD_NET.num_addresses - 2:
            raise ValueError(f"at most {POD_NET.num_addresses - 2} endpoints ({POD_NET})")
        if not set(self.first_lists) <= {"cache", "consistent"} or not self.first_lists:
            raise ValueError("first lists: cache and/or consistent")


def node_name(i: int) -> str:
    return f"fleet-node-{i}"


# --- the cluster's objects ------------------------------------------------------------


def endpoint_ip(settings: Settings, i: int, j: int) -> str:
    return str(POD_NET.network_address + 1 + i * settings.endpoints + j)


def service_obj(i: int) -> Obj:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"s-{i}", "namespace": NAMESPACE},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                "protocol": "TCP"}]}}


def slice_endpoints(settings: Settings, i: int, not_ready: int | None,
                    beta: bool) -> list[Obj]:
    out = []
    for j in range(settings.endpoints):
        ep: Obj = {"addresses": [endpoint_ip(settings, i, j)],
                   "conditions": {"ready": j != not_ready}}
        node = node_name(j)
        if beta:
            ep["topology"] = {"kubernetes.io/hostname": node}
        else:
            ep["nodeName"] = node
        out.append(ep)
    return out


def slice_obj(settings: Settings, i: int, group_version: str) -> Obj:
    return {"apiVersion": group_version, "kind": "EndpointSlice",
            "metadata": {"name": f"s-{i}-0", "namespace": NAMESPACE,
                         "labels": {"kubernetes.io/service-name": f"s-{i}",
                                    "endpointslice.kubernetes.io/managed-by": MANAGER}},
            "addressType": "IPv4",
            "endpoints": slice_endpoints(settings, i, None, group_version.endswith("beta1")),
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}


def node_obj(i: int) -> Obj:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node_name(i),
                         "labels": {"kubernetes.io/hostname": node_name(i)}}}


# --- /proc ------------------------------------------------------------------------------


class Sampler:
    """RSS of some processes every SAMPLE_EVERY seconds, in a thread: the peak of each."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self.peak = dict.fromkeys(pids, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError):
                    self.peak[name] = max(self.peak[name], status_mib(pid).get("VmRSS", 0.0))
            if self._stop.wait(SAMPLE_EVERY):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def snapshot(pids: Mapping[str, int]) -> dict[str, dict[str, float]]:
    out = {}
    for name, pid in pids.items():
        cpu, sizes = cpu_seconds(pid), status_mib(pid)
        out[name] = {"cpu_s": cpu, "rss_mib": sizes.get("VmRSS", 0.0),
                     "hwm_mib": sizes.get("VmHWM", 0.0)}
    return out


# --- the worker: agents in one process ---------------------------------------------------


class CountingResponse:
    """A response whose body bytes (after TLS and chunked decoding) are counted."""

    def __init__(self, inner: Response, api: CountingApi) -> None:
        self._inner, self._api = inner, api
        self.status = inner.status
        self.headers = inner.headers

    async def read(self) -> bytes:
        data = await self._inner.read()
        self._api.bytes += len(data)
        return data

    async def readany(self) -> bytes:
        data = await self._inner.readany()
        self._api.bytes += len(data)
        return data

    def close(self) -> None:
        self._inner.close()


class CountingApi:
    """An `Api` counting the bytes of every response body read through it."""

    def __init__(self, inner: Api) -> None:
        self.inner = inner
        self.bytes = 0

    @property
    def host(self) -> str:
        return self.inner.host

    async def get(self, path: str, query: Mapping[str, str], timeout: float) -> Response:
        return CountingResponse(await self.inner.get(path, query, timeout), self)

    async def close(self) -> None:
        await self.inner.close()


class Agent:
    """One node's watch layer: a ClusterWatch whose handler only counts."""

    def __init__(self, node: str, api: CountingApi) -> None:
        self.node, self.api = node, api
        self.watch: ClusterWatch | None = None
        self.events: dict[str, int] = {}
        self.synced_at: float | None = None
        self.synced_task: asyncio.Task[None] | None = None

    def handle(self, event: WatchEvent) -> None:
        kind = event.resource.kind
        self.events[kind] = self.events.get(kind, 0) + 1

    def start(self) -> None:
        assert self.watch is not None
        self.watch.start()
        self.synced_task = asyncio.create_task(self._synced())

    async def _synced(self) -> None:
        assert self.watch is not None
        await self.watch.wait_synced()
        self.synced_at = time.monotonic()

    def report(self) -> Obj:
        assert self.watch is not None
        return {"bytes": self.api.bytes, "events": dict(self.events),
                "objects": {r.resource.kind: r.object_count for r in self.watch.reflectors},
                "errors": sum(r.stats.errors for r in self.watch.reflectors)}

    async def stop(self) -> None:
        if self.watch is not None:
            await self.watch.stop()
        await self.api.close()


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    kubeconfig: str
    first: int  # index of the first agent (its node name)
    count: int
    consistent_first_list: bool


def worker_main(spec: WorkerSpec) -> int:
    """Reads commands on stdin (start, report, stop), answers one JSON line each."""
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    import logging
    logging.basicConfig(level=logging.ERROR, stream=sys.stderr)
    asyncio.run(_worker(spec))
    return 0


async def _worker(spec: WorkerSpec) -> None:
    from proxy.kube.client import ClientOptions, KubeApi
    from proxy.kube.ingest import EndpointsSource
    from proxy.kube.reflector import ReflectorOptions
    from proxy.kube.watch import endpoint_slice_resource

    options = ReflectorOptions(consistent_first_list=spec.consistent_first_list)
    agents: list[Agent] = []
    slices = None
    for i in range(spec.first, spec.first + spec.count):
        api = CountingApi(await KubeApi.connect(ClientOptions(kubeconfig=spec.kubeconfig)))
        if slices is None:  # once: discovery is not what is measured
            slices = await endpoint_slice_resource(api)
            api.bytes = 0
        agent = Agent(node_name(i), api)
        agent.watch = ClusterWatch(api, agent.node, EndpointsSource.ENDPOINT_SLICES,
                                   agent.handle, options, slices)
        agents.append(agent)
    _say({"ready": len(agents), "pid": os.getpid()})
    loop = asyncio.get_running_loop()
    try:
        while True:
            line = (await loop.run_in_executor(None, sys.stdin.readline)).strip()
            if line == "start":
                for agent in agents:
                    agent.start()
                await asyncio.gather(*(a.synced_task for a in agents if a.synced_task))
                _say({"synced_at": [a.synced_at for a in agents]})
            elif line == "report":
                _say({"agents": [a.report() for a in agents]})
            else:  # "stop", or our parent went away (EOF)
                break
    finally:
        for agent in agents:
            await agent.stop()
    _say({"stopped": len(agents)})


def _say(obj: Obj) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Worker:
    """One worker process, seen from the orchestrator."""

    def __init__(self, argv: Sequence[str], spec: WorkerSpec) -> None:
        self.spec = spec
        self.proc = subprocess.Popen(
            [*argv, sys.executable, "-m", "bench.reflector_fleet", "--worker",
             json.dumps(asdict(spec))],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=ROOT, text=True,
            start_new_session=True)
        self.pid = 0

    def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def answer(self, timeout: float) -> Obj:
        """The next JSON line, within `timeout` (a thread reads it: stdout blocks)."""
        out: list[str] = []
        stdout: IO[str] | None = self.proc.stdout
        assert stdout is not None
        reader = threading.Thread(target=lambda: out.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not out:
            raise TimeoutError(f"worker {self.spec.first}+{self.spec.count}: no answer "
                               f"within {timeout:.0f}s")
        if not out[0]:
            raise RuntimeError(f"worker {self.spec.first}+{self.spec.count} exited "
                               f"({self.proc.poll()})")
        answer: Obj = json.loads(out[0])
        return answer

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.send("stop")
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                with contextlib.suppress(OSError):
                    pipe.close()


# --- the servers ------------------------------------------------------------------------


@dataclass
class Target:
    """What a run needs of a server: its pids, how to write, how workers reach it."""

    name: str
    pids: Callable[[], dict[str, int]]  # "apiserver" (and "etcd")
    write: Callable[[str, str, Obj | None, str], tuple[int, Any]]  # method, path, body, type
    worker_argv: Sequence[str]  # prefix: `ip netns exec NS`, or nothing
    kubeconfig: str
    slice_group_version: str
    restart: Callable[[], None]
    describe: dict[str, Any] = field(default_factory=dict)
    # GET path with this Accept header -> (status, body bytes); None: JSON only (the sim)
    get_raw: Callable[[str, str], tuple[int, bytes]] | None = None


def preload(target: Target, settings: Settings, nodes: int,
             progress: Callable[[str], None]) -> dict[str, float]:
    gv = target.slice_group_version
    jobs: list[tuple[str, str, Obj]] = []
    jobs += [("nodes", "/api/v1/nodes", node_obj(i)) for i in range(nodes)]
    jobs += [("services", f"/api/v1/namespaces/{NAMESPACE}/services", service_obj(i))
             for i in range(settings.services)]
    jobs += [("slices", f"/apis/{gv}/namespaces/{NAMESPACE}/endpointslices",
              slice_obj(settings, i, gv)) for i in range(settings.services)]
    status, body = target.write("POST", "/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        "application/json")
    assert status in (201, 409), body
    seconds: dict[str, float] = {}
    for what in ("nodes", "services", "slices"):
        started = time.monotonic()
        todo = [(path, obj) for w, path, obj in jobs if w == what]

        def post(job: tuple[str, Obj]) -> None:
            status, body = target.write("POST", job[0], job[1], "application/json")
            if status not in (201, 409):
                raise RuntimeError(f"POST {job[0]}: HTTP {status}: {str(body)[:300]}")

        with ThreadPoolExecutor(settings.parallel) as pool:
            list(pool.map(post, todo))
        seconds[what] = round(time.monotonic() - started, 1)
        progress(f"{len(todo)} {what} written in {seconds[what]}s")
    return seconds


@contextlib.contextmanager
def real_target(cp: Any) -> Iterator[Target]:
    """A running tests/realcp ControlPlane as a target, with a network namespace of its
    own for the agents, linked to the control plane's (removed on the way out)."""
    from labs.realcp.rawapi import RawApi
    from proxy.lab.topology import delete_namespace, ip

    api = RawApi(cp.host_url, token=cp.token, context=cp.ssl_context())
    with contextlib.ExitStack() as stack:
        # Named as the lab's namespaces, so that a killed run's is swept.
        ns = f"spx-{os.getpid()}-{secrets.token_hex(3)}-fleet"
        ip("netns", "add", ns)
        stack.callback(delete_namespace, ns)
        ip("-n", ns, "link", "set", "lo", "up")
        cp.attach(ns)
        stack.callback(cp.detach, ns)

        def pids() -> dict[str, int]:
            procs = cp._procs  # ControlPlane's processes (`ip netns exec` execs them)
            return {"apiserver": procs["kube-apiserver"].popen.pid,
                    "etcd": procs["etcd"].popen.pid}

        def write(method: str, path: str, body: Obj | None, ctype: str) -> tuple[int, Any]:
            status, data, _ = api.request(method, path, body, content_type=ctype, timeout=60)
            return status, data

        def get_raw(path: str, accept: str) -> tuple[int, bytes]:
            conn = http.client.HTTPSConnection("127.0.0.1", cp.forwarder.port, timeout=120,
                                               context=cp.ssl_context())
            try:
                conn.request("GET", path, headers={"Authorization": f"Bearer {cp.token}",
                                                   "Accept": accept})
                resp = conn.getresponse()
                return resp.status, resp.read()
            finally:
                conn.close()

        v = cp.version()
        yield Target("real", pids, write, ("ip", "netns", "exec", ns),
                     str(cp.node_kubeconfig), "discovery.k8s.io/v1beta1",
                     cp.restart_apiserver,
                     {"server": f"kube-apiserver {v.get('gitVersion')} "
                                f"({v.get('goVersion')}), etcd 3.4 in the same namespace "
                                "(data on tmpfs)",
                      "agents_reach_it": "over a veth, https://198.18.96.1:6443, TLS, "
                                         "bearer token (system:masters: APF-exempt)"},
                     get_raw)


JSON = "application/json"
PROTOBUF = "application/vnd.kubernetes.protobuf"


def encodings(target: Target, settings: Settings, lists: int = 50) -> dict[str, Any]:
    """What the encoding costs: `lists` watch-cache lists (resourceVersion=0) of every
    Service and EndpointSlice, one after the other, as JSON (what sliceproxy asks for)
    and as protobuf (kube-proxy's default content type): body bytes and the API
    server's CPU seconds for each."""
    assert target.get_raw is not None
    gv = target.slice_group_version
    paths = ["/api/v1/services?resourceVersion=0&limit=500",
             f"/apis/{gv}/endpointslices?resourceVersion=0&limit=500"]
    pid = target.pids()["apiserver"]
    out: dict[str, Any] = {"lists": lists}
    for name, accept in (("json", JSON), ("protobuf", PROTOBUF)):
        sizes = []
        for path in paths:
            status, body = target.get_raw(path, accept)
            if status != 200:
                raise RuntimeError(f"GET {path} as {accept}: HTTP {status}")
            sizes.append(len(body))
        before = cpu_seconds(pid)
        for _ in range(lists):
            for path in paths:
                target.get_raw(path, accept)
        out[name] = {"bytes_services": sizes[0], "bytes_slices": sizes[1],
                     "apiserver_cpu_s": round(cpu_seconds(pid) - before, 2)}
    return out


def delete_objects(target: Target, settings: Settings, nodes: int) -> None:
    """Remove what `preload` wrote (for a shared control plane). The namespace stays."""
    gv = target.slice_group_version
    paths = [f"/apis/{gv}/namespaces/{NAMESPACE}/endpointslices/s-{i}-0"
             for i in range(settings.services)]
    paths += [f"/api/v1/namespaces/{NAMESPACE}/services/s-{i}" for i in range(settings.services)]
    paths += [f"/api/v1/nodes/{node_name(i)}" for i in range(nodes)]
    with ThreadPoolExecutor(settings.parallel) as pool:
        list(pool.map(lambda p: target.write("DELETE", p, None, "application/json"), paths))


@contextlib.contextmanager
def sim_target(settings: Settings, nodes: int,
               progress: Callable[[str], None]) -> Iterator[Target]:
    """The simulator in a process of its own, started afresh by `restart` with the
    cluster's objects loaded from a manifest (no writes needed)."""
    from labs.realcp.rawapi import RawApi

    gv = "discovery.k8s.io/v1"  # converted to v1beta1 by --api-level 1.20
    with tempfile.TemporaryDirectory(prefix="sliceproxy-fleet-") as d:
        manifest = Path(d) / "cluster.json"
        items = [node_obj(i) for i in range(nodes)]
        items += [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
        items += [service_obj(i) for i in range(settings.services)]
        items += [slice_obj(settings, i, gv) for i in range(settings.services)]
        manifest.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        kubeconfig = Path(d) / "sim.kubeconfig"
        state: dict[str, Any] = {}

        def stop() -> None:
            proc = state.pop("proc", None)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)

        def start() -> None:
            stop()
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy.sim", "--listen", "127.0.0.1:0",
                 "--api-level", "1.20", "--kubeconfig-out", str(kubeconfig),
                 "-f", str(manifest)], cwd=ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
            state["proc"] = proc
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "listening on URL", after the load
            if not line.startswith("listening on "):
                raise RuntimeError(f"the simulator did not start ({proc.poll()}): {line!r}")
            state["api"] = RawApi(line.split()[-1])

        def write(method: str, path: str, body: Obj | None, ctype: str) -> tuple[int, Any]:
            status, data, _ = state["api"].request(method, path, body, content_type=ctype)
            return status, data

        try:
            start()
            progress(f"simulator up with {len(items)} objects")
            yield Target("sim", lambda: {"apiserver": state["proc"].pid}, write, (),
                         str(kubeconfig), "discovery.k8s.io/v1beta1", start,
                         {"server": "python -m proxy.sim --api-level 1.20 (one process, "
                                    "plain HTTP on the host's loopback)"})
        finally:
            stop()


# --- one run: N agents, one first-list mode -----------------------------------------------


def _totals(workers: Sequence[Worker], timeout: float) -> list[Obj]:
    for w in workers:
        w.send("report")
    return [a for w in workers for a in w.answer(timeout)["agents"]]


def _churn(target: Target, settings: Settings, n: int, workers: Sequence[Worker],
           progress: Callable[[str], None]) -> dict[str, Any]:
    gv = target.slice_group_version
    beta = gv.endswith("beta1")
    before = _totals(workers, 60)
    base = [a["events"].get("EndpointSlice", 0) for a in before]
    started = time.monotonic()
    write_s = []
    for k in range(settings.changes):
        time.sleep(max(0.0, started + k / settings.rate - time.monotonic()))  # the rate
        # Pairs of writes: one endpoint of a service becomes not ready, then ready again
        # (every write a change: an unchanged object makes no event).
        i = (k // 2) % settings.services
        not_ready = (k // (2 * settings.services)) % settings.endpoints if k % 2 == 0 else None
        sent = time.monotonic()
        status, body = target.write(
            "PATCH", f"/apis/{gv}/namespaces/{NAMESPACE}/endpointslices/s-{i}-0",
            {"endpoints": slice_endpoints(settings, i, not_ready, beta)},
            "application/merge-patch+json")
        write_s.append(time.monotonic() - sent)
        if status != 200:
            raise RuntimeError(f"PATCH slice s-{i}-0: HTTP {status}: {str(body)[:300]}")
    written = time.monotonic()
    deadline = written + settings.deadline
    while True:  # until every agent has every change (polled, with a deadline)
        after = _totals(workers, 60)
        behind = sum(1 for a, b in zip(after, base, strict=True)
                     if a["events"].get("EndpointSlice", 0) < b + settings.changes)
        if not behind:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"churn: {behind} of {n} agents missed changes (the first "
                               f"agent before: {before[0]}, after: {after[0]})")
        time.sleep(0.2)
    done = time.monotonic()
    if settings.changes % 2:  # the last pair is open: leave every endpoint ready
        i = (settings.changes // 2) % settings.services
        target.write("PATCH", f"/apis/{gv}/namespaces/{NAMESPACE}/endpointslices/s-{i}-0",
                     {"endpoints": slice_endpoints(settings, i, None, beta)},
                     "application/merge-patch+json")
    received = [a["bytes"] - b["bytes"] for a, b in zip(after, before, strict=True)]
    return {"seconds_writing": round(written - started, 2),
            "seconds_to_all_received": round(done - started, 2),
            "last_write_to_all_received_s": round(done - written, 2),
            "patch_median_ms": round(statistics.median(write_s) * 1000, 1),
            "bytes_per_agent_per_change": round(statistics.mean(received) / settings.changes),
            "bytes_per_agent_per_change_max": round(max(received) / settings.changes)}


def run_one(target: Target, settings: Settings, n: int, first_list: str,
            progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
    target.restart()  # a fresh server process: a fresh baseline, a fresh watch cache
    pids = target.pids()
    per = -(-n // settings.workers)
    specs = [WorkerSpec(target.kubeconfig, first, min(per, n - first),
                        first_list == "consistent") for first in range(0, n, per)]
    workers: list[Worker] = []
    try:
        for spec in specs:
            workers.append(Worker(target.worker_argv, spec))
        for w in workers:
            w.pid = int(w.answer(settings.deadline)["pid"])
        idle = snapshot(pids)
        wpids = {f"worker{k}": w.pid for k, w in enumerate(workers)}
        w0 = snapshot(wpids)
        with Sampler({**pids, **wpids}) as sampler:
            started = time.monotonic()
            for w in workers:
                w.send("start")
            synced = [t for w in workers for t in w.answer(settings.deadline)["synced_at"]]
            synced_s = [t - started for t in synced]
            s1 = snapshot(pids)
            w1 = snapshot(wpids)
            peak_start = dict(sampler.peak)
            reports = _totals(workers, 60)
            progress(f"{target.name} {first_list} N={n}: all synced in "
                     f"{max(synced_s):.1f}s, API server CPU "
                     f"{s1['apiserver']['cpu_s'] - idle['apiserver']['cpu_s']:.1f}s")
            for name in sampler.peak:
                sampler.peak[name] = 0.0
            churn = _churn(target, settings, n, workers, progress)
            s2 = snapshot(pids)
            w2 = snapshot(wpids)
            peak_churn = dict(sampler.peak)
    finally:
        for w in workers:
            w.stop()

    def phase(a: Mapping[str, Mapping[str, float]], b: Mapping[str, Mapping[str, float]],
              peak: Mapping[str, float]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in pids:
            out[name] = {"cpu_s": round(b[name]["cpu_s"] - a[name]["cpu_s"], 2),
                         "rss_before_mib": round(a[name]["rss_mib"]),
                         "peak_rss_mib": round(peak[name]),
                         "hwm_mib": round(b[name]["hwm_mib"])}
        return out

    first_bytes = [r["bytes"] for r in reports]
    result = {
        "agents": n, "first_list": first_list, "workers": len(workers),
        "start": {
            **phase(idle, s1, peak_start),
            "all_synced_s": round(max(synced_s), 2),
            "median_synced_s": round(statistics.median(synced_s), 2),
            "workers_cpu_s": round(sum(w1[k]["cpu_s"] - w0[k]["cpu_s"] for k in wpids), 1),
            "workers_peak_rss_mib": round(sum(peak_start[k] for k in wpids)),
            "bytes_per_agent": round(statistics.mean(first_bytes)),
            "objects_per_agent": _objects(reports),
            # failed lists or watches, retried (e.g. an answer not read within
            # request_timeout while the server was busy): a list read twice
            "reflector_errors": sum(r["errors"] for r in reports),
        },
        "churn": {**phase(s1, s2, peak_churn), **churn,
                  "workers_cpu_s": round(sum(w2[k]["cpu_s"] - w1[k]["cpu_s"]
                                             for k in wpids), 1)},
    }
    return result


def _objects(reports: Sequence[Obj]) -> dict[str, int]:
    """What the first agent holds per resource (all agents hold the same)."""
    first: dict[str, int] = reports[0]["objects"]
    return first


def run(target: Target, settings: Settings,
        progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
    settings.check()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "settings": asdict(settings), "machine": machine(), **target.describe,
        "runs": []}
    for first_list in settings.first_lists:
        for n in settings.agents:
            result["runs"].append(run_one(target, settings, n, first_list, progress))
    return result


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], check=False, capture_output=True, text=True,
                                   timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         check=False, capture_output=True, text=True,
                         timeout=10).stdout.strip()
    return {"cpu": model, "nproc": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "sliceproxy": git,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


# --- output ---------------------------------------------------------------------------------


def markdown(result: Mapping[str, Any]) -> str:
    s = result["settings"]
    lines = [f"{result.get('server', s['server'])}; {s['services']} services x "
             f"{s['endpoints']} endpoints, {s['changes']} changes at {s['rate']}/s; "
             f"{result['machine']['cpu']}, {result['machine']['nproc']} CPUs",
             "",
             "| first list | N | start: API server CPU s | peak RSS MiB (before) | etcd CPU s | "
             "all synced s | bytes/agent | workers CPU s | churn: API server CPU s | "
             "etcd CPU s | bytes/agent/change | all received s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        st, ch = r["start"], r["churn"]
        etcd = st.get("etcd", {}).get("cpu_s", "-")
        etcd_ch = ch.get("etcd", {}).get("cpu_s", "-")
        lines.append(
            f"| {r['first_list']} | {r['agents']} | {st['apiserver']['cpu_s']} | "
            f"{st['apiserver']['peak_rss_mib']} ({st['apiserver']['rss_before_mib']}) | "
            f"{etcd} | {st['all_synced_s']} | {st['bytes_per_agent']:,} | "
            f"{st['workers_cpu_s']} | {ch['apiserver']['cpu_s']} | {etcd_ch} | "
            f"{ch['bytes_per_agent_per_change']:,} | {ch['seconds_to_all_received']} |")
    enc = result.get("encodings")
    if enc:
        lines += ["", f"{enc['lists']} watch-cache lists of all Services and all "
                  "EndpointSlices, one after the other: "
                  + "; ".join(f"{name} {enc[name]['bytes_services'] + enc[name]['bytes_slices']:,}"
                              f" bytes per pair, API server CPU {enc[name]['apiserver_cpu_s']} s"
                              for name in ("json", "protobuf"))]
    return "\n".join(lines)


def _on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds the with-blocks: everything is cleaned up


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["--worker"]:
        return worker_main(WorkerSpec(**json.loads(args_list[1])))
    p = argparse.ArgumentParser(prog="python -m bench.reflector_fleet",
                                description=__doc__.splitlines()[0])
    p.add_argument("--server", choices=("real", "sim"), default="real")
    p.add_argument("--size", choices=sorted(SIZES), default="small",
                   help="defaults for the rest (small: CI-sized; full: the issue's)")
    p.add_argument("--agents", type=int, nargs="+")
    p.add_argument("--first-list", nargs="+", choices=("cache", "consistent"),
                   default=["cache"])
    p.add_argument("--services", type=int)
    p.add_argument("--endpoints", type=int, help="per service")
    p.add_argument("--changes", type=int)
    p.add_argument("--rate", type=float, help="changes per second")
    p.add_argument("--workers", type=int, default=1, help="agent processes")
    p.add_argument("--deadline", type=float, default=600.0, help="per phase, seconds")
    p.add_argument("--json", type=Path, help="write the full results here")
    args = p.parse_args(args_list)
    size = SIZES[args.size]
    settings = Settings(
        server=args.server, agents=tuple(args.agents or size["agents"]),
        first_lists=tuple(args.first_list),
        services=args.services or size["services"],
        endpoints=args.endpoints or size["endpoints"],
        changes=args.changes or size["changes"], rate=args.rate or size["rate"],
        workers=args.workers, deadline=args.deadline)
    settings.check()
    if args.server == "real" and os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the API server's sockets

    def progress(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    result = run_cli(settings, progress)
    result["command"] = "python -m bench.reflector_fleet " + " ".join(args_list)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


def run_cli(settings: Settings, progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
    """The whole bench: start the server, preload, run every (mode, N), stop."""
    nodes = max(settings.agents)
    if settings.server == "sim":
        with sim_target(settings, nodes, progress) as target:
            return run(target, settings, progress)
    from labs.realcp.build import build
    from labs.realcp.controlplane import ControlPlane

    with ControlPlane(build()) as cp, real_target(cp) as target:
        progress(f"control plane up in namespace {cp.namespace}")
        seconds = preload(target, settings, nodes, progress)
        result = {**run(target, settings, progress), "preload_s": seconds}
        result["encodings"] = encodings(target, settings)
        progress(f"encodings: {result['encodings']}")
        return result


def settings_for(size: str, **over: Any) -> Settings:
    s = SIZES[size]
    base = Settings(agents=tuple(s["agents"]), services=s["services"],
                    endpoints=s["endpoints"], changes=s["changes"], rate=s["rate"])
    return replace(base, **over)


if __name__ == "__main__":
    sys.exit(main())
