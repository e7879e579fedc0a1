"""Failing fast on a vanished backend in IPVS mode, inside the kernel lab (run by
tests/kernel/test_ipvs_fail_fast.py through scenarios/run.py; never on the host).

A client holding an idle TCP connection through a service to a pod that dies and leaves
the slice gets ECONNRESET at once (common/fail_fast.py, its IPVS form): from the client
namespace (masqueraded) to a cluster IP over IPv4 and IPv6 and to a NodePort, and from
the node itself (host network: IPVS on the local-out path). A terminating pod that still
serves keeps its connection; without the opt-in, the client hears nothing. IpvsDataPlane
is driven directly, as scenario_traffic.py does; then once the real agent
(scenario_agent.py's way), from the slice written to the reset and its count.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from proxy.dataplane.common import fail_fast
from proxy.model.types import Family
from proxy.netns_lab import Lab, poll
from proxy.netns_lab.probe import Idle
from proxy.sim import SimServer
from tests.e2e.agent_support import AgentProcess, endpoint, endpoint_slice, run_cli
from tests.e2e.agent_support import service as agent_service
from tests.kernel.scenario_guest import (
    HELD_FLOW_TIMEOUT,
    READY_DEADLINE,
    Cluster,
    NodeThread,
    options,
)
from tests.unit.builders import ep, eps_slice, service

GOAL = 2.0  # seconds from the endpoint's removal to the client's error (issue 39)
# The lab's kernel may be emulated (no KVM: several times slower), where the sync alone
# can take most of GOAL (2.09 s once, the module's first case): the reset, sent within
# the sync, then reaches the client this soon after it returns. The host-kernel tests
# (tests/e2e/test_fail_fast.py) hold the other modes to GOAL itself.
AFTER_SYNC = 0.5
# The real agent under emulation: seconds to start, and its watch and sync are slower
# than a node's (its time to the reset is printed; the goal is the data plane's above).
AGENT_DEADLINE = 10.0
ON = {"sliceproxy.io/fail-fast": "true"}
SLICE_PORTS = ({"name": "http", "port": 8080, "protocol": "TCP"},)
MEMBERS = ("web-1", "web-2")


def objects(lab: Lab, name: str, vips: tuple[str, ...], annotations: dict[str, str] | None,
            node_port: int | None = None,
            conditions: dict[str, dict[str, Any] | None] | None = None
            ) -> list[dict[str, Any]]:
    """The service and its slices (IPv4, and IPv6 when it has an IPv6 address): web-1
    and web-2, with `conditions` by name; a name whose conditions are None has left."""
    port: dict[str, Any] = {"name": "http", "port": 80, "protocol": "TCP"}
    spec: dict[str, Any] = {}
    if node_port is not None:
        port["nodePort"], spec["type"] = node_port, "NodePort"
    out = [service(name, ips=vips, ports=(port,), annotations=annotations, **spec)]
    conditions = conditions or {}
    for family in (Family.V4, Family.V6)[:len(vips)]:
        eps = [ep(str(b.ipv4 if family is Family.V4 else b.ipv6), node="node-a",
                  **(conditions.get(n) or {}))
               for n, b in lab.backends.items()
               if n in MEMBERS and conditions.get(n, {}) is not None]
        out.append(eps_slice(f"{name}-{family.label.lower()}", eps, service_name=name,
                             ports=SLICE_PORTS, address_type=family.label))
    return out


@contextmanager
def dead(lab: Lab, name: str) -> Iterator[None]:
    """The pod dies: nothing it receives is answered (until the scenario ends)."""
    ns = lab.backends[name].ns
    lab.exec(ns, ["nft", "add table inet dead; add chain inet dead in { type filter hook "
                  "input priority 0; policy drop; }"], check=True)
    try:
        yield
    finally:
        lab.exec(ns, ["nft", "delete", "table", "inet", "dead"], check=True)


@pytest.fixture(scope="module", autouse=True)
def _nft_read(lab: Lab) -> None:
    """`nft` run once before any clock starts: under emulation its first run reads the
    binary and its libraries over 9p (seconds; milliseconds on a node's disk)."""
    lab.exec(lab.node_ns, ["nft", "list", "tables"], check=True)


@pytest.fixture(autouse=True)
def _no_table_left(lab: Lab) -> Iterator[None]:
    yield
    lab.exec(lab.node_ns, ["nft", "delete", "table", "inet", fail_fast.TABLE])


# (client, frontend, family, opted in by): the cluster IP from the client namespace over
# both families, a NodePort from there (by the node's --fail-fast), the cluster IP from
# the node itself.
CASES = [("client", "cluster-ip", Family.V4, "annotation"),
         ("client", "cluster-ip", Family.V6, "annotation"),
         ("client", "node-port", Family.V4, "flag"),
         ("node", "cluster-ip", Family.V4, "annotation")]


@pytest.mark.parametrize(("client", "frontend", "family", "how"), CASES,
                         ids=lambda v: v.label if isinstance(v, Family) else v)
def test_client_of_a_vanished_endpoint_gets_a_reset_within_2s(
        lab: Lab, node: NodeThread, cluster: Cluster, client: str, frontend: str,
        family: Family, how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    spent: list[float] = []  # fail_fast's own part of the sync, for the printed figure
    end = fail_fast.FailFast.end

    def timed(self: fail_fast.FailFast, gone: Sequence[fail_fast.Vanished]) -> int:
        started = time.monotonic()
        try:
            return end(self, gone)
        finally:
            spent.append(time.monotonic() - started)

    monkeypatch.setattr(fail_fast.FailFast, "end", timed)
    index = CASES.index((client, frontend, family, how))
    vips = (f"198.18.128.{60 + index}", f"fd00:198:18::{60 + index:x}")
    node_port = 30090 + index if frontend == "node-port" else None
    annotations = ON if how == "annotation" else None
    node.start_plane(options(fail_fast=how == "flag"))
    name = f"ff{index}"
    node.sync(cluster.apply(*objects(lab, name, vips, annotations, node_port)))
    ns = lab.client_ns if client == "client" else lab.node_ns
    address = (str(lab.node_ip4) if node_port else vips[0 if family is Family.V4 else 1])
    idle = Idle(ns, address, node_port or 80)
    try:
        with dead(lab, idle.backend):
            removed = time.monotonic()
            report = node.sync(cluster.apply(*objects(lab, name, vips, annotations,
                                                      node_port, {idle.backend: None})))
            synced = time.monotonic() - removed
            took = idle.reset_since(removed, GOAL + 1)
        print(f"fail fast (ipvs, {client}, {frontend}, {family.label}, {how}): ECONNRESET "
              f"{took:.3f} s after the removal (the sync returned after {synced:.3f} s, "
              f"of which fail_fast {spent[-1]:.3f} s)")
        assert took <= max(GOAL, synced + AFTER_SYNC)
        assert (report.flows_reset, report.details["flows_reset"]) == (1, 1)
    finally:
        idle.close()


def test_terminating_endpoint_still_serving_keeps_its_connection(
        lab: Lab, node: NodeThread, cluster: Cluster) -> None:
    vips = ("198.18.128.70",)
    node.sync(cluster.apply(*objects(lab, "ffdrain", vips, ON)))
    with lab.hold(lab.client_ns, vips[0], 80, timeout=HELD_FLOW_TIMEOUT) as flow:
        held = flow.ask()
        draining = {"ready": False, "serving": True, "terminating": True}
        report = node.sync(cluster.apply(*objects(lab, "ffdrain", vips, ON,
                                                  conditions={held: draining})))
        assert report.flows_reset == 0
        # New connections go to the other pod; the held one still talks to its own (a
        # reset, had one been provoked, comes back within milliseconds of the sync).
        other = ({"web-1", "web-2"} - {held}).pop()
        assert lab.ask(lab.client_ns, vips[0], 80, count=4) == {other: 4}
        assert [flow.ask() for _ in range(2)] == [held] * 2


def test_without_the_opt_in_the_client_hears_nothing(lab: Lab, node: NodeThread,
                                                     cluster: Cluster) -> None:
    vips = ("198.18.128.71",)
    node.sync(cluster.apply(*objects(lab, "ffoff", vips, None)))
    idle = Idle(lab.client_ns, vips[0], 80)
    try:
        with dead(lab, idle.backend):
            report = node.sync(cluster.apply(*objects(lab, "ffoff", vips, None,
                                                      conditions={idle.backend: None})))
            assert report.flows_reset == 0
            # Today's behaviour, for as long as the goal: silence (the real server drains
            # at weight 0; the client, sending nothing, learns nothing).
            with pytest.raises(poll.TimedOut):
                poll.wait(lambda: idle.ended, GOAL, "the client's wait to end")
    finally:
        idle.close()


def test_real_agent_resets_a_flow_and_counts_it(lab: Lab, sim: SimServer,
                                                workdir: Path) -> None:
    """The whole path: the slice written to the API server (the simulator), the agent's
    watch and sync in IPVS mode, the reset, its count in /metrics. The node's
    --fail-fast."""
    vip = "198.18.128.72"
    pods = {n: lab.backends[n] for n in MEMBERS}
    sim.apply(agent_service("ffagent", [vip]))
    sim.apply(endpoint_slice("ffagent-v4", "ffagent", [endpoint(b.ipv4) for b in pods.values()]))
    agent = AgentProcess(lab, sim, workdir, "--proxy-mode", "ipvs", "--fail-fast").start()
    try:
        agent.wait_ready(READY_DEADLINE)
        lab.wait_for(lab.client_ns, vip, 80, set(pods))
        idle = Idle(lab.client_ns, vip, 80)
        try:
            with dead(lab, idle.backend):
                written = time.monotonic()
                sim.apply(endpoint_slice("ffagent-v4", "ffagent", [
                    endpoint(b.ipv4) for n, b in pods.items() if n != idle.backend]))
                took = idle.reset_since(written, AGENT_DEADLINE, agent.log_tail)
            print(f"fail fast (ipvs, real agent): ECONNRESET {took:.3f} s after the slice "
                  "was written")
        finally:
            idle.close()
        # Counted once the sync that reset it has reported.
        poll.wait(lambda: agent.metrics().get("sliceproxy_tcp_flows_reset_total", 0) >= 1,
                  AGENT_DEADLINE, "the reset counted in /metrics",
                  detail=lambda: agent.metrics().get("sliceproxy_tcp_flows_reset_total"))
    finally:
        agent.stop()
        done = run_cli(lab, ["--cleanup", "--proxy-mode", "ipvs", "--hostname-override",
                             "node-a"], timeout=READY_DEADLINE)
        lab.exec(lab.node_ns, ["conntrack", "-F"])
        assert done.returncode == 0, done.stderr[-2000:]


def test_the_other_modes_table_loads_in_this_kernel_too(lab: Lab) -> None:
    """The iptables and nftables modes' form (a reject in prerouting, before DNAT) is
    accepted by Debian 12's kernel as by the host's: a kernel that refused it would leave
    fail-fast off with a warning, never the rules."""
    done = lab.exec(lab.node_ns, ["nft", "-f", "-"], input=fail_fast.table_script(ipvs=False))
    assert done.returncode == 0, done.stderr
    listed = lab.exec(lab.node_ns, ["nft", "list", "table", "inet", fail_fast.TABLE]).stdout
    # -150: nft names it `mangle`.
    assert "hook prerouting priority mangle" in listed and "ct reply ip saddr" in listed
