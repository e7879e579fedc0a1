"""What an operator sees of the kernel's traffic counts: the dump's `traffic` field and
the /metrics series, with one series per endpoint only where the port is counted per
endpoint (server/traffic.py)."""

from __future__ import annotations

import asyncio
import logging
import time
from ipaddress import ip_address

import pytest
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from proxy.dataplane.base import Counted, PortTraffic, TrafficByPort
from proxy.model.types import Family, ServicePortKey
from proxy.server.http import metrics_app, serve
from proxy.server.metrics import CONTENT_TYPE, AgentMetrics
from proxy.server.traffic import (
    PART_LINES,
    READ_SPACING,
    TrafficReading,
    series_text,
    traffic_view,
)

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


def test_a_reading_kept_as_numbers_shows_as_the_counts_it_was_read_as() -> None:
    """TrafficByPort (a reading as the modes keep it) gives the dump and the metrics
    the same counts as the objects it was read as: totals, packets and bytes where
    counted, endpoints where counted, and a port read again replaces its last."""
    ipvs = PortTraffic(Counted(2, 20, 3000), {(ip_address("fd00::5"), 53): Counted(2, 20, 3000)})
    objects = {WEB: PER_ENDPOINT, DNS: ipvs,
               ServicePortKey("demo", "api", "", Family.V4): PortTraffic(Counted(9))}
    kept = TrafficByPort()
    for key, pt in objects.items():
        kept.add(key, pt)
    kept.add(WEB, PortTraffic(Counted(1)))
    assert kept[WEB] == PortTraffic(Counted(1))  # its endpoints gone with the rest
    kept.add(WEB, PER_ENDPOINT)
    kept.add_connections(ServicePortKey("demo", "api", "", Family.V4), 9)
    assert kept == objects and list(kept) == list(objects)
    assert kept.get(ServicePortKey("demo", "gone", "", Family.V4)) is None
    assert series_text(kept) == series_text(objects)
    assert traffic_view(kept[DNS]) == traffic_view(ipvs)


def test_metrics_have_a_series_per_port_and_per_counted_endpoint_only() -> None:
    reading = TrafficReading()
    metrics = AgentMetrics()
    metrics.watch_traffic(reading)
    assert "sliceproxy_service_connections_total{" not in metrics.render().decode()
    reading.update({WEB: PER_ENDPOINT, DNS: PortTraffic(Counted(9))})
    text = metrics.render().decode()
    assert "# TYPE sliceproxy_service_connections_total counter" in text.splitlines()
    assert ('sliceproxy_service_connections_total{namespace="demo",service="web",port="http",'
            'family="IPv4"} 7') in text.splitlines()
    assert ('sliceproxy_service_connections_total{namespace="kube-system",service="dns",'
            'port="",family="IPv6"} 9') in text.splitlines()
    assert ('sliceproxy_endpoint_connections_total{namespace="demo",service="web",port="http",'
            'family="IPv4",endpoint="198.18.1.10:8080"} 4') in text.splitlines()
    endpoint_series = [line for line in text.splitlines()
                       if line.startswith("sliceproxy_endpoint_connections_total{")]
    assert len(endpoint_series) == 2  # the DNS port is counted per port only
    assert "sliceproxy_service_packets_total" not in text  # no mode here counts packets
    # The whole scrape is Prometheus text a parser takes: our families are counters.
    parsed = {f.name: (f.type, len(f.samples)) for f in text_string_to_metric_families(text)}
    assert parsed["sliceproxy_service_connections"] == ("counter", 2)
    assert parsed["sliceproxy_endpoint_connections"] == ("counter", 2)


