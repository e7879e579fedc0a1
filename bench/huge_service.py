"""One service, many endpoints: the cost of one endpoint going not ready and ready again.

    .venv/bin/python -m bench.huge_service                       # 10,000 endpoints, 100 slices
    .venv/bin/python -m bench.huge_service --huge                # and 50,000 in 500
    .venv/bin/python -m bench.huge_service --planes model ipvs   # no root needed

The service has its endpoints in slices of ENDPOINTS_PER_SLICE, written as the
EndpointSlice controller writes them (service-name and managed-by labels, an owner
reference to the Service, generateName, ready/serving/terminating, nodeName, zone, a
targetRef to the Pod). Each change is one slice update in which one endpoint flips
ready/serving (not ready, then ready again), taken through:

- model: JSON parse + decode of the slice, `ClusterModel.apply_slice` + `resolve`;
- iptables (iptables-restore on the host's back end) and nftables (the native mode):
  a partial `sync` into a network namespace the bench creates (and removes, even on
  failure), split into render (render + diff + text, `details[family].render_seconds`)
  and apply (the kernel-facing step), with the lines written;
- ipvs: render + diff only (pure: the virtual server's operations, from the model's
  endpoint delta as the plane does when it has one; the kernel step needs the QEMU
  guest of docs/kernel-tests.md and is not run here).

With --drain, each change instead takes one more endpoint out (not ready, and it stays
so), each time in another slice: the endpoint count only falls, so a large nftables path
moves the split between its main slot map and its tail every TAIL changes
(nftables/slot_tail.py), and the maximum shows what that costs.

p50/p99 (and the maximum) over --changes changes. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import signal
import statistics
import sys
import time
from collections.abc import Iterator
from ipaddress import IPv4Address
from typing import Any

import orjson

from bench.common import ENDPOINTS_PER_SLICE, node_namespace, print_results
from proxy.dataplane.base import DataplaneOptions
from proxy.kube.decode import decode_endpoint_slice, decode_service
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.model.types import Family, ServicePortKey

NODE = "node-0"
NAMESPACE = "bench"
SERVICE = "huge"
SERVICE_IP = "198.18.255.1"
SERVICE_UID = "5e1ec7ed-0000-4000-8000-000000000001"
NODES = 200
ZONES = 3
PLANES = ("model", "iptables", "nftables", "ipvs")
KEY = ServicePortKey(NAMESPACE, SERVICE, "http", Family.V4)


def pod_address(i: int) -> str:
    """Distinct for i < 98,304: 198.19.0.0/16, then 198.18.0.0/17 (bench ranges only)."""
    if i < 65536:
        return str(IPv4Address("198.19.0.0") + i)
    if i < 65536 + 32768:
        return str(IPv4Address("198.18.0.0") + (i - 65536))
    raise ValueError("at most 98,304 endpoints in one service")


def service_object() -> dict[str, Any]:
    return {
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": SERVICE, "namespace": NAMESPACE, "uid": SERVICE_UID,
                     "resourceVersion": "1"},
        "spec": {"type": "ClusterIP", "clusterIP": SERVICE_IP, "clusterIPs": [SERVICE_IP],
                 "ipFamilies": ["IPv4"], "selector": {"app": SERVICE},
                 "ports": [{"name": "http", "port": 80, "protocol": "TCP",
                            "targetPort": 8080}]},
    }


def endpoint_object(i: int, ready: bool = True) -> dict[str, Any]:
    pod = f"{SERVICE}-{i:06d}"
    return {
        "addresses": [pod_address(i)],
        "conditions": {"ready": ready, "serving": ready, "terminating": False},
        "nodeName": f"node-{i % NODES}",
        "zone": f"zone-{i % ZONES}",
        "targetRef": {"kind": "Pod", "namespace": NAMESPACE, "name": pod,
                      "uid": f"00000000-0000-4000-8000-{i:012d}"},
    }


def slice_object(index: int, endpoints: int, rv: int = 1,
                 not_ready: frozenset[int] = frozenset()) -> dict[str, Any]:
    """Slice `index` of the service, as the EndpointSlice controller owns it."""
    first = index * ENDPOINTS_PER_SLICE
    last = min(first + ENDPOINTS_PER_SLICE, endpoints)
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": f"{SERVICE}-{index:05x}", "generateName": f"{SERVICE}-",
            "namespace": NAMESPACE, "resourceVersion": str(rv),
            "labels": {"kubernetes.io/service-name": SERVICE,
                       "endpointslice.kubernetes.io/managed-by":
                           "endpointslice-controller.k8s.io"},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": SERVICE,
                                 "uid": SERVICE_UID, "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": [endpoint_object(i, i not in not_ready) for i in range(first, last)],
    }


def slice_count(endpoints: int) -> int:
    return -(-endpoints // ENDPOINTS_PER_SLICE)


def build(endpoints: int) -> ClusterModel:
    model = ClusterModel(NODE)
    svc, _ = decode_service(service_object())
    assert svc is not None
    model.apply_service(svc)
    for i in range(slice_count(endpoints)):
        sl, _ = decode_endpoint_slice(slice_object(i, endpoints))
        assert sl is not None
        model.apply_slice(sl)
    model.resolve()
    return model


def changes(endpoints: int, count: int, drain: bool = False) -> Iterator[tuple[int, bytes]]:
    """(change number, slice JSON): endpoint e goes not ready, then ready again, for
    `count` updates, each time in another slice; `drain`: one more endpoint goes not
    ready each time (module docstring)."""
    slices = slice_count(endpoints)
    if drain:
        yield from _drained(endpoints, count, slices)
        return
    for n in range(count):
        pair = n // 2
        index = (pair * 37) % slices
        first = index * ENDPOINTS_PER_SLICE
        size = min(ENDPOINTS_PER_SLICE, endpoints - first)
        ep = first + (pair * 13) % size
        down = n % 2 == 0
        obj = slice_object(index, endpoints, rv=2 + n,
                           not_ready=frozenset({ep}) if down else frozenset())
        yield n, orjson.dumps(obj)


def _drained(endpoints: int, count: int, slices: int) -> Iterator[tuple[int, bytes]]:
    down: dict[int, set[int]] = {}
    for n in range(min(count, endpoints - 1)):
        index = (n * 37) % slices
        first = index * ENDPOINTS_PER_SLICE
        size = min(ENDPOINTS_PER_SLICE, endpoints - first)
        taken = down.setdefault(index, set())
        if len(taken) == size:
            continue  # (only with fewer slices than changes: that slice is drained)
        ep = next(first + (n * 13 + k) % size for k in range(size)
                  if first + (n * 13 + k) % size not in taken)
        taken.add(ep)
        yield n, orjson.dumps(slice_object(index, endpoints, rv=2 + n,
                                           not_ready=frozenset(taken)))


def model_step(model: ClusterModel, raw: bytes) -> tuple[float, float, DesiredState]:
    """(decode seconds, apply + resolve seconds, new state) for one slice update."""
    start = time.perf_counter()
    sl, _ = decode_endpoint_slice(orjson.loads(raw))
    assert sl is not None
    mid = time.perf_counter()
    model.apply_slice(sl)
    state = model.resolve()
    end = time.perf_counter()
    assert state.changed == {KEY}, state.changed
    return mid - start, end - mid, state


def pct(values: list[float], q: float) -> float:
    """The q-quantile (nearest rank) of `values`."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered) + 0.5) - 1))]


