"""One agent per pacing on the simulator, and the phases run against it."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from bench.churn.kernel import AddressWatch, Sampler
from bench.churn.workload import (
    FIRST_SYNC,
    NAMESPACE,
    NODE,
    POD_CIDR,
    Obj,
    Settings,
    endpoint_slice,
    service,
)
from bench.common import (
    PACINGS,
    POD_CIDR_V6,
    ROOT,
    SERVICE_CIDR_V6,
    agent_pid,
    simulator,
    size_mib,
)
from bench.rolling_update.api import Api
from bench.rolling_update.lab import logged_syncs, ms_summary
from proxy.netns_lab import Lab
from proxy.netns_lab.poll import TimedOut, wait

MARKED = re.compile(r"input marks added for every port")
KEPT_MADE = re.compile(r"restart: kept ports' state made.*")
RESYNCS = re.compile(r"resync done.*|full sync done.*trigger=periodic.*")
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
SERVICES = f"/api/v1/namespaces/{NAMESPACE}/services"
Progress = Callable[[str], None]


class Cluster:
    """What the API holds: each service's endpoint addresses and its slice's version."""

    def __init__(self, settings: Settings) -> None:
        self.ipv6 = settings.ipv6
        self.pool = settings.pool()
        self.names = [f"s-{i}" for i in range(settings.services)]
        self.addresses = {name: [self.pool.take() for _ in range(settings.endpoints)]
                          for name in self.names}
        self.rv: dict[str, str] = {}

    def manifest(self) -> list[Obj]:
        out: list[Obj] = []
        for name in self.names:
            out += [service(name, self.ipv6),
                    endpoint_slice(self.pool, name, self.addresses[name])]
        return out


class Phase:
    """The writes of one phase: (write id, sent, answered) and each one's lag."""

    def __init__(self, name: str, watch: AddressWatch, first_id: int) -> None:
        self.name, self.watch = name, watch
        self.next_id = first_id
        self.sent: dict[int, float] = {}
        self.groups: list[list[int]] = []  # ids that make one change (a burst's service)
        self.slice_of: dict[int, str] = {}  # a replacing write -> the slice it wrote
        self._seen_at_check = -1

    def new_id(self, packed: bytes) -> int:
        i = self.next_id
        self.next_id += 1
        self.watch.expect(packed, i)
        return i

    def all_seen(self) -> bool:
        # lags() walks every write: only when something new was seen since last time.
        if len(self.watch.seen) == self._seen_at_check:
            return False
        self._seen_at_check = len(self.watch.seen)
        return None not in self.lags()

    def lags(self) -> list[float | None]:
        """Each change's lag: its write sent -> the kernel holding it or a later write
        of the same slice (the agent may fold writes into one sync, and a later write
        that replaced the same endpoint again means this one's address never comes);
        for a group, the last of its addresses."""
        seen = self.watch.seen
        # Per slice, from its last write back: the earliest time a write at least as
        # new was in the kernel.
        covered: dict[int, float | None] = {}
        later: dict[str, float | None] = {}
        for group in reversed(self.groups):
            times = [seen.get(i) for i in group]
            known = [t for t in times if t is not None]
            mine = max(known) if len(known) == len(times) else None
            key = self.slice_of.get(group[0], f"#{group[0]}")
            best = later.get(key)
            if mine is not None and (best is None or mine < best):
                best = mine
            later[key] = best
            covered[group[0]] = best
        out: list[float | None] = []
        for g in self.groups:
            t = covered[g[0]]
            out.append(None if t is None else t - self.sent[g[0]])
        return out

    def superseded(self) -> int:
        """Changes in the kernel only through a later write of the same slice."""
        return sum(1 for g in self.groups if any(i not in self.watch.seen for i in g)
                   and g[0] in self.slice_of)