def test_a_large_reading_is_served_whole_from_its_parts() -> None:
    """Made and written in parts (not one 10 MB text at 100,000 ports): a scrape gets
    every series once, each family under one HELP and TYPE, its length announced."""
    n = 2 * PART_LINES + 7
    ports = {ServicePortKey("ns", f"s-{i}", "http", Family.V4):
             PortTraffic(Counted(i), {(ip_address("198.18.1.10"), 80): Counted(i)}
                         if i % 2 else None) for i in range(n)}
    reading = TrafficReading()
    reading.update(ports)
    assert len(reading.series()) > 3  # in parts, several per family
    metrics = AgentMetrics()
    metrics.watch_traffic(reading)

    async def scrape() -> tuple[bytes, dict[str, str]]:
        async with TestClient(TestServer(metrics_app(metrics, None))) as client:
            got = await client.get("/metrics")
            assert got.status == 200
            return await got.read(), dict(got.headers)

    body, headers = asyncio.run(scrape())
    assert headers["Content-Type"] == CONTENT_TYPE
    assert int(headers["Content-Length"]) == len(body) and body == metrics.render()
    text = body.decode()
    parsed = {f.name: f for f in text_string_to_metric_families(text)}
    service = parsed["sliceproxy_service_connections"].samples
    assert sorted(int(s.value) for s in service) == list(range(n))
    assert len(parsed["sliceproxy_endpoint_connections"].samples) == n // 2
    for name in ("sliceproxy_service_connections_total", "sliceproxy_endpoint_connections_total"):
        assert text.count(f"# TYPE {name} counter\n") == 1


