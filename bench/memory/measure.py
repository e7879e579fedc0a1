"""One mode at one size: the agent's memory through the situations a node sees.

The simulator serves N services x M endpoints (bench/agent_start.py's cluster, real-shaped
by default: the fields kube-apiserver adds); the agent runs in a network namespace made
for the run, with default flags but `--sync-period` (to bring the periodic full resync
into the run) and JSON logs at -v 2 (every sync's line), inside a memory cgroup of its
own (cgroup.py). The cluster is IPv4 (ClusterIPs from 198.18.0.0/16: 65,533 of them,
the bursts' new services included) or, with `ipv6`, single-stack IPv6 as
bench/agent_start.py's --ipv6 makes it (ClusterIPs from fd00:198:18::/104, pods from
fd00:19::/64, the bursts' objects IPv6 too). In order:

  cold_start     process start -> the first sync's commit, on a node with no rules
  burst_new      K new services, each slice then its service -> every one synced
  burst_replace  every endpoint of 10% of the services replaced (one PUT per slice) ->
                 every one synced
                 (a burst is written while the agent is stopped, SIGSTOP, and reaches it
                 whole when it goes on: as a burst that arrives during a long sync)
  resync         the periodic full resync (`--sync-period` after the last sync), to its
                 end: in nftables mode a partial sync, then a table a part (`in_parts`:
                 its ports, seconds from begun to done, seconds of the parts, the
                 longest part, which is what a change waited for at most)
  restart        the agent stopped and started again over its own rules, in the same
                 cgroup (as a pod's: the first process's rules are still charged to it)

Each situation starts by resetting the peaks: the agent's (VmHWM, through
/proc/PID/clear_refs) and the cgroup's. Its figures: the agent's peak RSS (exact), the
agent + its children's RSS (sampled every 0.1 s; a child caught between fork and exec
counts the agent's pages twice), the cgroup's peak charge and kernel memory peak
(exact), anon + kernel memory (sampled); then, `settle` seconds after, the steady
figures. The syncs each situation caused are counted from the log by trigger and kind
(full or partial), with the longest, so a burst that a full sync absorbed shows as such.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from ipaddress import ip_network
from pathlib import Path
from typing import Any

from bench.agent_start import (
    NODE,
    NODES,
    POD_ADDRESSES,
    POD_BASE,
    POD_BASE_V6,
    cluster,
    namespace,
    plant_backend_hint,
)
from bench.common import (
    POD_CIDR_V6,
    ROOT,
    SERVICE_CIDR_V6,
    agent_pid,
    cpu_seconds,
    descendants,
    in_namespace,
    simulator,
    single_stack_v6,
    size_mib,
    stop,
)
from bench.memory.cgroup import MemoryCgroup
from bench.rolling_update.api import Api
from proxy.netns_lab.poll import TimedOut, wait

# nftables' periodic resync a table at a time (dataplane/nftables/resync_steps.py).
RESYNC_BEGUN = "resync: rewriting our tables one at a time"
RESYNC_DONE = "resync done"
SITUATIONS = ("cold_start", "burst_new", "burst_replace", "resync", "restart")
NAMESPACE = "default"
SERVICES = f"/api/v1/namespaces/{NAMESPACE}/services"
SLICES = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
# Replacement and new endpoints: the cluster's pod range (bench/agent_start.py), half of
# it further on, so a replaced endpoint really changes (addresses shared with other
# services cost the agent the same as distinct ones).
NEW_POD_BASE = POD_BASE
NEW_POD_ADDRESSES = POD_ADDRESSES
NEW_POD_SHIFT = POD_ADDRESSES // 2
# ClusterIPs for up to 65,533 services (the simulator's default range holds 32,766; it
# allocates neither the network address, nor the first host, nor the broadcast one).
SERVICE_CIDR = "198.18.0.0/16"
V4_SERVICES = ip_network(SERVICE_CIDR).num_addresses - 3
POD_CIDR = "198.19.0.0/16"  # the agent's --cluster-cidr: bench/agent_start.py's pods
SAMPLE_EVERY = 0.1
Obj = dict[str, Any]


@dataclass(frozen=True)
class Settings:
    services: int
    endpoints: int = 10
    mode: str = "nftables"
    situations: tuple[str, ...] = SITUATIONS
    burst_new: int = 1000  # services created in burst_new
    replace_share: float = 0.1  # of the services, in burst_replace
    sync_period: float | None = None  # seconds: the periodic resync's (None: period())
    settle: float = 5.0  # seconds after a situation, before its steady figures
    real_shaped: bool = True
    iptables_backend: str = "auto"  # the node's kubelet hint (auto: none, detected)
    limit_mib: int | None = None  # the cgroup's limit (None: none)
    timeout: float = 1200.0  # per situation
    ipv6: bool = False  # a single-stack IPv6 cluster (host modes only)

    def period(self) -> float:
        """The agent's --sync-period: the resync comes this long after the last sync,
        and the bursts' syncs stay partial only while they start within it of the first
        sync's start; by default 60 s, plus 1 s per 250 services past 15,000 (a first sync
        in iptables mode takes minutes at 50,000)."""
        if self.sync_period is not None:
            return self.sync_period
        return max(60.0, self.services / 250)

    def check(self) -> None:
        if self.services < 1 or self.endpoints < 1:
            raise ValueError("services and endpoints must be positive")
        if not set(self.situations) <= set(SITUATIONS) or "cold_start" not in self.situations:
            raise ValueError(f"situations: cold_start and any of {SITUATIONS}")
        if not 0 < self.replace_share <= 1:
            raise ValueError("the replaced share is in (0, 1]")
        if self.ipv6 and self.mode == "ipvs":
            raise ValueError("--ipv6 runs in the host's modes only (iptables, nftables): "
                             "the IPVS guest's cluster is IPv4")
        if self.ipv6:
            return  # fd00:19::/64 and the /104 of ClusterIPs hold far more than any run
        if self.burst_new * self.endpoints > NEW_POD_ADDRESSES:
            raise ValueError(f"at most {NEW_POD_ADDRESSES:,} new endpoints in burst_new")
        if self.cluster_ips() > V4_SERVICES:
            raise ValueError(f"the IPv4 service range {SERVICE_CIDR} holds {V4_SERVICES:,} "
                             f"ClusterIPs, not {self.cluster_ips():,} (services + "
                             "burst_new): use --ipv6 for more services")

    def cluster_ips(self) -> int:
        """The services the run makes at most: the cluster's and burst_new's."""
        return self.services + (self.burst_new if "burst_new" in self.situations else 0)

    def family(self) -> str:
        return "IPv6" if self.ipv6 else "IPv4"


class AgentDied(RuntimeError):
    pass


# --- the agent's log -------------------------------------------------------------------


class Log:
    """The agent's JSON log, read on from where the last read ended."""

    SYNCS = frozenset({"sync done", "full sync done"})

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.records: list[Obj] = []

    def read(self) -> list[Obj]:
        with contextlib.suppress(FileNotFoundError), self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
            end = data.rfind(b"\n") + 1  # a line still being written waits
            self.offset += end
            for line in data[:end].splitlines():
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict):
                        self.records.append(record)
        return self.records

    def syncs(self, since: int = 0) -> list[Obj]:
        return [r for r in self.read()[since:]
                if r.get("msg") in self.SYNCS or str(r.get("msg", "")).startswith(
                    "first sync done")]


