"""One run: the control plane's objects, the proxies started one after the other, the changes."""

from __future__ import annotations

import contextlib
import functools
import math
import os
import platform
import random
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.common import PACINGS, quiet
from bench.realcp_latency.measure import Commits, commit_tables, summary, wait_initial, watch_rule
from bench.realcp_latency.nat import _run
from bench.realcp_latency.proxies import (
    Side,
    cpu_seconds,
    histogram_delta,
    logged_syncs,
    memory_mib,
    scrape,
)
from bench.realcp_latency.settings import (
    NODE,
    PROXY_FLAGS,
    SLICES,
    TARGET_PORT,
    Settings,
    pod_ip,
    pod_name,
    service_name,
)
from bench.realcp_latency.watch import SliceWatch, Writer, ready_addresses
from labs.realcp.build import Binaries
from labs.realcp.clusters import service, services_path
from labs.realcp.controlplane import ControlPlane
from labs.realcp.nodes import (
    ROOT,
    KubeProxy,
    NodeProxy,
    Sliceproxy,
    Workload,
    ensure_node,
    pod_status,
)
from labs.realcp.rawapi import RawApi
from proxy.netns_lab import Lab
from proxy.netns_lab.topology import NODE_LAN4


def _parallel(settings: Settings, jobs: Sequence[Callable[[], object]], what: str,
              progress: Callable[[str], None]) -> float:
    started = time.monotonic()
    with ThreadPoolExecutor(settings.parallel) as pool:
        for future in [pool.submit(job) for job in jobs]:
            future.result(timeout=max(1.0, started + settings.setup_deadline
                                      - time.monotonic()))
    seconds = time.monotonic() - started
    progress(f"{what}: {len(jobs)} in {seconds:.1f}s")
    return seconds


def _wait_slices(api: RawApi, ns: str, want: Mapping[str, frozenset[str]],
                 deadline: float, progress: Callable[[str], None]) -> float:
    """Until the EndpointSlice controller has written every service's ready pods."""
    started = time.monotonic()
    path = SLICES.format(ns=ns)
    while True:
        status, body = api.request("GET", path, timeout=120)[:2]
        have: dict[str, frozenset[str]] = {}
        if status == 200:
            for obj in body["items"]:
                svc = str((obj["metadata"].get("labels") or {})
                          .get("kubernetes.io/service-name", ""))
                have[svc] = have.get(svc, frozenset()) | ready_addresses(obj)
        done = sum(1 for s, ips in want.items() if have.get(s) == ips)
        if done == len(want):
            seconds = time.monotonic() - started
            progress(f"EndpointSlices for {done} services written in {seconds:.1f}s")
            return seconds
        if time.monotonic() > deadline:
            raise TimeoutError(f"EndpointSlice controller: {done}/{len(want)} services done")
        time.sleep(1.0)  # re-list pacing while the controller works; bounded by the deadline


def _make_proxy(name: str, cp: ControlPlane, bins: Binaries, lab: Lab,
                workdir: Path, backend: str = "auto") -> NodeProxy:
    if backend != "auto":
        lab.exec(lab.node_ns, [f"iptables-{backend}", "-t", "mangle", "-N",
                               "KUBE-IPTABLES-HINT"], check=True)
    base, _, pacing = name.partition("/")
    if base != "kube-proxy":
        return Sliceproxy.make(lab, cp.node_kubeconfig, workdir, "endpointslices",
                               *PROXY_FLAGS.get(base, ()), *PACINGS.get(pacing, ()))
    proxy = KubeProxy.make(lab, bins.path("kube-proxy"), cp.node_kubeconfig, workdir,
                           "endpointslices")
    if backend != "auto":
        tools = workdir / f"iptables-{backend}-tools"
        tools.mkdir(exist_ok=True)
        for base in ("iptables", "ip6tables"):
            for suffix in ("", "-save", "-restore"):
                link = tools / f"{base}{suffix}"
                if not link.exists():
                    link.symlink_to(f"/usr/sbin/{base}-{backend}{suffix}")
        proxy.env["PATH"] = f"{tools}:{proxy.env.get('PATH', '/usr/sbin:/usr/bin')}"
    return proxy


