"""One run: the agent started, the roll driven, its lag and failed connections measured."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import PACINGS, ROOT, agent_pid, simulator, size_mib
from bench.rolling_update.api import Api
from bench.rolling_update.kernel import KernelView, KernelWatch, SlotMapWatch
from bench.rolling_update.lab import (
    add_pods,
    agent_cpu,
    logged_syncs,
    manifest,
    ms_summary,
    pods_namespace,
    remove_pods,
)
from bench.rolling_update.traffic import Outcome, Traffic
from bench.rolling_update.workload import (
    FIRST_SYNC,
    MAX_ENDPOINTS,
    NODE,
    POD_CIDR,
    READY,
    SLICES_PATH,
    TICK,
    Roll,
    Settings,
    Write,
    pod_address,
)
from proxy.netns_lab import Lab
from proxy.netns_lab.poll import TimedOut, wait

# --- one run ---------------------------------------------------------------------------------


@dataclass
class Record:
    writes: list[tuple[Write, float, float]] = field(default_factory=list)  # sent, answered
    created: dict[int, float] = field(default_factory=dict)  # pod -> its address added
    terminating: dict[int, float] = field(default_factory=dict)  # old pod -> write sent
    deleted: dict[int, float] = field(default_factory=dict)
    removed: dict[int, float] = field(default_factory=dict)  # address removed
    slips: list[float] = field(default_factory=list)  # tick started late by


def roll_through(api: Api, pods_ns: str, roll: Roll, rec: Record,
                 alive: Callable[[], None]) -> None:
    """Every tick of the roll, paced at TICK (a late tick runs at once, its slip kept)."""
    t0 = time.monotonic()
    for tick in range(roll.ticks):
        due = t0 + tick * TICK
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)  # pacing the roll, not synchronisation
        rec.slips.append(max(0.0, time.monotonic() - due))
        alive()
        new = roll.created(tick)
        add_pods(pods_ns, new)
        now = time.monotonic()
        rec.created.update(dict.fromkeys(new, now))
        for write, body in roll.step(tick):
            path = SLICES_PATH if write.op == "POST" else f"{SLICES_PATH}/{write.slice}"
            status, answer, sent, acked = api.call(write.op, path, body)
            if not 200 <= status < 300:
                raise RuntimeError(f"{write.op} {path}: HTTP {status}: {str(answer)[:300]}")
            if write.op != "DELETE":
                sl = next(s for s in roll.slices if s.name == write.slice)
                sl.rv = answer["metadata"]["resourceVersion"]
            rec.writes.append((write, sent, acked))
            for p in write.removes:
                rec.terminating[p] = sent
        rec.deleted.update(dict.fromkeys(roll.deleted(tick), time.monotonic()))
        gone = roll.torn_down(tick)
        remove_pods(pods_ns, gone)
        now = time.monotonic()
        rec.removed.update(dict.fromkeys(gone, now))


def lags(rec: Record, timeline: list[tuple[float, frozenset[str]]],
         n: int) -> dict[str, Any]:
    """Each kernel-changing write's lag; when each endpoint came and went in the kernel."""
    appeared: dict[str, float] = {}
    vanished: dict[str, float] = {}
    flaps = 0
    before: frozenset[str] = frozenset()
    for t, eps in timeline:
        for a in eps - before:
            if a in vanished:
                flaps += 1  # came back after leaving
            appeared.setdefault(a, t)
        for a in before - eps:
            vanished.setdefault(a, t)
        before = eps
    per_write: list[tuple[float, float | None]] = []  # (sent, lag or None: never seen)
    for write, sent, _acked in rec.writes:
        if not write.adds and not write.removes:
            continue
        times = [appeared.get(pod_address(p)) for p in write.adds]
        times += [vanished.get(pod_address(p)) for p in write.removes]
        known = [t for t in times if t is not None]
        per_write.append((sent, max(known) - sent if len(known) == len(times) else None))
    seen = [lag for _, lag in per_write if lag is not None]
    tail = per_write[len(per_write) - max(1, len(per_write) // 10):]
    final = frozenset(pod_address(n + s) for s in range(n))
    last_write = max((s for s, _ in per_write), default=0.0)
    exact = next((t for t, eps in timeline if t >= last_write and eps == final), None)
    return {
        "during": ms_summary(seen),
        "end": ms_summary([lag for _, lag in tail if lag is not None]),
        "converged_s": None if exact is None else round(exact - last_write, 3),
        "never_seen": sum(1 for _, lag in per_write if lag is None),
        "flaps": flaps,
        "samples_ms": [round(x * 1000, 1) for x in seen],
    }


def traffic_summary(outcomes: list[Outcome], rec: Record, origin: float,
                    n: int) -> dict[str, Any]:
    """Failures by kind (with times), and answers from pods that had already gone
    terminating (a new connection sent where the proxy should no longer send)."""
    by_pod = {pod_address(p): p for p in range(2 * n)}
    kinds: Counter[str] = Counter()
    failures = []
    late = []
    for o in sorted(outcomes, key=lambda o: o.started):
        pod = by_pod.get(o.answer)
        if pod is None:
            kinds[o.answer] += 1
            failures.append({"at_s": round(o.started - origin, 3), "kind": o.answer})
            continue
        gone = rec.terminating.get(pod) if pod is not None else None
        if gone is not None and o.started > gone:
            late.append(o.started - gone)
    starts = [o.started - o.due for o in outcomes]
    return {"connections": len(outcomes), "failed": sum(kinds.values()),
            "failures_by_kind": dict(kinds), "failures": failures[:200],
            "to_terminating": len(late),
            "to_terminating_max_after_s": round(max(late), 3) if late else None,
            "start_slip_ms": ms_summary(starts)}


def pacing_flags(settings: Settings) -> list[str]:
    if settings.min_sync_period:
        return ["--min-sync-period", settings.min_sync_period]
    return list(PACINGS[settings.pacing])


def run(settings: Settings, workdir: Path,
        progress: Callable[[str], None] = lambda _t: None) -> dict[str, Any]:
    """One roll in one mode; the figures and the behaviour (see the module's doc)."""
    n = settings.endpoints
    if not 1 <= n <= MAX_ENDPOINTS:
        raise ValueError(f"--endpoints must be 1..{MAX_ENDPOINTS}")
    roll = Roll(n, settings.rate, settings.ready_delay, settings.grace, settings.teardown)
    out: dict[str, Any] = {"mode": settings.mode, "endpoints": n, "rate": settings.rate,
                           "traffic_rate": settings.traffic_rate,
                           "ready_delay_s": settings.ready_delay, "grace_s": settings.grace,
                           "teardown_s": settings.teardown,
                           "pacing": "custom" if settings.min_sync_period else settings.pacing,
                           "agent_flags": " ".join(pacing_flags(settings)),
                           "slices_before": len(roll.slices)}
    (workdir / "cluster.json").write_text(json.dumps(manifest(roll)))
    (workdir / "kubeconfig").unlink(missing_ok=True)  # the simulator writes it when up
    with Lab([], node_name=NODE, ipv6=False) as lab:
        pods = pods_namespace(lab)
        add_pods(pods, range(n))
        with simulator(lab.node_ns, workdir / "cluster.json", workdir, True) as kubeconfig:
            api = Api(lab.node_ns, kubeconfig)
            try:
                out |= _with_agent(lab, pods, api, kubeconfig, roll, settings, workdir,
                                   progress)
            finally:
                api.close()
    return out


def _with_agent(lab: Lab, pods: str, api: Api, kubeconfig: Path, roll: Roll,
                settings: Settings, workdir: Path,
                progress: Callable[[str], None]) -> dict[str, Any]:
    n = roll.n
    status, listed, _, _ = api.call("GET", SLICES_PATH)
    if status != 200:
        raise RuntimeError(f"listing the slices: HTTP {status}")
    rvs = {o["metadata"]["name"]: o["metadata"]["resourceVersion"] for o in listed["items"]}
    for sl in roll.slices:
        sl.rv = rvs[sl.name]
    log_path = workdir / f"agent-{settings.mode}.log"
    argv = [sys.executable, "-m", "proxy", "--kubeconfig", str(kubeconfig),
            "--hostname-override", NODE, "--proxy-mode", settings.mode,
            "--cluster-cidr", POD_CIDR, "-v", "2"]
    argv += pacing_flags(settings)
    with log_path.open("wb") as log:
        proc = lab.popen(lab.node_ns, argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})

    def alive() -> None:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the agent exited {proc.returncode}:\n{tail}")

    def first_sync() -> bool:
        if FIRST_SYNC.search(log_path.read_text(errors="replace")):
            return True
        alive()
        return False

    began = time.monotonic()
    deadline = began + settings.start_timeout
    try:
        wait(first_sync, settings.start_timeout, "the first sync", interval=0.05)
    except TimedOut:
        raise RuntimeError(f"no first sync: {log_path}") from None
    agent = agent_pid(proc.pid) or proc.pid
    view = KernelView(lab.node_ns, settings.mode)

    def located() -> bool:
        if view.locate():
            return True
        alive()
        return False

    try:  # what is left of the same start deadline
        wait(located, max(0.0, deadline - time.monotonic()), "the service's chain",
             interval=0.05)
    except TimedOut:
        raise RuntimeError("the service's chain never appeared") from None
    where = view.slot_map()
    watch = SlotMapWatch(view, *where) if where else KernelWatch(view)
    watch.start()
    try:
        old = frozenset(pod_address(p) for p in range(n))
        if watch.wait_for(lambda eps: eps == old, deadline, alive) is None:
            raise RuntimeError(f"the kernel never held the {n} endpoints")
        progress(f"{settings.mode}: first sync in {time.monotonic() - began:.1f} s; rolling "
                 f"{n} endpoints at {settings.rate:g}/s")
        return _roll(lab, pods, api, roll, settings, watch, agent, log_path, alive)
    finally:
        watch.stop()


def _roll(lab: Lab, pods: str, api: Api, roll: Roll, settings: Settings, watch: KernelWatch,
          agent: int, log_path: Path, alive: Callable[[], None]) -> dict[str, Any]:
    n = roll.n
    rec = Record()
    span = settings.before + roll.ticks * TICK + settings.after
    traffic = Traffic(lab.client_ns, settings.traffic_rate, settings.connect_timeout,
                      count=math.ceil(settings.traffic_rate * (span + settings.settle_timeout)))
    log_offset = log_path.stat().st_size
    rss_before = size_mib(agent, "VmRSS")
    traffic.start()
    try:
        time.sleep(settings.before)  # traffic on the old endpoints first (a pace, not a sync)
        cpu0, origin = agent_cpu(agent), time.monotonic()
        roll_through(api, pods, roll, rec, alive)
        roll_end = time.monotonic()
        final = frozenset(pod_address(n + s) for s in range(n))
        last = max((s for w, s, _ in rec.writes if w.adds or w.removes), default=origin)
        exact = watch.wait_for(lambda eps: eps == final, last + settings.settle_timeout, alive)
        converged = time.monotonic()
        cpu1 = agent_cpu(agent)
        # Traffic goes on `after` seconds past the last address removal and convergence.
        time.sleep(max(0.0, max(roll_end, converged) + settings.after - time.monotonic()))
    finally:
        traffic.stop()
    alive()
    syncs = logged_syncs(log_path, log_offset)
    errors = [line for line in log_path.read_text(errors="replace").splitlines()
              if "level=error" in line][:10]
    kernel = watch.latest() or frozenset()
    api_final = roll.api_state()
    status, listed, _, _ = api.call("GET", SLICES_PATH)
    stored = {e["addresses"][0]: e["conditions"].get("ready")
              for o in (listed or {}).get("items", []) for e in o.get("endpoints") or []}
    roll_s = roll_end - origin
    cpu_self = cpu1["self"] - cpu0["self"]
    cpu_children = cpu1["children"] - cpu0["children"]
    return {
        "ticks": roll.ticks, "roll_s": round(roll_s, 2),
        "tick_slip_ms": ms_summary(rec.slips),
        "writes": dict(Counter(w.op for w, _, _ in rec.writes)),
        "write_ms": ms_summary([a - s for _, s, a in rec.writes]),
        "slices_after": len(roll.slices),
        "replaced": sum(1 for p, c in api_final.items() if p >= n and c == READY),
        "api_exactly_new": (status == 200 and set(stored) == final
                            and all(stored.values())),
        "kernel_exactly_new": kernel == final,
        "kernel_old_left": len(kernel - final), "kernel_new_missing": len(final - kernel),
        "kernel_converged": exact is not None,
        "lag": lags(rec, watch.timeline, n),
        "traffic": traffic_summary(traffic.outcomes, rec, origin, n),
        "agent": {
            "cpu_s": round(cpu_self + cpu_children, 2),
            "cpu_self_s": round(cpu_self, 2), "cpu_children_s": round(cpu_children, 2),
            "cpu_percent": round(100 * (cpu_self + cpu_children) / max(roll_s, 1e-9), 1),
            "rss_before_mib": rss_before, "peak_rss_mib": size_mib(agent, "VmHWM"),
            "syncs": len(syncs), "sync_ms": ms_summary(syncs), "errors": errors},
        # (seconds since the roll began, old endpoints, new endpoints) at each change
        "kernel_timeline": [
            (round(t - origin, 3), sum(1 for a in eps if a not in final), len(eps & final))
            for t, eps in watch.timeline],
        "kernel_reads": {"n": watch.reads, "seconds": round(watch.read_seconds, 2),
                         "commits_heard": watch.commits,
                         "announcements_lost": getattr(watch, "lost", 0),
                         "dated_by": "slot map announcements"
                         if isinstance(watch, SlotMapWatch) else "nf_tables commit"
                         if watch.view.commit_tables() else "poll"},
    }