# --- sampling ----------------------------------------------------------------------------


class Sampler:
    """Every SAMPLE_EVERY s: the agent's and its children's RSS, and the cgroup's anon +
    kernel memory; the largest of each since `restart()`."""

    def __init__(self, group: MemoryCgroup | None) -> None:
        self.group = group
        self.agent: int | None = None
        self.tree_peak = 0.0
        self.unreclaimable_peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="memory-sampler", daemon=True)

    def restart(self) -> None:
        self.tree_peak = self.unreclaimable_peak = 0.0

    def _sample(self) -> None:
        agent = self.agent
        if agent is not None:
            tree = 0.0
            for pid in [agent, *descendants(agent)]:
                tree += size_mib(pid, "VmRSS") or 0.0
            self.tree_peak = max(self.tree_peak, tree)
        if self.group is not None:
            with contextlib.suppress(OSError, KeyError, ValueError):
                self.unreclaimable_peak = max(self.unreclaimable_peak,
                                              self.group.charged().unreclaimable)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            self._sample()

    @contextmanager
    def running(self) -> Iterator[Sampler]:
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(5)


# --- the cluster's writes ----------------------------------------------------------------


def _address(k: int, v6_past: int | None) -> str:
    if v6_past is not None:  # IPv6 has room for every address to be new
        return str(POD_BASE_V6 + v6_past + k)
    return str(NEW_POD_BASE + (k + NEW_POD_SHIFT) % NEW_POD_ADDRESSES)


