"""The real agent, `python -m proxy --proxy-mode ipvs`, inside the kernel lab (run by
tests/kernel/test_ipvs_agent.py through scenarios/run.py; never on the host).

What scenario_traffic.py checks by driving IpvsDataPlane directly, here goes through
everything an operator runs: the command line, the watch layer against the cluster
simulator, the sync runner and its data-plane thread, /healthz, /metrics and
/debug/dump, SIGTERM, a restart, and `--cleanup`. The simulator runs in this process,
listening on the node namespace's loopback; the agent runs in the node namespace
(tests/e2e/agent_support.py, as the iptables-mode e2e tests); traffic comes from the
client namespace. Each scenario has service addresses of its own; afterwards its agents
are stopped and `--cleanup --proxy-mode ipvs` and `conntrack -F` run, so scenarios do not
see each other's state.

The node is a Debian 12 node: its plain `iptables` is the nf_tables back end, and the
agent's few iptables rules go there. The restart scenario runs on a node that kubelet
marked as legacy, so both back ends are covered.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from proxy.dataplane.base import PortTraffic
from proxy.dataplane.ipvs.index import RenderIndex
from proxy.dataplane.ipvs.kernel import IpvsTable, Links
from proxy.dataplane.ipvs.render import DUMMY_INTERFACE, IpvsContext, render_all
from proxy.dataplane.ipvs.traffic import TrafficReader
from proxy.model.types import (
    ANNOTATION_TRAFFIC_PER_ENDPOINT,
    Family,
    ServicePortKey,
    format_endpoint,
)
from proxy.netns_lab import BackendSpec, Lab
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    AgentProcess,
    PortSpec,
    endpoint,
    endpoint_slice,
    our_rules,
    quiet_icmp_limits,
    run_cli,
    service,
    wait_for,
)
from tests.kernel.scenario_guest import (
    HELD_FLOW_TIMEOUT,
    READY_DEADLINE,
    Cluster,
    KernelView,
    NodeThread,
    options,
    read_kernel,
)

BACKENDS = {"web-1": "node-a", "web-2": "node-b", "web-3": "node-b"}
NAMES = set(BACKENDS)
BOTH: tuple[PortSpec, ...] = (("http", 80, 8080, "TCP"), ("dns", 53, 8081, "UDP"))
HTTP: tuple[PortSpec, ...] = BOTH[:1]
IPVS = ("--proxy-mode", "ipvs")
CHANGE_DEADLINE = 30.0


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """One lab for the module (building it is slow). Overrides conftest's `lab`."""
    with Lab([BackendSpec(name, node=node) for name, node in BACKENDS.items()]) as lab:
        quiet_icmp_limits(lab)
        lab.start_backends()  # TCP 8080, UDP 8081
        yield lab


@pytest.fixture(scope="module")
def reader(lab: Lab) -> Iterator[NodeThread]:
    """A thread in the node namespace for reading the kernel (no data plane of its own)."""
    thread = NodeThread(lab.node_ns)
    try:
        yield thread
    finally:
        thread.close()


