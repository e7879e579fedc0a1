"""The fault suite (tests/faults, iptables mode on the host) in IPVS mode, inside the
kernel lab (run by tests/kernel/test_ipvs_faults.py through scenarios/run.py; never on
the host). Behaviour only: the kernel is emulated, so no figure here is a bound.

One lab, one simulator and one agent (`python -m proxy --proxy-mode ipvs`) for the
module, since starting an agent is the slow part under emulation; the scenarios run in
file order, each injecting one fault while a client keeps opening fresh connections to
the services of tests/faults (web over TCP and UDP, a NodePort, a Local-policy one).
For each: connections tried and failed, the longest failure window, the time to
converge, agent restarts (none). The table is written next to the run's result
(faults.json), where the host test prints it from.

The node is a Debian 12 node: the agent's iptables rules go to the nf_tables back end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from proxy.dataplane.ipvs.render import DUMMY_INTERFACE
from proxy.netns_lab import BackendSpec, Lab
from proxy.netns_lab.netns import entered
from proxy.netns_lab.probe import Flow, UdpFlow
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    namespace_object,
    node_object,
    our_rules,
    quiet_icmp_limits,
    run_cli,
    service,
    start_sim,
    wait_for,
)
from tests.faults.conftest import BOTH_PORTS, FAULTS, WEB, FaultNode, settle, web_objects
from tests.faults.test_api_faults import (
    ApiFault,
    _calm,
    _compact,
    _storm,
    add_probe,
    answered,
    through_each,
)
from tests.faults.test_kernel_faults import slow_restore
from tests.faults.test_restart_flows import restarts_under_udp_flows
from tests.faults.traffic import StallClock, Traffic
from tests.kernel.scenario_guest import HELD_FLOW_TIMEOUT, READY_DEADLINE

CHANGE_DEADLINE = 60.0
OUTAGE = float(os.environ.get("SLICEPROXY_KERNEL_FAULT_OUTAGE", "10"))
STORM = float(os.environ.get("SLICEPROXY_KERNEL_FAULT_STORM", "5"))
# Emulated, a connection through IPVS can take longer than the host suite's 0.5 s while
# an agent starts on the same two virtual CPUs, and the guest itself can stall for over
# a second while the real-node tier loads the host (seen once in CI: a lone connection
# timed out at 1 s with no agent running): a failure here is no answer in 2 s.
TIMEOUT, INTERVAL = 2.0, 0.1
FLAP = "198.18.128.40"


class IpvsFaultNode(FaultNode):
    """tests/faults' node with the agent in IPVS mode."""

    modes = ("ipvs/nft",)

    def start_agent(self, *flags: str, env: dict[str, str] | None = None) -> AgentProcess:
        return super().start_agent("--proxy-mode", "ipvs", *flags, env=env)

    def traffic(self, **kw: Any) -> Traffic:
        return super().traffic(**{"timeout": TIMEOUT, "interval": INTERVAL, **kw})

    def rules(self) -> list[str]:
        return sorted(our_rules(self.lab, ("nft",)))

    def addresses(self) -> list[str]:
        """The addresses on our dummy interface ([] when there is none)."""
        out = self.lab.exec(self.lab.node_ns, ["ip", "-o", "addr", "show", "dev",
                                               DUMMY_INTERFACE])
        words = out.stdout.split()
        return sorted(words[i + 1] for i, w in enumerate(words[:-1])
                      if w in ("inet", "inet6") and not words[i + 1].startswith("fe80:"))

    def virtual_servers(self) -> list[str]:
        out = self.lab.exec(self.lab.node_ns, ["ipvsadm", "-Sn"])
        assert out.returncode == 0, out.stderr
        return sorted(ln for ln in out.stdout.splitlines() if ln.startswith("-A"))

    def metric(self, name: str) -> float:
        return self.agent.metrics().get(name, 0.0)


def report_path() -> Path:
    result = os.environ.get("KERNEL_RESULT")
    base = Path(result).parent if result else Path(os.environ["KERNEL_SCRATCH"])
    return base / "faults.json"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """tests/faults' lab: web-1 on this node, web-2 on node-b; IPv4 only."""
    with Lab([BackendSpec("web-1"), BackendSpec("web-2", node="node-b")], ipv6=False) as lab:
        quiet_icmp_limits(lab)
        lab.start_backends()
        yield lab


