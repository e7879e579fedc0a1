"""The real agent process in a node namespace, against the simulator: when the first
sync happens, what a stop, a restart and --cleanup do to the rules and to traffic."""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.netns_lab import BackendSpec, Lab
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    node_object,
    our_rules,
    run_cli,
    service,
    start_sim,
    wait_for,
)

pytestmark = pytest.mark.root

VIP = "198.18.128.10"


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab([BackendSpec("web-1"), BackendSpec("web-2", node="node-b")]) as lab:
        lab.start_backends()
        yield lab


def web_objects(lab: Lab) -> list[dict[str, object]]:
    b = lab.backends
    return [node_object(), service("web", [VIP]),
            endpoint_slice("zz-web", "web", [endpoint(b["web-1"].ipv4),
                                             endpoint(b["web-2"].ipv4, node="node-b")])]


@pytest.fixture
def sim(lab: Lab) -> Iterator[SimServer]:
    with start_sim(lab, web_objects(lab)) as server:
        yield server


def test_first_sync_waits_until_every_list_is_complete(lab: Lab, tmp_path: Path) -> None:
    # 1,100 unrelated slices make the EndpointSlice list three pages of 500 (the
    # reflector's page size) while Services and the Node list in one page, and every
    # request is slowed down: the service is known long before its endpoints are.
    # web's slice sorts last, so it arrives with the last page. (Pages: a server
    # without the watch cache; with it, the first lists come whole.)
    fillers = [endpoint_slice(f"filler-{i:04d}", "nothing", [endpoint(f"198.18.2.{i % 250}")])
               for i in range(1100)]
    sim = start_sim(lab, [*fillers, *web_objects(lab)], watch_cache=False)
    try:
        sim.set_latency(0.4)
        agent = AgentProcess(lab, sim, tmp_path).start()
        # While the slices are still listing: no rules, not ready, no sync.
        wait_for(lambda: "initial list done\" resource=services.v1" in agent.log_text(),
                 20, "the services list")
        assert "every watched resource has listed" not in agent.log_text()
        assert our_rules(lab) == []
        assert agent.healthz()[0] == 503 and agent.livez() == 200
        assert agent.dump()["syncs"] == []
        agent.wait_ready()
        sim.set_latency(0.0)
        log = agent.log_text()
        order = [log.index(f'initial list done" resource={r}')
                 for r in ("services.v1", "nodes.v1", "endpointslices.discovery.k8s.io/v1")]
        assert max(order) < log.index("every watched resource has listed")
        # Exactly one sync, the full one, and it already had web's endpoints.
        syncs = agent.dump()["syncs"]
        assert [(s["trigger"], s["full"]) for s in syncs] == [("initial", True)]
        assert set(lab.ask(lab.client_ns, VIP, 80, count=20)) == {"web-1", "web-2"}
        assert agent.metrics()['sliceproxy_syncs_total{kind="full",result="ok"}'] == 1
        agent.stop()
    finally:
        sim.stop()


def test_sigterm_leaves_rules_serving_and_cleanup_removes_them(
        lab: Lab, sim: SimServer, tmp_path: Path) -> None:
    agent = AgentProcess(lab, sim, tmp_path).start()
    startup = agent.wait_ready()
    rules = our_rules(lab)
    assert rules
    assert set(lab.ask(lab.client_ns, VIP, 80, count=20)) == {"web-1", "web-2"}
    seconds = agent.stop()
    assert agent.proc is not None and agent.proc.returncode == 0
    assert seconds < 5, f"SIGTERM took {seconds:.1f}s"
    assert "stopping; the rules stay in place" in agent.log_text()
    # The agent is gone; its rules are not, and neither is the traffic.
    assert our_rules(lab) == rules
    assert set(lab.ask(lab.client_ns, VIP, 80, count=20)) == {"web-1", "web-2"}
    # --cleanup needs no API server: no kubeconfig at all.
    done = run_cli(lab, ["--cleanup", "--hostname-override", "node-a"])
    assert done.returncode == 0, done.stderr
    assert our_rules(lab) == []
    assert set(lab.ask(lab.client_ns, VIP, 80, count=5, timeout=0.3)) == {"timeout"}
    print(f"\nstartup to first sync: {startup:.2f}s; SIGTERM to exit: {seconds:.2f}s")


def test_sigint_stops_too(lab: Lab, sim: SimServer, tmp_path: Path) -> None:
    import signal

    agent = AgentProcess(lab, sim, tmp_path, "--no-uvloop").start()
    agent.wait_ready()
    assert 'event_loop=asyncio' in agent.log_text()
    assert agent.stop(signal.SIGINT) < 5
    assert agent.proc is not None and agent.proc.returncode == 0


def test_restart_keeps_established_flows_and_new_connections(
        lab: Lab, sim: SimServer, tmp_path: Path) -> None:
    first = AgentProcess(lab, sim, tmp_path, name="first").start()
    first.wait_ready()
    results: Counter[str] = Counter()
    stop = threading.Event()

    def probe() -> None:
        # Fresh connections all through the restart, about 100 a second (the wait only
        # paces them); bounded in count and time.
        end = time.monotonic() + 60
        while time.monotonic() < end and sum(results.values()) < 5000:
            results.update(lab.ask(lab.client_ns, VIP, 80, count=1, timeout=1.0))
            if stop.wait(0.01):
                return

    with lab.hold(lab.client_ns, VIP, 80) as flow:
        backend = flow.ask()
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        try:
            wait_for(lambda: sum(results.values()) >= 20, 20, "probes before the restart")
            first.stop()
            second = AgentProcess(lab, sim, tmp_path, name="second").start()
            starting = sum(results.values())
            second.wait_ready()
            before = sum(results.values())
            # Connections were made while the new agent started up and took over (a
            # start-up that flushed the old rules first would show here as timeouts).
            assert before - starting >= 10, (starting, before)
            wait_for(lambda: sum(results.values()) >= before + 20, 20,
                     "probes after the restart")
            assert flow.ask() == backend  # the established flow never noticed
        finally:
            stop.set()
            prober.join(10)
    assert set(results) <= {"web-1", "web-2"}, results
    assert second.dump()["syncs"][-1]["trigger"] == "initial"
    second.stop()
