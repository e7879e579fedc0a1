"""Another service proxy programming the node, as an operator would see it: the real
agent in a lab node where kube-proxy's leftovers (iptables-nft and iptables-legacy, both
of a kube-proxy gone) raise nothing; then a "kube-proxy" writes (its v1.20 iptables
mode's restore of KUBE-SERVICES, then its nftables mode's table) and the agent says so
in its log, /metrics and /healthz within a few checks; then its rules are removed as
`kube-proxy --cleanup` removes them, and the agent says it is over.

The rules are kube-proxy's text (labs/kube_proxy_rules.py) for three services; every
wait polls with a deadline."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from labs.kube_proxy_rules import cleanup, hooks, iptables_restore, nftables
from proxy.dataplane.common.foreign_proxy import KubeProxyReader
from proxy.dataplane.common.kube_proxy_objects import writes
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from tests.e2e.agent_support import (
    HEALTHZ_PORT,
    AgentProcess,
    node_object,
    start_sim,
    wait_for,
)

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

INTERVAL = "200ms"  # the agent's check, so the test waits little (default 10s)
DEADLINE = 10.0
ACTIVE = 'sliceproxy_foreign_proxy_active{proxy="kube-proxy"}'
DETECTIONS = 'sliceproxy_foreign_proxy_detections_total{proxy="kube-proxy"}'
CHECKS = "sliceproxy_foreign_proxy_checks_total"
MESSAGE = "another service proxy is programming this node"
ENDED = "another service proxy stopped programming this node"


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab(ipv6=False) as lab:
        yield lab


def restore(lab: Lab, backend: str, text: str) -> None:
    result = lab.exec(lab.node_ns, [f"iptables-{backend}-restore", "-w", "5", "--noflush"],
                      input=text)
    assert result.returncode == 0, result.stderr


def lines(agent: AgentProcess, msg: str) -> list[dict[str, Any]]:
    out = []
    for line in agent.log_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if record.get("msg") == msg:
            out.append(record)
    return out


def healthz_foreign(agent: AgentProcess) -> list[dict[str, Any]]:
    status, body = agent.healthz()
    assert status == 200, body  # shown in the body, never failing the probe
    found: list[dict[str, Any]] = body.get("foreignProxies", [])
    return found


def test_kube_proxy_writing_is_reported_and_its_leftovers_are_not(
        lab: Lab, tmp_path: Path) -> None:
    rules = iptables_restore(3)
    for backend in ("nft", "legacy"):  # a kube-proxy that ran here once, on either
        restore(lab, backend, rules + hooks())
    sim = start_sim(lab, [node_object()])
    try:
        agent = AgentProcess(lab, sim, tmp_path, "--foreign-proxy-check-interval", INTERVAL,
                             "--logging-format", "json").start()
        agent.wait_ready()

        # Leftovers nobody writes: checked several times, nothing said.
        wait_for(lambda: agent.metrics().get(CHECKS, 0) >= 4, DEADLINE, "a few checks",
                 detail=agent.log_tail)
        samples = agent.metrics()
        assert samples[ACTIVE] == 0 and samples[DETECTIONS] == 0
        assert lines(agent, MESSAGE) == [] and healthz_foreign(agent) == []

        # kube-proxy's sync rewrites KUBE-SERVICES (iptables-nft: new rule handles).
        restore(lab, "nft", rules)
        wait_for(lambda: agent.metrics()[ACTIVE] == 1, DEADLINE,
                 "the agent to report kube-proxy", detail=agent.log_tail)
        (error,) = lines(agent, MESSAGE)
        assert error["level"] == "error" and error["proxy"] == "kube-proxy"
        assert error["backends"] == "iptables-nft IPv4"
        assert "nat chain KUBE-SERVICES" in error["objects"]
        (shown,) = healthz_foreign(agent)
        assert shown["name"] == "kube-proxy"
        assert "iptables-nft IPv4 nat chain KUBE-SERVICES" in shown["objects"]
        assert agent.livez() == 200

        # Its nftables mode's table, written: seen too, in the same episode.
        before = agent.metrics()[DETECTIONS]
        result = lab.exec(lab.node_ns, ["nft", "-f", "-"], input=nftables(3))
        assert result.returncode == 0, result.stderr
        wait_for(lambda: any("nftables IPv4 table ip kube-proxy" in obj
                             for p in healthz_foreign(agent) for obj in p["objects"]),
                 DEADLINE, "the nftables table in /healthz", detail=agent.log_tail)
        assert agent.metrics()[DETECTIONS] > before
        assert len(lines(agent, MESSAGE)) == 1  # not repeated at every write

        # Removed, as kube-proxy --cleanup removes them: over, said once.
        restore(lab, "nft", cleanup(rules))
        restore(lab, "legacy", cleanup(rules))
        result = lab.exec(lab.node_ns, ["nft", "delete", "table", "ip", "kube-proxy"])
        assert result.returncode == 0, result.stderr
        wait_for(lambda: agent.metrics()[ACTIVE] == 0, DEADLINE,
                 "the agent to say kube-proxy stopped", detail=agent.log_tail)
        (ended,) = lines(agent, ENDED)
        assert ended["level"] == "info" and ended["why"] == "its objects were removed"
        assert healthz_foreign(agent) == []
        assert agent.get("/healthz", HEALTHZ_PORT)[0] == 200
        agent.stop()
    finally:
        sim.stop()


@pytest.mark.parametrize("backend", ["iptables-nft", "iptables-legacy", "nftables", "ipvs"])
def test_the_cost_benchmark_reads_each_back_end(backend: str) -> None:
    """bench/foreign_proxy_check.py at a tiny size, so it keeps working: the check
    finds kube-proxy's objects in each back end, sees each "sync" as a write, and
    neither a check where nothing changed nor another nf_tables commit as one."""
    from bench.foreign_proxy_check import measure

    result = measure(backend, 20, repeat=1)
    assert result["objects"] >= 1, result
    assert result["kube-proxy-wrote_detected"] == 1, result
    assert result["steady_detected"] == result["other-commit_detected"] == 0, result


def test_a_legacy_rewrite_of_the_same_rules_shows_through_their_counters(lab: Lab) -> None:
    """iptables-legacy has no handles: kube-proxy writing the same text again is seen
    only because the rewrite resets the counters of rules that had matched packets."""
    rules = iptables_restore(2)
    counted = rules.replace("-A KUBE-SERVICES ", "[7:420] -A KUBE-SERVICES ")
    result = lab.exec(lab.node_ns, ["iptables-legacy-restore", "-w", "5", "-c"],
                      input=counted)
    assert result.returncode == 0, result.stderr
    with entered(lab.node_ns):
        reader = KubeProxyReader(budget=None)
        try:
            before = reader.read()
            assert writes(before, reader.read()) == []  # as it was: nothing
            restore(lab, "legacy", rules)  # the same text, counters from zero
            after = reader.read()
        finally:
            reader.close()
    assert [str(p) for p in writes(before, after)] == [
        "iptables-legacy IPv4 nat chain KUBE-SERVICES"]