class Agents:
    """Agents started by one scenario; all stopped, and the node cleaned, afterwards."""

    def __init__(self, lab: Lab, sim: SimServer, workdir: Path, reader: NodeThread) -> None:
        self.lab, self.sim, self.workdir, self.reader = lab, sim, workdir, reader
        self.started: list[AgentProcess] = []
        # Set by a scenario that ran --cleanup itself and found nothing left: another
        # one here would only cost an agent's start-up (seconds under emulation).
        self.cleaned = False

    def start(self, *flags: str, name: str = "agent") -> AgentProcess:
        agent = AgentProcess(self.lab, self.sim, self.workdir, *IPVS, *flags, name=name)
        self.started.append(agent)
        return agent.start()

    def close(self) -> None:
        for agent in self.started:
            if agent.alive():
                # stop() kills it if it will not go; the scenario's own failure is
                # what matters then.
                with contextlib.suppress(AssertionError):
                    agent.stop(timeout=15.0)
        if self.cleaned and not any(a.alive() for a in self.started):
            self.reader.exec("conntrack", "-F")
            return
        # Plain --cleanup (the chosen mode, iptables by default, then the other one best
        # effort): the README's promise that it removes both modes' rules is checked
        # here, --proxy-mode ipvs explicitly in test_sigterm_restart_and_cleanup.
        done = run_cli(self.lab, ["--cleanup", "--hostname-override", "node-a"],
                       timeout=READY_DEADLINE)
        self.reader.exec("conntrack", "-F")
        assert done.returncode == 0, f"--cleanup failed:\n{done.stdout}\n{done.stderr}"
        left = leftovers(self.lab, self.reader)
        assert not left, f"--cleanup left {left}:\n{done.stderr[-3000:]}"


@pytest.fixture
def agents(lab: Lab, sim: SimServer, workdir: Path, reader: NodeThread) -> Iterator[Agents]:
    group = Agents(lab, sim, workdir, reader)
    try:
        yield group
    finally:
        group.close()


# --- helpers ---------------------------------------------------------------------------


def slices(lab: Lab, svc: str, members: dict[str, dict[str, Any]],
           ports: Sequence[PortSpec] = BOTH, ipv6: bool = False) -> list[dict[str, Any]]:
    """EndpointSlices of `svc`: backend name -> endpoint() keyword arguments (ready...)."""
    b = lab.backends
    out = [endpoint_slice(f"{svc}-v4", svc, [endpoint(b[n].ipv4, node=b[n].node, **kw)
                                             for n, kw in members.items()], ports)]
    if ipv6:
        out.append(endpoint_slice(f"{svc}-v6", svc, [endpoint(b[n].ipv6, node=b[n].node, **kw)
                                                     for n, kw in members.items()],
                                  ports, family="IPv6"))
    return out


def rs(lab: Lab, name: str, port: int = 8080, family: int = 4) -> str:
    """A backend's real server as the kernel read-back names it ("ip:port", "[ip]:port")."""
    b = lab.backends[name]
    return f"{b.ipv4}:{port}" if family == 4 else f"[{b.ipv6}]:{port}"


def dests(reader: NodeThread, vs: str) -> dict[str, int]:
    """Real servers of virtual server `vs` ("TCP 198.18.128.10:80") with their weights."""
    found: dict[str, int] = read_kernel(reader).services.get(vs, {}).get("dests", {})
    return found


def ipvsadm(reader: NodeThread) -> str:
    out = reader.exec("ipvsadm", "-Ln")
    assert out.returncode == 0, out.stderr
    return out.stdout


def leftovers(lab: Lab, reader: NodeThread) -> list[str]:
    """Whatever of ours the node namespace still holds: virtual servers (only the agent
    makes any here), the dummy interface, our ipsets, our iptables rules (both back ends,
    both families)."""
    left: list[str] = []
    view = read_kernel(reader)
    left += [f"virtual server {k}" for k in view.services]
    if reader.exec("ip", "link", "show", DUMMY_INTERFACE).returncode == 0:
        left.append(f"dummy interface {DUMMY_INTERFACE}")
    sets = reader.exec("ipset", "list", "-n")
    assert sets.returncode == 0, sets.stderr
    left += [f"ipset {n}" for n in sets.stdout.split() if n.startswith("SPX")]  # ours
    left += [f"iptables {r}" for r in our_rules(lab)]
    return left


def answered_by(got: Counter[str]) -> set[str]:
    """The backends among the answers (failures left out)."""
    return set(got) & NAMES


# A reading: by service port name, its new connections and each endpoint's ("ip:port").
Reading = dict[str, tuple[int, dict[str, int]]]


