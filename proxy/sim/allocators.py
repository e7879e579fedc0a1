"""Cluster IP and node port allocation, as the real server does on Service create.

The used sets are kept by the store from committed Services (`observe`), so they can never
drift from the objects: a restart that keeps state rebuilds them from the objects.
Allocation is sequential from a cursor (upstream picks at random): deterministic runs are
worth more in tests than imitating the randomness.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from proxy.sim.errors import Cause
from proxy.sim.validation import invalid

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

DEFAULT_V4_RANGE = "198.18.128.0/17"
DEFAULT_V6_RANGE = "fd00:198:18::/112"
NODE_PORT_RANGE = (30000, 32767)


def service_ips(obj: dict[str, Any] | None) -> list[str]:
    spec = (obj or {}).get("spec") or {}
    ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    return [ip for ip in ips if isinstance(ip, str) and ip != "None"]


def service_node_ports(obj: dict[str, Any] | None) -> list[int]:
    ports = ((obj or {}).get("spec") or {}).get("ports") or []
    return [p["nodePort"] for p in ports
            if isinstance(p, dict) and isinstance(p.get("nodePort"), int) and p["nodePort"]]


class Allocators:
    def __init__(self, v4_range: str = DEFAULT_V4_RANGE, v6_range: str = DEFAULT_V6_RANGE,
                 node_ports: tuple[int, int] = NODE_PORT_RANGE) -> None:
        self.ranges: dict[int, IPNetwork] = {
            4: ipaddress.ip_network(v4_range), 6: ipaddress.ip_network(v6_range)}
        self.node_ports = node_ports
        self.used_ips: set[str] = set()
        self.used_node_ports: set[int] = set()
        self._ip_cursor = {4: 0, 6: 0}
        self._port_cursor = 0

    def observe(self, old: dict[str, Any] | None, new: dict[str, Any] | None) -> None:
        """Track a committed Service change (old -> new; either may be None)."""
        for ip in service_ips(old):
            self.used_ips.discard(_canon(ip))
        self.used_node_ports.difference_update(service_node_ports(old))
        self.used_ips.update(_canon(ip) for ip in service_ips(new))
        self.used_node_ports.update(service_node_ports(new))

    def reset(self) -> None:
        self.used_ips.clear()
        self.used_node_ports.clear()

    def check_ip(self, ip: str, path: str) -> Cause | None:
        addr = ipaddress.ip_address(ip)
        net = self.ranges[addr.version]
        if addr not in net:
            return invalid(path, ip, "provided IP is not in the valid range. The range of "
                           f"valid IPs is {net}")
        if _canon(ip) in self.used_ips:
            return invalid(path, ip, "provided IP is already allocated")
        return None

    def allocate_ip(self, version: int) -> str | None:
        net = self.ranges[version]
        # Skip the network address and the first host (upstream keeps it for the
        # `kubernetes` service); for IPv4 also the broadcast address.
        first = int(net.network_address) + 2
        last = int(net.broadcast_address) - (1 if version == 4 else 0)
        size = last - first + 1
        for step in range(size):
            offset = (self._ip_cursor[version] + step) % size
            candidate = str(ipaddress.ip_address(first + offset))
            if candidate not in self.used_ips:
                self._ip_cursor[version] = offset + 1
                return candidate
        return None

    def check_node_port(self, port: int, path: str) -> Cause | None:
        low, high = self.node_ports
        if not low <= port <= high:
            return invalid(path, port, "provided port is not in the valid range. The range "
                           f"of valid ports is {low}-{high}")
        if port in self.used_node_ports:
            return invalid(path, port, "provided port is already allocated")
        return None

    def allocate_node_port(self) -> int | None:
        low, high = self.node_ports
        size = high - low + 1
        for step in range(size):
            offset = (self._port_cursor + step) % size
            if low + offset not in self.used_node_ports:
                self._port_cursor = offset + 1
                return low + offset
        return None


def _canon(ip: str) -> str:
    try:
        return str(ipaddress.ip_address(ip))
    except ValueError:
        return ip
