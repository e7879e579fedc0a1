"""Switching between the IPVS mode and the iptables mode with no `--cleanup` in between,
inside the kernel lab (run by tests/kernel/test_ipvs_mode_switch.py; never on the host): the
real agent, stopped in one mode (SIGTERM leaves its rules), started in the other, serves
and, once its first sync is in the kernel, removes the old mode's leftovers. Both modes write `SPX-`
chains; each must remove exactly the other's (proxy/dataplane/leftovers.py).
(nftables <-> iptables runs on the host: tests/e2e/test_mode_switch.py.)

And the switch from kube-proxy: the node settings kube-proxy v1.20.2 itself writes in the
guest's initial network namespace (conntrack table size, hash size, TCP timeouts; the
IPVS sysctls in IPVS mode) are what `python -m proxy --init-only` writes from the same
KubeProxyConfiguration (tests/kernel/node_settings_guest.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.dataplane.common.kube_proxy_objects import ipvs_set_names
from proxy.dataplane.ipvs.handover import kube_proxy_chain
from proxy.dataplane.ipvs.render import DUMMY_INTERFACE
from proxy.dataplane.xtables.saved import Table
from proxy.netns_lab import Lab
from proxy.netns_lab.poll import wait as wait_for
from proxy.netns_lab.probe import Flow
from proxy.netns_lab.topology import POD_GW4
from proxy.sim import SimServer, v1beta1
from tests.e2e.agent_support import (
    ROOT,
    AgentProcess,
    PortSpec,
    endpoint,
    endpoint_slice,
    iptables_save,
    namespace_object,
    node_object,
    our_rules,
    run_cli,
    service,
    start_sim,
)
from tests.faults.traffic import Laps, Target, Traffic
from tests.kernel import kube_proxy_guest as kube_proxy
from tests.kernel import node_settings_guest as settings
from tests.kernel.kube_proxy_guest import KubeProxy
from tests.kernel.scenario_guest import (
    HELD_FLOW_TIMEOUT,
    READY_DEADLINE,
    Cluster,
    NodeThread,
    read_kernel,
)
from tests.kernel.scenarios.scenario_agent import leftovers
from tests.kernel.scenarios.scenario_traffic import HTTP as HTTP_PORT
from tests.kernel.scenarios.scenario_traffic import local, reply_destinations, slices
from tests.unit.builders import service as service_object

HTTP: tuple[PortSpec, ...] = (("http", 80, 8080, "TCP"),)
WEB = {"web-1", "web-2"}
CHANGE_DEADLINE = 30.0


@pytest.fixture(scope="module")
def reader(lab: Lab) -> Iterator[NodeThread]:
    thread = NodeThread(lab.node_ns)
    try:
        yield thread
    finally:
        thread.close()


@pytest.fixture
def agents(lab: Lab, reader: NodeThread) -> Iterator[list[AgentProcess]]:
    """Agents a scenario starts; stopped, and every mode's rules removed, afterwards."""
    started: list[AgentProcess] = []
    try:
        yield started
    finally:
        for agent in started:
            if agent.alive():
                agent.stop()
        done = run_cli(lab, ["--cleanup", "--hostname-override", "node-a"],
                       timeout=READY_DEADLINE)
        reader.exec("conntrack", "-F")
        assert done.returncode == 0, done.stderr
        assert leftovers(lab, reader) == []


def start(lab: Lab, sim: SimServer, workdir: Path, agents: list[AgentProcess],
          mode: str) -> AgentProcess:
    agent = AgentProcess(lab, sim, workdir, "--proxy-mode", mode,
                         name=f"agent-{len(agents) + 1}-{mode}")
    agents.append(agent.start())
    agent.wait_ready(READY_DEADLINE)
    # Ready = the first sync is done; the other mode's leftovers go right after it, and
    # the drift watch starts once they are handled.
    wait_for(lambda: "watching for changes to our" in agent.log_text(), READY_DEADLINE,
             "the other mode's leftovers handled", detail=agent.log_tail)
    return agent


