"""Model benchmark: decode, resolve N services from scratch, then one endpoint change.

    .venv/bin/python -m bench.model_bench --services 10000 --endpoints 10

Reports medians (and the spread) as a Markdown table and JSON. It never passes or fails
on time: CI runs it small so it keeps working; the numbers go in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import orjson

from bench.common import NODE, make_objects
from proxy.kube.decode import decode_endpoint_slice, decode_service
from proxy.model.tracker import ClusterModel
from proxy.model.types import EndpointSlice, Service


def timed(fn: Callable[[], Any], repeat: int) -> tuple[list[float], Any]:
    times, result = [], None
    for _ in range(repeat):
        gc.collect()
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return times, result


def build(services: list[Service], slices: list[EndpointSlice]) -> ClusterModel:
    model = ClusterModel(NODE)
    for svc in services:
        model.apply_service(svc)
    for sl in slices:
        model.apply_slice(sl)
    model.resolve()
    return model


def run(services: int, endpoints: int, repeat: int) -> dict[str, Any]:
    svc_objs, slice_objs = make_objects(services, endpoints)
    slice_json = [orjson.dumps(s) for s in slice_objs]

    parse_times, _ = timed(lambda: [orjson.loads(b) for b in slice_json], repeat)
    decode_times, decoded = timed(
        lambda: ([decode_service(s)[0] for s in svc_objs],
                 [decode_endpoint_slice(s)[0] for s in slice_objs]),
        repeat,
    )
    model_services = [s for s in decoded[0] if s is not None]
    model_slices = [s for s in decoded[1] if s is not None]

    full_times, model = timed(lambda: build(model_services, model_slices), repeat)
    full_state = model.state

    # One endpoint flips between ready and not ready: decode + apply + resolve.
    target = slice_objs[len(slice_objs) // 2]
    flipped = json.loads(json.dumps(target))
    flipped["endpoints"][0]["conditions"]["ready"] = False
    variants = [flipped, target]
    change_times: list[float] = []
    changed_keys = 0
    for i in range(max(repeat * 50, 200)):
        obj = variants[i % 2]
        start = time.perf_counter()
        sl, _ = decode_endpoint_slice(obj)
        assert sl is not None
        model.apply_slice(sl)
        state = model.resolve()
        change_times.append(time.perf_counter() - start)
        changed_keys = len(state.changed)

    # Memory the model holds (inputs decoded into model types, plus the snapshot).
    del model, full_state
    gc.collect()
    tracemalloc.start()
    decoded_services = [decode_service(s)[0] for s in make_objects(services, endpoints)[0]]
    decoded_slices = [decode_endpoint_slice(s)[0] for s in slice_objs]
    gc.collect()
    kept = build([s for s in decoded_services if s is not None],
                 [s for s in decoded_slices if s is not None])
    gc.collect()
    current, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert len(kept.state) == services

    def ms(values: list[float]) -> dict[str, float]:
        return {"median_ms": round(statistics.median(values) * 1000, 3),
                "min_ms": round(min(values) * 1000, 3), "max_ms": round(max(values) * 1000, 3)}

    per_1000 = 1000 / services
    return {
        "services": services,
        "endpoints_per_service": endpoints,
        "total_endpoints": services * endpoints,
        "json_parse_slices": ms(parse_times),
        "json_parse_per_1000_slices_ms": round(statistics.median(parse_times) * 1000 * per_1000, 3),
        "decode_all": ms(decode_times),
        "decode_per_1000_slices_ms": round(statistics.median(decode_times) * 1000 * per_1000, 3),
        "full_resolve": ms(full_times),
        "one_endpoint_change": ms(change_times),
        "one_endpoint_change_keys_changed": changed_keys,
        "model_memory_mib": round(current / 2**20, 1),
        "model_peak_memory_mib": round(peak / 2**20, 1),
        "python": sys.version.split()[0],
    }


def markdown(r: dict[str, Any]) -> str:
    return "\n".join([
        f"| measure ({r['services']} services x {r['endpoints_per_service']} endpoints) | median |",
        "|---|---|",
        f"| JSON parse of all slices (orjson) | {r['json_parse_slices']['median_ms']} ms |",
        f"| decode services + slices into model types | {r['decode_all']['median_ms']} ms "
        f"({r['decode_per_1000_slices_ms']} ms per 1,000 slices) |",
        f"| apply + resolve everything from scratch | {r['full_resolve']['median_ms']} ms |",
        f"| one endpoint change: decode + apply + resolve | "
        f"{r['one_endpoint_change']['median_ms']} ms |",
        f"| memory held by the model (tracemalloc) | {r['model_memory_mib']} MiB "
        f"(peak {r['model_peak_memory_mib']} MiB) |",
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, default=10_000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--json", action="store_true", help="print JSON only")
    args = p.parse_args(argv)
    result = run(args.services, args.endpoints, args.repeat)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(markdown(result))
        print()
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