@pytest.fixture(scope="module")
def node(lab: Lab) -> Iterator[IpvsFaultNode]:
    result = os.environ.get("KERNEL_RESULT")
    workdir = (Path(result).parent if result else Path(os.environ["KERNEL_SCRATCH"])) \
        / "agents" / "faults"
    workdir.mkdir(parents=True, exist_ok=True)
    objects = [node_object(), namespace_object("demo"), *web_objects(lab)]
    sim: SimServer
    with start_sim(lab, objects) as sim:
        fault_node = IpvsFaultNode(lab, sim, workdir, "ipvs/nft")
        try:
            fault_node.start_agent().wait_ready(READY_DEADLINE)
            yield fault_node
        finally:
            for agent in fault_node.agents:
                if agent.alive():
                    with contextlib.suppress(AssertionError):
                        agent.stop()
            # The figures first: they stand whatever the clean-up does.
            report_path().write_text(json.dumps([asdict(r) for r in FAULTS], indent=2) + "\n")
            # Emulated on a loaded host, importing the agent for --cleanup alone once
            # took over 60 s.
            run_cli(lab, ["--cleanup", "--proxy-mode", "ipvs", "--hostname-override",
                          "node-a"], timeout=READY_DEADLINE)
            lab.exec(lab.node_ns, ["conntrack", "-F"])


def healthy(node: IpvsFaultNode) -> None:
    assert node.agent.alive(), node.agent.log_tail()
    assert node.restarts() == 0, [a.proc.returncode for a in node.agents if a.proc]


# --- the API server misbehaves --------------------------------------------------------


def test_api_server_down_then_back(node: IpvsFaultNode) -> None:
    sim = node.sim
    kernel = (node.virtual_servers(), node.addresses(), node.rules())
    with node.traffic() as traffic:
        settle(1.0)
        began = time.monotonic()
        sim.stop()
        ip = add_probe(node, 1)  # written to the store while nobody can reach it
        settle(OUTAGE)
        assert (node.virtual_servers(), node.addresses(), node.rules()) == kernel, \
            "the kernel changed while the API server was down"
        back = time.monotonic()
        with entered(node.lab.node_ns):  # it listens on the node's own loopback
            sim.start()
        converged = answered(node.lab, ip, CHANGE_DEADLINE) - back
        settle(1.0)
    report = traffic.report(since=began)
    node.record(f"API server down {OUTAGE:g}s", report, converged,
                restarts=node.restarts(), notes="change written while down: converge "
                "counted from the server's return")
    healthy(node)
    assert report.failed == 0, report.failures()


def _cuts(sim: SimServer) -> None:
    for i in range(2):
        sim.cut_watches(abrupt=bool(i % 2))
        settle(1.0)


API_FAULTS = [
    ApiFault("watch streams cut twice, 1 s apart", _cuts, 0.0),
    ApiFault("history compacted (410, relist)", _compact, 0.0),
    ApiFault(f"every request 500 for {STORM:g}s", _storm(500), STORM, _calm),
]


def test_watch_faults_one_after_another(node: IpvsFaultNode) -> None:
    report = through_each(node, API_FAULTS, CHANGE_DEADLINE)
    healthy(node)
    assert report.failed == 0
    # Our own syncs (services added, each a new address on the dummy interface and new
    # virtual servers) never counted as someone else's change.
    assert node.metric("sliceproxy_rules_drift_repairs_total") == 0
    print("drift checks after our own syncs only:",
          node.metric("sliceproxy_rules_drift_checks_total"))


# --- what the cluster says ------------------------------------------------------------