def kernel_traffic(reader: NodeThread, objects: Sequence[dict[str, Any]]) -> Reading:
    """What IpvsDataPlane.traffic() reads from the node's kernel for the IPv4 service
    ports of `objects`, rendered here as an agent renders them (for a reading while no
    agent runs)."""
    state = Cluster().apply(*objects)

    def read() -> dict[ServicePortKey, PortTraffic]:
        links, table = Links(DUMMY_INTERFACE), IpvsTable()
        try:
            ctx = IpvsContext.build(options(), links.node_addresses(exclude=links.index()))
            index = RenderIndex(render_all(state, ctx, (Family.V4,)))
            return TrafficReader().read(index.ports, index, table, False)
        finally:
            links.close()
            table.close()

    return {k.port: (t.total.connections, {format_endpoint(*ep): c.connections
                                           for ep, c in (t.endpoints or {}).items()})
            for k, t in reader.run(read).items()}


def metrics_traffic(agent: AgentProcess, service: str, ports: Sequence[str]) -> Reading:
    """The same from the agent's /metrics (IPv4 ports of demo/`service`)."""
    samples = agent.metrics()
    out: Reading = {}
    for port in ports:
        labels = f'namespace="demo",service="{service}",port="{port}",family="IPv4"'
        prefix = f"sliceproxy_endpoint_connections_total{{{labels},endpoint=\""
        endpoints = {k[len(prefix):-2]: int(v) for k, v in samples.items()
                     if k.startswith(prefix)}
        total = samples.get(f"sliceproxy_service_connections_total{{{labels}}}")
        if total is not None:
            out[port] = (int(total), endpoints)
    return out


# --- scenarios -------------------------------------------------------------------------


def test_services_in_the_simulator_become_traffic(lab: Lab, sim: SimServer, agents: Agents,
                                                  reader: NodeThread) -> None:
    v4, v6, c = "198.18.128.10", "fd00:198:18::10", lab.client_ns
    agent = agents.start()
    agent.wait_ready(READY_DEADLINE)
    # Created: dual stack, TCP and UDP; web-3 is not ready and must never answer.
    members: dict[str, dict[str, Any]] = {"web-1": {}, "web-2": {}, "web-3": {"ready": False}}
    sim.apply(service("web", [v4, v6], BOTH))
    for obj in slices(lab, "web", members, ipv6=True):
        sim.apply(obj)
    for vip in (v4, v6):
        lab.wait_for(c, vip, 80, {"web-1", "web-2"}, deadline=CHANGE_DEADLINE)
        lab.wait_for(c, vip, 53, {"web-1", "web-2"}, proto="udp", deadline=CHANGE_DEADLINE)
        assert set(lab.ask(c, vip, 80, count=12)) == {"web-1", "web-2"}
        assert set(lab.ask(c, vip, 53, "udp", count=12)) == {"web-1", "web-2"}
    kernel = read_kernel(reader)
    assert kernel.services[f"TCP {v4}:80"]["dests"] == {rs(lab, "web-1"): 1,
                                                          rs(lab, "web-2"): 1}
    assert kernel.services[f"UDP [{v6}]:53"]["dests"] == {rs(lab, "web-1", 8081, 6): 1,
                                                           rs(lab, "web-2", 8081, 6): 1}
    assert {str(a) for a in kernel.addresses} >= {v4, v6}
    # The node's iptables is nf_tables, and the agent's masquerade and NodePort rules are
    # there, nowhere else.
    assert "SPX-IPVS" in "".join(our_rules(lab, ["nft"])) and not our_rules(lab, ["legacy"])
    assert 'msg="iptables back end detected" backend=nft' in agent.log_text()

    # An endpoint stops being ready: no new connections reach it, while one it already
    # holds carries on (its real server drains at weight 0).
    with lab.hold(c, v4, 80, timeout=HELD_FLOW_TIMEOUT) as flow:
        held = flow.ask()
        other = ({"web-1", "web-2"} - {held}).pop()
        members[held] = {"ready": False}
        for obj in slices(lab, "web", members, ipv6=True):
            sim.apply(obj)
        for vip in (v4, v6):
            lab.wait_for(c, vip, 80, {other}, deadline=CHANGE_DEADLINE)
            lab.wait_for(c, vip, 53, {other}, proto="udp", deadline=CHANGE_DEADLINE)
        assert lab.ask(c, v4, 80, count=10) == {other: 10}
        assert dests(reader, f"TCP {v4}:80")[rs(lab, held)] == 0
        assert dests(reader, f"UDP {v4}:53") == {rs(lab, other, 8081): 1}
        assert [flow.ask() for _ in range(3)] == [held] * 3

    # Deleted: its virtual servers and its addresses on the dummy interface go.
    sim.delete("v1", "Service", "web", "demo")

    def gone() -> KernelView | None:
        view = read_kernel(reader)
        left = [k for k in view.services if v4 in k or v6 in k]
        addresses = {str(a) for a in view.addresses} & {v4, v6}
        return None if left or addresses else view

    wait_for(gone, CHANGE_DEADLINE, "the deleted service's virtual servers and addresses",
             interval=0.2)
    table = ipvsadm(reader)
    assert v4 not in table and v6 not in table, table
    for vip in (v4, v6):
        got = lab.ask(c, vip, 80, count=3, timeout=0.5)
        assert not answered_by(got), got
    dump = agent.dump()
    assert dump["services"] == []
    assert not [s for s in dump["syncs"] if s["error"]], dump["syncs"]
    assert agent.alive()


