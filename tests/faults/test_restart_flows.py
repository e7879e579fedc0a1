"""Restarts and upgrades move no flow (issue 28), with real traffic through the real agent
(`python -m proxy`) in a lab node, in the iptables mode (nf_tables back end) and the
nftables mode:

- long-lived UDP flows (eight clients, each keeping one socket, so one source port and
  one conntrack entry, four answered by each of two endpoints) through a SIGTERM and then
  a SIGKILL restart of the agent: none moves to the other endpoint, no datagram goes
  unanswered (no answer within 1 s);
- an endpoint removed while no agent runs (its pod gone: its address no longer exists,
  so its flows are blackholed): once the next agent's first sync is done, its flows are
  answered by the live endpoint within 5 s, and the other endpoint's flows never move;
- a client that sent datagrams to a cluster IP before its service existed (conntrack
  entries without DNAT, which would otherwise keep it from the endpoints, kubernetes
  issue 48370) is answered within 5 s of the service getting endpoints: with the agent
  running throughout, across a restart, and with the endpoints written while no agent
  ran (5 s from the first sync).

The figures go into the fault suite's table and are printed. The restart scenario runs in
IPVS mode too, in the kernel lab (tests/kernel/scenarios/scenario_faults.py).
"""

from __future__ import annotations

import os
import signal
import time
from datetime import datetime

import pytest

from proxy.netns_lab.probe import UdpFlow
from tests.e2e.agent_support import AgentProcess, PortSpec, endpoint, endpoint_slice, service
from tests.faults.conftest import FAULTS, FaultNode, FaultRecord
from tests.faults.traffic import FlowLog, UdpFlows, pinned_flows

pytestmark = [pytest.mark.root, pytest.mark.slow,
              pytest.mark.parametrize("mode", ["iptables/nft", "nftables"])]

FLOWS_IP, LATE_IP = "198.18.128.80", "198.18.128.90"
DNS: tuple[PortSpec, ...] = (("dns", 53, 8081, "UDP"),)
WEB = ("web-1", "web-2")
PER_BACKEND = 4  # flows answered by each endpoint: 8 in all
INTERVAL = 0.075  # seconds between a datagram's answer and the next datagram
TIMEOUT = 1.0  # a datagram not answered within this is unanswered
AFTER = 25  # datagrams per flow after each restart (about 2 s)
ANSWER_WITHIN = 5.0  # the bound, from endpoints (or the first sync) to an answer


def udp_service(node: FaultNode, name: str, ip: str, backends: tuple[str, ...]) -> None:
    """Service `name` on `ip`, 53/UDP, with an EndpointSlice of `backends` (may be none)."""
    node.sim.apply(service(name, [ip], DNS))
    endpoints_of(node, name, backends)


def endpoints_of(node: FaultNode, name: str, backends: tuple[str, ...]) -> None:
    b = node.lab.backends
    eps = [endpoint(b[n].ipv4, node=b[n].node) for n in backends]
    node.sim.apply(endpoint_slice(f"{name}-1", name, eps, DNS))


def first_sync_done(agent: AgentProcess) -> float:
    """When the agent's first sync ended (its /debug/dump), on our monotonic clock."""
    (first,) = [s for s in agent.dump()["syncs"] if s["trigger"] == "initial"]
    began = datetime.fromisoformat(first["started"].replace("Z", "+00:00")).timestamp()
    done = began + float(first["duration_seconds"])
    return time.monotonic() - (time.time() - done)


def restart(node: FaultNode, sig: signal.Signals, ready_deadline: float = 30.0
            ) -> tuple[float, int | None]:
    """Stop the agent with `sig` (SIGKILL: its whole process group, as a container is
    killed) and start a successor. Seconds from the signal to the successor's first sync
    done (its /healthz), and the conntrack entries that first sync deleted."""
    old = node.agent
    assert old.proc is not None and old.alive(), old.log_tail()
    began = time.monotonic()
    if sig is signal.SIGKILL:
        os.killpg(old.proc.pid, signal.SIGKILL)
        old.proc.wait(10)
    else:
        old.stop(sig)
        assert old.proc.returncode == 0, old.log_tail()
    successor = node.start_agent()
    successor.wait_ready(ready_deadline)
    took = time.monotonic() - began
    (first,) = [s for s in successor.dump()["syncs"] if s["trigger"] == "initial"]
    assert first["error"] is None, first
    return took, first.get("conntrack_cleared")


