"""Helpers for the agent's integration tests: a test double of OUR data-plane interface
(proxy/dataplane/base.py) and an in-process agent against the simulator.

The double only records what it was asked to apply; the traffic tests in tests/e2e use
the real data planes and the kernel.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from proxy.agent.app import Agent
from proxy.config.options import Config, parse_args
from proxy.dataplane.base import (
    ApplyError,
    Counted,
    GiveWay,
    PortTraffic,
    SyncReport,
    TrafficRead,
    offer_lock,
)
from proxy.kube.reflector import ReflectorOptions
from proxy.model.snapshot import DesiredState, ResolvedServicePort
from proxy.model.types import Family, IPAddress, ServicePortKey, format_endpoint
from proxy.netns_lab.poll import wait
from proxy.sim import SimServer

T = TypeVar("T")


@dataclass
class FakeDataPlane:
    """Records every sync; can be gated (to hold a sync) or told to fail."""

    mode: str = "fake"
    syncs: list[tuple[bool, DesiredState]] = field(default_factory=list)
    threads: set[int] = field(default_factory=set)
    gate: threading.Event = field(default_factory=threading.Event)
    fail_next: int = 0
    # What each sync, or injected failure, adds to the mode's own counters.
    counted: dict[str, int] = field(default_factory=dict)
    rendered_ahead: int = 0  # ports handed to render_ahead before the first sync
    housekept: int = 0
    parts_left: int = 0  # housekeeping calls that leave work for the next (nftables' marks)
    resync_parts: int = 0  # the parts a periodic resync takes (0: a full sync instead)
    resyncs: int = 0  # resyncs begun in parts
    repairs: int = 0  # of them, repairs after drift
    housekeeping_fails: int = 0  # housekeeping calls to refuse (a resync's part refused)
    closed: bool = False
    cleaned: bool = False
    # Drift: what the next check_drift reports, the agent's notify callback once it
    # asked, and how many checks it made.
    drift: list[str] = field(default_factory=list)
    notify: Callable[[str], None] | None = None
    drift_checks: int = 0
    # Traffic readings: the threads their reading part ran on; while `reading_gate` is
    # set and not open, that part waits for it (a slow kernel dump).
    reading_threads: set[int] = field(default_factory=set)
    reading_gate: threading.Event | None = None
    _applied: DesiredState | None = None

    def __post_init__(self) -> None:
        self.gate.set()

    def sync(self, state: DesiredState, full: bool = False) -> SyncReport:
        self.threads.add(threading.get_ident())
        if not self.gate.wait(timeout=60):
            raise ApplyError("gate never opened")
        if self.fail_next:
            self.fail_next -= 1
            raise ApplyError("injected failure", offending="-A FAKE", counted=self.counted)
        old = self._applied.ports if self._applied is not None else {}
        written = tuple(k for k, v in state.ports.items() if full or old.get(k) is not v)
        removed = tuple(k for k in old if k not in state.ports)
        self._applied = state
        self.syncs.append((full, state))
        return SyncReport(full=full, written=written, removed=removed,
                          operations=len(written) + len(removed), counted=dict(self.counted))

    @property
    def applied(self) -> DesiredState | None:
        return self._applied

    def endpoints(self, service: str, port: str = "") -> set[str]:
        """Cluster endpoints last applied for a service port (any family)."""
        state = self._applied
        if state is None:
            return set()
        return {str(ep) for rsp in state for ep in rsp.cluster_endpoints
                if rsp.key.service == service and rsp.key.port == port}

    def applied_rules(self, key: ServicePortKey) -> Sequence[str]:
        rsp = self._applied.get(key) if self._applied is not None else None
        if rsp is None:
            return []
        return [f"-> {format_endpoint(ep.address, ep.port)}" for ep in rsp.cluster_endpoints]

    def traffic(self) -> Mapping[ServicePortKey, PortTraffic]:
        """One connection counted per applied port (a fake kernel counts nothing)."""
        ports = self._applied.ports if self._applied is not None else {}
        return {k: PortTraffic(Counted(1)) for k in ports}

    def traffic_reader(self, give_way: GiveWay = offer_lock) -> TrafficRead:
        self.threads.add(threading.get_ident())
        ports = self.traffic()
        gate = self.reading_gate

        def read() -> Mapping[ServicePortKey, PortTraffic]:
            self.reading_threads.add(threading.get_ident())
            if gate is not None and not gate.wait(timeout=60):
                raise OSError("reading gate never opened")
            return ports
        return read

    def housekeeping(self) -> None:
        self.threads.add(threading.get_ident())
        self.housekept += 1
        self.parts_left = max(0, self.parts_left - 1)
        if self.housekeeping_fails:
            self.housekeeping_fails -= 1
            raise ApplyError("injected housekeeping failure")

    def housekeeping_pending(self) -> bool:
        return self.parts_left > 0

    def begin_resync(self, repair: bool) -> bool:
        """`resync_parts` more housekeeping parts, if set; else a full sync resyncs."""
        self.parts_left += self.resync_parts
        self.resyncs += bool(self.resync_parts)
        self.repairs += repair and bool(self.resync_parts)
        return self.resync_parts > 0

    def render_ahead(self, ports: Sequence[ResolvedServicePort],
                     expected: Mapping[Family, int],
                     primary_ips: Sequence[IPAddress] = ()) -> None:
        self.threads.add(threading.get_ident())
        self.rendered_ahead += len(ports)

    def watch_drift(self, notify: Callable[[str], None]) -> None:
        self.notify = notify

    def check_drift(self) -> list[str]:
        """What a test put in `drift` (someone else's change), once."""
        self.drift_checks += 1
        found, self.drift = self.drift, []
        return found

    def cleanup(self) -> None:
        self.cleaned = True

    def close(self) -> None:
        self.closed = True


class AgentThread:
    """The real Agent on its own event loop thread, with a fake data plane."""

    def __init__(self, config: Config, dataplane: FakeDataPlane,
                 reflector_options: ReflectorOptions | None = None) -> None:
        self.config, self.dataplane = config, dataplane
        self.agent = Agent(config, dataplane_factory=lambda: dataplane,
                           reflector_options=reflector_options, started_at=time.monotonic())
        self.loop = asyncio.new_event_loop()
        self.stop_event: asyncio.Event | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="agent", daemon=True)
        self._ready = threading.Event()

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)

        async def go() -> None:
            self.stop_event = asyncio.Event()
            self._ready.set()
            await self.agent.run(self.stop_event)

        try:
            self.loop.run_until_complete(go())
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def start(self) -> AgentThread:
        self._thread.start()
        self._ready.wait(10)
        return self

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run fn on the agent's loop (where the model lives) and return its result."""
        async def wrapped() -> Any:
            return fn()
        return asyncio.run_coroutine_threadsafe(wrapped(), self.loop).result(10)

    def dump(self, service: str | None = None) -> dict[str, Any]:
        fut = asyncio.run_coroutine_threadsafe(self.agent.debug_dump(service), self.loop)
        result: dict[str, Any] = fut.result(10)
        return result

    def stop(self, timeout: float = 10.0) -> None:
        if self.stop_event is not None and self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.stop_event.set)
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


def wait_until(cond: Callable[[], T | None], timeout: float = 10.0,
               what: str = "condition") -> T:
    """The project's `wait` (returns what `cond` returned) with this tier's defaults."""
    return wait(cond, timeout, what, interval=0.02)


FAST_WATCH = ReflectorOptions(min_watch_timeout=30, backoff_initial=0.05, backoff_max=0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextmanager
def running_agent(sim: SimServer, tmp: Path, *flags: str,
                  dataplane: FakeDataPlane | None = None) -> Iterator[AgentThread]:
    kubeconfig = sim.write_kubeconfig(tmp / "kubeconfig")
    config = parse_args(["--kubeconfig", str(kubeconfig), "--hostname-override", "node-a",
                         "--healthz-bind-address", f"127.0.0.1:{free_port()}",
                         "--metrics-bind-address", f"127.0.0.1:{free_port()}", *flags])
    agent = AgentThread(config, dataplane or FakeDataPlane(), FAST_WATCH).start()
    try:
        yield agent
    finally:
        agent.stop()
