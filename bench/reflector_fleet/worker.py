"""The worker: many agents' watch layers in one process, driven over stdin/stdout."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import resource
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import IO

from bench.common import ROOT
from bench.reflector_fleet.workload import Obj, node_name
from proxy.kube.client import Api, Response
from proxy.kube.cluster_watch import ClusterWatch
from proxy.kube.reflector import WatchEvent

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
    from proxy.kube.cluster_watch import endpoint_slice_resource
    from proxy.kube.ingest import EndpointsSource
    from proxy.kube.reflector import ReflectorOptions

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
