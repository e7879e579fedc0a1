"""What counting each service port's (and endpoint's) traffic costs in the nftables mode
(dataplane/common/traffic.py): per new connection, and per scrape.

Per connection: N services x E endpoints programmed in a lab node, TCP connects from the
lab's client to a service whose one endpoint is the lab's backend, with the node's rules
counting nothing (the policy chain's counter rule left out), per port (the default) and
per endpoint too (--traffic-per-endpoint). Only a connection's first packet passes the
nat chains where the counters are: an established flow's packets pay nothing.
Configurations alternate round by round; medians are reported.

Per scrape: with the same rules, the data plane's `traffic()` (the named counters read
from the kernel, mapped to ports and endpoints) and the Prometheus text of its series,
per port and per endpoint.

    python -m bench.nftables.traffic_cost --services 10000 --endpoints 10
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

from bench.common import NODE
from bench.nftables.conn_cost import connect_times, desired
from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.nftables import render
from proxy.dataplane.nftables.apply import NftablesDataPlane
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family
from proxy.netns_lab import BackendSpec, Lab
from proxy.netns_lab.netns import entered
from proxy.netns_lab.topology import TCP_PORT
from proxy.server.traffic import TrafficReading, series_text

CONFIGS = ("not counted", "per port", "per endpoint")


def _uncounted() -> Any:
    """The renderer without the port's counter rule (its object stays, unreferenced)."""
    first: Callable[..., tuple[str, ...]] = render.policy_first
    return mock.patch.object(render, "policy_first",
                             lambda rsp, ctx, internal: first(rsp, ctx, internal)[1:])


@contextmanager
def programmed(ns: str, state: DesiredState, config: str) -> Iterator[NftablesDataPlane]:
    options = DataplaneOptions(NODE, families=(Family.V4,),
                               traffic_per_endpoint=config == "per endpoint")
    patch = _uncounted() if config == "not counted" else contextlib.nullcontext()
    with entered(ns), patch:
        dp = NftablesDataPlane(options, clear_conntrack=False)
        dp.sync(state, full=True)
    try:
        yield dp
    finally:
        with entered(ns):
            dp.cleanup()
            dp.close()


def scrape(ns: str, dp: NftablesDataPlane, times: int) -> dict[str, Any]:
    """Median milliseconds of `traffic()` and of the series' text, and the series."""
    read, text = [], []
    reading = TrafficReading()
    size = 0
    for _ in range(times):
        began = time.perf_counter()
        with entered(ns):
            reading.update(dp.traffic())
        read.append((time.perf_counter() - began) * 1e3)
        began = time.perf_counter()
        size = sum(map(len, series_text(reading.ports)))
        text.append((time.perf_counter() - began) * 1e3)
    series = sum(1 + len(p.endpoints or ()) for p in reading.ports.values())
    return {"read_ms": round(statistics.median(read), 1),
            "text_ms": round(statistics.median(text), 1), "series": series, "bytes": size}


def run(services: int, endpoints: int, connections: int, rounds: int) -> dict[str, Any]:
    connects: dict[str, list[float]] = {}
    scrapes: dict[str, dict[str, Any]] = {}
    with Lab([BackendSpec("web-1")], ipv6=False) as lab:
        lab.start_backends()
        backend = str(lab.backends["web-1"].ipv4)
        state, vip = desired(services, backend, endpoints)
        connect_times(lab.client_ns, backend, TCP_PORT, min(connections, 200))  # warm up
        for _ in range(rounds):
            for config in CONFIGS:
                with programmed(lab.node_ns, state, config) as dp:
                    connects.setdefault(config, []).extend(
                        connect_times(lab.client_ns, vip, 80, connections))
                    if config != "not counted" and config not in scrapes:
                        scrapes[config] = scrape(lab.node_ns, dp, 5)
    return {"services": services, "endpoints": endpoints, "connections": connections,
            "rounds": rounds,
            "connect": {c: {"median_us": round(statistics.median(v), 1),
                            "p90_us": round(statistics.quantiles(v, n=10)[-1], 1),
                            "n": len(v)} for c, v in connects.items()},
            "scrape": scrapes}


def markdown(result: dict[str, Any]) -> str:
    base = result["connect"]["not counted"]["median_us"]
    rows = ["| counting | connect (median / p90) | vs not counted | traffic() | series text "
            "| series |", "|---|---|---|---|---|---|"]
    for config, c in result["connect"].items():
        s = result["scrape"].get(config)
        read = f"{s['read_ms']:.1f} ms" if s else "-"
        text = f"{s['text_ms']:.1f} ms" if s else "-"
        rows.append(f"| {config} | {c['median_us']:.0f} / {c['p90_us']:.0f} µs "
                    f"| {c['median_us'] / base:.3f} | {read} | {text} "
                    f"| {s['series'] if s else '-'} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--connections", type=int, default=2000,
                        help="connects per configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    result = run(args.services, args.endpoints, args.connections, args.rounds)
    print(json.dumps(result))
    if not args.json:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
