"""Switching between the IPVS mode and the iptables mode with no `--cleanup` in between,
inside the kernel lab (run by tests/kernel/test_mode_switch.py; never on the host): the
real agent, stopped in one mode (SIGTERM leaves its rules), started in the other, removes
the old mode's leftovers before its first sync and serves. Both modes write `SPX-`
chains; each must remove exactly the other's (proxy/dataplane/leftovers.py).
(nftables <-> iptables runs on the host: tests/e2e/test_mode_switch.py.)

And the switch from kube-proxy: the node settings kube-proxy v1.20.2 itself writes in the
guest's initial network namespace (conntrack table size, hash size, TCP timeouts; the
IPVS sysctls in IPVS mode) are what `python -m proxy --init-only` writes from the same
KubeProxyConfiguration (tests/kernel/node_settings_guest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.lab import Lab
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    ROOT,
    AgentProcess,
    PortSpec,
    endpoint,
    endpoint_slice,
    our_rules,
    run_cli,
    service,
)
from tests.kernel import node_settings_guest as settings
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


@pytest.fixture
def guest_settings() -> Iterator[dict[str, int]]:
    """The guest's own values of every setting either proxy may write, put back after."""
    before = settings.read()
    try:
        yield before
    finally:
        settings.write(before)


@pytest.mark.parametrize("mode", ["", "ipvs"], ids=["iptables (kubeadm's default)", "ipvs"])
def test_from_kube_proxy_its_node_settings_are_kept(
        mode: str, workdir: Path, guest_settings: dict[str, int]) -> None:
    config = settings.kube_proxy_config(workdir, mode)
    checked = [*settings.CONNTRACK, "hashsize", *(settings.IPVS if mode else ())]
    # Ours: the kubeadm ConfigMap's nulls are kube-proxy's defaults (2 CPUs: the minimum).
    settings.write(settings.NEW_NODE)
    run = subprocess.run([sys.executable, "-m", "proxy", "--init-only", "--config",
                          str(config)], capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    ours = settings.read(checked)
    assert {k: ours[k] for k in (*settings.CONNTRACK, "hashsize")} == {
        "net/netfilter/nf_conntrack_max": 131072, "hashsize": 32768,
        "net/netfilter/nf_conntrack_tcp_timeout_established": 86400,
        "net/netfilter/nf_conntrack_tcp_timeout_close_wait": 3600}
    assert all(ours[k] == 1 for k in settings.IPVS if k in checked)
    print(f"\nsliceproxy --init-only ({mode or 'iptables'}): {ours}")
    binary = os.environ.get("KUBE_PROXY")
    if not binary:
        pytest.skip("no kube-proxy v1.20.2 binary (KUBE_PROXY): compared against "
                    "upstream's formula only")
    # Theirs, from the same new node's values.
    settings.write(settings.NEW_NODE)
    log = settings.run_kube_proxy(binary, config, workdir / f"kube-proxy-{mode}.log",
                                  timeout=120)
    assert ("Using ipvs Proxier" if mode else "Using iptables Proxier") in log
    theirs = settings.read(checked)
    print(f"kube-proxy v1.20.2 ({mode or 'iptables'}): {theirs}")
    assert ours == theirs
    # What only v1.20.2 writes (docs/upstream-differences.md).
    extra = settings.read(list(settings.ONLY_V1_20))
    assert extra["net/ipv4/conf/all/route_localnet"] == 1
    assert extra["net/ipv4/vs/conn_reuse_mode"] == (0 if mode else 1)