# Log lines that say what each proxy read and how it was tuned.
_EVIDENCE = {
    "kube-proxy": re.compile(r"^.*(?:Using iptables Proxier|sync params|Starting reflector "
                             r"\*v1beta1\.EndpointSlice|Starting endpoint slice config).*$",
                             re.MULTILINE),
    "sliceproxy": re.compile(r"^.*(?:using EndpointSlice API|agent started|iptables back end "
                             r"detected).*$", re.MULTILINE),
}


def _log_evidence(side: Side) -> list[str]:
    try:
        text = side.proxy.log_path.read_text(errors="replace")
    except OSError:
        return []
    return [m.group(0).strip()[:300] for m in _EVIDENCE[side.kind].finditer(text)][:6]


def environment() -> dict[str, Any]:
    """What else the machine was doing: load and the busiest processes."""
    ps = _run(["ps", "-eo", "pcpu,rss,comm", "--sort=-pcpu"], timeout=10).stdout
    return {"loadavg": Path("/proc/loadavg").read_text().split()[:3],
            "busiest": [" ".join(ln.split()) for ln in ps.splitlines()[1:7]]}


def versions(cp: ControlPlane, bins: Binaries) -> dict[str, Any]:
    kp = _run([str(bins.path("kube-proxy")), "--version"], timeout=30).stdout.strip()
    git = _run(["git", "-C", str(ROOT), "describe", "--always", "--dirty"], timeout=10)
    v = cp.version()
    return {"kube-apiserver": f"{v.get('gitVersion')} ({v.get('goVersion')})",
            "kube-proxy": kp, "source_package": bins.source_version,
            "sliceproxy": git.stdout.strip() or "unknown",
            "python": platform.python_version(),
            "iptables": _run(["iptables", "--version"], timeout=10).stdout.strip(),
            "kernel": platform.release(), "cpus": os.cpu_count()}


