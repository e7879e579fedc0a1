"""The iptables mode's traffic counts against the real kernel: the real agent in a lab's
node namespace, real TCP connections from the client, and the kernel's nfacct objects
read back and mapped to endpoints the way `IptablesDataPlane.traffic` maps them (the
same rendering of the same objects). Counts must equal, connection for connection,
what each backend answered: across an agent restart, while no agent runs, and across a
change that rewrites the service's chains. Both iptables back ends, and the iptc
applier."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from ipaddress import ip_address
from pathlib import Path
from typing import Any

import pytest

from proxy.dataplane.base import DataplaneOptions, rules_digest
from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.common.nfacct import Nfacct, Reading
from proxy.dataplane.iptables.render import PortCounters, render_port
from proxy.dataplane.xtables.restore_runner import Backend, IptablesRunner
from proxy.dataplane.xtables.saved import ours, parse_save
from proxy.model.types import Family, ServicePortKey
from proxy.netns_lab import BackendSpec, Lab
from proxy.netns_lab.netns import entered
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    iptables_save,
    namespace_object,
    node_object,
    quiet_icmp_limits,
    run_cli,
    service,
    start_sim,
    wait_for,
)
from tests.e2e.conftest import POD_CIDRS, Cluster, NodePlane
from tests.unit.builders import ep, eps_slice
from tests.unit.builders import service as svc

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

VIP = "198.18.128.20"
KEY = ServicePortKey("demo", "web", "http", Family.V4)
PER_ENDPOINT = {"sliceproxy.io/traffic-per-endpoint": "true"}
# (name, iptables back end the node's hint chain selects, extra agent flags)
SETUPS = {"nft": ("nft", ()), "legacy": ("legacy", ()),
          "legacy-iptc": ("legacy", ("--iptables-applier", "iptc"))}


@pytest.fixture
def lab() -> Iterator[Lab]:
    with Lab([BackendSpec(f"web-{i}") for i in (1, 2, 3)]) as lab:
        quiet_icmp_limits(lab)
        lab.start_backends()
        yield lab


def web_objects(lab: Lab, names: tuple[str, ...]) -> list[dict[str, Any]]:
    svc = service("web", [VIP])
    svc["metadata"]["annotations"] = PER_ENDPOINT
    slice_ = endpoint_slice("web-v4", "web",
                            [endpoint(lab.backends[n].ipv4) for n in names])
    return [svc, slice_]


class Counts:
    """The kernel's counts for the service port, by backend name, read as traffic()
    reads them: one dump, the objects named by rendering the same state."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.cluster = Cluster()
        self.by_ip = {str(b.ipv4): name for name, b in lab.backends.items()}

    def counters(self, objects: list[dict[str, Any]]) -> PortCounters:
        state = self.cluster.become(*(o for o in objects if o["kind"] != "Namespace"))
        counters = render_port(state.ports[KEY], RenderContext(Family.V4)).counters
        assert counters is not None and counters.endpoints is not None
        return counters

    def dump(self) -> dict[str, Reading]:
        with entered(self.lab.node_ns):
            return Nfacct().dump()

    def read(self, objects: list[dict[str, Any]]) -> tuple[int, Counter[str]]:
        counters = self.counters(objects)
        readings = self.dump()
        assert counters.endpoints is not None
        each = Counter({self.by_ip[str(ip)]: readings[name].packets
                        for name, ip, _ in counters.endpoints if name in readings})
        return readings[counters.port].packets, +each


def scraped(agent: AgentProcess, lab: Lab) -> tuple[float, Counter[str]]:
    """The port's and each endpoint's connections as the agent's /metrics shows them."""
    samples = agent.metrics()
    total = [v for k, v in samples.items()
             if k.startswith("sliceproxy_service_connections_total{") and 'service="web"' in k]
    each = Counter({name: int(v) for k, v in samples.items()
                    if k.startswith("sliceproxy_endpoint_connections_total{")
                    for name, b in lab.backends.items() if f'endpoint="{b.ipv4}:8080"' in k})
    assert len(total) == 1, total
    return total[0], +each