def record(node: FaultNode, fault: str, logs: list[FlowLog], converge: float | None,
           notes: str, **extra: object) -> FaultRecord:
    """The flows' figures as a row of the fault table: datagrams sent, those unanswered or
    answered by another endpoint than the flow had, the longest silence of a flow."""
    sent = sum(len(g.datagrams) for g in logs)
    failed = sum(1 for g in logs for d in g.datagrams
                 if d.answer is None or (g.pinned and d.answer != g.pinned))
    rec = FaultRecord(fault, node.mode, sent, failed,
                      round(max(g.longest_silence() for g in logs), 3),
                      None if converge is None else round(converge, 3), node.restarts(),
                      notes, dict(extra))
    FAULTS.append(rec)
    print(f"\n{fault} ({node.mode}): {sent} datagrams on {len(logs)} flows, "
          f"{sum(g.unanswered for g in logs)} unanswered, "
          f"{sum(1 for g in logs if g.moved)} flows moved; {notes}; {extra}\n  "
          + "\n  ".join(map(str, logs)))
    return rec


def restarts_under_udp_flows(node: FaultNode, *, ready_deadline: float = 30.0,
                             timeout: float = TIMEOUT, interval: float = INTERVAL) -> None:
    """Eight long-lived UDP flows through a SIGTERM and a SIGKILL restart: none moves,
    none loses a datagram. Shared with the kernel lab's IPVS run."""
    lab = node.lab
    udp_service(node, "flows", FLOWS_IP, WEB)
    lab.wait_for(lab.client_ns, FLOWS_IP, 53, set(WEB), proto="udp",
                 deadline=ready_deadline)
    flows = pinned_flows(lab.client_ns, FLOWS_IP, 53, dict.fromkeys(WEB, PER_BACKEND),
                         timeout)
    took: dict[str, float] = {}
    cleared: dict[str, int | None] = {}
    with UdpFlows(flows, interval=interval) as busy:
        busy.more(AFTER)
        for sig in (signal.SIGTERM, signal.SIGKILL):
            took[sig.name], cleared[sig.name] = restart(node, sig, ready_deadline)
            busy.more(AFTER)
        logs = busy.logs()
    record(node, f"SIGTERM + SIGKILL restarts, {len(logs)} UDP flows", logs,
           max(took.values()), f"{sum(1 for g in logs if g.moved)} of {len(logs)} flows "
           "moved; converge: signal -> successor ready (longest)",
           ready_after={k: round(v, 2) for k, v in took.items()},
           first_sync_conntrack_cleared=cleared)
    moved = [str(g) for g in logs if g.moved]
    assert not moved, f"{len(moved)} of {len(logs)} flows moved: {moved}"
    silent = {g.name: g.unanswered for g in logs if g.unanswered}
    assert not silent, f"datagrams unanswered within {timeout:g} s: {silent}"
    assert node.agent.alive() and node.restarts() == 0


def test_restarts_move_no_udp_flow(fault_node: FaultNode) -> None:
    restarts_under_udp_flows(fault_node)


