"""deploy/daemonset.yaml on a dual-stack cluster: v1.20's IPv6DualStack gate (alpha) on
in the API server, the controller manager and every kubelet; nodes, pods and Services
with an address of each family, IPv4 the primary (tests/nodes/cluster.py with
DUAL_STACK). One rollout, the shipped manifest in nftables mode (whose NodePorts default
to the node's primary address of each family): every agent Ready; echo's Services
`ipFamilyPolicy: RequireDualStack`: ClusterIP TCP and UDP over both families from a pod
on every node, the NodePort at both of every node's addresses from outside, every
connection counted.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from ipaddress import ip_address

import pytest

from labs.realcp.addressing import DUAL_STACK
from tests.nodes import workload as wl
from tests.nodes.conftest import report, started_cluster
from tests.nodes.scenario import Counts, Workload, ready, rollout_status

pytestmark = [pytest.mark.nodes, pytest.mark.root, pytest.mark.slow]

counts = Counts()


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workload]:
    started = time.monotonic()
    with started_cluster(tmp_path_factory.mktemp("dual"), stack=DUAL_STACK) as c:
        c.kubectl("apply", "-f", "-", stdin=wl.shipped_daemonset(c.image.ref, c.api_url,
                                                                 "nftables"))
        rollout_status(c, "sliceproxy", "ds/sliceproxy")
        w = Workload(c)
        w.deploy()
        yield w
    report.append(f"dual-stack module: {time.monotonic() - started:.0f}s; "
                  f"{counts.summary()}")


def versions(addresses: list[str]) -> list[int]:
    return [ip_address(a).version for a in addresses]


def test_nodes_pods_and_services_have_an_address_of_each_family(workload: Workload) -> None:
    c = workload.cluster
    for node in c.nodes.values():
        status = c.node_status(node.name)
        assert status is not None
        internal = [a["address"] for a in status["status"]["addresses"]
                    if a["type"] == "InternalIP"]
        assert internal == list(map(str, node.addresses)) and versions(internal) == [4, 6]
    for pod in c.pods(wl.NAMESPACE, "app=echo"):
        assert versions([p["ip"] for p in pod["status"]["podIPs"]]) == [4, 6], pod["status"]
    assert versions(workload.family_ips["echo"]) == [4, 6], workload.family_ips
    slices = c.get_json("endpointslices", "-n", wl.NAMESPACE, "-l",
                        "kubernetes.io/service-name=echo")["items"]
    assert sorted(s["addressType"] for s in slices) == ["IPv4", "IPv6"], slices


def test_every_agent_ready_and_traffic_over_both_families(workload: Workload) -> None:
    c = workload.cluster
    agents = c.pods("sliceproxy", "app.kubernetes.io/name=sliceproxy")
    assert sorted(p["spec"]["nodeName"] for p in agents) == sorted(c.nodes)
    assert all(ready(p) for p in agents), [p["status"] for p in agents]
    report.append(f"dual-stack, shipped DaemonSet: {sum(map(ready, agents))} of "
                  f"{len(c.nodes)} agents Ready")
    assert workload.check_every_family("nftables", counts) == []