def connect(lab: Lab, count: int, tally: Counter[str]) -> None:
    """`count` fresh TCP connections; every one must be answered by a backend."""
    answers = lab.ask(lab.client_ns, VIP, 80, count=count, timeout=2.0)
    assert set(answers) <= set(lab.backends), f"failed connections: {dict(answers)}"
    tally.update(answers)


@pytest.mark.parametrize("setup", list(SETUPS))
def test_endpoint_counts_equal_the_connections_across_restarts_and_rewrites(
        lab: Lab, tmp_path: Path, setup: str) -> None:
    backend, flags = SETUPS[setup]
    if backend == "legacy":  # kubelet's hint chain: the agent picks legacy
        lab.exec(lab.node_ns, ["iptables-legacy", "-t", "mangle", "-N", "KUBE-IPTABLES-HINT"],
                 check=True)
    three = web_objects(lab, ("web-1", "web-2", "web-3"))
    counts, tally = Counts(lab), Counter[str]()
    with start_sim(lab, [node_object(), namespace_object("demo"), *three]) as sim:
        argv = ("--proxy-mode", "iptables", *flags)
        agent = AgentProcess(lab, sim, tmp_path, *argv).start()
        agent.wait_ready()
        assert "nfacct-name" in iptables_save(lab, backends=(backend,))
        connect(lab, 30, tally)
        assert counts.read(three) == (30, tally)

        # Stopped: the rules (and counters) stay and count; a new agent keeps them.
        agent.stop()
        connect(lab, 10, tally)
        agent = AgentProcess(lab, sim, tmp_path, *argv, name="agent-2").start()
        agent.wait_ready()
        connect(lab, 20, tally)
        assert counts.read(three) == (60, tally)
        assert scraped(agent, lab) == (60, tally)  # what /metrics says: the same

        # web-3 leaves: the chains are rewritten, web-3's object goes once they are.
        two = web_objects(lab, ("web-1", "web-2"))
        gone = counts.counters(three).endpoints[2][0]  # type: ignore[index]
        sim.apply(two[1])
        wait_for(lambda: gone not in counts.dump(), 15, "web-3's counter to go")
        connect(lab, 20, tally)
        assert set(tally) == {"web-1", "web-2", "web-3"}
        total, each = counts.read(two)
        assert total == 80
        assert each == Counter({n: tally[n] for n in ("web-1", "web-2")})
        agent.stop()
    result = run_cli(lab, ["--cleanup", "--proxy-mode", "iptables"])
    assert result.returncode == 0, result.stderr[-2000:]
    assert counts.dump() == {}


@pytest.mark.parametrize(("backend", "applier"), [
    (Backend.LEGACY, "restore"), (Backend.NFT, "restore"), (Backend.LEGACY, "iptc")],
    ids=["legacy", "nft", "legacy-iptc"])
def test_the_kernel_prints_back_the_counting_rules_as_written(backend: Backend,
                                                             applier: str) -> None:
    # Drift checks compare what we wrote with iptables-save: the nfacct match's own
    # spelling ("--nfacct-name  NAME", two spaces) must be the one we write.
    objects = [svc("web", annotations=PER_ENDPOINT, sessionAffinity="ClientIP"),
               eps_slice("web-1", [ep("198.18.1.10", node="node-a"), ep("198.18.1.11")],
                         service_name="web")]
    options = DataplaneOptions("node-a", cluster_cidrs=POD_CIDRS)
    with Lab([]) as bare:
        plane = NodePlane(bare.node_ns, backend, options, applier=applier,
                          addresses=lambda: [ip_address("198.18.0.1")])
        plane.sync(Cluster().become(*objects), full=True)
        with entered(bare.node_ns):
            kernel = parse_save(IptablesRunner(Family.V4, backend).save())
            assert len(Nfacct().dump()) == 3  # the port and its two endpoints
        ruleset = plane.dp._families[Family.V4].ruleset
        assert ruleset is not None
        mine = {(t, c): rules_digest(r) for t, chains in kernel.items()
                for c, r in chains.items() if ours(c)}
        assert mine == ruleset.digests()
        assert ruleset.differences(kernel) == []
        plane.cleanup()
        with entered(bare.node_ns):
            assert Nfacct().dump() == {}
