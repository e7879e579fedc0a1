"""The fault suite's node: the real agent (`python -m proxy`) in a lab node namespace,
the simulator as its API server, echo pods, and traffic that never stops.

Services (IPv4; dual stack is the e2e tier's business):

    web    198.18.128.10  80/TCP, 53/UDP   web-1 (this node), web-2 (node-b)
    np     NodePort 30080/TCP on 198.18.0.1 web-1, web-2
    local  198.18.128.30  80/TCP           internalTrafficPolicy Local: web-1 only

Every fault's figures go into `FAULTS` and are printed at the end of the run (and
written as JSON to $SLICEPROXY_FAULT_REPORT when set), for docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from proxy.lab import BackendSpec, Lab
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    namespace_object,
    node_object,
    our_rules,
    quiet_icmp_limits,
    service,
    start_sim,
)
from tests.faults.traffic import Report, Target, Traffic

WEB, LOCAL, NODE_PORT = "198.18.128.10", "198.18.128.30", 30080
BOTH_PORTS = (("http", 80, 8080, "TCP"), ("dns", 53, 8081, "UDP"))
ANY = frozenset({"web-1", "web-2"})
LOCAL_ONLY = frozenset({"web-1"})


@dataclass
class FaultRecord:
    fault: str
    mode: str
    attempts: int
    failed: int
    longest_window: float
    converge: float | None  # seconds from the end of the fault to the kernel matching
    restarts: int
    notes: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    def row(self) -> str:
        conv = f"{self.converge:.2f}s" if self.converge is not None else "-"
        return (f"  {self.fault:<44} {self.mode:<14} {self.attempts:>6} {self.failed:>6} "
                f"{self.longest_window:>7.2f}s {conv:>8} {self.restarts:>3}  {self.notes}")


FAULTS: list[FaultRecord] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FAULTS:
        return
    tr = terminalreporter
    tr.write_line("fault suite (connections attempted, failed, longest failure window, "
                  "time to converge, agent restarts):")
    tr.write_line(f"  {'fault':<44} {'mode':<14} {'tried':>6} {'failed':>6} "
                  f"{'window':>8} {'converge':>8} {'rst':>3}")
    for record in FAULTS:
        tr.write_line(record.row())
    out = os.environ.get("SLICEPROXY_FAULT_REPORT")
    if out:
        Path(out).write_text(json.dumps([vars(r) for r in FAULTS], indent=2) + "\n")


def web_objects(lab: Lab) -> list[dict[str, Any]]:
    b = lab.backends
    eps = [endpoint(b[n].ipv4, node=b[n].node) for n in ("web-1", "web-2")]
    node_port = service("np", ["198.18.128.20"], type="NodePort")
    node_port["spec"]["ports"][0]["nodePort"] = NODE_PORT
    return [
        service("web", [WEB], BOTH_PORTS),
        endpoint_slice("web-1", "web", eps, BOTH_PORTS),
        node_port,
        endpoint_slice("np-1", "np", eps),
        service("local", [LOCAL], internalTrafficPolicy="Local"),
        endpoint_slice("local-1", "local", eps),
    ]


def bulk_services(lab: Lab, count: int) -> list[dict[str, Any]]:
    """`count` more services of one port each (198.18.160.1 onwards), both web pods."""
    b = lab.backends
    eps = [endpoint(b[n].ipv4, node=b[n].node) for n in ("web-1", "web-2")]
    out: list[dict[str, Any]] = []
    for i in range(count):
        out.append(service(f"bulk-{i}", [f"198.18.{160 + i // 250}.{1 + i % 250}"]))
        out.append(endpoint_slice(f"bulk-{i}-1", f"bulk-{i}", eps))
    return out


def targets(lab: Lab) -> list[Target]:
    return [
        Target("web", WEB, 80, "tcp", ANY),
        Target("web", WEB, 53, "udp", ANY),
        Target("np", str(lab.node_ip4), NODE_PORT, "tcp", ANY),
        Target("local", LOCAL, 80, "tcp", LOCAL_ONLY),
    ]


def use_legacy(lab: Lab) -> None:
    """Make the node's back end legacy, as kubelet does (its hint chain)."""
    lab.exec(lab.node_ns, ["iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
             check=True)


class FaultNode:
    """One lab, its simulator, the agent and the traffic, for one test."""

    def __init__(self, lab: Lab, sim: SimServer, workdir: Path, backend: str) -> None:
        self.lab, self.sim, self.workdir, self.backend = lab, sim, workdir, backend
        self.targets = targets(lab)
        self.agents: list[AgentProcess] = []

    @property
    def mode(self) -> str:
        return f"iptables/{self.backend}"

    def start_agent(self, *flags: str, env: dict[str, str] | None = None) -> AgentProcess:
        agent = AgentProcess(self.lab, self.sim, self.workdir, *flags, env=env,
                             name=f"agent-{len(self.agents) + 1}").start()
        self.agents.append(agent)
        return agent

    @property
    def agent(self) -> AgentProcess:
        return self.agents[-1]

    def traffic(self, **kw: Any) -> Traffic:
        return Traffic(self.lab.client_ns, self.targets, **kw)

    def rules(self) -> list[str]:
        return our_rules(self.lab, (self.backend,))

    def record(self, fault: str, report: Report, converge: float | None,
               restarts: int = 0, notes: str = "", **extra: Any) -> FaultRecord:
        rec = FaultRecord(fault, self.mode, report.attempts, report.failed,
                          round(report.longest_window, 3),
                          None if converge is None else round(converge, 3), restarts,
                          notes, extra)
        FAULTS.append(rec)
        return rec

    def restarts(self) -> int:
        """Agent processes that died on their own (each test starts one on purpose)."""
        return sum(1 for a in self.agents if a.proc is not None and a.proc.poll() is not None
                   and a.proc.returncode not in (0, -9, -15))


@pytest.fixture
def fault_lab() -> Iterator[Lab]:
    with Lab([BackendSpec("web-1"), BackendSpec("web-2", node="node-b")], ipv6=False) as lab:
        quiet_icmp_limits(lab)
        lab.start_backends()
        yield lab


@pytest.fixture(params=["nft", "legacy"])
def backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.contextmanager
def make_node(lab: Lab, tmp_path: Path, backend: str,
              objects: list[dict[str, Any]] | None = None) -> Iterator[FaultNode]:
    if backend == "legacy":
        use_legacy(lab)
    objs = [node_object(), namespace_object("demo"), *web_objects(lab), *(objects or [])]
    with start_sim(lab, objs) as sim:
        node = FaultNode(lab, sim, tmp_path, backend)
        try:
            yield node
        finally:
            for agent in node.agents:
                if agent.alive():
                    agent.stop()


@pytest.fixture
def fault_node(fault_lab: Lab, tmp_path: Path, backend: str) -> Iterator[FaultNode]:
    """A node on `backend` (both, parametrized) with the agent running and ready."""
    with make_node(fault_lab, tmp_path, backend) as node:
        node.start_agent().wait_ready()
        yield node


@pytest.fixture
def nft_node(fault_lab: Lab, tmp_path: Path) -> Iterator[FaultNode]:
    """For faults of the API server side, which do not depend on the back end."""
    with make_node(fault_lab, tmp_path, "nft") as node:
        node.start_agent().wait_ready()
        yield node


def settle(seconds: float) -> None:
    """Let traffic run for a while with nothing happening (a measuring interval, not a
    wait for anything)."""
    time.sleep(seconds)