def test_service_flapping_udp_client_on_one_socket(node: IpvsFaultNode) -> None:
    """kubernetes#48370: a UDP client keeping one socket through 0 -> 1 endpoints must be
    answered again (stale conntrack entries of the removed real server cleared)."""
    lab, sim = node.lab, node.sim
    web1 = lab.backends["web-1"]
    some = [endpoint(web1.ipv4, node=web1.node)]
    sim.apply(service("flap", [FLAP], BOTH_PORTS))
    sim.apply(endpoint_slice("flap-1", "flap", some, BOTH_PORTS))
    sticky = UdpFlow(lab.client_ns, FLAP, 53, timeout=0.3)
    try:
        wait_for(lambda: sticky.ask() == "web-1", CHANGE_DEADLINE, "flap answering")
        returns: list[float] = []
        with node.traffic() as traffic:
            began = time.monotonic()
            for _ in range(2):
                sim.apply(endpoint_slice("flap-1", "flap", [], BOTH_PORTS))
                wait_for(lambda: sticky.ask() is None, CHANGE_DEADLINE,
                         "flap without endpoints")
                settle(1.0)  # the client keeps asking into the void
                written = time.monotonic()
                sim.apply(endpoint_slice("flap-1", "flap", some, BOTH_PORTS))
                wait_for(lambda: sticky.ask() == "web-1", CHANGE_DEADLINE,
                         "the same UDP socket answered again (no blackhole)")
                returns.append(time.monotonic() - written)
        report = traffic.report(since=began)
    finally:
        sticky.close()
    node.record("service flapping 0<->1 x2 (UDP, one socket)", report, max(returns),
                restarts=node.restarts(),
                notes="converge: endpoints back -> the same UDP socket answered")
    healthy(node)
    assert report.failed == 0, report.failures()


# --- someone else changes what we own -------------------------------------------------


def _run(node: IpvsFaultNode, *args: str) -> None:
    done = node.lab.exec(node.lab.node_ns, list(args))
    assert done.returncode == 0, done.stderr


FOREIGN: dict[str, Callable[[IpvsFaultNode], None]] = {
    "nat table flushed (iptables -t nat -F)":
        lambda n: _run(n, "iptables-nft", "-t", "nat", "-F"),
    "firewall reload (nft flush ruleset)": lambda n: _run(n, "nft", "flush", "ruleset"),
    f"an address deleted from {DUMMY_INTERFACE}":
        lambda n: _run(n, "ip", "addr", "del", f"{WEB}/32", "dev", DUMMY_INTERFACE),
    f"{DUMMY_INTERFACE} deleted": lambda n: _run(n, "ip", "link", "del", DUMMY_INTERFACE),
    # What `kube-proxy --cleanup` does to the table; IPVS announces nothing: sampled.
    "IPVS table flushed (ipvsadm -C)": lambda n: _run(n, "ipvsadm", "-C"),
}


def test_foreign_changes_are_repaired(node: IpvsFaultNode) -> None:
    """One after another; each is noticed from an announcement (nf_tables, rtnetlink)
    or, for the IPVS table, which announces nothing, by the sampler's next look
    (ipvs/sample.py), checked, and repaired by a full sync long before --sync-period
    (an hour)."""
    agent = node.agent

    def kernel() -> tuple[list[str], list[str], list[str]]:
        return node.rules(), node.addresses(), node.virtual_servers()

    for name, change in FOREIGN.items():
        before = kernel()
        assert before[0] and WEB + "/32" in before[1], before
        repairs = node.metric("sliceproxy_rules_drift_repairs_total")
        with StallClock(gap=TIMEOUT / 2) as clock, node.traffic() as traffic:
            settle(0.5)
            began = time.monotonic()
            change(node)
            assert kernel() != before, f"{name} changed nothing"

            def restored(want: tuple[list[str], list[str], list[str]] = before) -> bool:
                return kernel() == want

            wait_for(restored, CHANGE_DEADLINE,
                     f"ours back after: {name}", interval=0.1)
            repaired = time.monotonic()
            settle(2.0 + TIMEOUT)  # connections started after the repair, answered
        report = traffic.report(since=began)
        # A connection that waited out a stop of the guest of half its timeout or more
        # (seen under TCG beside the real-node tier) is counted apart, not as a failure.
        after = traffic.report(since=repaired + TIMEOUT, stalls=clock.stalls())
        node.record(f"foreign change: {name}", report, repaired - began,
                    restarts=node.restarts(), notes="converge: repaired (may cut the "
                    "data path until then)")
        healthy(node)
        assert node.metric("sliceproxy_rules_drift_repairs_total") == repairs + 1, \
            agent.log_tail()
        assert after.failed == 0, f"{name}: {after.failures()}"
        assert all(t.attempts for t in after.targets), f"{name}: {after.targets}"
    assert "another process changed our rules" in agent.log_text()
    # Repairs, not the periodic resync: the only full syncs are the first and the repairs.
    assert node.metric('sliceproxy_syncs_total{kind="full",result="ok"}') \
        <= 1 + node.metric("sliceproxy_rules_drift_repairs_total")


