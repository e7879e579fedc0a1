"""Each service port's traffic from IPVS's own statistics (`IpvsDataPlane.traffic`).

The kernel counts, for every virtual server and every real server, the connections it
scheduled and the packets and bytes it forwarded both ways; nothing of ours is added to
the packet path. A service port has a virtual server per frontend (its cluster IPs,
external and load-balancer IPs, each node address at its NodePort: render.py), so its
total is their sum, read in one dump of every virtual server. Where the port is counted
per endpoint (the service's annotation, carried in its PortRules, else the node's flag:
common/traffic.per_endpoint), each of its virtual servers' real servers is read too, one
dump per virtual server (the kernel dumps real servers one service at a time), and an
endpoint's count is its real servers' sum over the port's virtual servers. A virtual
server that has counted nothing is not asked: its real servers read 0. The kernel
refreshes what it reports every 2 s (its rate estimator's tick): a reading lags by up
to that.

What survives: the counts are the virtual and real servers' own, so an agent restart or
a full sync, which keep the servers that are right, keeps them; a virtual server made
again (deleted by someone, or its port gone and back) starts at 0, and so does a real
server, unless the kernel still held the deleted one (a real server is kept aside for a
while after its last connection, and a re-added one takes its old counts back). A
draining real server (weight 0) is still the port's and still read.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

from proxy.dataplane.base import Counted, PortTraffic, TrafficByPort
from proxy.dataplane.common.traffic import port_traffic, summed
from proxy.dataplane.ipvs.index import RenderIndex
from proxy.dataplane.ipvs.netlink import RawVsKey, raw_key
from proxy.dataplane.ipvs.render import PortRules, RsKey, VirtualServer, VsKey
from proxy.model.types import IPAddress, ServicePortKey

# IPVS counts packets and bytes too: nothing counted is 0 of each (Counted's None would
# mean "not counted" and swallow whatever it is added to).
ZERO = Counted(0, 0, 0)


class StatsTable(Protocol):
    """What is read from the kernel (kernel.IpvsTable)."""

    def service_stats(self) -> dict[RawVsKey, Counted]: ...

    def dest_stats(self, key: VsKey) -> dict[RsKey, Counted]: ...


class TrafficReader:
    """Reads the applied ports' traffic. Remembers each port's virtual servers as the
    statistics are keyed (netlink.raw_key), by PortRules (immutable, replaced when the
    port changes), so that a reading at 10,000 ports hashes builtins only."""

    def __init__(self) -> None:
        self._raw: dict[int, tuple[PortRules, tuple[RawVsKey, ...]]] = {}

    def read(self, ports: Mapping[ServicePortKey, PortRules], index: RenderIndex,
             table: StatsTable, per_endpoint_default: bool
             ) -> TrafficByPort:
        """`ports` as applied, with the counts of the virtual servers each one owns: a
        virtual server two ports claim is counted for the one programming it (index.py)."""
        servers = table.service_stats()
        contested = index.contested()
        out = TrafficByPort()
        for key, rules in ports.items():
            raw = self._raw_keys(rules)
            if contested and any(vs.key in contested for vs in rules.virtual_servers):
                owned = [(vs, r) for vs, r in zip(rules.virtual_servers, raw, strict=True)
                         if vs.key not in contested or _owner(index, vs.key) == key]
                mine, raw = [vs for vs, _ in owned], tuple(r for _, r in owned)
            else:
                mine = list(rules.virtual_servers)
            total = summed(servers, raw) or ZERO
            wanted = rules.traffic_per_endpoint
            if not (per_endpoint_default if wanted is None else wanted):
                out.add(key, PortTraffic(total))
                continue
            out.add(key, port_traffic(total, _endpoints(zip(mine, raw, strict=True), servers,
                                                        table)))
        if len(self._raw) > 2 * len(ports) + 64:  # forget rules replaced since
            live = {id(rules) for rules in ports.values()}
            self._raw = {k: v for k, v in self._raw.items() if k in live}
        return out

    def _raw_keys(self, rules: PortRules) -> tuple[RawVsKey, ...]:
        found = self._raw.get(id(rules))
        if found is not None and found[0] is rules:
            return found[1]
        raw = tuple(raw_key(vs.key) for vs in rules.virtual_servers)
        self._raw[id(rules)] = (rules, raw)
        return raw


def _owner(index: RenderIndex, vs_key: VsKey) -> ServicePortKey | None:
    found = index.virtual_server(vs_key)
    return found[0] if found is not None else None


def _endpoints(mine: Iterator[tuple[VirtualServer, RawVsKey]],
               servers: Mapping[RawVsKey, Counted], table: StatsTable
               ) -> Iterator[tuple[tuple[IPAddress, int], Counted]]:
    """Every real server of the port's virtual servers, rendered (0 until counted) or
    in the kernel (a draining one), by virtual server; port_traffic sums them up."""
    for vs, raw in mine:
        counted = servers.get(raw)
        idle = counted is None or (counted.connections == 0 and not counted.packets)
        found = {} if idle else table.dest_stats(vs.key)
        for rs in found.keys() | set(vs.real_servers):
            yield (rs.address, rs.port), found.get(rs, ZERO)
