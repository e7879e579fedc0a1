"""One run: N agents, one first-list mode; then every run of a size."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import ROOT, quiet
from bench.reflector_fleet.sampling import Sampler, snapshot
from bench.reflector_fleet.servers import Target
from bench.reflector_fleet.worker import Worker, WorkerSpec
from bench.reflector_fleet.workload import NAMESPACE, Obj, Settings, slice_endpoints

# --- one run: N agents, one first-list mode -----------------------------------------------


def _totals(workers: Sequence[Worker], timeout: float) -> list[Obj]:
    for w in workers:
        w.send("report")
    return [a for w in workers for a in w.answer(timeout)["agents"]]


def _churn(target: Target, settings: Settings, n: int, workers: Sequence[Worker],
           progress: Callable[[str], None]) -> dict[str, Any]:
    gv = target.slice_group_version
    beta = gv.endswith("beta1")
    before = _totals(workers, 60)
    base = [a["events"].get("EndpointSlice", 0) for a in before]
    started = time.monotonic()
    write_s = []
    for k in range(settings.changes):
        time.sleep(max(0.0, started + k / settings.rate - time.monotonic()))  # the rate
        # Pairs of writes: one endpoint of a service becomes not ready, then ready again
        # (every write a change: an unchanged object makes no event).
        i = (k // 2) % settings.services
        not_ready = (k // (2 * settings.services)) % settings.endpoints if k % 2 == 0 else None
        sent = time.monotonic()
        status, body = target.write(
            "PATCH", f"/apis/{gv}/namespaces/{NAMESPACE}/endpointslices/s-{i}-0",
            {"endpoints": slice_endpoints(settings, i, not_ready, beta)},
            "application/merge-patch+json")
        write_s.append(time.monotonic() - sent)
        if status != 200:
            raise RuntimeError(f"PATCH slice s-{i}-0: HTTP {status}: {str(body)[:300]}")
    written = time.monotonic()
    deadline = written + settings.deadline
    while True:  # until every agent has every change (polled, with a deadline)
        after = _totals(workers, 60)
        behind = sum(1 for a, b in zip(after, base, strict=True)
                     if a["events"].get("EndpointSlice", 0) < b + settings.changes)
        if not behind:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"churn: {behind} of {n} agents missed changes (the first "
                               f"agent before: {before[0]}, after: {after[0]})")
        time.sleep(0.2)
    done = time.monotonic()
    if settings.changes % 2:  # the last pair is open: leave every endpoint ready
        i = (settings.changes // 2) % settings.services
        target.write("PATCH", f"/apis/{gv}/namespaces/{NAMESPACE}/endpointslices/s-{i}-0",
                     {"endpoints": slice_endpoints(settings, i, None, beta)},
                     "application/merge-patch+json")
    received = [a["bytes"] - b["bytes"] for a, b in zip(after, before, strict=True)]
    return {"seconds_writing": round(written - started, 2),
            "seconds_to_all_received": round(done - started, 2),
            "last_write_to_all_received_s": round(done - written, 2),
            "patch_median_ms": round(statistics.median(write_s) * 1000, 1),
            "bytes_per_agent_per_change": round(statistics.mean(received) / settings.changes),
            "bytes_per_agent_per_change_max": round(max(received) / settings.changes)}


def run_one(target: Target, settings: Settings, n: int, first_list: str,
            progress: Callable[[str], None] = quiet) -> dict[str, Any]:
    target.restart()  # a fresh server process: a fresh baseline, a fresh watch cache
    pids = target.pids()
    per = -(-n // settings.workers)
    specs = [WorkerSpec(target.kubeconfig, first, min(per, n - first),
                        first_list == "consistent") for first in range(0, n, per)]
    workers: list[Worker] = []
    try:
        for spec in specs:
            workers.append(Worker(target.worker_argv, spec))
        for w in workers:
            w.pid = int(w.answer(settings.deadline)["pid"])
        idle = snapshot(pids)
        wpids = {f"worker{k}": w.pid for k, w in enumerate(workers)}
        w0 = snapshot(wpids)
        with Sampler({**pids, **wpids}) as sampler:
            started = time.monotonic()
            for w in workers:
                w.send("start")
            synced = [t for w in workers for t in w.answer(settings.deadline)["synced_at"]]
            synced_s = [t - started for t in synced]
            s1 = snapshot(pids)
            w1 = snapshot(wpids)
            peak_start = dict(sampler.peak)
            reports = _totals(workers, 60)
            progress(f"{target.name} {first_list} N={n}: all synced in "
                     f"{max(synced_s):.1f}s, API server CPU "
                     f"{s1['apiserver']['cpu_s'] - idle['apiserver']['cpu_s']:.1f}s")
            for name in sampler.peak:
                sampler.peak[name] = 0.0
            churn = _churn(target, settings, n, workers, progress)
            s2 = snapshot(pids)
            w2 = snapshot(wpids)
            peak_churn = dict(sampler.peak)
    finally:
        for w in workers:
            w.stop()

    def phase(a: Mapping[str, Mapping[str, float]], b: Mapping[str, Mapping[str, float]],
              peak: Mapping[str, float]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in pids:
            out[name] = {"cpu_s": round(b[name]["cpu_s"] - a[name]["cpu_s"], 2),
                         "rss_before_mib": round(a[name]["rss_mib"]),
                         "peak_rss_mib": round(peak[name]),
                         "hwm_mib": round(b[name]["hwm_mib"])}
        return out

    first_bytes = [r["bytes"] for r in reports]
    result = {
        "agents": n, "first_list": first_list, "workers": len(workers),
        "start": {
            **phase(idle, s1, peak_start),
            "all_synced_s": round(max(synced_s), 2),
            "median_synced_s": round(statistics.median(synced_s), 2),
            "workers_cpu_s": round(sum(w1[k]["cpu_s"] - w0[k]["cpu_s"] for k in wpids), 1),
            "workers_peak_rss_mib": round(sum(peak_start[k] for k in wpids)),
            "bytes_per_agent": round(statistics.mean(first_bytes)),
            "objects_per_agent": _objects(reports),
            # failed lists or watches, retried (e.g. an answer not read within
            # request_timeout while the server was busy): a list read twice
            "reflector_errors": sum(r["errors"] for r in reports),
        },
        "churn": {**phase(s1, s2, peak_churn), **churn,
                  "workers_cpu_s": round(sum(w2[k]["cpu_s"] - w1[k]["cpu_s"]
                                             for k in wpids), 1)},
    }
    return result


def _objects(reports: Sequence[Obj]) -> dict[str, int]:
    """What the first agent holds per resource (all agents hold the same)."""
    first: dict[str, int] = reports[0]["objects"]
    return first


def run(target: Target, settings: Settings,
        progress: Callable[[str], None] = quiet) -> dict[str, Any]:
    settings.check()
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "settings": asdict(settings), "machine": machine(), **target.describe,
        "runs": []}
    for first_list in settings.first_lists:
        for n in settings.agents:
            result["runs"].append(run_one(target, settings, n, first_list, progress))
    return result


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        for line in subprocess.run(["lscpu"], check=False, capture_output=True, text=True,
                                   timeout=10).stdout.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    git = subprocess.run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"],
                         check=False, capture_output=True, text=True,
                         timeout=10).stdout.strip()
    return {"cpu": model, "nproc": os.cpu_count(), "kernel": platform.release(),
            "python": platform.python_version(), "sliceproxy": git,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}