def test_health_metrics_and_debug_dump(lab: Lab, sim: SimServer, agents: Agents,
                                       reader: NodeThread) -> None:
    v4, v6, c = "198.18.128.20", "fd00:198:18::20", lab.client_ns
    members: dict[str, dict[str, Any]] = {"web-1": {}, "web-2": {}, "web-3": {"ready": False}}
    sim.apply(service("web", [v4, v6], BOTH))
    for obj in slices(lab, "web", members, ipv6=True):
        sim.apply(obj)
    # Every API request slowed down: the agent is up well before its first sync.
    sim.set_latency(2.0)
    agent = agents.start("--ipvs-scheduler", "lc")
    wait_for(lambda: agent.livez() == 200 or not agent.alive(), READY_DEADLINE,
             "the agent's /livez")
    assert agent.alive(), agent.log_tail()
    status, body = agent.healthz()
    assert status == 503, (status, body)
    assert agent.dump()["syncs"] == []
    started = agent.wait_ready(READY_DEADLINE)
    sim.set_latency(0.0)
    status, body = agent.healthz()
    assert status == 200 and body["nodeEligible"] is True, body
    lab.wait_for(c, v4, 80, {"web-1", "web-2"}, deadline=CHANGE_DEADLINE)
    # --ipvs-scheduler reached the kernel.
    assert {s["scheduler"] for s in read_kernel(reader).services.values()} == {"lc"}

    metrics = agent.metrics()
    assert metrics['sliceproxy_syncs_total{kind="full",result="ok"}'] == 1
    assert metrics["kubeproxy_sync_proxy_rules_duration_seconds_count"] >= 1
    assert metrics["kubeproxy_sync_proxy_rules_last_timestamp_seconds"] > 0
    assert metrics["sliceproxy_first_sync_seconds"] > 0
    assert metrics["sliceproxy_service_ports"] == 4  # http and dns, IPv4 and IPv6
    assert not [k for k, v in metrics.items()
                if k.startswith("sliceproxy_sync_apply_failures_total") and v], metrics

    doc = agent.dump("demo/web")
    assert doc["config"]["proxy-mode"] == "ipvs"
    assert doc["config"]["ipvs-scheduler"] == "lc"
    assert doc["node"]["name"] == "node-a" and doc["health"]["ready"] is True
    entries = {(s["port"], s["family"]): s for s in doc["services"]}
    assert set(entries) == {("http", "IPv4"), ("http", "IPv6"), ("dns", "IPv4"),
                            ("dns", "IPv6")}
    http4 = entries[("http", "IPv4")]
    assert http4["cluster_endpoints"] == [rs(lab, "web-1"), rs(lab, "web-2")]
    assert {e["endpoint"]: e["selected_for"] for e in http4["endpoints"]} == {
        rs(lab, "web-1"): ["cluster"], rs(lab, "web-2"): ["cluster"], rs(lab, "web-3"): []}
    rules = http4["applied_rules"]
    for name in ("web-1", "web-2"):
        assert f"TCP {v4}:80 lc -> {rs(lab, name)} weight 1" in rules, rules
    (first,) = doc["syncs"]
    assert first["trigger"] == "initial" and first["full"] and first["error"] is None
    assert first["details"]["virtual_servers"] == 4, first["details"]

    # A change: web-3 becomes ready; a partial sync, seen in traffic, metrics and dump.
    members["web-3"] = {}
    for obj in slices(lab, "web", members, ipv6=True):
        sim.apply(obj)
    lab.wait_for(c, v4, 80, {"web-1", "web-2", "web-3"}, deadline=CHANGE_DEADLINE)
    lab.wait_for(c, v6, 53, {"web-1", "web-2", "web-3"}, proto="udp",
                 deadline=CHANGE_DEADLINE)
    # The kernel changes before the agent books the sync (metrics and history are
    # recorded together once the data-plane thread returns): wait for the booking. The
    # two slices may have been applied by one sync or two.
    wanted = {"demo/web:http (IPv4)", "demo/web:dns (IPv6)"}

    def change_syncs() -> list[dict[str, Any]]:
        syncs = [s for s in agent.dump()["syncs"] if s["trigger"] == "change"]
        return syncs if wanted <= {p for s in syncs for p in s["changed"]} else []

    changes = wait_for(change_syncs, CHANGE_DEADLINE, "the change's syncs in the dump",
                       interval=0.2)
    assert all(not s["full"] and s["error"] is None for s in changes), changes
    metrics = agent.metrics()
    assert metrics['sliceproxy_syncs_total{kind="partial",result="ok"}'] == len(changes)
    assert metrics["kubeproxy_sync_proxy_rules_endpoint_changes_total"] >= 2
    assert metrics["kubeproxy_network_programming_duration_seconds_count"] >= 1
    doc = agent.dump("demo/web")
    http4 = next(s for s in doc["services"] if (s["port"], s["family"]) == ("http", "IPv4"))
    assert rs(lab, "web-3") in http4["cluster_endpoints"]
    assert f"TCP {v4}:80 lc -> {rs(lab, 'web-3')} weight 1" in http4["applied_rules"]
    print(f"\nstart to first sync under 2 s API latency: {started:.2f} s")


