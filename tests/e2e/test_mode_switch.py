"""Switching `--proxy-mode` with no `--cleanup` in between: the real agent, stopped in
one mode (SIGTERM leaves its rules), started in another, removes the old mode's rules
once its own first sync is in the kernel, and serves: fresh connections made all through
the switch are every one answered (removing the old rules first left a moment with
neither mode's rules: "Network is unreachable"). Somebody else's tables and chains stay
as they were. (IPVS -> iptables needs IPVS: tests/kernel/scenarios/scenario_mode_switch.py.)"""

from __future__ import annotations

import re
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from proxy.dataplane.common.nfacct import Nfacct
from proxy.netns_lab import BackendSpec, Lab
from proxy.netns_lab.netns import entered
from proxy.netns_lab.poll import wait as wait_for
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
)

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

VIP = "198.18.128.40"
WEB = {"web-1", "web-2"}
# Somebody else's rules in the node namespace: kubelet's hint (which also makes the
# agent choose the nf_tables back end), a CNI's nat chain with a jump to it (both back
# ends), a firewall's nf_tables table.
FOREIGN_IPTABLES = [
    ["iptables-nft", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
    ["iptables-nft", "-t", "nat", "-N", "CNI-NAT"],
    ["iptables-nft", "-t", "nat", "-A", "CNI-NAT", "-d", "198.18.3.0/24", "-j", "RETURN"],
    ["iptables-nft", "-t", "nat", "-A", "POSTROUTING", "-j", "CNI-NAT"],
    ["ip6tables-nft", "-t", "nat", "-N", "CNI-NAT6"],
    ["iptables-legacy", "-t", "nat", "-N", "OLD-NAT"],
    ["iptables-legacy", "-t", "nat", "-A", "OLD-NAT", "-d", "198.18.4.0/24", "-j", "RETURN"],
]
FOREIGN_TABLE = """table inet firewall {
  chain input { type filter hook input priority 0; policy accept; tcp dport 22 accept; }
}
"""


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab([BackendSpec("web-1"), BackendSpec("web-2", node="node-b")]) as lab:
        lab.start_backends()
        for cmd in FOREIGN_IPTABLES:
            lab.exec(lab.node_ns, cmd, check=True)
        lab.exec(lab.node_ns, ["nft", "-f", "-"], input=FOREIGN_TABLE, check=True)
        yield lab


@pytest.fixture
def sim(lab: Lab) -> Iterator[SimServer]:
    b = lab.backends
    objects = [node_object(), service("web", [VIP]),
               endpoint_slice("web", "web", [endpoint(b["web-1"].ipv4),
                                             endpoint(b["web-2"].ipv4, node="node-b")])]
    with start_sim(lab, objects) as server:
        yield server


BUILTIN = re.compile(r"^:(PREROUTING|INPUT|FORWARD|OUTPUT|POSTROUTING) ")


def foreign(lab: Lab) -> str:
    """Every chain and rule in the node namespace that is not ours (an empty built-in
    table the agent's rules made is no foreign rule)."""
    out = []
    for tool in ("iptables-nft-save", "ip6tables-nft-save", "iptables-legacy-save"):
        table = ""
        for line in lab.exec(lab.node_ns, [tool], check=True).stdout.splitlines():
            if line.startswith("*"):
                table = line
            elif line[:1] in (":", "-") and "SPX-" not in line and not BUILTIN.match(line):
                out.append(f"{tool} {table} {line}")
    out.append(lab.exec(lab.node_ns, ["nft", "list", "table", "inet", "firewall"],
                        check=True).stdout)
    return "\n".join(out)


def our_tables(lab: Lab) -> list[str]:
    listed = lab.exec(lab.node_ns, ["nft", "list", "tables"], check=True).stdout
    return [line for line in listed.splitlines() if "sliceproxy" in line]


def removal_lines(agent: AgentProcess) -> list[str]:
    return [line for line in agent.log_text().splitlines()
            if "leftovers" in line and "level=info" in line]


def timing(agent: AgentProcess) -> str:
    """The probe's time (-v 2 line) or the removal's, from the agent's log."""
    found = re.findall(r"(probe_seconds|seconds)=([0-9.]+)",
                       "\n".join(line for line in agent.log_text().splitlines()
                                 if "logger=proxy.dataplane.leftovers" in line))
    return ", ".join(f"{k} {v}" for k, v in found)


@pytest.fixture
def agents(lab: Lab, sim: SimServer, tmp_path: Path) -> Iterator[list[AgentProcess]]:
    started: list[AgentProcess] = []
    try:
        yield started
    finally:
        for agent in started:
            if agent.alive():
                agent.stop()
        run_cli(lab, ["--cleanup", "--hostname-override", "node-a"])


def start(lab: Lab, sim: SimServer, tmp_path: Path, agents: list[AgentProcess],
          mode: str) -> AgentProcess:
    agent = AgentProcess(lab, sim, tmp_path, "--proxy-mode", mode,
                         name=f"agent-{len(agents) + 1}-{mode}")
    agents.append(agent.start())
    agent.wait_ready()
    # The other mode's leftovers go right after the first sync (healthy from then on):
    # the next start-up line is the drift watch's, once they are gone.
    wait_for(lambda: "watching for changes to our" in agent.log_text(), 15,
             "the other mode's leftovers handled")
    return agent


@contextmanager
def connections(lab: Lab) -> Iterator[Counter[str]]:
    """Fresh connections to the service from the client namespace all the while (about
    100 a second; the wait only paces them), bounded in count and time; what answered."""
    answers: Counter[str] = Counter()
    stop = threading.Event()

    def run() -> None:
        end = time.monotonic() + 90
        while time.monotonic() < end and answers.total() < 9000:
            answers.update(lab.ask(lab.client_ns, VIP, 80, count=1, timeout=1.0))
            if stop.wait(0.01):
                return

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: answers.total() >= 20, 20, "connections before the switch")
        yield answers
        seen = answers.total()
        wait_for(lambda: answers.total() >= seen + 20, 20, "connections after the switch")
    finally:
        stop.set()
        thread.join(10)