def _put(api: Api, cluster: Cluster, name: str) -> tuple[float, float]:
    body = endpoint_slice(cluster.pool, name, cluster.addresses[name], cluster.rv[name])
    status, answer, sent, acked = api.call("PUT", f"{SLICES}/{name}-x1", body)
    if status != 200:
        raise RuntimeError(f"PUT slice {name}: HTTP {status}: {str(answer)[:300]}")
    cluster.rv[name] = answer["metadata"]["resourceVersion"]
    return sent, acked


def replace_one(api: Api, cluster: Cluster, phase: Phase, rng: random.Random) -> None:
    """One random endpoint of one random service gets a fresh address (a pod replaced)."""
    name = rng.choice(cluster.names)
    eps = cluster.addresses[name]
    j = rng.randrange(len(eps))
    new = cluster.pool.take()
    cluster.pool.give_back(eps[j])
    eps[j] = new
    write = phase.new_id(cluster.pool.packed(new))
    phase.groups.append([write])
    phase.slice_of[write] = name
    phase.sent[write], _ = _put(api, cluster, name)


def _settle(phase: Phase, settings: Settings, alive: Callable[[], None]) -> None:
    def done() -> bool:
        alive()
        return phase.all_seen()

    with contextlib.suppress(TimedOut):  # reported: the writes never seen
        wait(done, settings.settle, f"every change of {phase.name} in the kernel",
             interval=0.05)


def isolated(api: Api, cluster: Cluster, phase: Phase, settings: Settings,
             rng: random.Random, alive: Callable[[], None]) -> None:
    for _ in range(settings.isolated):
        replace_one(api, cluster, phase, rng)
        _settle(phase, settings, alive)
        time.sleep(settings.spacing)  # the quiet before the next change: a pace


def churn(api: Api, cluster: Cluster, phase: Phase, settings: Settings, rate: float,
          rng: random.Random, alive: Callable[[], None]) -> None:
    t0 = time.monotonic()
    for k in range(max(1, round(rate * settings.duration))):
        due = t0 + k / rate
        if (late := due - time.monotonic()) > 0:
            time.sleep(late)  # pacing the writes, not synchronisation
        if k % 100 == 0:
            alive()
        replace_one(api, cluster, phase, rng)
    _settle(phase, settings, alive)


def burst(api: Api, cluster: Cluster, phase: Phase, settings: Settings,
          alive: Callable[[], None]) -> None:
    """`settings.burst` new services, each with its slice, as fast as one connection
    writes them."""
    for b in range(settings.burst):
        name = f"burst-{b}"
        eps = [cluster.pool.take() for _ in range(settings.endpoints)]
        group = [phase.new_id(cluster.pool.packed(k)) for k in eps]
        status, answer, sent, _ = api.call("POST", SERVICES, service(name, cluster.ipv6))
        if status not in (200, 201):
            raise RuntimeError(f"POST service {name}: HTTP {status}: {str(answer)[:300]}")
        status, answer, _, _ = api.call("POST", SLICES, endpoint_slice(cluster.pool, name, eps))
        if status not in (200, 201):
            raise RuntimeError(f"POST slice {name}: HTTP {status}: {str(answer)[:300]}")
        phase.groups.append(group)
        phase.sent.update(dict.fromkeys(group, sent))
        if b % 100 == 0:
            alive()
    _settle(phase, settings, alive)


def summarise(phase: Phase, sampler: Sampler, rate: float | None, log: Path,
              log_offset: int) -> dict[str, Any]:
    lags = phase.lags()
    seen = [x for x in lags if x is not None]
    first = min(phase.sent.values())
    last = max(phase.sent.values())
    ends = [phase.watch.seen[i] for i in phase.sent if i in phase.watch.seen]
    end = max([last, *ends])
    with contextlib.suppress(TimedOut):  # the 1-s windows that end after the phase
        wait(lambda: sampler.samples[-1][0] > end + 1.1, 5.0, "the CPU samples")
    out: dict[str, Any] = {
        "phase": phase.name, "rate": rate, "changes": len(lags),
        "never_seen": sum(1 for x in lags if x is None),
        "superseded": phase.superseded(),
        "writes_s": round(last - first, 2),
        "sent_rate": round((len(lags) - 1) / (last - first), 1) if last > first else None,
        "lag": {**ms_summary(seen), "samples_ms": [round(x * 1000, 2) for x in seen]},
        "all_in_s": round(end - first, 3), "last_write_to_all_in_s": round(end - last, 3),
        "syncs": len(logged_syncs(log, log_offset))}
    out |= sampler.window(first, end)
    return out


