"""What a new connection pays for the nftables mode's shard tables.

The nftables mode spreads service ports over K shard tables so that a change costs the
same at 1,000 and 50,000 services (proxy/dataplane/nftables/render.py). The price is
paid per new connection: each shard's nat chains run in turn at the hook (one verdict
map lookup each, and a fib lookup for the node ports) until one of them translates the
connection, and a connection that is for no service passes all of them.

This bench programs N services in a lab node and times TCP connects from the lab's
client, through the node, three ways:
  service     to the cluster IP of a service whose endpoint is the lab's backend
              (DNAT in the node);
  no service  straight to the backend's own address (forwarded; every nat chain misses);
with the node's rules as: none at all (the kernel's own cost), sliceproxy's nftables
mode with its K shards, and the same with every service port in one table (K = 1).
Configurations alternate round by round, and medians are reported: the machine's
noise moves every configuration alike.

    python -m bench.nftables.conn_cost --services 10000 --connections 2000 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any
from unittest import mock

from bench.common import NODE, cluster_model
from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.nftables import apply as nft_apply
from proxy.dataplane.nftables.apply import NftablesDataPlane
from proxy.dataplane.nftables.render import shards_for
from proxy.kube.decode import decode_endpoint_slice
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family
from proxy.netns_lab import BackendSpec, Lab
from proxy.netns_lab.netns import entered
from proxy.netns_lab.topology import TCP_PORT


def connect_times(ns: str, ip: str, port: int, count: int) -> list[float]:
    """Microseconds per TCP connect (handshake done), `count` fresh connections."""
    out = []
    with entered(ns):
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.settimeout(2.0)
            start = time.perf_counter()
            sock.connect((ip, port))
            out.append((time.perf_counter() - start) * 1e6)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
            sock.close()  # a reset, not a TIME_WAIT per connection
    return out


def desired(services: int, backend: str, endpoints: int = 1) -> tuple[DesiredState, str]:
    """N services of `endpoints` each; the first one's only endpoint is the lab's
    backend. (state, its VIP)."""
    model, slices = cluster_model(services, endpoints)
    probe = dict(slices[0])
    probe["endpoints"] = [{"addresses": [backend], "nodeName": NODE,
                           "conditions": {"ready": True, "serving": True,
                                          "terminating": False}}]
    probe["ports"] = [{"name": "http", "port": TCP_PORT, "protocol": "TCP"}]
    decoded, _ = decode_endpoint_slice(probe)
    assert decoded is not None
    model.apply_slice(decoded)
    state = model.resolve()
    vip = next(str(ip) for p in state.ports.values() for ip in p.cluster_ips
               if p.key.name == "svc-0")
    return state, vip


@contextmanager
def programmed(ns: str, state: DesiredState, shards: int | None) -> Iterator[int]:
    """The node's rules for `state` (None: no rules at all); yields the shard count."""
    if shards == 0:
        yield 0
        return
    options = DataplaneOptions(NODE, families=(Family.V4,))
    with entered(ns), mock.patch.object(
            nft_apply, "shards_for",
            (lambda n: 1) if shards == 1 else shards_for):
        dp = NftablesDataPlane(options, clear_conntrack=False)
        dp.sync(state, full=True)
        count = dp._families[Family.V4].shards
    try:
        yield count
    finally:
        with entered(ns):
            dp.cleanup()
            dp.close()


def run(services: int, connections: int, rounds: int) -> dict[str, Any]:
    results: dict[str, dict[str, list[float]]] = {}
    shard_counts: dict[str, int] = {}
    with Lab([BackendSpec("web-1")], ipv6=False) as lab:
        lab.start_backends()
        backend = str(lab.backends["web-1"].ipv4)
        state, vip = desired(services, backend)
        connect_times(lab.client_ns, backend, TCP_PORT, min(connections, 200))  # warm up
        configs = {"no rules": 0, "sharded": None, "one table": 1}
        for _ in range(rounds):
            for name, shards in configs.items():
                with programmed(lab.node_ns, state, shards) as count:
                    shard_counts[name] = count
                    got = results.setdefault(name, {})
                    paths = {"no service": (backend, TCP_PORT)}
                    if shards != 0:
                        paths["service"] = (vip, 80)  # the port make_objects gives
                    for path, (ip, port) in paths.items():
                        got.setdefault(path, []).extend(
                            connect_times(lab.client_ns, ip, port, connections))
    out: dict[str, Any] = {"services": services, "connections": connections,
                           "rounds": rounds, "configs": {}}
    for name, samples in results.items():
        out["configs"][name] = {"shards": shard_counts[name], **{
            path: {"median_us": round(statistics.median(v), 1),
                   "p90_us": round(statistics.quantiles(v, n=10)[-1], 1), "n": len(v)}
            for path, v in samples.items()}}
    return out


def markdown(result: dict[str, Any]) -> str:
    rows = ["| rules in the node | shard tables | connect, service (median / p90) "
            "| connect, no service (median / p90) |", "|---|---|---|---|"]
    for name, c in result["configs"].items():
        def cell(path: str, c: dict[str, Any] = c) -> str:
            p = c.get(path)
            return f"{p['median_us']:.0f} / {p['p90_us']:.0f} µs" if p else "-"
        rows.append(f"| {name} | {c['shards']} | {cell('service')} | {cell('no service')} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--connections", type=int, default=2000,
                        help="connects per path, configuration and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    result = run(args.services, args.connections, args.rounds)
    print(json.dumps(result))
    if not args.json:
        print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