def endpoint_slice(name: str, endpoints: int, first: int, port: int = 8080,
                   v6_past: int | None = None) -> Obj:
    """A service's one slice, as the controller writes it, with fresh addresses (and
    another target port: every endpoint then changes, whatever addresses it had).
    `v6_past`: IPv6 addresses, past that many of the cluster's own (None: IPv4)."""
    eps = [{"addresses": [_address(first + j, v6_past)], "conditions": {"ready": True},
            "nodeName": f"node-{'a' if (first + j) % NODES == 0 else (first + j) % NODES}"}
           for j in range(endpoints)]
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-x1", "namespace": NAMESPACE,
                         "labels": {"kubernetes.io/service-name": name,
                                    "endpointslice.kubernetes.io/managed-by":
                                        "endpointslice-controller.k8s.io"}},
            "addressType": "IPv4" if v6_past is None else "IPv6", "endpoints": eps,
            "ports": [{"name": "http", "port": port, "protocol": "TCP"}]}


def service(name: str, ipv6: bool = False) -> Obj:
    svc: Obj = {"apiVersion": "v1", "kind": "Service",
                "metadata": {"name": name, "namespace": NAMESPACE},
                "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP",
                                    "targetPort": 8080}]}}
    return single_stack_v6(svc) if ipv6 else svc


def _call(api: Api, method: str, path: str, body: Obj) -> None:
    status, answer, _, _ = api.call(method, path, body)
    if status not in (200, 201):
        raise RuntimeError(f"{method} {path}: HTTP {status}: {str(answer)[:300]}")


# --- one run -----------------------------------------------------------------------------