def run(settings: Settings, workdir: Path, progress: Progress = lambda _t: None
        ) -> dict[str, Any]:
    """Every phase with each pacing, one fresh agent (and simulator) per pacing."""
    settings.check()
    # The watch thread dates announcements when it gets the interpreter: while this one
    # writes 1,000 slices a second, within 0.5 ms rather than the default 5 ms.
    sys.setswitchinterval(0.0005)
    out: dict[str, Any] = {"services": settings.services, "endpoints": settings.endpoints,
                           "family": settings.family, "settings": dict(vars(settings)),
                           "runs": []}
    for pacing in settings.pacing:
        sub = workdir / pacing
        sub.mkdir(parents=True, exist_ok=True)
        out["runs"].append(run_one(settings, pacing, sub, progress))
    return out


def _read_versions(api: Api, cluster: Cluster) -> None:
    """Each slice's resourceVersion as the simulator loaded it, which its first PUT names."""
    status, listed, _, _ = api.call("GET", SLICES)
    if status != 200:
        raise RuntimeError(f"listing the slices: HTTP {status}")
    for obj in listed["items"]:
        cluster.rv[obj["metadata"]["labels"]["kubernetes.io/service-name"]] = \
            obj["metadata"]["resourceVersion"]


def _agent_argv(settings: Settings, kubeconfig: Path, flags: list[str]) -> list[str]:
    """The agent in nftables mode, logging every sync (`-v 2`), pods in the pool's range."""
    period = [] if settings.resync is None else ["--sync-period", f"{settings.resync:g}s"]
    return [sys.executable, "-m", "proxy", "--kubeconfig", str(kubeconfig),
            "--hostname-override", NODE, "--proxy-mode", "nftables",
            "--cluster-cidr", POD_CIDR_V6 if settings.ipv6 else POD_CIDR, "-v", "2",
            *period, *flags]


def _start_agent(lab: Lab, settings: Settings, kubeconfig: Path, flags: list[str],
                 log: Path) -> tuple[subprocess.Popen[bytes], Path, Callable[[], None]]:
    """The agent started, once its first sync is logged: its process, log, and a check
    that it still runs."""
    with log.open("wb") as f:
        proc = lab.popen(lab.node_ns, _agent_argv(settings, kubeconfig, flags),
                         stdout=f, stderr=subprocess.STDOUT,
                         cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})

    def alive() -> None:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the agent exited {proc.returncode}:\n{tail}")

    def first_sync() -> bool:
        alive()
        return bool(FIRST_SYNC.search(log.read_text(errors="replace")))

    wait(first_sync, settings.start_timeout, "the agent's first sync", interval=0.05)
    return proc, log, alive


