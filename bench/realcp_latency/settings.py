"""The run's settings and the workload's names and addresses."""

from __future__ import annotations

import math
from dataclasses import dataclass
from ipaddress import IPv4Network
from typing import Any

from bench.common import PACINGS

NODE = "node-a"
# Pod IPs: they need not answer (nothing sends traffic), so they come from ranges of
# their own rather than the lab's 200 backends. Inside 198.18.0.0/15, clear of the
# lab (198.18.0-1.x), the control plane (198.18.96.0/24) and services (198.18.128/17):
# 97,534 addresses. Past that they repeat across services (10,000 x 10 needs 100,000),
# never within one (the API server does not mind; the proxy pays the same per endpoint).
POD_NETS = (IPv4Network("198.19.0.0/16"), IPv4Network("198.18.2.0/23"),
            IPv4Network("198.18.4.0/22"), IPv4Network("198.18.8.0/21"),
            IPv4Network("198.18.16.0/20"), IPv4Network("198.18.32.0/19"),
            IPv4Network("198.18.64.0/19"), IPv4Network("198.18.97.0/24"),
            IPv4Network("198.18.98.0/23"), IPv4Network("198.18.100.0/22"),
            IPv4Network("198.18.104.0/21"), IPv4Network("198.18.112.0/20"))
POD_ADDRESSES = [a for net in POD_NETS for a in net.hosts()]
TARGET_PORT = 8080
SLICES = "/apis/discovery.k8s.io/v1beta1/namespaces/{ns}/endpointslices"
# The controller manager's client QPS (default 20, burst 30) would make writing the
# Endpoints and EndpointSlices of 1,000 services take ~2 minutes. It only matters in
# bursts: every measured change is a single write after a quiet period.
KCM_FLAGS = ("--kube-api-qps=200", "--kube-api-burst=400")
PROXIES = ("sliceproxy", "sliceproxy-nftables", "kube-proxy")
# Extra flags per side: sliceproxy in its native nftables mode is a third side.
PROXY_FLAGS = {"sliceproxy-nftables": ("--proxy-mode", "nftables")}
# Issue 29's sync pacing, for sliceproxy's sides: "old" is the fixed-rate runner set
# explicitly (kube-proxy's 1 s); "new" passes no pacing flag, so it measures whatever the
# agent's default is. With --pacing, each sliceproxy side runs once per pacing, as
# "NAME/PACING" (kube-proxy once, with its defaults).
DISPATCH = {"sliceproxy": "SPX-SERVICES", "kube-proxy": "KUBE-SERVICES"}
SERVICE_CHAIN = {"sliceproxy": "SPX-SVC-", "kube-proxy": "KUBE-SVC-"}
BACKENDS = ("nft", "legacy")
NFTABLES = "nftables"  # a side's `backend` when its rules are our own nf_tables tables
NFT_MAIN = "sliceproxy"  # the nftables mode's main table; shards are sliceproxy-0..K-1
NFT_MAX_SHARDS = 64
# A chain of the main table packets enter by: a first start in parts adds every hooked
# chain with its last part, so this one says the first sync is live.
NFT_LIVE_CHAIN = "nat-postrouting"
INITIAL_POLL = 0.25  # seconds between checks of the initial sync
Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Settings:
    services: int = 1000
    pods_per_service: int = 2
    changes: int = 20
    poll_interval: float = 0.02  # seconds between polls of a node's nat table
    spacing: float = 3.0  # seconds between a change being seen everywhere and the next
    change_deadline: float = 60.0  # per change, per proxy
    setup_deadline: float = 900.0  # objects created, controllers done, proxies synced
    parallel: int = 16  # concurrent API requests while creating objects
    seed: int = 7
    cleanup_objects: bool = False  # delete Pods and Services at the end (shared cluster)
    proxies: tuple[str, ...] = PROXIES  # one alone: no competition for the CPU
    # The iptables back end each node uses: "auto" leaves it to each proxy (sliceproxy's
    # detection; kube-proxy runs `iptables` from PATH, Debian's being nft); "nft" or
    # "legacy" plant kubelet's hint chain there and give kube-proxy that back end's tools,
    # as kube-proxy's image's iptables-wrapper does.
    iptables_backend: str = "auto"
    pacing: tuple[str, ...] = ()  # () : sliceproxy with its defaults, one side each

    def sides(self) -> list[str]:
        """The sides' names, in start order: each proxy, a sliceproxy once per pacing."""
        out: list[str] = []
        for name in self.proxies:
            paced = name != "kube-proxy" and self.pacing
            out += [f"{name}/{pace}" for pace in self.pacing] if paced else [name]
        return out

    def check(self) -> None:
        if self.services < 1 or self.pods_per_service < 1 or self.changes < 1:
            raise ValueError("services, pods per service and changes must be positive")
        if self.pods_per_service > len(POD_ADDRESSES):
            raise ValueError(f"at most {len(POD_ADDRESSES)} pods per service")
        if math.ceil(self.changes / 2) > self.services:
            raise ValueError("each pair of changes needs a service of its own")
        if not self.proxies or not set(self.proxies) <= set(PROXIES):
            raise ValueError(f"proxies: one or more of {PROXIES}")
        if not set(self.pacing) <= set(PACINGS) or len(set(self.pacing)) != len(self.pacing):
            raise ValueError(f"pacing: distinct ones of {sorted(PACINGS)}")
        if self.iptables_backend not in ("auto", *BACKENDS):
            raise ValueError(f"iptables back end: auto or one of {BACKENDS}")


def service_name(i: int) -> str:
    return f"s-{i}"


def pod_name(i: int, j: int) -> str:
    return f"p-{i}-{j}"


def pod_ip(settings: Settings, i: int, j: int) -> str:
    return str(POD_ADDRESSES[(i * settings.pods_per_service + j) % len(POD_ADDRESSES)])