def web(lab: Lab, sim: SimServer, name: str, vip: str) -> None:
    b = lab.backends
    sim.apply(service(name, [vip], HTTP))
    sim.apply(endpoint_slice(name, name, [endpoint(b[n].ipv4) for n in sorted(WEB)], HTTP))


def ipvs_chains(lab: Lab) -> list[str]:
    return [r for r in our_rules(lab) if "SPX-IPVS-" in r]


def iptables_mode_chains(lab: Lab) -> list[str]:
    return [r for r in our_rules(lab) if "SPX-IPVS-" not in r]


def info_lines(agent: AgentProcess, text: str) -> list[str]:
    return [line for line in agent.log_text().splitlines()
            if text in line and "level=info" in line]


def test_ipvs_to_iptables_and_back_each_removes_only_what_the_other_left(
        lab: Lab, sim: SimServer, workdir: Path, reader: NodeThread,
        agents: list[AgentProcess]) -> None:
    """ipvs -> iptables -> ipvs -> ipvs (a restart), one agent after another on the same
    node: each switch removes the other mode's leftovers once its first sync is done; a
    restart in the same mode removes nothing. (One chain rather than a scenario per
    direction: an agent start is the slow part under emulation. Its name must not say
    "leftovers": the agents' logs name the scenario's folder, and info_lines looks for
    that word.)"""
    vip, c = "198.18.128.50", lab.client_ns
    web(lab, sim, "switch", vip)
    first = start(lab, sim, workdir, agents, "ipvs")
    lab.wait_for(c, vip, 80, WEB, deadline=CHANGE_DEADLINE)
    assert f"TCP {vip}:80" in read_kernel(reader).services
    first.stop()
    before = leftovers(lab, reader)  # SIGTERM leaves all of it
    assert any(x.startswith("virtual server") for x in before), before
    assert "dummy interface spx-ipvs0" in before and ipvs_chains(lab)

    # ipvs -> iptables: every IPVS object goes.
    second = start(lab, sim, workdir, agents, "iptables")
    left = [x for x in leftovers(lab, reader)
            if not x.startswith("iptables") or "SPX-IPVS-" in x]
    assert left == []  # no virtual server, dummy interface, ipset or SPX-IPVS- chain
    assert iptables_mode_chains(lab)
    lab.wait_for(c, vip, 80, WEB, deadline=CHANGE_DEADLINE)
    assert set(lab.ask(c, vip, 80, count=12)) == WEB
    (line,) = info_lines(second, "leftovers")
    assert "removed the ipvs mode's leftovers: virtual servers: 1, dummy interfaces: 1" \
        in line, line
    log = second.log_text()
    assert log.index("first sync done") < log.index("removed the ipvs mode's leftovers")
    print(f"\n{line}")
    second.stop()
    assert iptables_mode_chains(lab)  # SIGTERM leaves them

    # iptables -> ipvs: the iptables mode's chains go, its own SPX-IPVS- ones stay.
    third = start(lab, sim, workdir, agents, "ipvs")
    assert iptables_mode_chains(lab) == []
    assert ipvs_chains(lab)  # its own, written by its first sync, kept
    assert f"TCP {vip}:80" in read_kernel(reader).services
    lab.wait_for(c, vip, 80, WEB, deadline=CHANGE_DEADLINE)
    (line,) = info_lines(third, "leftovers")
    assert "removed the iptables mode's leftovers" in line and "SPX-IPVS-* kept" in line, line
    print(line)

    # A restart in IPVS mode: its own chains and virtual servers are not leftovers.
    third.stop()
    chains, kernel = ipvs_chains(lab), read_kernel(reader)
    fourth = start(lab, sim, workdir, agents, "ipvs")
    assert info_lines(fourth, "leftovers") == []
    assert ipvs_chains(lab) == chains and read_kernel(reader) == kernel
    assert set(lab.ask(c, vip, 80, count=12)) == WEB


