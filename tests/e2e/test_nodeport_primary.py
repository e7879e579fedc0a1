"""`--nodeport-addresses primary`, judged by real traffic from the lab's client: a NodePort
answers on the node's primary address (its Node object's InternalIP) and is refused on
the node's other address, and follows the Node when its address moves, with no
restart. nftables mode by its default (no flag: kube-proxy's nftables default), iptables
mode by the flag. IPVS mode: tests/unit/test_nodeport_addresses.py (render and plane)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.netns_lab import Lab
from proxy.netns_lab.topology import POD_GW4
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    namespace_object,
    node_object,
    one_backend_lab,
    service,
    start_sim,
    wait_for,
)

pytestmark = pytest.mark.root

NODE_PORT = 30080
OTHER4 = str(POD_GW4)  # the node's second address (its pod bridge's)


@pytest.fixture
def lab() -> Iterator[Lab]:
    with one_backend_lab() as lab:
        yield lab


def kubelet_node(lab: Lab, internal4: object) -> dict[str, Any]:
    return node_object(addresses=[("InternalIP", internal4), ("InternalIP", lab.node_ip6),
                                  ("Hostname", lab.node_name)])


@pytest.mark.parametrize("flags", [(), ("--nodeport-addresses", "primary")],
                         ids=["nftables-default", "iptables-primary"])
def test_nodeport_answers_on_the_primary_address_only_and_follows_the_node(
        lab: Lab, tmp_path: Path, flags: tuple[str, ...]) -> None:
    mode = "iptables" if flags else "nftables"
    web = service("web", ["198.18.128.10"], type="NodePort")
    web["spec"]["ports"][0]["nodePort"] = NODE_PORT
    objects = [kubelet_node(lab, lab.node_ip4), namespace_object("demo"), web,
               endpoint_slice("web-x", "web", [endpoint(lab.backends["web-1"].ipv4)])]
    c = lab.client_ns

    def answers(address: object) -> set[str]:
        return set(lab.ask(c, address, NODE_PORT, count=3, timeout=0.5))

    with start_sim(lab, objects) as sim:
        agent = AgentProcess(lab, sim, tmp_path, "--proxy-mode", mode, *flags).start()
        try:
            agent.wait_ready()
            lab.wait_for(c, lab.node_ip4, NODE_PORT, {"web-1"})
            # The same node, another of its addresses: the port is not open there.
            assert answers(OTHER4) == {"refused"}
            node = agent.dump()["node"]
            assert node["primary_ips"] == [str(lab.node_ip4), str(lab.node_ip6)]
            assert node["nodeports"]["IPv4"] == [f"{lab.node_ip4}/32"]
            # The kubelet reports another InternalIP: NodePorts move, the agent runs on.
            sim.update_status(kubelet_node(lab, OTHER4))
            lab.wait_for(c, OTHER4, NODE_PORT, {"web-1"})
            wait_for(lambda: answers(lab.node_ip4) == {"refused"}, 15,
                     "the old primary address to stop taking the NodePort")
            assert agent.dump()["node"]["nodeports"]["IPv4"] == [f"{OTHER4}/32"]
            assert agent.alive()
        finally:
            if agent.alive():
                agent.stop()
