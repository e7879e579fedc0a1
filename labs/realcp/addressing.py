"""The addresses of a lab cluster, one plan per address family: the control plane's
network (API server, nodes, the outside client), the Service range and the pod network.

    family  cp network (API .1)  services (`kubernetes` .1)  pods (a block per node)
    IPv4    198.18.96.0/24       198.18.128.0/17             198.18.64.0/19, /24 each
    IPv6    fd00:198:18:96::/64  fd00:198:18:128::/108       fd00:198:18:6400::/56, /64 each

A cluster's stack is a tuple of plans, its primary family first: `IPV4_ONLY` (every
tier's default), `IPV6_ONLY`, `DUAL_STACK`. Everything is inside 198.18.0.0/15 and
fd00::/8.

ClusterIPs (`Family.cluster_ips`): IPv4's /17 holds 32,766. IPv6's /108 is as wide as
v1.20's kube-apiserver accepts (at most 20 host bits: a /107 is "too large"), but its
allocator serves only the first 65,536 addresses of an IPv6 range (ipallocator's
RangeSize cap; measured: ::ffff allocated, ::1:0 "not in the valid range"), so 65,535.
No single-stack v1.20 cluster of this lab holds 100,000 Services.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_network

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network
# Attached namespaces take the cp network's addresses after the API server's + 10:
# .11, .12, ... (::b, ::c, ...).
MEMBER_OFFSET = 10
# The most addresses v1.20's ClusterIP allocator serves from an IPv6 range (its bitmap's
# size), however wide the range it accepted.
IPV6_ALLOCATOR_CAP = 2**16


@dataclass(frozen=True, slots=True)
class Family:
    cp_net: IPNetwork  # the control plane's bridge: API server, nodes, outside
    services: IPNetwork  # --service-cluster-ip-range
    pods: IPNetwork  # the pod network; node i has its i-th block of `pod_prefixlen`
    pod_prefixlen: int

    @property
    def version(self) -> int:
        return self.cp_net.version

    @property
    def name(self) -> str:  # as Kubernetes spells it (ipFamilies, addressType)
        return f"IPv{self.version}"

    @property
    def api_addr(self) -> IPAddress:
        """The API server's address (the bridge's, in the control plane's namespace)."""
        return self.cp_net.network_address + 1

    @property
    def kubernetes_service_ip(self) -> IPAddress:
        """The `kubernetes` Service's ClusterIP: the range's first address."""
        return self.services.network_address + 1

    @property
    def cluster_ips(self) -> int:
        """How many ClusterIPs v1.20 allocates from the range, the `kubernetes` Service's
        among them: all but the network (and IPv4's broadcast) address, and for IPv6 no
        more than IPV6_ALLOCATOR_CAP."""
        if self.version == 4:
            return self.services.num_addresses - 2
        return min(self.services.num_addresses, IPV6_ALLOCATOR_CAP) - 1

    @property
    def default_route(self) -> str:
        return "0.0.0.0/0" if self.version == 4 else "::/0"

    def member(self, index: int) -> IPAddress:
        """The address of the `index`-th namespace attached to the cp network."""
        addr = self.api_addr + MEMBER_OFFSET + index
        if addr not in self.cp_net or addr == self.cp_net.broadcast_address:
            raise ValueError(f"no address {index} in {self.cp_net}")
        return addr

    def pod_range(self, index: int) -> IPNetwork:
        """Node `index`'s pod range."""
        size = 2 ** (self.pods.max_prefixlen - self.pod_prefixlen)
        net = ip_network((self.pods.network_address + size * index, self.pod_prefixlen))
        if not net.subnet_of(self.pods):  # type: ignore[arg-type]  # same family
            raise ValueError(f"no pod range {index} in {self.pods}")
        return net


IPV4 = Family(IPv4Network("198.18.96.0/24"), IPv4Network("198.18.128.0/17"),
              IPv4Network("198.18.64.0/19"), 24)
IPV6 = Family(IPv6Network("fd00:198:18:96::/64"), IPv6Network("fd00:198:18:128::/108"),
              IPv6Network("fd00:198:18:6400::/56"), 64)

Stack = tuple[Family, ...]  # the primary family first
IPV4_ONLY: Stack = (IPV4,)
IPV6_ONLY: Stack = (IPV6,)
DUAL_STACK: Stack = (IPV4, IPV6)
STACKS = {"ipv4": IPV4_ONLY, "ipv6": IPV6_ONLY, "dual": DUAL_STACK}  # by name


def url_host(addr: IPAddress | str) -> str:
    """An address as the host part of a URL or `host:port` (IPv6 in brackets)."""
    text = str(addr)
    return f"[{text}]" if ":" in text else text


def dual(stack: Stack) -> bool:
    return len(stack) > 1
