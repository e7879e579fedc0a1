"""Where the real agent listens, in a node namespace made by the test: with default flags
/healthz answers on both families, from the node and from another host, as kube-proxy's
does (the kubelet probes an IPv6 node on its IPv6 address); on IPv4 alone where the
namespace has IPv6 disabled; and /debug/dump, with the metrics server on every address
(as kubeadm clusters scraped by Prometheus set it), answers loopback clients only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.netns_lab import Lab
from proxy.netns_lab.poll import wait as wait_for
from proxy.netns_lab.probe import http_get
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    HEALTHZ_PORT,
    METRICS_PORT,
    AgentProcess,
    node_object,
    run_cli,
    start_sim,
)

pytestmark = pytest.mark.root


def started(lab: Lab, sim: SimServer, tmp_path: Path, *flags: str) -> AgentProcess:
    agent = AgentProcess(lab, sim, tmp_path, *flags).start()
    wait_for(lambda: agent.livez() == 200 or agent._dead(), 20, "the agent's /livez")
    return agent


def livez(lab: Lab, ns: str, host: object) -> int:
    return http_get(ns, str(host), HEALTHZ_PORT, "/livez", timeout=2.0)[0]


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab() as lab:
        yield lab


@pytest.fixture
def sim(lab: Lab) -> Iterator[SimServer]:
    with start_sim(lab, [node_object()]) as server:
        yield server


def test_default_health_server_answers_both_families_and_the_dump_loopback_only(
        lab: Lab, sim: SimServer, tmp_path: Path) -> None:
    agent = started(lab, sim, tmp_path, "--metrics-bind-address", "0.0.0.0:10249")
    node, client = lab.node_ns, lab.client_ns
    # /healthz's server, default flags: every address of both families.
    answered = {(ns, str(host)): livez(lab, ns, host) for ns, host in (
        (node, "127.0.0.1"), (node, "::1"), (client, lab.node_ip4), (client, lab.node_ip6))}
    assert set(answered.values()) == {200}, answered
    assert 'msg="serving healthz" address=[::]:10256 families="IPv4 and IPv6"' \
        in agent.log_text()
    # The dump: loopback clients, of either family, and the node's own command.
    assert agent.get("/debug/dump", host="127.0.0.1")[0] == 200
    assert agent.get("/debug/dump", host="::1")[0] == 200
    done = run_cli(lab, ["dump", "-o", "json"], timeout=30)
    assert done.returncode == 0 and "services" in json.loads(done.stdout), done.stderr
    # Anyone else: refused, saying how to change it; /metrics stays open to them.
    for ns, host in ((client, lab.node_ip4), (client, lab.node_ip6), (node, lab.node_ip4)):
        status, body = http_get(ns, str(host), METRICS_PORT, "/debug/dump")
        assert status == 403, (ns, host, status)
        assert "--debug-dump=true" in json.loads(body)["error"]
    assert http_get(client, str(lab.node_ip4), METRICS_PORT, "/metrics")[0] == 200
    agent.stop()


def test_without_ipv6_the_health_server_is_ipv4_alone_and_says_so(
        lab: Lab, sim: SimServer, tmp_path: Path) -> None:
    for key in ("all", "default", "lo"):
        lab.sysctl(lab.node_ns, f"net.ipv6.conf.{key}.disable_ipv6", "1")
    agent = started(lab, sim, tmp_path)
    assert livez(lab, lab.node_ns, "127.0.0.1") == 200
    assert livez(lab, lab.client_ns, lab.node_ip4) == 200
    assert livez(lab, lab.node_ns, "::1") == 0  # nothing there: IPv6 is off
    log = agent.log_text()
    assert 'msg="IPv6 is not available here: serving healthz on IPv4 only"' in log
    assert 'msg="serving healthz" address=0.0.0.0:10256 families=IPv4' in log
    agent.stop()