class Run:
    """The agent on one cluster, through the situations."""

    def __init__(self, settings: Settings, ns: str, kubeconfig: Path, work: Path,
                 group: MemoryCgroup | None, sampler: Sampler) -> None:
        self.s = settings
        self.ns, self.kubeconfig, self.work = ns, kubeconfig, work
        self.group, self.sampler = group, sampler
        self.proc: subprocess.Popen[bytes] | None = None
        self.agent: int | None = None
        self.log = Log(work / "agent-0.log")
        self.starts = 0
        self.services = settings.services
        # IPv6: the bursts' addresses come past the cluster's own (bench/agent_start.py's)
        self.v6_past = settings.services * settings.endpoints if settings.ipv6 else None

    def start(self) -> None:
        self.log = Log(self.work / f"agent-{self.starts}.log")
        argv = in_namespace(self.ns, [
            sys.executable, "-m", "proxy", "--kubeconfig", str(self.kubeconfig),
            "--hostname-override", NODE, "--proxy-mode", self.s.mode,
            "--cluster-cidr", POD_CIDR_V6 if self.s.ipv6 else POD_CIDR,
            "--sync-period", f"{self.s.period():g}s", "--logging-format", "json", "-v", "2"])
        if self.group is not None:
            argv = self.group.wrap(argv)
        with self.log.path.open("wb") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                         env={**os.environ, "PYTHONPATH": str(ROOT)})
        self.starts += 1
        self.agent = None
        self.sampler.agent = None

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)
        self.agent = None
        self.sampler.agent = None

    def alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            kills = self.group.oom_kills() if self.group is not None else 0
            raise AgentDied(f"the agent exited ({self.proc and self.proc.returncode}); "
                            f"cgroup OOM kills: {kills}; log: {self.log.path}")
        if self.agent is None:
            self.agent = agent_pid(self.proc.pid)
            self.sampler.agent = self.agent

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The agent stopped (SIGSTOP) while a burst is written, so that the whole burst
        reaches it at once, as when it arrives during a long sync: the most one sync
        takes in (the watch events wait in the socket and the simulator meanwhile)."""
        assert self.agent is not None
        os.kill(self.agent, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(self.agent, signal.SIGCONT)

    def reset(self) -> None:
        if self.agent is not None:
            Path(f"/proc/{self.agent}/clear_refs").write_text("5")  # VmHWM := VmRSS
        if self.group is not None:
            self.group.reset_peaks()
        self.sampler.restart()

    def until(self, done: Callable[[], bool], what: str) -> None:
        def check() -> bool:
            self.alive()
            return done()

        try:
            wait(check, self.s.timeout, what, interval=0.05)
        except TimedOut:
            raise RuntimeError(f"{what}: not within {self.s.timeout:.0f} s "
                               f"(log: {self.log.path})") from None

    def quiet(self, since: int, seconds: float = 2.0) -> None:
        """No new sync line for `seconds` (changes held by the CPU budget still come)."""
        seen = [len(self.log.syncs(since)), time.monotonic()]

        def settled() -> bool:
            n = len(self.log.syncs(since))
            if n != seen[0]:
                seen[:] = [n, time.monotonic()]
            return time.monotonic() - seen[1] >= seconds

        self.until(settled, "the agent to settle")

    def figures(self, began: float, since: int) -> Obj:
        """The situation's peaks (since the last reset), then its steady figures."""
        assert self.agent is not None
        out: Obj = {"seconds": round(time.monotonic() - began, 2),
                    "agent_peak_mib": _r(size_mib(self.agent, "VmHWM")),
                    "tree_peak_mib": _r(self.sampler.tree_peak)}
        if self.group is not None:
            peak, kernel = self.group.peaks()
            out |= {"cgroup_peak_mib": _r(peak), "cgroup_kernel_peak_mib": _r(kernel),
                    "cgroup_unreclaimable_peak_mib": _r(self.sampler.unreclaimable_peak)}
        out["syncs"] = _syncs(self.log.syncs(since))
        time.sleep(self.s.settle)  # the steady state is what is left after this long
        self.alive()
        out["steady_agent_mib"] = _r(size_mib(self.agent, "VmRSS"))
        out["steady_agent_anon_mib"] = _r(size_mib(self.agent, "RssAnon"))
        out["agent_cpu_s"] = round(cpu_seconds(self.agent), 2)
        if self.group is not None:
            out["steady_cgroup"] = {k: _r(v) for k, v in asdict(self.group.charged()).items()}
        return out

    # --- the situations ---

    def cold_start(self) -> Obj:
        began = time.monotonic()
        self.start()
        self.until(lambda: bool(self.log.syncs()), "the first sync")
        first = self.log.syncs()[0]
        out = self.figures(began, 0)
        out["since_start_s"] = float(str(first.get("since_start", "0")).rstrip("s"))
        return out

    def burst_new(self, api: Api) -> Obj:
        since = len(self.log.read())
        self.reset()
        began = time.monotonic()
        k = self.s.burst_new
        with self.paused():
            for b in range(k):
                name = f"burst-{b}"
                # The slice first: its service then comes with its endpoints known.
                _call(api, "POST", SLICES, endpoint_slice(
                    name, self.s.endpoints, b * self.s.endpoints, v6_past=self.v6_past))
                _call(api, "POST", SERVICES, service(name, self.s.ipv6))
        self.services += k
        want = self.services
        self.until(lambda: any((r.get("service_ports") or 0) >= want
                               for r in self.log.syncs(since)), f"{want:,} service ports")
        self.quiet(since)
        return self.figures(began, since)

    def burst_replace(self, api: Api) -> Obj:
        since = len(self.log.read())
        self.reset()
        began = time.monotonic()
        step = max(1, round(1 / self.s.replace_share))
        chosen = range(0, self.s.services, step)
        first = (self.s.burst_new + 1) * self.s.endpoints  # clear of burst_new's addresses
        with self.paused():
            for n, i in enumerate(chosen):
                _call(api, "PUT", f"{SLICES}/s-{i}-x1", endpoint_slice(
                    f"s-{i}", self.s.endpoints, first + n * self.s.endpoints, 8081,
                    self.v6_past))
        want = len(chosen)
        self.until(lambda: sum(r.get("changed") or 0 for r in self.log.syncs(since)) >= want,
                   f"{want:,} changed service ports")
        self.quiet(since)
        out = self.figures(began, since)
        out["replaced_services"] = want
        return out

    def resync(self) -> Obj:
        since = len(self.log.read())
        self.reset()
        began = time.monotonic()

        def done() -> bool:  # in one full sync, or a table at a time (nftables)
            records = self.log.read()[since:]
            begun = sum(r.get("msg") == RESYNC_BEGUN for r in records)
            ended = [r for r in records if r.get("msg") == RESYNC_DONE]
            return (begun > 0 and len(ended) >= begun) or any(
                r.get("trigger") == "periodic" and r.get("full") for r in self.log.syncs(since))

        self.until(done, "the periodic resync")
        out = self.figures(began, since)
        ended = [r for r in self.log.read()[since:] if r.get("msg") == RESYNC_DONE]
        if ended:  # over the families: every port, the longest of each time
            out["in_parts"] = {"ports": sum(int(r.get("ports", 0)) for r in ended)} | {
                k: max(float(r.get(k, 0)) for r in ended)
                for k in ("seconds", "work_seconds", "longest_part")}
        return out

    def restart(self) -> Obj:
        self.stop()
        if self.group is not None:
            self.group.reset_peaks()
        self.sampler.restart()
        out = self.cold_start()
        return out