# --- the agent killed -----------------------------------------------------------------


class Sampler:
    """How many virtual servers the kernel holds, sampled in the background."""

    def __init__(self, node: IpvsFaultNode) -> None:
        self.node = node
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        end = time.monotonic() + 300
        while not self._stop.is_set() and time.monotonic() < end:
            self.samples.append(len(self.node.virtual_servers()))
            self._stop.wait(0.2)  # pacing, not synchronisation

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def test_sigkill_in_the_middle_of_a_full_sync(node: IpvsFaultNode) -> None:
    """A rolling update (SIGTERM: everything stays), a change meanwhile, a successor
    SIGKILLed while its first full sync writes iptables rules, then another one. IPVS
    state is the kernel's, not the process's: no window without virtual servers, and
    an established connection keeps its backend."""
    scratch = Path(os.environ.get("KERNEL_SCRATCH", "/tmp")) / "sigkill"
    scratch.mkdir(parents=True, exist_ok=True)
    count = len(node.virtual_servers())
    with node.traffic() as traffic, Sampler(node) as sampler, \
            Flow(node.lab.client_ns, WEB, 80, timeout=HELD_FLOW_TIMEOUT) as flow:
        first = flow.ask()
        began = time.monotonic()
        events: list[str] = []

        def event(what: str) -> None:
            events.append(f"{what} {time.monotonic() - began:.2f}")

        node.agent.stop()
        event("stopped")
        ip = add_probe(node, 50)  # a change the successors must apply
        marks = scratch / "marks"
        env = slow_restore(scratch / "bin", marks)
        doomed = node.start_agent(env=env)
        wait_for(lambda: any(marks.iterdir()), READY_DEADLINE, "the first restore")
        event("first restore")
        assert doomed.proc is not None
        os.killpg(doomed.proc.pid, signal.SIGKILL)  # the agent and its restore
        doomed.proc.wait(10)
        event("killed")
        assert "first sync done" not in doomed.log_text(), "killed too late"
        successor = node.start_agent()
        successor.wait_ready(READY_DEADLINE)
        event("successor ready")
        answered(node.lab, ip, CHANGE_DEADLINE)
        event("change answered")
        converged = time.monotonic() - began
        settle(1.0)
        assert flow.ask() == first, "the established flow moved or broke"
    report = traffic.report(since=began)
    node.record("SIGKILL mid full sync, restarted", report, converged,
                restarts=node.restarts(), notes="converge: from the first stop to the "
                "change's traffic through the successor", fewest_vs=min(sampler.samples))
    healthy(node)
    # Two Python agents start on the emulated CPUs here, and in some CI runs a lone
    # connection timed out (once while the agent was merely stopped). What this fault
    # could break shows otherwise: a moment without virtual servers (the sampler), an
    # established flow moving, or a window of failures, every connection for its
    # length: two in a row. The window is counted in attempts, not seconds: a lone
    # timeout on emulated CPUs has spanned 2.1 s from its start to the next answer.
    where = f"{report.failures()}; events (s): {', '.join(events)}"
    assert report.longest_run < 2, where
    assert report.failed <= max(2, report.attempts // 100), where
    assert min(sampler.samples) >= count, sampler.samples[:50]



def test_restarts_move_no_udp_flow(node: IpvsFaultNode) -> None:
    """Issue 28 in IPVS mode: eight long-lived UDP flows (one socket each, four per
    endpoint) through a SIGTERM and a SIGKILL restart of the agent: none moves, none
    loses a datagram. IPVS keeps its own connection table, which outlives the agent,
    and the agent's start leaves conntrack alone. Emulated, an answer may take longer
    than the host suite's 1 s while an agent starts on the same two virtual CPUs: a
    datagram counts as unanswered here after 2 s."""
    restarts_under_udp_flows(node, ready_deadline=READY_DEADLINE, timeout=TIMEOUT,
                             interval=0.25)  # light: the agent starts on the same CPUs
    healthy(node)