def run_one(settings: Settings, pacing: str, workdir: Path, progress: Progress
            ) -> dict[str, Any]:
    cluster = Cluster(settings)
    (workdir / "cluster.json").write_text(json.dumps(cluster.manifest()))
    (workdir / "kubeconfig").unlink(missing_ok=True)  # the simulator writes it when up
    with ExitStack() as stack:
        # An IPv6 node has IPv6 addresses too (the lab's, in fd00:18::/32).
        lab = stack.enter_context(Lab([], node_name=NODE, ipv6=settings.ipv6))
        kubeconfig = stack.enter_context(simulator(
            lab.node_ns, workdir / "cluster.json", workdir, True,
            service_cidr_v6=SERVICE_CIDR_V6 if settings.ipv6 else None))
        api = Api(lab.node_ns, kubeconfig)
        stack.callback(api.close)
        _read_versions(api, cluster)
        flags = list(PACINGS[pacing])
        began = time.monotonic()
        proc, log, alive = _start_agent(lab, settings, kubeconfig, flags, workdir / "agent.log")
        agent = agent_pid(proc.pid) or proc.pid
        result: dict[str, Any] = {
            "pacing": pacing, "agent_flags": " ".join(flags),
            "start_s": round(time.monotonic() - began, 2),
            "start_peak_rss_mib": size_mib(agent, "VmHWM"), "phases": []}
        progress(f"{pacing}: the agent synced {settings.services:,} services in "
                 f"{result['start_s']} s")
        if settings.restart:
            # As a DaemonSet rollout does: the agent stopped once it marked every port
            # (what lets a restart keep them unrendered), its tables left, another
            # started over them; the phases begin at its first sync (no gap first).
            wait(lambda: bool(MARKED.search(log.read_text(errors="replace"))),
                 settings.start_timeout, "every port's input mark", interval=0.2)
            proc.terminate()
            proc.wait(timeout=60)
            began = time.monotonic()
            proc, log, alive = _start_agent(lab, settings, kubeconfig, flags,
                                            workdir / "agent-restarted.log")
            agent = agent_pid(proc.pid) or proc.pid
            result["restart_s"] = round(time.monotonic() - began, 2)
            progress(f"{pacing}: restarted over its tables in {result['restart_s']} s")
        watch = AddressWatch(lab.node_ns)
        watch.start()
        stack.callback(watch.stop)
        sampler = Sampler(agent)
        sampler.start()
        stack.callback(sampler.stop)
        rng = random.Random(f"{settings.seed}")  # the same changes for both pacings
        next_id = 0
        plan: list[tuple[str, float | None]] = []
        for name in settings.phases:
            plan += [(name, r) for r in settings.rates] if name == "random" else [(name, None)]
        for i, (name, rate) in enumerate(plan):
            if i or not settings.restart:
                time.sleep(settings.gap)  # quiet between phases: a pace, not synchronisation
            label = f"{name} {rate:g}/s" if rate else name
            phase = Phase(label, watch, next_id)
            offset = log.stat().st_size
            if name == "isolated":
                isolated(api, cluster, phase, settings, rng, alive)
            elif name == "random":
                assert rate is not None
                churn(api, cluster, phase, settings, rate, rng, alive)
            else:
                burst(api, cluster, phase, settings, alive)
            next_id = phase.next_id
            summary = summarise(phase, sampler, rate, log, offset)
            summary["phase"] = name
            result["phases"].append(summary)
            lag = summary["lag"]
            progress(f"{pacing}: {label}: {summary['changes']} changes, lag p50 "
                     f"{lag.get('p50')} / p99 {lag.get('p99')} / max {lag.get('max')} ms, "
                     f"never seen {summary['never_seen']}, CPU {summary['cpu_percent']}% "
                     f"(1 s max {summary['cpu_max_1s_percent']}%)")
        alive()
        kept = KEPT_MADE.search(log.read_text(errors="replace"))
        if kept:  # after a restart: when its kept state was all made, and in how long
            result["kept_state_made"] = kept.group(0)
        # The periodic resyncs: in one full sync, or a table at a time (nftables).
        result["resyncs"] = RESYNCS.findall(log.read_text(errors="replace"))[:5]
        result["peak_rss_mib"] = size_mib(agent, "VmHWM")
        result["errors"] = [ln for ln in log.read_text(errors="replace").splitlines()
                            if "level=error" in ln][:10]
        result["watch"] = {"messages": watch.messages, "lost": watch.lost}
        return result