def test_endpoint_removed_while_no_agent_runs(fault_node: FaultNode) -> None:
    """web-1's pod goes while no agent runs (out of the slice, its address gone): its
    flows are answered by web-2 within 5 s of the successor's first sync; web-2's flows
    never notice."""
    node, lab = fault_node, fault_node.lab
    udp_service(node, "flows", FLOWS_IP, WEB)
    lab.wait_for(lab.client_ns, FLOWS_IP, 53, set(WEB), proto="udp")
    flows = pinned_flows(lab.client_ns, FLOWS_IP, 53, dict.fromkeys(WEB, PER_BACKEND),
                         TIMEOUT)
    gone, live = lab.backends["web-1"], "web-2"
    with UdpFlows(flows, interval=INTERVAL) as busy:
        busy.more(5)
        node.agent.stop()
        endpoints_of(node, "flows", (live,))
        lab.exec(gone.ns, ["ip", "addr", "del", f"{gone.ipv4}/24", "dev", "eth0"],
                 check=True)
        removed = time.monotonic()
        busy.more(2)  # web-1's flows now go unanswered: nothing moves them yet
        node.start_agent().wait_ready()
        synced = first_sync_done(node.agent)
        orphans = [g.name for g in busy.logs() if g.pinned == gone.name]

        def answered_again(logs: list[FlowLog]) -> bool:
            return all(g.first_answer(removed, live) for g in logs if g.name in orphans)

        busy.until(answered_again, 10 + ANSWER_WITHIN,
                   "web-1's flows answered by web-2")
        busy.more(AFTER)
        logs = busy.logs()
    after = {g.name: (g.first_answer(removed, live) or 0.0) - synced
             for g in logs if g.name in orphans}
    stayed = [g for g in logs if g.name not in orphans]
    record(node, "endpoint removed while no agent ran, UDP flows", logs, max(after.values()),
           "converge: successor's first sync -> the gone endpoint's flows answered "
           "(longest)", answered_after_first_sync={k: round(v, 2) for k, v in after.items()},
           first_sync_after_removal=round(synced - removed, 2))
    assert len(orphans) == PER_BACKEND, [str(g) for g in logs]
    late = {k: round(v, 2) for k, v in after.items() if v > ANSWER_WITHIN}
    assert not late, f"answered by {live} more than {ANSWER_WITHIN:g} s after the first " \
                     f"sync: {late}"
    moved = [str(g) for g in stayed if g.moved]
    assert not moved, f"web-2's flows moved: {moved}"
    silent = {g.name: g.unanswered for g in stayed if g.unanswered}
    assert not silent, f"web-2's flows: datagrams unanswered: {silent}"
    assert node.agent.alive() and node.restarts() == 0


@pytest.mark.parametrize("when", ["agent running", "after a restart", "while no agent ran"])
def test_client_that_sent_first_is_answered_once_endpoints_come(
        fault_node: FaultNode, when: str) -> None:
    """A client sends to a cluster IP before its service exists (its datagrams leave the
    node un-DNATed, a conntrack entry without DNAT records that), and keeps its socket.
    - agent running: the service is created with endpoints;
    - after a restart: the service is created without endpoints, the agent restarted,
      then the endpoints come;
    - while no agent ran: the service and its endpoints are created while no agent runs,
      and the 5 s count from the successor's first sync.
    Each time it is answered within 5 s."""
    node, lab = fault_node, fault_node.lab
    client = UdpFlow(lab.client_ns, LATE_IP, 53, timeout=0.5)
    with UdpFlows([(client, None)], interval=INTERVAL) as busy:
        busy.more(3)  # into the void: entries without DNAT
        took: dict[str, float] = {}
        if when == "after a restart":
            udp_service(node, "late", LATE_IP, ())
            busy.more(3)
            took["restart"] = round(restart(node, signal.SIGTERM)[0], 2)
            busy.more(3)
        if when == "while no agent ran":
            node.agent.stop()
            udp_service(node, "late", LATE_IP, WEB)
            busy.more(3)
            node.start_agent().wait_ready()
            since = first_sync_done(node.agent)
        elif when == "after a restart":
            since = time.monotonic()
            endpoints_of(node, "late", WEB)
        else:
            since = time.monotonic()
            udp_service(node, "late", LATE_IP, WEB)
        answered = busy.until(lambda logs: bool(logs[0].first_answer(since)),
                              10 + ANSWER_WITHIN,
                              "the client's socket answered (it sent before the service)")
        busy.more(5)
        logs = busy.logs()
    waited = (logs[0].first_answer(since) or answered) - since
    record(node, f"client sent before its service existed ({when})", logs, waited,
           "converge: endpoints (or the first sync) -> the same socket answered", **took)
    assert waited <= ANSWER_WITHIN, f"answered {waited:.2f} s after: {logs[0]}"
    assert set(logs[0].answers(since=logs[0].datagrams[-5].sent)) <= set(WEB), logs[0]
    assert node.agent.alive() and node.restarts() == 0