def switch(lab: Lab, sim: SimServer, tmp_path: Path, agents: list[AgentProcess],
           old: AgentProcess, mode: str) -> AgentProcess:
    """Stop `old`, start an agent in `mode`, with connections made all through; every
    one of them answered by a backend."""
    with connections(lab) as answers:
        old.stop()
        new = start(lab, sim, tmp_path, agents, mode)
    failed = {k: n for k, n in answers.items() if k not in WEB}
    assert not failed, f"{failed} of {answers.total()} connections failed in the switch"
    print(f"\nswitch to {mode}: {answers.total()} connections, 0 failed")
    return new


def nfacct_objects(lab: Lab) -> list[str]:
    with entered(lab.node_ns):
        return sorted(Nfacct().dump())


def test_iptables_then_nftables_removes_the_iptables_rules(
        lab: Lab, sim: SimServer, tmp_path: Path, agents: list[AgentProcess]) -> None:
    before = foreign(lab)
    assert "CNI-NAT" in before and "OLD-NAT" in before and "firewall" in before
    first = start(lab, sim, tmp_path, agents, "iptables")
    assert our_rules(lab, ["nft"]) and not our_rules(lab, ["legacy"])
    assert set(lab.ask(lab.client_ns, VIP, 80, count=20)) == WEB
    assert removal_lines(first) == []  # nothing to remove in a fresh namespace
    assert nfacct_objects(lab)  # the iptables mode's traffic counters
    second = switch(lab, sim, tmp_path, agents, first, "nftables")
    assert our_rules(lab) == []  # neither back end, neither family
    assert nfacct_objects(lab) == []  # its counters went with its rules
    assert {"table ip sliceproxy", "table ip6 sliceproxy"} <= set(our_tables(lab))
    assert set(lab.ask(lab.client_ns, VIP, 80, count=20)) == WEB
    (line,) = removal_lines(second)
    assert "removed the iptables mode's leftovers" in line and "mode=nftables" in line
    log = second.log_text()
    # The new rules first, then the old ones go: never a moment with neither.
    assert log.index("first sync done") < log.index("removed the iptables mode's leftovers")
    assert foreign(lab) == before
    print(f"\niptables -> nftables: {timing(first)} (first start); {timing(second)}")


def test_nftables_then_iptables_removes_our_tables(
        lab: Lab, sim: SimServer, tmp_path: Path, agents: list[AgentProcess]) -> None:
    before = foreign(lab)
    first = start(lab, sim, tmp_path, agents, "nftables")
    assert our_tables(lab) and our_rules(lab) == []
    assert removal_lines(first) == []

    second = switch(lab, sim, tmp_path, agents, first, "iptables")
    assert our_tables(lab) == []
    assert our_rules(lab, ["nft"])
    assert set(lab.ask(lab.client_ns, VIP, 80, count=20)) == WEB
    (line,) = removal_lines(second)
    assert "removed the nftables mode's leftovers: tables ip sliceproxy, ip sliceproxy-0, " \
        "ip6 sliceproxy, ip6 sliceproxy-0" in line and "mode=iptables" in line
    log = second.log_text()
    assert log.index("first sync done") < log.index("removed the nftables mode's leftovers")
    assert foreign(lab) == before

    # A restart in the same mode removes nothing: its own rules are not leftovers.
    second.stop()
    third = start(lab, sim, tmp_path, agents, "iptables")
    assert removal_lines(third) == []
    assert set(lab.ask(lab.client_ns, VIP, 80, count=20)) == WEB
    print(f"\nnftables -> iptables: {timing(first)} (first start); {timing(second)}; "
          f"restart: {timing(third)}")