@pytest.fixture
def legacy_node(lab: Lab) -> Iterator[None]:
    """The node marked as legacy the way kubelet marks the back end it uses (the agent
    follows it, as upstream does); unmarked again afterwards."""
    hint = ["iptables-legacy", "-t", "mangle"]
    lab.exec(lab.node_ns, [*hint, "-N", "KUBE-IPTABLES-HINT"], check=True)
    try:
        yield
    finally:
        lab.exec(lab.node_ns, [*hint, "-X", "KUBE-IPTABLES-HINT"], check=True)


@pytest.mark.usefixtures("legacy_node")
def test_sigterm_restart_and_cleanup(lab: Lab, sim: SimServer, agents: Agents,
                                     reader: NodeThread) -> None:
    a, b, c = "198.18.128.30", "198.18.128.31", lab.client_ns
    members: dict[str, dict[str, Any]] = {"web-1": {}, "web-2": {}}
    for name, vip in (("a", a), ("b", b)):
        sim.apply(service(name, [vip], HTTP))
        for obj in slices(lab, name, members, HTTP):
            sim.apply(obj)
    first = agents.start(name="first")
    first.wait_ready(READY_DEADLINE)
    for vip in (a, b):
        lab.wait_for(c, vip, 80, {"web-1", "web-2"}, deadline=CHANGE_DEADLINE)
    before = read_kernel(reader)
    assert {f"TCP {a}:80", f"TCP {b}:80"} <= set(before.services), before.services
    assert "SPX-IPVS" in "".join(our_rules(lab, ["legacy"])) and not our_rules(lab, ["nft"])

    results: Counter[str] = Counter()
    stop = threading.Event()

    def probe() -> None:
        # Fresh connections to b all through the stop and the restart, bounded in count
        # and time (the wait only paces them).
        end = time.monotonic() + 120
        while time.monotonic() < end and sum(results.values()) < 5000:
            results.update(lab.ask(c, b, 80, count=1, timeout=1.0))
            if stop.wait(0.02):
                return

    with lab.hold(c, b, 80, timeout=HELD_FLOW_TIMEOUT) as flow:
        held = flow.ask()
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        try:
            wait_for(lambda: sum(results.values()) >= 10, 30, "probes before the stop")
            # SIGTERM: the agent goes, its virtual servers stay and keep serving.
            seconds = first.stop()
            assert first.proc is not None and first.proc.returncode == 0, first.log_tail()
            assert "stopping; the rules stay in place" in first.log_text()
            assert read_kernel(reader) == before
            assert set(lab.ask(c, a, 80, count=10)) == {"web-1", "web-2"}
            assert flow.ask() == held
            # While no agent runs, someone deletes a virtual server by hand.
            out = reader.exec("ipvsadm", "-D", "-t", f"{a}:80")
            assert out.returncode == 0, out.stderr
            assert lab.ask(c, a, 80, count=2, timeout=0.5) == {"refused": 2}
            # A new agent takes over: it repairs that one, and only that one, without
            # flushing anything first.
            second = agents.start(name="second")
            starting = sum(results.values())
            second.wait_ready(READY_DEADLINE)
            during = sum(results.values()) - starting
            lab.wait_for(c, a, 80, {"web-1", "web-2"}, deadline=CHANGE_DEADLINE)
            mark = sum(results.values())
            wait_for(lambda: sum(results.values()) >= mark + 10, 30, "probes after the restart")
            assert [flow.ask() for _ in range(3)] == [held] * 3
        finally:
            stop.set()
            prober.join(10)
    assert set(results) <= {"web-1", "web-2"}, results
    assert during >= 5, f"only {during} probes while the second agent started"
    assert read_kernel(reader) == before
    (initial,) = second.dump()["syncs"]
    assert initial["trigger"] == "initial" and initial["error"] is None
    # Exactly the missing virtual server and its two real servers were written.
    assert initial["details"]["ipvs_changes"] == 3, initial["details"]
    second.stop()
    assert second.proc is not None and second.proc.returncode == 0

    # --cleanup (no API server needed): nothing of ours is left, nothing else is touched.
    assert our_rules(lab), "SPX- chains before the clean-up"
    done = run_cli(lab, ["--cleanup", *IPVS, "--hostname-override", "node-a"],
                   timeout=READY_DEADLINE)
    assert done.returncode == 0, done.stderr
    assert leftovers(lab, reader) == []
    agents.cleaned = True
    assert read_kernel(reader) == KernelView({}, set(), set())
    table = ipvsadm(reader)
    assert "TCP" not in table and "UDP" not in table, table
    hint = lab.exec(lab.node_ns, ["iptables-legacy-save", "-t", "mangle"]).stdout
    assert ":KUBE-IPTABLES-HINT" in hint  # not ours: left alone
    for vip in (a, b):
        got = lab.ask(c, vip, 80, count=3, timeout=0.5)
        assert not answered_by(got), got
    print(f"\nSIGTERM to exit: {seconds:.2f} s; probes during the restart: {during}")


