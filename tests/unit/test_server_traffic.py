"""What an operator sees of the kernel's traffic counts: the dump's `traffic` field and
the /metrics series, with one series per endpoint only where the port is counted per
endpoint (server/traffic.py)."""

from __future__ import annotations

import asyncio
from ipaddress import ip_address

from prometheus_client import CollectorRegistry, generate_latest

from proxy.dataplane.base import Counted, PortTraffic
from proxy.model.types import Family, ServicePortKey
from proxy.server.traffic import TrafficCollector, TrafficReading, traffic_view

WEB = ServicePortKey("demo", "web", "http", Family.V4)
DNS = ServicePortKey("kube-system", "dns", "", Family.V6)
PER_ENDPOINT = PortTraffic(Counted(7), {(ip_address("198.18.1.11"), 8080): Counted(3),
                                        (ip_address("198.18.1.10"), 8080): Counted(4)})


def test_the_dump_shows_totals_and_endpoints_as_the_dump_spells_them() -> None:
    assert traffic_view(PER_ENDPOINT) == {"connections": 7, "endpoints": {
        "198.18.1.10:8080": {"connections": 4}, "198.18.1.11:8080": {"connections": 3}}}
    ipvs = PortTraffic(Counted(2, 20, 3000), {(ip_address("fd00::5"), 53): Counted(2, 20, 3000)})
    assert traffic_view(ipvs) == {"connections": 2, "packets": 20, "bytes": 3000,
                                  "endpoints": {"[fd00::5]:53": {
                                      "connections": 2, "packets": 20, "bytes": 3000}}}
    # Counted per port only: no endpoints, said as null; never read: null.
    assert traffic_view(PortTraffic(Counted(5))) == {"connections": 5, "endpoints": None}
    assert traffic_view(None) is None


def test_metrics_have_a_series_per_port_and_per_counted_endpoint_only() -> None:
    reading = TrafficReading()
    registry = CollectorRegistry()
    registry.register(TrafficCollector(reading))
    assert "sliceproxy_service_connections_total{" not in generate_latest(registry).decode()
    reading.update({WEB: PER_ENDPOINT, DNS: PortTraffic(Counted(9))})
    text = generate_latest(registry).decode()
    assert ('sliceproxy_service_connections_total{family="IPv4",namespace="demo",port="http",'
            'service="web"} 7.0') in text
    assert ('sliceproxy_service_connections_total{family="IPv6",namespace="kube-system",'
            'port="",service="dns"} 9.0') in text
    assert ('sliceproxy_endpoint_connections_total{endpoint="198.18.1.10:8080",family="IPv4",'
            'namespace="demo",port="http",service="web"} 4.0') in text
    endpoint_series = [line for line in text.splitlines()
                       if line.startswith("sliceproxy_endpoint_connections_total{")]
    assert len(endpoint_series) == 2  # the DNS port is counted per port only
    assert "sliceproxy_service_packets_total{" not in text  # no mode here counts packets


def test_a_reading_that_fails_or_waits_too_long_keeps_the_last_one() -> None:
    reading = TrafficReading()
    reading.update({WEB: PER_ENDPOINT})

    async def slow() -> dict[ServicePortKey, PortTraffic]:
        await asyncio.sleep(5)
        return {}

    async def broken() -> dict[ServicePortKey, PortTraffic]:
        raise OSError("netlink dump failed")

    async def fresh() -> dict[ServicePortKey, PortTraffic]:
        return {DNS: PortTraffic(Counted(1))}

    asyncio.run(reading.refresh(slow, timeout=0.05))
    asyncio.run(reading.refresh(broken, timeout=1))
    assert reading.ports == {WEB: PER_ENDPOINT}
    asyncio.run(reading.refresh(fresh, timeout=1))
    assert reading.ports == {DNS: PortTraffic(Counted(1))}
