"""Switching between the IPVS mode and the iptables mode with no `--cleanup` in between,
inside the kernel lab (run by tests/kernel/test_mode_switch.py; never on the host): the
real agent, stopped in one mode (SIGTERM leaves its rules), started in the other, removes
the old mode's leftovers before its first sync and serves. Both modes write `SPX-`
chains; each must remove exactly the other's (proxy/dataplane/leftovers.py).
(nftables <-> iptables runs on the host: tests/e2e/test_mode_switch.py.)"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.lab import Lab
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    AgentProcess,
    PortSpec,
    endpoint,
    endpoint_slice,
    our_rules,
    run_cli,
    service,
)
from tests.kernel.scenario_guest import NodeThread, read_kernel
from tests.kernel.scenarios.scenario_agent import leftovers

HTTP: tuple[PortSpec, ...] = (("http", 80, 8080, "TCP"),)
WEB = {"web-1", "web-2"}
READY_DEADLINE = 90.0  # an emulated machine: an agent takes seconds to import and start
CHANGE_DEADLINE = 30.0


@pytest.fixture(scope="module")
def reader(lab: Lab) -> Iterator[NodeThread]:
    thread = NodeThread(lab.node_ns)
    try:
        yield thread
    finally:
        thread.close()


@pytest.fixture
def agents(lab: Lab, reader: NodeThread) -> Iterator[list[AgentProcess]]:
    """Agents a scenario starts; stopped, and every mode's rules removed, afterwards."""
    started: list[AgentProcess] = []
    try:
        yield started
    finally:
        for agent in started:
            if agent.alive():
                agent.stop()
        done = run_cli(lab, ["--cleanup", "--hostname-override", "node-a"])
        reader.exec("conntrack", "-F")
        assert done.returncode == 0, done.stderr
        assert leftovers(lab, reader) == []


def start(lab: Lab, sim: SimServer, workdir: Path, agents: list[AgentProcess],
          mode: str) -> AgentProcess:
    agent = AgentProcess(lab, sim, workdir, "--proxy-mode", mode,
                         name=f"agent-{len(agents) + 1}-{mode}")
    agents.append(agent.start())
    agent.wait_ready(READY_DEADLINE)
    return agent


def web(lab: Lab, sim: SimServer, name: str, vip: str) -> None:
    b = lab.backends
    sim.apply(service(name, [vip], HTTP))
    sim.apply(endpoint_slice(name, name, [endpoint(b[n].ipv4) for n in sorted(WEB)], HTTP))


def ipvs_chains(lab: Lab) -> list[str]:
    return [r for r in our_rules(lab) if "SPX-IPVS-" in r]


def iptables_mode_chains(lab: Lab) -> list[str]:
    return [r for r in our_rules(lab) if "SPX-IPVS-" not in r]


def info_lines(agent: AgentProcess, text: str) -> list[str]:
    return [line for line in agent.log_text().splitlines()
            if text in line and "level=info" in line]


def test_ipvs_then_iptables_removes_virtual_servers_dummy_ipsets_and_chains(
        lab: Lab, sim: SimServer, workdir: Path, reader: NodeThread,
        agents: list[AgentProcess]) -> None:
    vip, c = "198.18.128.50", lab.client_ns
    web(lab, sim, "switch-a", vip)
    first = start(lab, sim, workdir, agents, "ipvs")
    lab.wait_for(c, vip, 80, WEB, deadline=CHANGE_DEADLINE)
    assert f"TCP {vip}:80" in read_kernel(reader).services
    first.stop()
    before = leftovers(lab, reader)  # SIGTERM leaves all of it
    assert any(x.startswith("virtual server") for x in before), before
    assert "dummy interface spx-ipvs0" in before and ipvs_chains(lab)

    second = start(lab, sim, workdir, agents, "iptables")
    left = [x for x in leftovers(lab, reader)
            if not x.startswith("iptables") or "SPX-IPVS-" in x]
    assert left == []  # no virtual server, dummy interface, ipset or SPX-IPVS- chain
    assert iptables_mode_chains(lab)
    lab.wait_for(c, vip, 80, WEB, deadline=CHANGE_DEADLINE)
    assert set(lab.ask(c, vip, 80, count=12)) == WEB
    (line,) = info_lines(second, "leftovers")
    assert "removed the ipvs mode's leftovers: virtual servers: 1, dummy interfaces: 1" \
        in line, line
    log = second.log_text()
    assert log.index("removed the ipvs mode's leftovers") < log.index("first sync done")
    print(f"\n{line}")


def test_iptables_then_ipvs_removes_the_iptables_chains_and_keeps_its_own(
        lab: Lab, sim: SimServer, workdir: Path, reader: NodeThread,
        agents: list[AgentProcess]) -> None:
    vip, c = "198.18.128.51", lab.client_ns
    web(lab, sim, "switch-b", vip)
    first = start(lab, sim, workdir, agents, "iptables")
    lab.wait_for(c, vip, 80, WEB, deadline=CHANGE_DEADLINE)
    assert iptables_mode_chains(lab) and not ipvs_chains(lab)
    first.stop()
    assert iptables_mode_chains(lab)

    second = start(lab, sim, workdir, agents, "ipvs")
    assert iptables_mode_chains(lab) == []
    assert ipvs_chains(lab)  # its own, written by its first sync, kept
    assert f"TCP {vip}:80" in read_kernel(reader).services
    lab.wait_for(c, vip, 80, WEB, deadline=CHANGE_DEADLINE)
    (line,) = info_lines(second, "leftovers")
    assert "removed the iptables mode's leftovers" in line and "SPX-IPVS-* kept" in line, line

    # A restart in IPVS mode: its own chains and virtual servers are not leftovers.
    second.stop()
    chains, kernel = ipvs_chains(lab), read_kernel(reader)
    third = start(lab, sim, workdir, agents, "ipvs")
    assert info_lines(third, "leftovers") == []
    assert ipvs_chains(lab) == chains and read_kernel(reader) == kernel
    assert set(lab.ask(c, vip, 80, count=12)) == WEB
    print(f"\n{line}")