@pytest.fixture
def guest_settings() -> Iterator[dict[str, int]]:
    """The guest's own values of every setting either proxy may write, put back after."""
    before = settings.read()
    try:
        yield before
    finally:
        settings.write(before)


@pytest.mark.parametrize("mode", ["", "ipvs"], ids=["iptables (kubeadm's default)", "ipvs"])
def test_from_kube_proxy_its_node_settings_are_kept(
        mode: str, workdir: Path, guest_settings: dict[str, int]) -> None:
    config = settings.kube_proxy_config(workdir, mode)
    checked = [*settings.CONNTRACK, "hashsize", *(settings.IPVS if mode else ())]
    # Ours: the kubeadm ConfigMap's nulls are kube-proxy's defaults (2 CPUs: the minimum).
    settings.write(settings.NEW_NODE)
    run = subprocess.run([sys.executable, "-m", "proxy", "--init-only", "--config",
                          str(config)], capture_output=True, text=True, timeout=120,
                         check=False, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert run.returncode == 0, run.stderr
    ours = settings.read(checked)
    assert {k: ours[k] for k in (*settings.CONNTRACK, "hashsize")} == {
        "net/netfilter/nf_conntrack_max": 131072, "hashsize": 32768,
        "net/netfilter/nf_conntrack_tcp_timeout_established": 86400,
        "net/netfilter/nf_conntrack_tcp_timeout_close_wait": 3600}
    assert all(ours[k] == 1 for k in settings.IPVS if k in checked)
    print(f"\nsliceproxy --init-only ({mode or 'iptables'}): {ours}")
    binary = os.environ.get("KUBE_PROXY")
    if not binary:
        pytest.skip("no kube-proxy v1.20.2 binary (KUBE_PROXY): compared against "
                    "upstream's formula only")
    # Theirs, from the same new node's values.
    settings.write(settings.NEW_NODE)
    log = settings.run_kube_proxy(binary, config, workdir / f"kube-proxy-{mode}.log",
                                  timeout=120)
    assert ("Using ipvs Proxier" if mode else "Using iptables Proxier") in log
    theirs = settings.read(checked)
    print(f"kube-proxy v1.20.2 ({mode or 'iptables'}): {theirs}")
    assert ours == theirs
    # What only v1.20.2 writes (docs/upstream-differences.md).
    extra = settings.read(list(settings.ONLY_V1_20))
    assert extra["net/ipv4/conf/all/route_localnet"] == 1
    assert extra["net/ipv4/vs/conn_reuse_mode"] == (0 if mode else 1)


# --- IPVS both ways: kube-proxy v1.20.2 in IPVS mode <-> sliceproxy in IPVS mode ---------

HANDOVER, GONE = "198.18.128.60", "198.18.128.61"
# An emulated machine beside a loaded host (the real-node tier): 2 s to answer, as the
# fault scenarios allow.
TRAFFIC_TIMEOUT, TRAFFIC_INTERVAL = 2.0, 0.05


def web_v1beta1(sim: SimServer, lab: Lab, name: str, vip: str) -> None:
    """A service and its slice as a v1.20 API server keeps them."""
    b = lab.backends
    sim.apply(service(name, [vip], HTTP))
    sim.apply(v1beta1.from_v1(endpoint_slice(
        name, name, [endpoint(b[n].ipv4) for n in sorted(WEB)], HTTP)))


def virtual_servers(lab: Lab) -> dict[str, list[str]]:
    """`ipvsadm -Sn`: each virtual server (`-t ADDR:PORT`) with its real servers."""
    out = lab.exec(lab.node_ns, ["ipvsadm", "-Sn"], check=True).stdout
    table: dict[str, list[str]] = {}
    for line in out.splitlines():
        words = line.split()
        if line.startswith("-A"):
            table[f"{words[1]} {words[2]}"] = []
        elif line.startswith("-a"):
            table[f"{words[1]} {words[2]}"].append(words[4])
    return table


def interface_addresses(lab: Lab, name: str) -> list[str] | None:
    out = lab.exec(lab.node_ns, ["ip", "-o", "addr", "show", "dev", name])
    if out.returncode != 0:
        return None
    words = out.stdout.split()
    return [words[i + 1].split("/")[0] for i, w in enumerate(words[:-1]) if w == "inet"]


def kube_proxy_synced(lab: Lab, vs: str) -> bool:
    """kube-proxy's first sync is done, iptables rules and all, as docs/migrate.md's step 5
    waits for: its address on kube-ipvs0, both real servers, and its rules, written last
    (10 s after its virtual servers under emulation). Our clean-up removes the rules
    that had the kernel track connections; with none of kube-proxy's there yet, a
    connection we masqueraded would lose its translation and be reset."""
    return (HANDOVER in (interface_addresses(lab, "kube-ipvs0") or ())
            and len(virtual_servers(lab).get(vs, ())) == 2
            and "-A KUBE-POSTROUTING " in iptables_save(lab))


def cleanup_beside_kube_proxy(lab: Lab) -> None:
    """The way back's step 5, `--cleanup`: every virtual server of kube-proxy's kept (the
    one both serve included), nothing of ours left."""
    theirs = virtual_servers(lab)
    step = run_cli(lab, ["--cleanup", "--proxy-mode", "ipvs", "--hostname-override", "node-a"],
                   timeout=READY_DEADLINE)
    assert step.returncode == 0, step.stderr
    assert virtual_servers(lab) == theirs
    assert our_rules(lab) == [] and interface_addresses(lab, DUMMY_INTERFACE) is None
    assert "left 1 virtual servers that kube-proxy programs too" in step.stderr, step.stderr


def answer(flow: Flow) -> str:
    """A held connection's answer (a backend's name), or how it failed."""
    try:
        return flow.ask()
    except OSError as exc:
        return type(exc).__name__


def handover(lab: Lab) -> subprocess.CompletedProcess[str]:
    """deploy/migrate/kube-proxy-cleanup-ipvs.yaml's command, in the node namespace."""
    return lab.exec(lab.node_ns, [sys.executable, "-m", "proxy.dataplane.ipvs.handover"],
                    timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)


def kube_proxy_objects(lab: Lab) -> list[str]:
    """What kube-proxy's own clean-up removes that is still there: chains (and rules)
    and ipsets (KUBE-MARK-DROP and the canaries it leaves too)."""
    found = []
    for family in ("4", "6"):
        table = None
        for line in iptables_save(lab, family).splitlines():
            if line.startswith("*"):
                table = Table(line[1:]) if line[1:] in ("nat", "filter") else None
            elif table is not None and line.startswith(":") \
                    and kube_proxy_chain(table)(line[1:].split()[0]):
                found.append(f"IPv{family} {table.value} {line.split()[0]}")
    sets = lab.exec(lab.node_ns, ["ipset", "list", "-n"], check=True).stdout.split()
    return found + [f"ipset {n}" for n in sets if n in ipvs_set_names()]


@pytest.fixture
def kube_proxy_binary() -> str:
    binary = os.environ.get("KUBE_PROXY")
    if not binary:
        pytest.fail("no kube-proxy v1.20.2 binary (KUBE_PROXY)")
    return binary


@pytest.fixture
def sim_v120(lab: Lab) -> Iterator[SimServer]:
    with start_sim(lab, [node_object(), namespace_object("demo")], api_level="1.20") as server:
        yield server


@pytest.fixture
def kube_proxies(lab: Lab, kube_proxy_binary: str) -> Iterator[list[KubeProxy]]:
    """kube-proxies a scenario starts; stopped and their rules removed afterwards, by
    `kube-proxy --cleanup` as deploy/migrate/kube-proxy-cleanup.yaml runs it (what it
    leaves of the IPVS mode is printed), then the rest of the IPVS table flushed (the
    namespace is the test's own)."""
    started: list[KubeProxy] = []
    try:
        yield started
    finally:
        for proxy in started:
            proxy.stop()
        if started:
            done = kube_proxy.cleanup(lab, kube_proxy_binary)
            assert done.returncode == 0, done.stderr[-2000:]
            there = interface_addresses(lab, "kube-ipvs0") is not None
            print(f"kube-proxy v1.20.2 --cleanup: left {len(virtual_servers(lab))} virtual "
                  f"servers, kube-ipvs0 {'present' if there else 'gone'}, "
                  f"{len(kube_proxy_objects(lab))} of its chains and ipsets")
        lab.exec(lab.node_ns, ["ipvsadm", "-C"], check=True)


def test_a_connection_older_than_the_first_sync_keeps_its_addresses(
        lab: Lab, node: NodeThread, cluster: Cluster) -> None:
    """A connection made through kube-proxy's virtual server before our first sync, in a
    node namespace where no rule had the kernel track connections (kube-proxy stopped
    before its first sync wrote its iptables rules, as can happen in the scenario
    below), still answers after that sync. Our rules switch tracking on, so conntrack
    first sees the connection at its next segment; masqueraded as a new connection from
    outside the cluster would be, that segment reached the endpoint from the node's
    address and was reset (netfilter.py, MIDSTREAM)."""
    vip, c = "198.18.128.62", lab.client_ns
    # kube-proxy's table, and its IPVS sysctl: with it, IPVS keeps conntrack's view of its
    # connections up to date once conntrack tracks them (without, it would untrack them).
    imitation = [["sysctl", "-qw", "net.ipv4.vs.conntrack=1"],
                 ["ip", "link", "add", "kube-ipvs0", "type", "dummy"],
                 ["ip", "addr", "add", f"{vip}/32", "dev", "kube-ipvs0"],
                 ["ipvsadm", "-A", "-t", f"{vip}:80", "-s", "rr"]]
    imitation += [["ipvsadm", "-a", "-t", f"{vip}:80", "-r", f"{lab.backends[n].ipv4}:8080",
                   "-m", "-w", "1"] for n in sorted(WEB)]
    try:
        for cmd in imitation:
            assert node.exec(*cmd).returncode == 0, cmd
        with lab.hold(c, vip, 80, timeout=HELD_FLOW_TIMEOUT) as flow:
            held, port = flow.ask(), flow.sock.getsockname()[1]
            tracked = node.exec("conntrack", "-L", "-p", "tcp", "--orig-port-dst", "80")
            assert f"sport={port} " not in tracked.stdout, \
                "conntrack already tracked the connection: this needs a node where nothing did"
            node.sync(cluster.apply(service_object("older", ips=(vip,), ports=(HTTP_PORT,)),
                                    *slices(lab, "older", {n: local() for n in WEB})))
            assert set(lab.ask(c, vip, 80, count=6)) <= WEB
            # New connections from the client are masqueraded now: the rule that must
            # leave the older connection alone is in force.
            assert reply_destinations(node, 80)[str(POD_GW4)] >= 6
            assert [answer(flow) for _ in range(2)] == [held, held]
    finally:
        node.exec("ip", "link", "del", "kube-ipvs0")
        node.exec("ipvsadm", "-D", "-t", f"{vip}:80")


def test_ipvs_from_kube_proxy_and_back_with_traffic(
        lab: Lab, sim_v120: SimServer, workdir: Path, kube_proxy_binary: str,
        agents: list[AgentProcess], kube_proxies: list[KubeProxy]) -> None:
    """docs/migrate.md#ipvs-mode, both ways, with a client opening a fresh connection to
    the service every 50 ms throughout and holding one long-lived connection across each
    switch: no connection fails, and neither proxy's clean-up removes a virtual server
    the other one serves."""
    sim, c, vs = sim_v120, lab.client_ns, f"-t {HANDOVER}:80"
    web_v1beta1(sim, lab, "handover", HANDOVER)
    web_v1beta1(sim, lab, "gone", GONE)
    first = KubeProxy(lab, sim, kube_proxy_binary, workdir, "kube-proxy-1").start()
    kube_proxies.append(first)
    wait_for(lambda: len(virtual_servers(lab).get(vs, ())) == 2
             and f"-t {GONE}:80" in virtual_servers(lab), READY_DEADLINE,
             "kube-proxy's first sync", detail=first.log_tail)
    lab.wait_for(c, HANDOVER, 80, WEB, deadline=CHANGE_DEADLINE)
    target = Target("handover", HANDOVER, 80, "tcp", frozenset(WEB))
    with contextlib.ExitStack() as held:
        traffic = held.enter_context(Traffic(c, [target], interval=TRAFFIC_INTERVAL,
                                             timeout=TRAFFIC_TIMEOUT))
        # kube-proxy -> sliceproxy. A service deleted while neither proxy runs leaves a
        # virtual server of kube-proxy's that sliceproxy never serves. kube-proxy stops
        # once its virtual servers serve, maybe before it writes its iptables rules.
        kept = held.enter_context(lab.hold(c, HANDOVER, 80, timeout=HELD_FLOW_TIMEOUT))
        kept_there = [kept.ask()]
        began = time.monotonic()
        steps = Laps(began)
        first.stop()
        steps("kube-proxy stopped")
        sim.delete("v1", "Service", "gone", "demo")
        agent = start(lab, sim, workdir, agents, "ipvs")
        steps("sliceproxy ready")
        ours = virtual_servers(lab)
        assert ours[vs] and f"-t {GONE}:80" in ours
        assert kube_proxy_objects(lab)
        step = handover(lab)
        steps("handover done")
        assert step.returncode == 0, step.stderr
        assert f"1 virtual servers (kube-proxy's alone, first TCP {GONE}:80), 1 interface" \
            in step.stdout, step.stdout
        left = virtual_servers(lab)
        assert left == {k: v for k, v in ours.items() if k != f"-t {GONE}:80"}
        assert interface_addresses(lab, "kube-ipvs0") is None
        assert kube_proxy_objects(lab) == []
        print(f"\n{step.stdout.strip()}")
        lab.wait_for(c, HANDOVER, 80, WEB, deadline=CHANGE_DEADLINE)
        to_sliceproxy = traffic.report(since=began)
        there = str(steps)
        kept_there.append(answer(kept))

        # sliceproxy -> kube-proxy.
        kept = held.enter_context(lab.hold(c, HANDOVER, 80, timeout=HELD_FLOW_TIMEOUT))
        kept_back = [kept.ask()]
        began = time.monotonic()
        steps = Laps(began)
        agent.stop()
        steps("sliceproxy stopped")
        second = KubeProxy(lab, sim, kube_proxy_binary, workdir, "kube-proxy-2").start()
        kube_proxies.append(second)
        wait_for(lambda: kube_proxy_synced(lab, vs), READY_DEADLINE,
                 "kube-proxy's first sync after sliceproxy", detail=second.log_tail)
        steps("kube-proxy synced")
        cleanup_beside_kube_proxy(lab)
        steps("sliceproxy --cleanup done")
        lab.wait_for(c, HANDOVER, 80, WEB, deadline=CHANGE_DEADLINE)
        to_kube_proxy = traffic.report(since=began)
        back = str(steps)
        kept_back.append(answer(kept))
    print(f"\nsteps to sliceproxy: {there}; back: {back}")
    held_text = f"held connections, before and after: to sliceproxy {kept_there}, back {kept_back}"
    print(f"\nIPVS kube-proxy -> sliceproxy: {to_sliceproxy.attempts} connections, "
          f"{to_sliceproxy.failed} failed; sliceproxy -> kube-proxy: "
          f"{to_kube_proxy.attempts} connections, {to_kube_proxy.failed} failed; {held_text}")
    assert to_sliceproxy.failed == 0, f"{to_sliceproxy.failures()}; steps: {there}"
    assert to_kube_proxy.failed == 0, f"{to_kube_proxy.failures()}; steps: {back}"
    assert (kept_there[0], kept_back[0]) == (kept_there[1], kept_back[1]), held_text