def summary(values: list[float], scale: float = 1000.0, digits: int = 3) -> dict[str, float]:
    return {"p50": round(pct(values, 0.5) * scale, digits),
            "p99": round(pct(values, 0.99) * scale, digits),
            "max": round(max(values) * scale, digits)}


def _plane(name: str, options: DataplaneOptions) -> Any:
    if name == "nftables":
        from proxy.dataplane.nftables.apply import NftablesDataPlane

        return NftablesDataPlane(options, clear_conntrack=False)
    from proxy.dataplane.iptables.apply import IptablesDataPlane

    return IptablesDataPlane(options, clear_conntrack=False)


def _kernel_step(name: str, model: ClusterModel, endpoints: int, count: int,
                 out: dict[str, Any], rows: dict[str, list[float]], drain: bool) -> None:
    from proxy.netns_lab.netns import entered

    options = DataplaneOptions(NODE, families=(Family.V4,))
    with node_namespace() as ns, entered(ns):
        dp = _plane(name, options)
        start = time.perf_counter()
        report = dp.sync(model.state, full=True)
        out["full_sync_s"] = round(time.perf_counter() - start, 3)
        out["full_sync_lines"] = report.operations
        if name == "iptables":
            out["backend"] = report.details.get("backend")
        for _n, raw in changes(endpoints, count, drain):
            gc.collect()
            decode, apply, state = model_step(model, raw)
            report = dp.sync(state)
            assert not report.full and report.written == (KEY,), report
            fam = report.details["IPv4"]
            rows["decode"].append(decode)
            rows["model"].append(apply)
            rows["render"].append(fam["render_seconds"])
            rows["apply"].append(fam["apply_seconds"])
            rows["lines"].append(fam["lines"])
        dp.cleanup()