def begin(cp: ControlPlane, bins: Binaries, settings: Mapping[str, Any],
          prefix: str) -> tuple[RawApi, str, dict[str, Any]]:
    """What a run on the control plane starts with: a client, a namespace of its own
    (`prefix`-<ms>, created) and the result's head (date, settings, namespace, versions,
    what else the machine was doing)."""
    api = RawApi(cp.host_url, token=cp.token, context=cp.ssl_context())
    ns = f"{prefix}-{int(time.time() * 1000) % 10**8}"
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "settings": dict(settings), "namespace": ns, "versions": versions(cp, bins),
        "environment_start": environment()}
    api.must("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                            "metadata": {"name": ns}})
    return api, ns, result


def run(cp: ControlPlane, bins: Binaries, settings: Settings, workdir: Path,
        progress: Callable[[str], None] = quiet) -> dict[str, Any]:
    """The whole measurement on a running control plane; returns the results (JSON-able).
    Everything it starts (namespaces, processes, the watch) is gone when it returns."""
    settings.check()
    api, ns, result = begin(cp, bins, asdict(settings), "lat")
    deadline = time.monotonic() + settings.setup_deadline
    n, per = settings.services, settings.pods_per_service
    want = {service_name(i): frozenset(pod_ip(settings, i, j) for j in range(per))
            for i in range(n)}
    sides: list[Side] = []
    watch = SliceWatch(api, ns)
    with contextlib.ExitStack() as stack:
        if settings.cleanup_objects:
            stack.callback(_delete_objects, api, ns, settings)
        # --- the cluster's objects -------------------------------------------------------
        # The node first: the EndpointSlice controller refuses pods on an unknown node
        # (and then retries with a growing backoff). Every lab's node has this address.
        ensure_node(api, NODE, str(NODE_LAN4))
        loads = {service_name(i): Workload(api, ns, service_name(i)) for i in range(n)}
        setup: dict[str, float] = {}
        setup["pods_s"] = _parallel(settings, [
            functools.partial(loads[service_name(i)].add, pod_name(i, j),
                              pod_ip(settings, i, j), NODE)
            for i in range(n) for j in range(per)], "pods created and made ready", progress)
        setup["services_s"] = _parallel(settings, [
            functools.partial(api.must, "POST", services_path(ns), service(
                service_name(i), ns, selector={"app": service_name(i)}))
            for i in range(n)], "services created", progress)
        setup["slices_s"] = _wait_slices(api, ns, want, deadline, progress)
        result["setup"] = {k: round(v, 1) for k, v in setup.items()}
        # --- the proxies, one after the other --------------------------------------------
        for name in settings.sides():
            lab = stack.enter_context(Lab([], node_name=NODE, ipv6=False))
            cp.attach(lab.node_ns)
            stack.callback(cp.detach, lab.node_ns)
            side = Side(name, lab, _make_proxy(name, cp, bins, lab, workdir,
                                               settings.iptables_backend))
            sides.append(side)
            stack.callback(side.proxy.stop)
            side.proxy.start()
            expected = {(f"{ns}/{s}:http", f"{ip}:{TARGET_PORT}")
                        for s, ips in want.items() for ip in ips}
            side.initial = wait_initial(side, ns, expected, n, deadline)
            own, _ = logged_syncs(side)
            side.initial["first_sync_logged_s"] = round(own[0], 4) if own else None
            progress(f"{name}: all {len(expected)} endpoints programmed "
                     f"{side.initial['seconds_to_rules']:.2f}s after start "
                     f"({side.initial['backend']}, {side.initial['nat_rules']} nat rules)")
        for side in sides:
            side.initial["own_metrics"] = _startup_metrics(side)
            side.initial["log"] = _log_evidence(side)
            side.initial["argv"] = side.proxy.argv
        # --- the changes -----------------------------------------------------------------
        watch.start()
        stack.callback(watch.stop)
        changes = _changes(api, ns, settings, sides, watch, loads, progress)
        result["environment_end"] = environment()
        result["changes"] = changes["samples"]
        result["slice_watch_error"] = watch.error
        result["proxies"] = {}
        for side in sides:
            result["proxies"][side.name] = _side_result(side, changes)
    return result


def _startup_metrics(side: Side) -> dict[str, Any]:
    m = scrape(side.proxy)
    out = {"sync_proxy_rules_duration": histogram_delta({}, m,
           "kubeproxy_sync_proxy_rules_duration_seconds")}
    if "sliceproxy_first_sync_seconds" in m:
        out["sliceproxy_first_sync_seconds"] = {"value": m["sliceproxy_first_sync_seconds"]}
    return out


def _changes(api: RawApi, ns: str, settings: Settings, sides: Sequence[Side],
             watch: SliceWatch, loads: Mapping[str, Workload],
             progress: Callable[[str], None]) -> dict[str, Any]:
    rng = random.Random(settings.seed)
    chosen = rng.sample(range(settings.services), math.ceil(settings.changes / 2))
    # Pacing, here and between changes: each change comes after a quiet period (the
    # proxies' rate limiters full again, the initial syncs' tails over); not
    # synchronisation, which is by polling below.
    time.sleep(settings.spacing)
    before = {s.name: (scrape(s.proxy), cpu_seconds(s.pid), logged_syncs(s)[1]) for s in sides}
    samples: list[dict[str, Any]] = []
    with ThreadPoolExecutor(len(sides)) as pool, Writer(api) as writer, \
            contextlib.ExitStack() as listening:
        commits: dict[str, Commits] = {}
        for side in sides:
            if tables := commit_tables(side.backend):
                commits[side.name] = Commits(side.lab.node_ns, tables)
                listening.callback(commits[side.name].stop)
        for k in range(settings.changes):
            i = chosen[k // 2]
            svc, pod, ip = service_name(i), pod_name(i, 0), pod_ip(settings, i, 0)
            present = k % 2 == 1  # first not ready (the rule goes), then ready (it comes back)
            port, endpoint = f"{ns}/{svc}:http", f"{ip}:{TARGET_PORT}"
            all_ready = frozenset(pod_ip(settings, i, j)
                                  for j in range(settings.pods_per_service))
            ready_after = all_ready if present else all_ready - {ip}
            sent, acked = writer.patch(f"{loads[svc].path}/{pod}/status",
                                       pod_status(ip, present))
            futures = {}
            for side in sides:
                svc_chain, sep_chain = side.chains(port, endpoint)
                futures[side.name] = pool.submit(
                    watch_rule, side.lab.node_ns, side.backend, svc_chain, sep_chain, present,
                    sent, sent + settings.change_deadline, settings.poll_interval,
                    commits.get(side.name))
            seen = {name: f.result(timeout=settings.change_deadline + 60)
                    for name, f in futures.items()}
            sliced = watch.first(svc, ready_after, sent)
            sample: dict[str, Any] = {
                "change": k, "service": port, "endpoint": endpoint,
                "action": "add" if present else "remove",
                "patch_rtt_s": round(acked - sent, 4),
                "slice_seen_s": round(sliced - sent, 4) if sliced is not None else None}
            for name, s in seen.items():
                sample[name] = {"seconds": _r(s.seconds), "resolution_s": _r(s.resolution),
                                "polls": s.polls, "committed_s": _r(s.committed),
                                "commits": s.commits}
            samples.append(sample)
            progress(f"change {k + 1}/{settings.changes} ({sample['action']} {endpoint}): "
                     + ", ".join(f"{name} {_ms(s.seconds)} (commit {_ms(s.committed)})"
                                 for name, s in seen.items())
                     + f"; slice seen {_ms(sample['slice_seen_s'])}")
            if k + 1 < settings.changes:
                time.sleep(settings.spacing)
    # A proxy's rules are in the kernel before its sync function returns and records
    # its metrics: wait until every proxy counted a sync per change (or a deadline).
    after = {s.name: (_settled(s, before[s.name][0], settings.changes), cpu_seconds(s.pid))
             for s in sides}
    return {"samples": samples, "before": before, "after": after}


SYNC_COUNT = "kubeproxy_sync_proxy_rules_duration_seconds_count"


def _settled(side: Side, before: Mapping[str, float], syncs: int,
             timeout: float = 15.0) -> dict[str, float]:
    """The proxy's metrics once it has counted `syncs` more syncs than in `before`, or
    as they are after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape(side.proxy)
        if m.get(SYNC_COUNT, 0.0) - before.get(SYNC_COUNT, 0.0) >= syncs:
            return m
        if time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def _ms(x: float | None) -> str:
    return "MISSED" if x is None else f"{x * 1000:.0f} ms"


def _side_result(side: Side, changes: Mapping[str, Any]) -> dict[str, Any]:
    samples = changes["samples"]
    m0, cpu0, offset = changes["before"][side.name]
    m1, cpu1 = changes["after"][side.name]
    mine = [s[side.name]["seconds"] for s in samples]
    proxy_part = [None if s[side.name]["seconds"] is None or s["slice_seen_s"] is None
                  else s[side.name]["seconds"] - s["slice_seen_s"] for s in samples]
    syncs, _ = logged_syncs(side, offset)
    return {
        "latency": summary(mine),
        "latency_remove": summary([s[side.name]["seconds"] for s in samples
                                   if s["action"] == "remove"]),
        "latency_add": summary([s[side.name]["seconds"] for s in samples
                                if s["action"] == "add"]),
        "after_slice_seen": summary(proxy_part),
        "resolution": summary([s[side.name]["resolution_s"] for s in samples]),
        "committed": summary([s[side.name].get("committed_s") for s in samples]),
        "committed_after_slice_seen": summary([
            None if s[side.name].get("committed_s") is None or s["slice_seen_s"] is None
            else s[side.name]["committed_s"] - s["slice_seen_s"] for s in samples]),
        "commits_per_change": summary([s[side.name].get("commits") for s in samples]),
        "syncs_logged_during_changes": summary(syncs),
        "metrics_during_changes": {
            "network_programming_duration": histogram_delta(
                m0, m1, "kubeproxy_network_programming_duration_seconds"),
            "sync_proxy_rules_duration": histogram_delta(
                m0, m1, "kubeproxy_sync_proxy_rules_duration_seconds")},
        "cpu_during_changes_s": {k: round(cpu1[k] - cpu0[k], 2) for k in cpu0},
        "initial": side.initial,
        "memory_end_mib": memory_mib(side.pid),
    }


def _delete_objects(api: RawApi, ns: str, settings: Settings) -> None:
    """Pods and Services go (so that the proxies of later tests do not carry them); the
    namespace stays (no namespace controller runs), as in the other tests."""
    api.request("DELETE", f"/api/v1/namespaces/{ns}/pods",
                {"apiVersion": "v1", "kind": "DeleteOptions", "gracePeriodSeconds": 0},
                timeout=120)
    with ThreadPoolExecutor(settings.parallel) as pool:
        list(pool.map(lambda i: api.request("DELETE", f"{services_path(ns)}/{service_name(i)}"),
                      range(settings.services)))