def _syncs(lines: list[Obj]) -> Obj:
    """The syncs of a situation: how many of each kind, by trigger, and the longest."""
    seconds = [float(str(r.get("duration", "0")).rstrip("s")) for r in lines]
    triggers: dict[str, int] = {}
    for r in lines:
        key = f"{r.get('trigger')}/{'full' if r.get('full') else 'partial'}"
        triggers[key] = triggers.get(key, 0) + 1
    return {"count": len(lines), "by_trigger": triggers,
            "longest_s": round(max(seconds, default=0.0), 3),
            "most_changed": max((r.get("changed") or 0 for r in lines), default=0)}


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 1)


def run(settings: Settings, work: Path, progress: Callable[[str], None] = lambda _t: None
        ) -> Obj:
    """One (mode, size): every situation's figures, or the error that ended the run (an
    OOM kill under `limit_mib` among them)."""
    settings.check()
    manifest = work / "cluster.json"
    manifest.write_bytes(json.dumps(cluster(settings.services, settings.endpoints,
                                            settings.real_shaped, ipv6=settings.ipv6)
                                    ).encode())
    mode = settings.mode
    if settings.iptables_backend != "auto" and mode != "nftables":
        mode += f" ({settings.iptables_backend})"
    out: Obj = {"mode": mode, "services": settings.services,
                "endpoints": settings.endpoints, "family": settings.family(),
                "settings": asdict(settings), "situations": {}}
    label = f"{settings.mode}-{settings.services}"
    if settings.iptables_backend != "auto":
        label += f"-{settings.iptables_backend}"
    if settings.ipv6:
        label += "-ipv6"
    began = time.monotonic()
    with contextlib.ExitStack() as stack:
        ns = stack.enter_context(namespace())
        kubeconfig = stack.enter_context(simulator(
            ns, manifest, work, True, SERVICE_CIDR,
            SERVICE_CIDR_V6 if settings.ipv6 else None))
        out["setup_s"] = round(time.monotonic() - began, 1)
        if settings.iptables_backend != "auto":
            plant_backend_hint(ns, settings.iptables_backend)
        group = stack.enter_context(MemoryCgroup.made(label, settings.limit_mib))
        out["cgroup"] = str(group.path) if group else None
        sampler = stack.enter_context(Sampler(group).running())
        agent = Run(settings, ns, kubeconfig, work, group, sampler)
        stack.callback(agent.stop)
        api = Api(ns, kubeconfig)
        stack.callback(api.close)
        steps: dict[str, Callable[[], Obj]] = {
            "cold_start": agent.cold_start, "burst_new": lambda: agent.burst_new(api),
            "burst_replace": lambda: agent.burst_replace(api), "resync": agent.resync,
            "restart": agent.restart}
        try:
            for name in SITUATIONS:
                if name in settings.situations:
                    progress(f"{label}: {name}")
                    out["situations"][name] = steps[name]()
                    progress(f"{label}: {name}: {_brief(out['situations'][name])}")
        except (AgentDied, RuntimeError) as exc:
            out["error"] = str(exc)
            progress(f"{label}: FAILED: {exc}")
        if group is not None:
            out["oom_kills"] = group.oom_kills()
    out["seconds"] = round(time.monotonic() - began, 1)
    return out


def _brief(s: Obj) -> str:
    parts = [f"agent peak {s.get('agent_peak_mib')} MiB"]
    if "cgroup_peak_mib" in s:
        parts.append(f"cgroup peak {s['cgroup_peak_mib']} MiB (kernel "
                     f"{s['cgroup_kernel_peak_mib']})")
    parts.append(f"steady {s.get('steady_agent_mib')} MiB, {s['seconds']} s")
    return ", ".join(parts)