def test_a_scraper_that_gives_up_during_a_reading_is_not_an_error(
        caplog: pytest.LogCaptureFixture) -> None:
    """A scraper whose timeout passes while the reading is awaited closes its
    connection; the answer then has nowhere to go. That is logged for debugging, not
    as an error with a traceback at every such scrape, and the next scrape is served."""
    metrics = AgentMetrics()
    reading = TrafficReading()
    metrics.watch_traffic(reading)
    reading.update({WEB: PortTraffic(Counted(3))})
    caplog.set_level(logging.DEBUG)

    def outcome() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.levelno >= logging.ERROR
                or "went away" in r.getMessage()]

    async def go() -> list[bytes]:
        entered, gate = asyncio.Event(), asyncio.Event()

        async def refresh() -> None:
            entered.set()
            await gate.wait()

        # The agent's own server (agent/app.py serves it so), not aiohttp's test server,
        # which cancels a handler whose client went away.
        runner, listening = await serve(metrics_app(metrics, None, refresh=refresh),
                                        "127.0.0.1", 0)
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", listening.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: node\r\n\r\n")
            await writer.drain()
            await entered.wait()
            writer.close()  # the scraper gives up while the reading is awaited
            await writer.wait_closed()
            server = runner.server
            assert server is not None
            deadline = time.monotonic() + 10
            while (any(h.transport is not None for h in server.connections)
                   and time.monotonic() < deadline):
                await asyncio.sleep(0.01)  # until the agent has seen the close
            gate.set()
            while not outcome() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            reader, writer = await asyncio.open_connection("127.0.0.1", listening.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: node\r\nConnection: close\r\n\r\n")
            answer = (await reader.read()).split(b"\r\n")
            writer.close()
            return answer
        finally:
            await runner.cleanup()

    answer = asyncio.run(go())
    assert answer[0] == b"HTTP/1.1 200 OK" and b"} 3" in answer[-1]  # the next is served
    assert [r.levelname for r in outcome()] == ["DEBUG"]


def test_a_reading_that_fails_or_waits_too_long_keeps_the_last_one() -> None:
    reading = TrafficReading()
    reading.update({WEB: PER_ENDPOINT})

    async def slow() -> tuple[dict[ServicePortKey, PortTraffic], float]:
        await asyncio.sleep(5)
        return {}, 5.0

    async def broken() -> tuple[dict[ServicePortKey, PortTraffic], float]:
        raise OSError("netlink dump failed")

    async def fresh() -> tuple[dict[ServicePortKey, PortTraffic], float]:
        return {DNS: PortTraffic(Counted(1))}, 0.0

    asyncio.run(reading.refresh(slow, timeout=0.05))
    asyncio.run(reading.refresh(broken, timeout=1))
    assert reading.ports == {WEB: PER_ENDPOINT}
    asyncio.run(reading.refresh(fresh, timeout=1))
    assert reading.ports == {DNS: PortTraffic(Counted(1))}


def test_a_reading_that_held_the_data_plane_long_is_not_taken_again_soon() -> None:
    """2-4 s at 100,000 services (the kernel's counter dump, CPU spent): not again
    before READ_SPACING times that, the scrapes between given the last one."""
    now = [100.0]
    reading = TrafficReading(clock=lambda: now[0])
    reads: list[float] = []

    async def read() -> tuple[dict[ServicePortKey, PortTraffic], float]:
        reads.append(now[0])
        return {DNS: PortTraffic(Counted(len(reads)))}, 2.0

    due = 100.0 + READ_SPACING * 2.0
    asyncio.run(reading.refresh(read, timeout=1))
    for at in (101.0, (100.0 + due) / 2, due - 0.1):
        now[0] = at
        asyncio.run(reading.refresh(read, timeout=1))
    assert reads == [100.0] and reading.ports == {DNS: PortTraffic(Counted(1))}
    now[0] = due
    asyncio.run(reading.refresh(read, timeout=1))
    assert reads == [100.0, due] and reading.ports == {DNS: PortTraffic(Counted(2))}
    cheap = TrafficReading(clock=lambda: now[0])  # a small node's: at every scrape

    async def quick() -> tuple[dict[ServicePortKey, PortTraffic], float]:
        reads.append(now[0])
        return {}, 0.05

    del reads[:]
    for _ in range(3):
        asyncio.run(cheap.refresh(quick, timeout=1))
    assert reads == [due] * 3



def test_a_scrape_during_a_reading_waits_for_it_instead_of_taking_another() -> None:
    reading = TrafficReading(clock=lambda: 100.0)
    began: list[int] = []

    async def scrapes() -> None:
        done = asyncio.Event()

        async def read() -> tuple[dict[ServicePortKey, PortTraffic], float]:
            began.append(len(began))
            await done.wait()
            return {DNS: PortTraffic(Counted(7))}, 1.0  # costly: the next one waits

        first = asyncio.create_task(reading.refresh(read, timeout=5))
        for _ in range(100):  # the first reading begins within a few turns of the loop
            if began:
                break
            await asyncio.sleep(0)
        second = asyncio.create_task(reading.refresh(read, timeout=5))
        for _ in range(5):
            await asyncio.sleep(0)
        assert len(began) == 1 and not second.done()
        done.set()
        await asyncio.gather(first, second)

    asyncio.run(scrapes())
    assert began == [0] and reading.ports == {DNS: PortTraffic(Counted(7))}


def test_a_reading_longer_than_a_scrape_waits_goes_on_and_is_kept() -> None:
    """At 100,000 ports a reading (3-4 s) outlasts a scrape's wait (2 s): it was given
    up, so none was ever kept, and each scrape began one more."""
    now = [100.0]
    reading = TrafficReading(clock=lambda: now[0])
    reading.update({WEB: PER_ENDPOINT})
    began: list[float] = []

    async def scrapes() -> None:
        done = asyncio.Event()

        async def read() -> tuple[dict[ServicePortKey, PortTraffic], float]:
            began.append(now[0])
            await done.wait()
            return {DNS: PortTraffic(Counted(3))}, 3.0

        await reading.refresh(read, timeout=0.01)  # the scrape's wait ends first
        assert reading.ports == {WEB: PER_ENDPOINT}
        now[0] = 105.0
        await reading.refresh(read, timeout=0.01)  # the next scrape: no second reading
        done.set()
        await reading.refresh(read, timeout=1)

    asyncio.run(scrapes())
    assert began == [100.0] and reading.ports == {DNS: PortTraffic(Counted(3))}
    assert reading.not_before == 100.0 + READ_SPACING * 3.0


def test_the_series_text_is_made_once_per_reading() -> None:
    """0.25 s at 100,000 ports: made at every scrape, on the event loop, it held each
    change meanwhile; now once per reading, and a new reading's off the loop."""
    reading = TrafficReading()
    reading.update({WEB: PER_ENDPOINT})
    first = reading.series()
    assert reading.series() is first and first == series_text({WEB: PER_ENDPOINT})

    async def read() -> tuple[dict[ServicePortKey, PortTraffic], float]:
        return {DNS: PortTraffic(Counted(4))}, 0.0

    asyncio.run(reading.refresh(read, timeout=1))
    assert reading.series() == series_text({DNS: PortTraffic(Counted(4))}) != first
