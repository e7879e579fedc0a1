"""The run's settings and the cluster's objects."""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Network
from typing import Any

POD_NET = IPv4Network("198.19.0.0/16")  # endpoint addresses: never sent traffic
NAMESPACE = "fleet"
MANAGER = "sliceproxy-bench.example.com"  # the EndpointSlice controller leaves these alone
SAMPLE_EVERY = 0.2  # seconds between /proc samples of the servers' RSS
SIZES: dict[str, dict[str, Any]] = {
    "small": {"agents": (5,), "services": 20, "endpoints": 3, "changes": 5, "rate": 5.0},
    "full": {"agents": (100, 500, 1000), "services": 1000, "endpoints": 10,
             "changes": 50, "rate": 5.0},
}
Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Settings:
    server: str = "real"  # "real" (kube-apiserver v1.20.2) or "sim"
    agents: tuple[int, ...] = (5,)
    first_lists: tuple[str, ...] = ("cache",)  # "cache" (resourceVersion=0), "consistent"
    services: int = 20
    endpoints: int = 3  # per service (one EndpointSlice each)
    changes: int = 5
    rate: float = 5.0  # changes per second
    workers: int = 1
    parallel: int = 16  # concurrent writes while preloading
    deadline: float = 600.0  # per phase

    def check(self) -> None:
        if self.server not in ("real", "sim"):
            raise ValueError("server: real or sim")
        if not self.agents or min(self.agents) < 1 or self.services < 1 or \
                self.endpoints < 1 or self.changes < 1 or self.rate <= 0 or self.workers < 1:
            raise ValueError("agents, services, endpoints, changes, rate, workers: positive")
        if self.services * self.endpoints > POD_NET.num_addresses - 2:
            raise ValueError(f"at most {POD_NET.num_addresses - 2} endpoints ({POD_NET})")
        if not set(self.first_lists) <= {"cache", "consistent"} or not self.first_lists:
            raise ValueError("first lists: cache and/or consistent")


def node_name(i: int) -> str:
    return f"fleet-node-{i}"


# --- the cluster's objects ------------------------------------------------------------


def endpoint_ip(settings: Settings, i: int, j: int) -> str:
    return str(POD_NET.network_address + 1 + i * settings.endpoints + j)


def service_obj(i: int) -> Obj:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"s-{i}", "namespace": NAMESPACE},
            "spec": {"ports": [{"name": "http", "port": 80, "targetPort": 8080,
                                "protocol": "TCP"}]}}


def slice_endpoints(settings: Settings, i: int, not_ready: int | None,
                    beta: bool) -> list[Obj]:
    out = []
    for j in range(settings.endpoints):
        ep: Obj = {"addresses": [endpoint_ip(settings, i, j)],
                   "conditions": {"ready": j != not_ready}}
        node = node_name(j)
        if beta:
            ep["topology"] = {"kubernetes.io/hostname": node}
        else:
            ep["nodeName"] = node
        out.append(ep)
    return out


def slice_obj(settings: Settings, i: int, group_version: str) -> Obj:
    return {"apiVersion": group_version, "kind": "EndpointSlice",
            "metadata": {"name": f"s-{i}-0", "namespace": NAMESPACE,
                         "labels": {"kubernetes.io/service-name": f"s-{i}",
                                    "endpointslice.kubernetes.io/managed-by": MANAGER}},
            "addressType": "IPv4",
            "endpoints": slice_endpoints(settings, i, None, group_version.endswith("beta1")),
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}


def node_obj(i: int) -> Obj:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": node_name(i),
                         "labels": {"kubernetes.io/hostname": node_name(i)}}}
