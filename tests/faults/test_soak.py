"""A soak: the API server's faults and the cluster's churn, at random and one after
another, for SLICEPROXY_FAULT_SOAK seconds (20 in the suite; by hand, e.g. 1800), with
traffic flowing throughout. No connection to a service with ready endpoints fails, the
agent never restarts, its memory stays bounded, and at the end its rules are exactly
those a freshly started agent writes for the same cluster."""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from proxy.netns_lab.probe import ask_once
from tests.e2e.agent_support import endpoint, endpoint_slice, service, wait_for
from tests.faults.conftest import ANY, FaultNode, make_node, settle
from tests.faults.test_api_faults import add_probe, answered
from tests.faults.traffic import Target

pytestmark = pytest.mark.root

SOAK = float(os.environ.get("SLICEPROXY_FAULT_SOAK", "20"))
SEED = int(os.environ.get("SLICEPROXY_FAULT_SEED", "13"))
CHURN, FLAP = "198.18.128.60", "198.18.128.61"
MAX_PROBES = 40  # new services written during the soak (each one stays)
# Growth of the agent's RSS over the soak allowed beyond its size once warmed up. The
# agent holds a few dozen services here: tens of MiB more would be a leak.
RSS_SLACK_KIB = 64 * 1024


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Soak:
    """The events, each drawn at random; what happened is counted."""

    def __init__(self, node: FaultNode, rng: random.Random) -> None:
        self.node, self.sim, self.rng = node, node.sim, rng
        self.done: Counter[str] = Counter()
        self.probes = 0
        self.churn_members = ("web-1", "web-2")

    def _slice(self, name: str, svc: str, members: tuple[str, ...]) -> None:
        b = self.node.lab.backends
        self.sim.apply(endpoint_slice(name, svc, [endpoint(b[m].ipv4, node=b[m].node)
                                                  for m in members]))

    def _for(self, seconds: float, begin: Callable[[], object]) -> None:
        begin()
        self.sim.cut_watches()  # every reflector goes through it
        settle(seconds)  # the fault lasts this long: a measured interval
        self.sim.fail_next(0)
        self.sim.set_latency(0.0)

    def cut(self) -> None:
        self.sim.cut_watches(abrupt=self.rng.random() < 0.5)

    def compact(self) -> None:
        self.sim.compact()
        self.sim.expire_watches()

    def storm_500(self) -> None:
        self._for(2.0, lambda: self.sim.fail_next(10**9, 500))

    def storm_429(self) -> None:
        self._for(2.0, lambda: self.sim.fail_next(10**9, 429, retry_after=1))

    def slow(self) -> None:
        self._for(2.0, lambda: self.sim.set_latency(1.0))

    def down(self) -> None:
        self.sim.stop()
        settle(3.0)
        with entered(self.node.lab.node_ns):  # it listens on the node's own loopback
            self.sim.start()

    def churn(self) -> None:
        """A service's endpoints replaced, never fewer than one: its traffic must hold."""
        self.churn_members = self.rng.choice([("web-1",), ("web-2",), ("web-1", "web-2")])
        self._slice("churn-1", "churn", self.churn_members)

    def flap(self) -> None:
        """A service no client asks, between no endpoints and one."""
        self._slice("flap-1", "flap", self.rng.choice([(), ("web-1",)]))

    def probe(self) -> None:
        if self.probes < MAX_PROBES:
            self.probes += 1
            add_probe(self.node, 100 + self.probes)

    def step(self) -> None:
        event = self.rng.choice([self.cut, self.compact, self.storm_500, self.storm_429,
                                 self.slow, self.down, self.churn, self.churn, self.flap,
                                 self.flap, self.probe])
        event()
        self.done[event.__name__] += 1


def churn_answers_only(lab: Lab, name: str, tries: int = 10) -> bool:
    return all(ask_once(lab.client_ns, CHURN, 80, timeout=0.3) == name for _ in range(tries))


def test_soak(fault_lab: Lab, tmp_path: Path) -> None:
    b = fault_lab.backends
    both = [endpoint(b[n].ipv4, node=b[n].node) for n in ("web-1", "web-2")]
    extra = [service("churn", [CHURN]), endpoint_slice("churn-1", "churn", both),
             service("flap", [FLAP]), endpoint_slice("flap-1", "flap", both[:1])]
    with make_node(fault_lab, tmp_path, "iptables/nft", extra) as node:
        node.targets.append(Target("churn", CHURN, 80, "tcp", ANY))
        agent = node.start_agent()
        agent.wait_ready()
        assert agent.proc is not None
        pid = agent.proc.pid
        soak = Soak(node, random.Random(SEED))
        with node.traffic(limit=SOAK + 300) as traffic:
            settle(1.0)
            rss_start, cpu_start = agent.rss_kib(), cpu_seconds(pid)
            rss_max = rss_start
            began = time.monotonic()
            while time.monotonic() - began < SOAK:
                soak.step()
                rss_max = max(rss_max, agent.rss_kib())
                settle(soak.rng.uniform(0.2, 1.0))
            ended = time.monotonic()
            # One last change after all of it reaches the kernel.
            node.sim.apply(endpoint_slice("churn-1", "churn", both[1:]))
            wait_for(lambda: churn_answers_only(fault_lab, "web-2"), 60.0,
                     "the last change after the soak")
            converged = time.monotonic() - ended
            if soak.probes:
                answered(fault_lab, "198.18.129.101", 30.0)
            rss_end, cpu = agent.rss_kib(), cpu_seconds(pid) - cpu_start
            settle(0.5)
        report = traffic.report(since=began)
        rules = sorted(node.rules())
        events = ", ".join(f"{k} {v}" for k, v in sorted(soak.done.items()))
        node.record(f"soak {SOAK:g}s (seed {SEED})", report, converged,
                    restarts=node.restarts(),
                    notes=f"RSS {rss_start // 1024}->{rss_end // 1024} MiB "
                          f"(max {rss_max // 1024}); CPU {cpu:.1f}s; {events}",
                    rss_start_kib=rss_start, rss_end_kib=rss_end, rss_max_kib=rss_max,
                    cpu_seconds=round(cpu, 2), events=dict(soak.done))
        assert agent.alive() and node.restarts() == 0, agent.log_tail()
        assert report.failed == 0, report.failures()
        assert rss_max <= rss_start + RSS_SLACK_KIB, (rss_start, rss_max)
        # What the soaked agent left in the kernel is what a fresh one writes.
        agent.stop()
        node.start_agent().wait_ready()
        wait_for(lambda: sorted(node.rules()) == rules, 30.0,
                 "a fresh agent's rules equal to the soaked agent's")