def _ipvs_step(model: ClusterModel, endpoints: int, count: int,
               rows: dict[str, list[float]]) -> None:
    from proxy.dataplane.ipvs.diff import (
        believed_after,
        believed_after_change,
        diff_real_servers,
        diff_service,
    )
    from proxy.dataplane.ipvs.render import IpvsContext, render_change, render_port

    ctx = IpvsContext.build(DataplaneOptions(NODE, families=(Family.V4,)), ())
    applied = model.state.ports[KEY]
    rules = render_port(applied, ctx)
    believed = {vs.key: believed_after(vs, None) for vs in rules.virtual_servers}
    for _n, raw in changes(endpoints, count):
        gc.collect()
        decode, apply, state = model_step(model, raw)
        start = time.perf_counter()
        # As the plane does: from the model's endpoint delta when it has one.
        rsp = state.ports[KEY]
        delta = rsp.endpoint_delta(applied)
        change = render_change(applied, rsp, delta, ctx, rules) if delta else None
        rules = change.rules if change else render_port(rsp, ctx)
        ops = []
        for vs in rules.virtual_servers:
            current = believed.get(vs.key)
            moved = change.real_servers.get(vs.key) if change else None
            if change and moved is None:
                continue  # its real servers did not change
            vs_ops = diff_real_servers(vs, current, moved) if moved and current else None
            if vs_ops is None:
                vs_ops = diff_service(vs, current)
                believed[vs.key] = believed_after(vs, current)
            else:
                assert moved is not None and current is not None
                believed[vs.key] = believed_after_change(vs, current, moved)
            ops += vs_ops
        applied = rsp
        rows["decode"].append(decode)
        rows["model"].append(apply)
        rows["render"].append(time.perf_counter() - start)
        rows["lines"].append(len(ops))


def run_plane(name: str, endpoints: int, count: int, drain: bool = False) -> dict[str, Any]:
    """One plane at one size: p50/p99/max per phase (ms), and what one change rewrites;
    `drain`: changes that only take endpoints out (module docstring)."""
    if name not in PLANES:
        raise ValueError(f"unknown plane {name!r}")
    model = build(endpoints)
    out: dict[str, Any] = {"plane": name, "endpoints": endpoints,
                           "slices": slice_count(endpoints), "changes": count,
                           "drain": drain}
    rows: dict[str, list[float]] = {"decode": [], "model": [], "render": [], "apply": [],
                                    "lines": []}
    if name in ("iptables", "nftables"):
        _kernel_step(name, model, endpoints, count, out, rows, drain)
    elif name == "ipvs":
        _ipvs_step(model, endpoints, count, rows)
        out["apply_note"] = "kernel step not run (QEMU guest only)"
    else:
        for _n, raw in changes(endpoints, count, drain):
            gc.collect()
            decode, apply, _ = model_step(model, raw)
            rows["decode"].append(decode)
            rows["model"].append(apply)
    for phase in ("decode", "model", "render", "apply"):
        if rows[phase]:
            out[f"{phase}_ms"] = summary(rows[phase])
    if rows["render"]:
        total = [sum(parts) for parts in zip(rows["decode"], rows["model"], rows["render"],
                                             rows["apply"] or [0.0] * len(rows["render"]),
                                             strict=True)]
        out["total_ms"] = summary(total)
        # Every change's total, for the distribution plot of `python -m bench`.
        out["total_ms"]["samples"] = [round(t * 1000.0, 3) for t in total]
    if rows["lines"]:
        out["lines"] = {"p50": int(statistics.median(rows["lines"])),
                        "max": int(max(rows["lines"]))}
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    rows = ["| plane | endpoints (slices) | decode | model apply+resolve | render+diff | "
            "apply (kernel) | total | lines/ops per change |",
            "|---|---|---|---|---|---|---|---|"]

    def cell(r: dict[str, Any], phase: str) -> str:
        v = r.get(f"{phase}_ms")
        if not v:
            return "-"
        return f"{v['p50']} / {v['p99']}" + (f" / {v['max']}" if phase == "total" else "")

    for r in results:
        lines = r.get("lines")
        written = f"{lines['p50']:,}" if lines else "-"
        drained = ", drain" if r.get("drain") else ""
        rows.append(f"| {r['plane']} | {r['endpoints']:,} ({r['slices']}{drained}) "
                    f"| {cell(r, 'decode')} "
                    f"| {cell(r, 'model')} | {cell(r, 'render')} | {cell(r, 'apply')} "
                    f"| {cell(r, 'total')} "
                    f"| {written} |")
    rows.append("")
    rows.append("milliseconds, p50 / p99 (total: and the maximum); lines: iptables-restore "
                "lines, nft script lines, IPVS operations")
    return "\n".join(rows)


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--endpoints", type=int, nargs="+", default=[10_000])
    p.add_argument("--huge", action="store_true", help="also 50,000 endpoints in 500 slices")
    p.add_argument("--planes", nargs="+", default=list(PLANES), choices=PLANES)
    p.add_argument("--changes", type=int, default=50)
    p.add_argument("--drain", action="store_true",
                   help="each change takes one more endpoint out (module docstring)")
    p.add_argument("--json", action="store_true", help="print JSON only")
    args = p.parse_args(argv)
    # SIGTERM (a `timeout`, a killed job) unwinds like an exception, so the namespaces
    # this bench made are removed on the way out.
    signal.signal(signal.SIGTERM, _terminated)
    sizes = list(args.endpoints) + ([50_000] if args.huge else [])
    print_results((run_plane(plane, size, args.changes, args.drain)
                   for size in sizes for plane in args.planes), markdown, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
