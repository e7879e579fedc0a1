"""A first start's Python, step by step, in microseconds of CPU per endpoint: where the
time of a cold start goes once the agent itself is the bottleneck (a quiet API server,
the simulator), without a kernel or a server.

    .venv/bin/python -m bench.start_budget --services 10000 --runs 3

Each run, in one process: the Services and EndpointSlices (IPv6, as bench.agent_start's)
as the API server's JSON; parse them (orjson), decode them, apply them to a model,
resolve every port, then the nftables mode's first sync onto no tables (render, the
kept state and the netlink framing; the batches built and dropped, as
bench.nftables.encode_bench does). The collector is held off as the agent holds it for
its start (agent/startup_gc.py). "render alone" renders every port once more on its
own: it is part of the first sync, not added to it. Medians of the runs; one run is one
sample of a machine whose speed drifts. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import orjson

from bench.common import NODE, make_objects
from bench.nftables.encode_bench import encode_only_plane
from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.nftables.render import render_port
from proxy.kube.decode import decode_endpoint_slice, decode_service
from proxy.model.tracker import ClusterModel
from proxy.model.types import Family

STEPS = ("parse", "decode services", "decode slices", "model apply", "resolve",
         "first sync", "render alone")
T = TypeVar("T")


def one_run(services: int, endpoints: int) -> dict[str, float]:
    """CPU seconds of each step (STEPS) of one start."""
    svc_objs, slice_objs = make_objects(services, endpoints, ipv6=True)
    bodies = [orjson.dumps(o) for o in (*svc_objs, *slice_objs)]
    del svc_objs, slice_objs
    gc.collect()
    gc.disable()
    took: dict[str, float] = {}

    def step(name: str, fn: Callable[[], T]) -> T:
        began = time.process_time()
        out = fn()
        took[name] = time.process_time() - began
        return out

    try:
        objs = step("parse", lambda: [orjson.loads(b) for b in bodies])
        svcs = step("decode services", lambda: [
            s for o in objs[:services] if (s := decode_service(o)[0]) is not None])
        slices = step("decode slices", lambda: [
            s for o in objs[services:] if (s := decode_endpoint_slice(o)[0]) is not None])
        model = ClusterModel(NODE)

        def apply() -> None:
            for svc in svcs:
                model.apply_service(svc)
            for sl in slices:
                model.apply_slice(sl)

        step("model apply", apply)
        state = step("resolve", model.resolve)
        dp, _ = encode_only_plane(Family.V6)
        step("first sync", lambda: dp.sync(state, full=True))
        ctx, ports = RenderContext(Family.V6), list(state.ports.values())
        step("render alone", lambda: [render_port(p, ctx, 64) for p in ports])
    finally:
        gc.enable()
    return took


def run(services: int, endpoints: int, runs: int) -> dict[str, Any]:
    samples = [one_run(services, endpoints) for _ in range(runs)]
    per_endpoint = 1e6 / (services * endpoints)
    us = {name: round(statistics.median(s[name] for s in samples) * per_endpoint, 2)
          for name in STEPS}
    start = sum(v for name, v in us.items() if name != "render alone")
    return {"services": services, "endpoints": endpoints, "runs": runs,
            "us_per_endpoint": us, "start_us_per_endpoint": round(start, 2),
            "python": sys.version.split()[0]}


def markdown(r: dict[str, Any]) -> str:
    rows = [f"| step ({r['services']:,} services x {r['endpoints']}, IPv6) "
            "| us of CPU an endpoint |", "|---|---|"]
    rows += [f"| {name} | {v} |" for name, v in r["us_per_endpoint"].items()]
    rows.append(f"| the start (every step but render alone) | {r['start_us_per_endpoint']} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, default=10_000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print JSON only")
    args = p.parse_args(argv)
    result = run(args.services, args.endpoints, args.runs)
    if not args.json:
        print(markdown(result))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
