"""Faults on the node's side: the agent SIGKILLed in the middle of a full sync, the
xtables lock held by someone else, a restore the kernel refuses. Traffic to services
with ready endpoints never fails; the agent (or its successor) converges afterwards."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from proxy.lab import Lab
from proxy.lab.probe import Flow
from tests.e2e.agent_support import wait_for
from tests.faults.conftest import WEB, FaultNode, bulk_services, make_node, settle
from tests.faults.test_api_faults import add_probe, answered

pytestmark = pytest.mark.root

BULK = 1400  # service ports enough for two nf_tables restore batches in a full sync


def slow_restore(bindir: Path, marks: Path) -> dict[str, str]:
    """An iptables-nft-restore first on PATH that runs the real one, leaves a mark, then
    takes a second more: a full sync slow enough to be killed in the middle of."""
    real = shutil.which("iptables-nft-restore")
    assert real
    bindir.mkdir()
    marks.mkdir()
    wrapper = bindir / "iptables-nft-restore"
    wrapper.write_text(f'#!/bin/sh\n"{real}" "$@"\nrc=$?\n'
                       f'touch "{marks}/$(date +%s%N)"\nsleep 1\nexit $rc\n')
    wrapper.chmod(0o755)
    return {"PATH": f"{bindir}:{os.environ.get('PATH', '')}"}


class RuleCounter:
    """Samples how many of our nat rules the kernel holds, in the background."""

    def __init__(self, node: FaultNode) -> None:
        self.node = node
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def count(self) -> int:
        out = self.node.lab.exec(self.node.lab.node_ns, ["iptables-nft-save", "-t", "nat"])
        return sum(1 for ln in out.stdout.splitlines() if ln.startswith("-A SPX-"))

    def _run(self) -> None:
        end = time.monotonic() + 300
        while not self._stop.is_set() and time.monotonic() < end:
            self.samples.append(self.count())
            self._stop.wait(0.2)

    def __enter__(self) -> RuleCounter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)


def test_sigkill_in_the_middle_of_a_full_sync(fault_lab: Lab, tmp_path: Path) -> None:
    with make_node(fault_lab, tmp_path, "iptables/nft",
                   bulk_services(fault_lab, BULK)) as node:
        node.start_agent().wait_ready(60)
        full = len(node.rules())
        with node.traffic() as traffic, RuleCounter(node) as counter, \
                Flow(fault_lab.client_ns, WEB, 80) as flow:
            first = flow.ask()
            nat_rules = counter.count()
            began = time.monotonic()
            node.agent.stop()  # a rolling update: SIGTERM, the rules stay
            marks = tmp_path / "marks"
            env = slow_restore(tmp_path / "bin", marks)
            doomed = node.start_agent(env=env)
            # Its first full sync has committed one restore batch and is in the next.
            wait_for(lambda: any(marks.iterdir()), 60.0, "the first restore batch")
            assert doomed.proc is not None
            os.killpg(doomed.proc.pid, signal.SIGKILL)  # the agent and its restore
            doomed.proc.wait(10)
            successor = node.start_agent()
            successor.wait_ready(60)
            converged = time.monotonic() - began
            settle(1.0)
            assert flow.ask() == first, "the established flow moved or broke"
        report = traffic.report(since=began)
        node.record("SIGKILL mid full sync, restarted", report, converged,
                    restarts=node.restarts(),
                    notes=f"{BULK} extra services; converge from the first kill",
                    fewest_rules=min(counter.samples), rules=full)
        assert report.failed == 0, report.failures()
        assert len(node.rules()) == full
        # Never a window without rules: every sample held at least what we had.
        assert min(counter.samples) >= nat_rules, counter.samples[:50]


def test_xtables_lock_held_for_10s(fault_lab: Lab, tmp_path: Path) -> None:
    """Legacy only: iptables' nf_tables back end does not take the xtables lock."""
    with make_node(fault_lab, tmp_path, "iptables/legacy") as node:
        node.start_agent().wait_ready()
        lock = "/run/xtables.lock"
        with node.traffic() as traffic:
            settle(0.5)
            began = time.monotonic()
            holder = fault_lab.popen(fault_lab.node_ns, ["flock", lock, "sleep", "10"])
            try:
                wait_for(lambda: fault_lab.exec(fault_lab.node_ns,
                                                ["flock", "-n", lock, "true"]).returncode,
                         10.0, "the lock to be held")
                ip = add_probe(node, 30)  # a change that cannot be applied yet
                holder.wait(30)
            finally:
                if holder.poll() is None:
                    holder.kill()
            released = time.monotonic()
            converged = answered(fault_lab, ip, 60.0) - released
        report = traffic.report(since=began)
        node.record("xtables lock held 10 s", report, converged, restarts=node.restarts(),
                    notes="converge from the lock's release")
        assert report.failed == 0, report.failures()
        assert node.agent.alive() and node.restarts() == 0


@pytest.mark.parametrize("mode", ["iptables/nft", "iptables/legacy"], indirect=True)
def test_a_restore_the_kernel_refuses(fault_node: FaultNode) -> None:
    """Someone jumps to one of our chains from their own; deleting the service must
    delete the chain, which the kernel refuses while it is referenced. The old rules
    stay and serve; once the reference is gone, the agent converges."""
    node, lab = fault_node, fault_node.lab
    tool = f"iptables-{node.backend}"
    victim = add_probe(node, 40)
    answered(lab, victim, 30.0)
    rules = "\n".join(node.rules())
    chain = next(line.split()[-1] for line in rules.splitlines()
                 if "demo/probe-40:http cluster IP" in line and "-j SPX-SVC-" in line)
    lab.exec(lab.node_ns, [tool, "-t", "nat", "-N", "FOREIGN"], check=True)
    lab.exec(lab.node_ns, [tool, "-t", "nat", "-A", "FOREIGN", "-j", chain], check=True)
    try:
        with node.traffic() as traffic:
            settle(0.5)
            began = time.monotonic()
            node.sim.delete("v1", "Service", "probe-40", namespace="demo")
            wait_for(lambda: "sync failed" in node.agent.log_text(), 30.0,
                     "the refused restore")
            late = add_probe(node, 41)  # blocked behind the refused one, as upstream
            settle(3.0)
            lab.exec(lab.node_ns, [tool, "-t", "nat", "-F", "FOREIGN"], check=True)
            lab.exec(lab.node_ns, [tool, "-t", "nat", "-X", "FOREIGN"], check=True)
            freed = time.monotonic()
            converged = answered(lab, late, 60.0) - freed
        report = traffic.report(since=began)
        node.record("restore refused (foreign jump to our chain)", report, converged,
                    restarts=node.restarts(),
                    notes="changes wait until the reference goes; converge from then")
        assert report.failed == 0, report.failures()
        assert not any(chain in r for r in node.rules())
        assert node.agent.alive() and node.restarts() == 0
    finally:
        lab.exec(lab.node_ns, [tool, "-t", "nat", "-F", "FOREIGN"])
        lab.exec(lab.node_ns, [tool, "-t", "nat", "-X", "FOREIGN"])
