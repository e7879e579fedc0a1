"""Each endpoint's traffic, as an operator reads it (/metrics, /debug/dump), against
what the client really sent (dataplane/common/traffic.py): the real agent in a node
namespace, fresh TCP connections from the client namespace, every count exact; across
an agent restart; and across a change that rewrites the port's rules. A service without
the annotation is counted per port only: no per-endpoint series."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.netns_lab import BackendSpec, Lab, probe
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    namespace_object,
    node_object,
    service,
    start_sim,
    wait_for,
)

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

COUNTED, PLAIN = "198.18.128.30", "198.18.128.31"
PER_ENDPOINT = {"sliceproxy.io/traffic-per-endpoint": "true"}
MODES = ["nftables", "iptables"]


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab([BackendSpec("web-1"), BackendSpec("web-2"), BackendSpec("web-3")]) as lab:
        lab.start_backends()
        yield lab


@pytest.fixture
def sim(lab: Lab) -> Iterator[SimServer]:
    with start_sim(lab, [node_object(), namespace_object("demo")]) as server:
        yield server


def publish(sim: SimServer, lab: Lab, name: str, vip: str, backends: tuple[str, ...],
            annotations: dict[str, str] | None = None) -> None:
    svc = service(name, [vip])
    if annotations:
        svc["metadata"]["annotations"] = annotations
    sim.apply(svc)
    sim.apply(endpoint_slice(name, name, [endpoint(lab.backends[n].ipv4) for n in backends]))


def series(agent: AgentProcess, scope: str, name: str) -> dict[str, float]:
    """The agent's connection counts for service `name`: by endpoint ("" for the port)."""
    prefix = f"sliceproxy_{scope}_connections_total{{"
    out = {}
    for key, value in agent.metrics().items():
        if key.startswith(prefix) and f'service="{name}"' in key:
            endpoint_label = key.partition('endpoint="')[2].partition('"')[0]
            out[endpoint_label] = value
    return out


def expected(lab: Lab, answered: Counter[str]) -> dict[str, float]:
    """What the per-endpoint series must say: each backend's answers, by its address."""
    return {f"{lab.backends[n].ipv4}:8080": float(count) for n, count in answered.items()}


def plus(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in {*a, *b}}


def send(lab: Lab, vip: str, count: int) -> Counter[str]:
    answered = probe.ask(lab.client_ns, vip, 80, count=count, timeout=2.0)
    assert set(answered) <= {"web-1", "web-2", "web-3"}, answered
    assert sum(answered.values()) == count
    return answered


def settle(agent: AgentProcess, name: str, total: float) -> dict[str, float]:
    """The per-endpoint series once the port's total says `total` (the scrape reads the
    kernel, so it is exact at once; polled only while a sync may still be writing)."""
    wait_for(lambda: series(agent, "service", name).get("") == total, 10,
             f"{name}'s connection count at {total}",
             detail=lambda: series(agent, "service", name))
    return series(agent, "endpoint", name)


@pytest.mark.parametrize("mode", MODES)
def test_counts_are_what_the_client_sent_across_a_restart_and_a_change(
        lab: Lab, sim: SimServer, tmp_path: Path, mode: str) -> None:
    publish(sim, lab, "counted", COUNTED, ("web-1", "web-2", "web-3"), PER_ENDPOINT)
    publish(sim, lab, "plain", PLAIN, ("web-1", "web-2"))
    agent = AgentProcess(lab, sim, tmp_path, "--proxy-mode", mode).start()
    try:
        agent.wait_ready()
        lab.wait_for(lab.client_ns, COUNTED, 80, {"web-1", "web-2", "web-3"})
        lab.wait_for(lab.client_ns, PLAIN, 80, {"web-1", "web-2"})
        # wait_for's own connections count too: start from what the agent says now.
        base = settle(agent, "counted", series(agent, "service", "counted")[""])
        base_plain = series(agent, "service", "plain")[""]
        answered = send(lab, COUNTED, 30)
        total = sum(base.values()) + 30
        got = settle(agent, "counted", total)
        assert got == plus(base, expected(lab, answered))
        send(lab, PLAIN, 10)
        settle(agent, "plain", base_plain + 10)
        assert series(agent, "endpoint", "plain") == {}  # counted per port only
        doc = agent.dump("demo/counted")["services"][0]["traffic"]
        assert doc["connections"] == total
        assert {k: float(v["connections"]) for k, v in doc["endpoints"].items()} == got

        # A restart: the kernel kept counting; the new agent reads on from there.
        agent.stop()
        more = send(lab, COUNTED, 12)  # while no agent runs: the rules still count
        agent = AgentProcess(lab, sim, tmp_path, "--proxy-mode", mode, name="agent-2").start()
        agent.wait_ready()
        more.update(send(lab, COUNTED, 18))
        total += 30
        after = settle(agent, "counted", total)
        assert after == plus(got, expected(lab, more))

        # web-3 leaves: the port's rules are rewritten, the others' counts stay.
        publish(sim, lab, "counted", COUNTED, ("web-1", "web-2"), PER_ENDPOINT)
        lab.wait_for(lab.client_ns, COUNTED, 80, {"web-1", "web-2"})
        now = series(agent, "service", "counted")[""]
        kept = settle(agent, "counted", now)
        gone = f"{lab.backends['web-3'].ipv4}:8080"
        assert set(kept) == set(after) - {gone}  # web-3's series went with it
        assert all(kept[k] >= after[k] for k in kept)  # the rewrite reset nothing
        last = send(lab, COUNTED, 10)
        assert settle(agent, "counted", now + 10) == plus(kept, expected(lab, last))
    finally:
        if agent.alive():
            agent.stop()
