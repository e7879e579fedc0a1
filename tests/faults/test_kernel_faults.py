"""Faults on the node's side: the agent SIGKILLed in the middle of a full sync, the
xtables lock held by someone else, a restore the kernel refuses (in the nftables mode,
a partial batch it refuses). Traffic to services with ready endpoints never fails; the
agent (or its successor) converges afterwards.

The nftables mode has no counterpart of the first two: a full sync there is one
nf_tables transaction per family, which the kernel commits whole or not at all, so a
SIGKILL cannot leave a half-written ruleset (the iptables mode's full sync is several
restore batches); and nft takes no xtables lock (nf_tables serialises transactions in
the kernel), so nobody can hold our syncs back by holding a lock."""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import pytest

from proxy.netns_lab import Lab
from proxy.netns_lab.probe import Flow
from tests.e2e.agent_support import endpoint, endpoint_slice, wait_for
from tests.faults.conftest import (
    BOTH_PORTS,
    WEB,
    FaultNode,
    bulk_services,
    make_node,
    settle,
)
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


def test_a_partial_batch_the_kernel_refuses(fault_lab: Lab, tmp_path: Path) -> None:
    """The nftables mode's refused transaction. nf_tables has no references across
    tables, so nobody outside our tables can hold one of our chains as in the test
    above; inside them, someone else's rule jumping to a service's chain makes the
    kernel refuse the batch that deletes the chain (EBUSY). Such a rule is drift, and
    the drift check (a full sync, which clears it) normally comes first; so the agent
    is stopped (SIGSTOP) while the rule is added and the service deleted, and on waking
    its partial batch meets the rule: refused whole, the old rules keep serving, the
    next sync is full and converges, with the change to web that was refused along."""
    with make_node(fault_lab, tmp_path, "nftables") as node:
        agent = node.start_agent()
        agent.wait_ready()
        assert agent.proc is not None
        lab = fault_lab
        # A port with a chain of its own (ClientIP affinity): a picked port has none.
        victim = add_probe(node, 40, sessionAffinity="ClientIP")
        answered(lab, victim, 30.0)
        element = next(r for r in node.rules() if r.startswith("element ip ")
                       and f" {victim} . tcp . 80 : goto " in r)
        table, chain = element.split()[2], element.split()[-1]
        with node.traffic() as traffic:
            settle(0.5)
            began = time.monotonic()
            os.killpg(agent.proc.pid, signal.SIGSTOP)
            try:
                lab.exec(lab.node_ns, ["nft", "-f", "-"], check=True,
                         input=f"add chain ip {table} foreign\n"
                               f"add rule ip {table} foreign jump {chain}\n")
                node.sim.delete("v1", "Service", "probe-40", namespace="demo")
                web2 = lab.backends["web-2"]  # in the same batch: web loses web-1
                node.sim.apply(endpoint_slice("web-1", "web", [endpoint(web2.ipv4,
                                                                        node=web2.node)],
                                              BOTH_PORTS))
                # Stopped for longer than --min-sync-period (1 s): on waking, the change
                # is synced at once (a measured interval, not a wait for anything).
                settle(1.2)
            finally:
                os.killpg(agent.proc.pid, signal.SIGCONT)
            woke = time.monotonic()
            wait_for(lambda: not any(f" {chain}" in r or " foreign" in r
                                     for r in node.rules()), 30.0,
                     "the victim's chain and the foreign chain gone")
            lab.wait_for(lab.client_ns, WEB, 80, {"web-2"})
            converged = time.monotonic() - woke
            late = add_probe(node, 41)
            answered(lab, late, 30.0)
        report = traffic.report(since=began)
        log = agent.log_text()
        metrics = agent.metrics()
        node.record("partial batch refused (foreign jump in our table)", report,
                    converged, restarts=node.restarts(),
                    notes="agent stopped meanwhile; converge from its waking")
        refused = [ln for ln in log.splitlines()
                   if "nftables transaction failed" in ln and "full=False" in ln]
        assert refused, agent.log_tail()
        assert f"delete chain ip {table} {chain}" in refused[0], refused[0]
        assert metrics['sliceproxy_syncs_total{kind="partial",result="error"}'] >= 1
        assert metrics['sliceproxy_syncs_total{kind="full",result="ok"}'] >= 2
        assert report.failed == 0, report.failures()
        assert agent.alive() and node.restarts() == 0