def test_traffic_counts_per_endpoint_across_a_restart(lab: Lab, sim: SimServer,
                                                     agents: Agents, reader: NodeThread) -> None:
    """Fresh connections counted per endpoint, exactly as the backends answered them,
    by IPVS's own statistics, in /metrics: before a restart, while no agent runs (read
    from the kernel as the data plane reads it), and after."""
    vip, c, rounds = "198.18.128.40", lab.client_ns, (30, 9, 21)
    objects = [{**service("count", [vip], BOTH),
                "metadata": {"name": "count", "namespace": "demo",
                             "annotations": {ANNOTATION_TRAFFIC_PER_ENDPOINT: "true"}}},
               *slices(lab, "count", {name: {} for name in NAMES})]
    for obj in objects:
        sim.apply(obj)
    first = agents.start(name="first")
    first.wait_ready(READY_DEADLINE)
    # No probe before counting: the virtual servers are read until all are there.
    wait_for(lambda: dests(reader, f"TCP {vip}:80") == {rs(lab, n): 1 for n in NAMES}
             and dests(reader, f"UDP {vip}:53") == {rs(lab, n, 8081): 1 for n in NAMES},
             CHANGE_DEADLINE, "the virtual servers with their three real servers",
             interval=0.2)
    answered = {"tcp": Counter[str](), "udp": Counter[str]()}
    wanted: Reading = {}

    def send(count: int) -> None:
        for proto, port, name, target in (("tcp", 80, "http", 8080), ("udp", 53, "dns", 8081)):
            got = lab.ask(c, vip, port, proto, count=count)
            assert set(got) <= NAMES and sum(got.values()) == count, (proto, got)
            answered[proto].update(got)
            wanted[name] = (sum(answered[proto].values()), {
                rs(lab, n, target): answered[proto][n] for n in NAMES})

    last: list[Reading] = [{}]

    def as_answered(read: Callable[[], Reading]) -> Callable[[], Reading | None]:
        # IPVS publishes its statistics every 2 s (its estimator's tick): read until then.
        def check() -> Reading | None:
            got = last[0] = read()
            return got if got == wanted else None

        return check

    def differs() -> str:  # what a timed-out wait read last, against what was answered
        return f"read {last[0]}, answered {wanted}"

    send(rounds[0])
    wait_for(as_answered(lambda: metrics_traffic(first, "count", ("http", "dns"))),
             CHANGE_DEADLINE, "the first round in /metrics", interval=0.5, detail=differs)
    first.stop()
    send(rounds[1])  # no agent: the kernel counts on
    wait_for(as_answered(lambda: kernel_traffic(reader, objects)), CHANGE_DEADLINE,
             "the round without an agent, in the kernel", interval=0.5, detail=differs)
    second = agents.start(name="second")
    second.wait_ready(READY_DEADLINE)
    send(rounds[2])
    wait_for(as_answered(lambda: metrics_traffic(second, "count", ("http", "dns"))),
             CHANGE_DEADLINE, "every round in the second agent's /metrics", interval=0.5,
             detail=differs)
    assert wanted["http"][0] == wanted["dns"][0] == sum(rounds)
    samples = second.metrics()
    labels = 'namespace="demo",service="count",port="http",family="IPv4"'
    assert samples[f"sliceproxy_service_packets_total{{{labels}}}"] > 0
    assert samples[f"sliceproxy_service_bytes_total{{{labels}}}"] > 0
    print(f"\nper endpoint, TCP: {dict(answered['tcp'])}; UDP: {dict(answered['udp'])}; "
          f"packets {samples[f'sliceproxy_service_packets_total{{{labels}}}']:.0f}, bytes "
          f"{samples[f'sliceproxy_service_bytes_total{{{labels}}}']:.0f}")
