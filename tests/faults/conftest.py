"""The fault suite's node: the real agent (`python -m proxy`) in a lab node namespace,
the simulator as its API server, echo pods, and traffic that never stops.

Services (IPv4; dual stack is the e2e tier's business):

    web    198.18.128.10  80/TCP, 53/UDP   web-1 (this node), web-2 (node-b)
    np     NodePort 30080/TCP on 198.18.0.1 web-1, web-2
    local  198.18.128.30  80/TCP           internalTrafficPolicy Local: web-1 only

Modes: "iptables/nft" and "iptables/legacy" (`--proxy-mode iptables` on either of
iptables' back ends) and "nftables" (`--proxy-mode nftables`, our own tables `ip|ip6
sliceproxy` and `sliceproxy-<i>`). `fault_node` runs each test in all three; faults that
mean something in one mode only take `make_node` with that mode.

Every fault's figures go into `FAULTS` and are printed at the end of the run (and
written as JSON to $SLICEPROXY_FAULT_REPORT when set), for docs/reliability.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from proxy.netns_lab import BackendSpec, Lab
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
        return (f"  {self.fault:<44} {self.mode:<15} {self.attempts:>6} {self.failed:>6} "
                f"{self.longest_window:>7.2f}s {conv:>8} {self.restarts:>3}  {self.notes}")


FAULTS: list[FaultRecord] = []


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not FAULTS:
        return
    tr = terminalreporter
    tr.write_line("fault suite (connections attempted, failed, longest failure window, "
                  "time to converge, agent restarts):")
    tr.write_line(f"  {'fault':<44} {'mode':<15} {'tried':>6} {'failed':>6} "
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


MODES = ("iptables/nft", "iptables/legacy", "nftables")
# Our nftables tables: the main one and its shards (proxy/dataplane/nftables/render.py).
OUR_NFT_TABLE = re.compile(r"^table (ip6?) (sliceproxy(?:-\d+)?) \{$")
_EXPIRES = re.compile(r" expires \S+")  # a dynamic element's countdown, not content


def nft_objects(ruleset: str) -> list[str]:
    """Our objects in `nft list ruleset` text, one line each, named by where they are:
    "table ip sliceproxy", "chain ip sliceproxy-0 services", "rule ip sliceproxy-0
    services <rule>", "element ip sliceproxy-0 service-ips <element>", ... Elements
    one by one, because nft prints a set's elements in the kernel's order, which a
    rewrite may change. Sorted, two listings compare as the rules a user would see."""
    out: list[str] = []
    table = kind = where = pending = ""
    for raw in ruleset.splitlines():
        line = raw.strip()
        if not line:
            continue
        if not raw.startswith("\t"):  # a table's first or last line
            match = OUR_NFT_TABLE.match(line)
            table = f"{match[1]} {match[2]}" if match else ""
            kind, where = "", table  # until its first chain or set: the table's own lines
            if table:
                out.append(f"table {table}")
            continue
        if not table or line == "}":
            continue
        head = re.match(r"^(chain|set|map|counter) (\S+) \{$", line)
        if head:
            kind, where = head[1], f"{table} {head[2]}"
            out.append(f"{kind} {where}")
        elif kind == "counter":  # its count, which traffic moves: not a rule
            continue
        elif pending or line.startswith("elements = {"):
            pending += " " + line.removeprefix("elements = {")
            if line.endswith("}"):
                out += [f"element {where} {_EXPIRES.sub('', e.strip())}"
                        for e in pending.rstrip("}").split(",") if e.strip()]
                pending = ""
        elif kind == "chain" and not re.match(r"type \S+ hook ", line):
            out.append(f"rule {where} {line}")
        else:  # a chain's type and hook, a set's type, flags, timeout...
            out.append(f"decl {where} {line}")
    return out


def nft_rules(lab: Lab) -> list[str]:
    """Our nftables objects in the node namespace (both families): `nft_objects`."""
    res = lab.exec(lab.node_ns, ["nft", "list", "ruleset"], check=True)
    return nft_objects(res.stdout)


class FaultNode:
    """One lab, its simulator, the agent and the traffic, for one test."""

    modes: tuple[str, ...] = MODES  # a subclass may run other modes (the kernel tier's IPVS)

    def __init__(self, lab: Lab, sim: SimServer, workdir: Path, mode: str) -> None:
        assert mode in self.modes, mode
        self.lab, self.sim, self.workdir, self.mode = lab, sim, workdir, mode
        self.targets = targets(lab)
        self.agents: list[AgentProcess] = []

    @property
    def nftables(self) -> bool:
        """The native nftables mode (else the iptables mode, on `backend`)."""
        return self.mode == "nftables"

    @property
    def backend(self) -> str:
        """iptables' back end, "nft" or "legacy" (the iptables mode only)."""
        assert not self.nftables, "the nftables mode has no iptables back end"
        return self.mode.split("/")[1]

    def start_agent(self, *flags: str, env: dict[str, str] | None = None) -> AgentProcess:
        mode = ("--proxy-mode", self.mode.split("/")[0])
        agent = AgentProcess(self.lab, self.sim, self.workdir, *mode, *flags, env=env,
                             name=f"agent-{len(self.agents) + 1}").start()
        self.agents.append(agent)
        return agent

    @property
    def agent(self) -> AgentProcess:
        return self.agents[-1]

    def traffic(self, **kw: Any) -> Traffic:
        return Traffic(self.lab.client_ns, self.targets, **kw)

    def rules(self) -> list[str]:
        """Our rules in the kernel: iptables-save lines of our chains, or our nftables
        tables' objects (`nft_objects`)."""
        if self.nftables:
            return nft_rules(self.lab)
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


@pytest.fixture(params=MODES)
def mode(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@contextlib.contextmanager
def make_node(lab: Lab, tmp_path: Path, mode: str,
              objects: list[dict[str, Any]] | None = None) -> Iterator[FaultNode]:
    if mode == "iptables/legacy":
        use_legacy(lab)
    objs = [node_object(), namespace_object("demo"), *web_objects(lab), *(objects or [])]
    with start_sim(lab, objs) as sim:
        node = FaultNode(lab, sim, tmp_path, mode)
        try:
            yield node
        finally:
            for agent in node.agents:
                if agent.alive():
                    agent.stop()


@pytest.fixture
def fault_node(fault_lab: Lab, tmp_path: Path, mode: str) -> Iterator[FaultNode]:
    """A node in `mode` (each of MODES, parametrized) with the agent running and ready."""
    with make_node(fault_lab, tmp_path, mode) as node:
        node.start_agent().wait_ready()
        yield node


@pytest.fixture
def nft_node(fault_lab: Lab, tmp_path: Path) -> Iterator[FaultNode]:
    """For faults of the API server side, which do not depend on the data plane."""
    with make_node(fault_lab, tmp_path, "iptables/nft") as node:
        node.start_agent().wait_ready()
        yield node


def settle(seconds: float) -> None:
    """Let traffic run for a while with nothing happening (a measuring interval, not a
    wait for anything)."""
    time.sleep(seconds)
