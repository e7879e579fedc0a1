"""The agent's cold start on the simulator: process start -> rules for every service.

    python -m bench.agent_start --services 1000 --endpoints 10 --mode nftables --runs 3
    python -m bench.agent_start --services 10000 --profile /tmp/cold.svg   (py-spy)

    python -m bench.agent_start --services 100000 --ipv6 --runs 2 --delete 1000
    python -m bench.agent_start --services 10000 --runs 2 --rewrite ports

The simulator (`python -m proxy.sim`, its own process) and the agent both run in a
network namespace made for the run (removed afterwards, its rules with it). The agent's
own figure is what it logs with "first sync done" (`since_start`: from the process's
start, imports included, to the first sync's commit), and its peak RSS (VmHWM) at that
moment. The simulator is not the real API server: its lists cost it more CPU (Python),
which the agent does not pay for; `bench/realcp_latency/` measures the same start on
kube-apiserver v1.20.2. Needs root.

Runs after the first start over the rules the one before left (a restart). `--delete N`
(nftables mode) deletes N services and their slices through the simulator's API before
each of them, while no agent runs: the restart then keeps what it can and deletes what
nobody claims (the sweep, nftables/restart.py). Its figures: when the sweep's log line
came (`sweep_done_s`, from the process's start) and its own `sweep_s`; and the kernel is
asked for each deleted service's ClusterIP (none may be left) and a kept one's.
`--rewrite` makes each run after the first another build's restart that writes every
port again: `ports`, an agent whose ports' fingerprints differ (the same rules; its bases
alike: the tables rewritten a transaction each, restart.rewrite_of), `all`, every
@fingerprints flushed before it (the bases too: every port written in one transaction).

Pod addresses come from 198.19.0.0/16; past 65,000 endpoints they repeat across
services, which costs the agent the same as distinct ones (each service's endpoints are
its own in the model and in the rules). ClusterIPs come from the simulator's IPv4
range, 198.18.128.0/17: 32,766 of them. Past that, `--ipv6` makes the cluster
single-stack IPv6 instead (ClusterIPs from fd00:198:18::/104, pods from fd00:19::/64,
every one distinct).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import datetime
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any

import yaml

from bench.common import (
    POD_BASE_V6,
    POD_CIDR_V6,
    ROOT,
    SERVICE_CIDR_V6,
    agent_pid,
    cpu_seconds,
    exit_on_sigterm,
    in_namespace,
    simulator,
    single_stack_v6,
    size_mib,
    stop,
    system_seconds,
)
from proxy.dataplane.nftables.render import CLUSTER_IPS, FINGERPRINTS, OUR_TABLES, TABLE
from proxy.dataplane.nftables.runner import NftRunner
from proxy.model.types import Family
from proxy.netns_lab.netns import entered
from proxy.netns_lab.poll import TimedOut, wait

POD_BASE = IPv4Address("198.19.0.1")
POD_ADDRESSES = 65_000
NODE = "node-a"
NODES = 50  # endpoints spread over this many nodes, one of them the agent's
FIRST_SYNC = re.compile(r"first sync done.*?since_start[=\"': ]+([0-9.]+)s")
# The split: process start -> every resource listed (imports, lists, decoding).
RESTART = re.compile(r"restart over our tables.*?ports_kept[=\"': ]+(\d+).*?"
                     r"ports_written[=\"': ]+(\d+)(?:.*?tables[=\"': ]+(\d+))?")
# The sweep after a restart (nftables/restart_steps.py), and a log line's time.
SWEPT = re.compile(r"time=(\S+) .*?what nobody claims deleted.*?seconds[=\"': ]+([0-9.]+)")
SWEEP_DUE = re.compile(r"restart over our tables: writing what differs.*?sweep=True")
FIRST_SYNC_AT = re.compile(r"time=(\S+) .*?first sync done")
LISTED = re.compile(r"every watched resource has listed.*?since_start[=\"': ]+([0-9.]+)s")
Obj = dict[str, Any]


def cluster(services: int, endpoints: int, real: bool = False,
            legacy: bool = False, ipv6: bool = False) -> list[Obj]:
    """Services with one TCP port and one EndpointSlice each (as the controller writes
    them: owned, labelled), endpoints ready, spread over NODES nodes; with `legacy`, an
    Endpoints object each too. `real`: the fields kube-apiserver v1.20's objects carry
    that the agent reads past (managedFields, targetRefs, owners, annotations): its
    EndpointSlice list is ~38 MB of JSON at 10,000 x 10, the simulator's own ~15 MB."""
    out: list[Obj] = []
    for i in range(services):
        name = f"s-{i}"
        svc: Obj = {"apiVersion": "v1", "kind": "Service",
                    "metadata": {"name": name, "namespace": "default"},
                    "spec": {"ports": [{"name": "http", "port": 80, "protocol": "TCP",
                                        "targetPort": 8080}]}}
        if ipv6:
            single_stack_v6(svc)
        eps, addresses = [], []
        for j in range(endpoints):
            k = i * endpoints + j
            pod = str(POD_BASE_V6 + k) if ipv6 else str(POD_BASE + k % POD_ADDRESSES)
            node = f"node-{'a' if k % NODES == 0 else k % NODES}"
            eps.append({"addresses": [pod], "conditions": {"ready": True}, "nodeName": node})
            addresses.append({"ip": pod, "nodeName": node})
        sl: Obj = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                   "metadata": {"name": f"{name}-x1", "namespace": "default",
                                "labels": {"kubernetes.io/service-name": name,
                                           "endpointslice.kubernetes.io/managed-by":
                                               "endpointslice-controller.k8s.io"}},
                   "addressType": "IPv6" if ipv6 else "IPv4", "endpoints": eps,
                   "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}
        ep: Obj = {"apiVersion": "v1", "kind": "Endpoints",
                   "metadata": {"name": name, "namespace": "default"},
                   "subsets": [{"addresses": addresses,
                                "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}]}]}
        if real:
            _as_served(i, svc, sl, ep)
        out += [svc, sl, ep] if legacy else [svc, sl]
    return out


def _as_served(i: int, svc: Obj, sl: Obj, ep: Obj) -> None:
    """What kube-apiserver v1.20 adds to the three objects of service `i`."""
    when = "2026-11-24T10:00:00Z"
    owner = f"00000000-0000-4000-8000-{i:012d}"
    trigger = {"endpoints.kubernetes.io/last-change-trigger-time": when}

    def managed(api: str, fields: Obj) -> list[Obj]:
        return [{"manager": "kube-controller-manager", "operation": "Update",
                 "apiVersion": api, "time": when, "fieldsType": "FieldsV1",
                 "fieldsV1": fields}]

    def pod(j: int) -> Obj:
        return {"kind": "Pod", "namespace": "default", "name": f"s-{i}-{j:05x}-abcde",
                "uid": f"00000000-0000-4000-9000-{i * 1000 + j:012d}",
                "resourceVersion": str(100_000 + i * 10 + j)}

    svc["spec"].update(selector={"app": f"s-{i}"}, sessionAffinity="None", type="ClusterIP")
    svc["metadata"]["managedFields"] = managed("v1", {"f:spec": {
        "f:ports": {".": {}, 'k:{"port":80,"protocol":"TCP"}': {
            ".": {}, "f:name": {}, "f:port": {}, "f:protocol": {}, "f:targetPort": {}}},
        "f:selector": {".": {}, "f:app": {}}, "f:sessionAffinity": {}, "f:type": {}}})
    meta = sl["metadata"]
    meta.update(generateName=f"s-{i}-", annotations=dict(trigger),
                ownerReferences=[{"apiVersion": "v1", "kind": "Service", "name": f"s-{i}",
                                  "uid": owner, "controller": True,
                                  "blockOwnerDeletion": True}])
    meta["managedFields"] = managed("discovery.k8s.io/v1", {
        "f:addressType": {}, "f:endpoints": {}, "f:ports": {},
        "f:metadata": {"f:annotations": {".": {}, "f:" + next(iter(trigger)): {}},
                       "f:generateName": {},
                       "f:labels": {".": {}, "f:endpointslice.kubernetes.io/managed-by": {},
                                    "f:kubernetes.io/service-name": {}},
                       "f:ownerReferences": {".": {}, f'k:{{"uid":"{owner}"}}': {
                           ".": {}, "f:apiVersion": {}, "f:blockOwnerDeletion": {},
                           "f:controller": {}, "f:kind": {}, "f:name": {}, "f:uid": {}}}}})
    for j, e in enumerate(sl["endpoints"]):
        e["targetRef"] = pod(j)
    ep["metadata"].update(annotations=dict(trigger), managedFields=managed("v1", {
        "f:metadata": {"f:annotations": {".": {}, "f:" + next(iter(trigger)): {}}},
        "f:subsets": {}}))
    for j, a in enumerate(ep["subsets"][0]["addresses"]):
        a["targetRef"] = pod(j)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@contextmanager
def namespace() -> Iterator[str]:
    ns = f"spx-cold-{uuid.uuid4().hex[:6]}"
    _ip("netns", "add", ns)
    try:
        _ip("-n", ns, "link", "set", "lo", "up")
        yield ns
    finally:
        subprocess.run(["ip", "netns", "delete", ns], check=False, capture_output=True)


def plant_backend_hint(ns: str, backend: str) -> None:
    """What kubelet does on a node: its KUBE-IPTABLES-HINT chain in the mangle table of
    the iptables back end the node uses, which the agent's detection follows."""
    subprocess.run(in_namespace(ns, [f"iptables-{backend}", "-t", "mangle", "-N",
                                     "KUBE-IPTABLES-HINT"]), check=True, capture_output=True)


def delete_services(ns: str, kubeconfig: Path, names: Sequence[str], legacy: bool,
                    keep: str) -> tuple[list[str], str]:
    """Delete the services `names`, their EndpointSlices (and Endpoints, `legacy`)
    through the simulator's API, while no agent runs: their ClusterIPs as they were, and
    the ClusterIP of service `keep`."""
    server = yaml.safe_load(kubeconfig.read_text())["clusters"][0]["cluster"]["server"]
    core = f"{server}/api/v1/namespaces/default"
    slices = f"{server}/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

    def call(method: str, url: str) -> Obj:
        with opener.open(urllib.request.Request(url, method=method), timeout=30) as r:
            out: Obj = json.loads(r.read())
            return out

    def cluster_ip(name: str) -> str:
        return str(call("GET", f"{core}/services/{name}")["spec"]["clusterIP"])

    ips = []
    with entered(ns):  # the simulator listens on the namespace's loopback
        for name in names:
            ips.append(cluster_ip(name))
            call("DELETE", f"{core}/services/{name}")
            call("DELETE", f"{slices}/{name}-x1")
            if legacy:
                call("DELETE", f"{core}/endpoints/{name}")
        return ips, cluster_ip(keep)


# The agent as another build whose every port renders otherwise (`--rewrite ports`), run
# at its start (Python's `sitecustomize`, `another_build`): the same rules, each port's
# fingerprint (render.fingerprint; a base's owner is its table alone) and its code's
# digest (which the input marks hold, marks.py) made with SALT.
ANOTHER_BUILD = """
import proxy.dataplane.nftables.marks as marks
import proxy.dataplane.nftables.render as render

SALT = {salt!r}
fingerprint = render.fingerprint


def salted(family, owner, *rest, **named):
    return fingerprint(family, (*owner, SALT) if len(owner) > 1 else owner, *rest, **named)


render.fingerprint = salted
marks.source_digest = SALT.encode
"""


def another_build(work: Path, salt: str) -> Path:
    """A folder whose `sitecustomize` makes the agent that has it on its path another
    build (`ANOTHER_BUILD`), one for each `salt`."""
    folder = work / f"build-{salt}"
    folder.mkdir(exist_ok=True)
    (folder / "sitecustomize.py").write_text(ANOTHER_BUILD.format(salt=salt))
    return folder


def forget_fingerprints(ns: str, ipv6: bool) -> None:
    """Every @fingerprints of our tables flushed, while no agent runs: what a version
    that renders every port and base otherwise (another layout) finds at its start."""
    family = "ip6" if ipv6 else "ip"
    listed = subprocess.run(in_namespace(ns, ["nft", "list", "tables", family]),
                            check=True, capture_output=True, text=True).stdout
    tables = [t for t in re.findall(rf"^table {family} (\S+)$", listed, re.M)
              if t in OUR_TABLES]
    script = "".join(f"flush set {family} {t} {FINGERPRINTS}\n" for t in tables)
    subprocess.run(in_namespace(ns, ["nft", "-f", "-"]), input=script, check=True,
                   capture_output=True, text=True)


def deletion_plan(services: int, delete: int, runs: int) -> list[list[str]]:
    """The services deleted before each run after the first: `delete` each, spread over
    the cluster, none twice; service s-0 is never deleted."""
    stride = services // delete
    return [[f"s-{i}" for i in range(run, services, stride)][:delete]
            for run in range(1, runs)]


def held_cluster_ips(ns: str, ips: Sequence[str], ipv6: bool) -> int:
    """How many of `ips` the main table's set of ClusterIPs holds, asked one by one
    (`NftRunner.probe`; `nft get element` reads the whole ruleset first: minutes at
    100,000)."""
    with entered(ns):
        runner = NftRunner()
        try:
            held = runner.probe(Family.V6 if ipv6 else Family.V4, TABLE, CLUSTER_IPS,
                                [(ip,) for ip in ips])
        finally:
            runner.close()
    return len(held.raw)


def sweep_figures(log_text: str, since_start: float) -> dict[str, float | None]:
    """When a restart's sweep ended (seconds from the process's start, by the log's
    clock against the first sync's line) and what it took itself. A restart that
    rendered every port deleted what nobody claims in its first sync: no sweep after."""
    swept, first = SWEPT.search(log_text), FIRST_SYNC_AT.search(log_text)
    if swept is None or first is None:
        return {"sweep_done_s": since_start, "sweep_s": None}
    gap = _log_time(swept.group(1)) - _log_time(first.group(1))
    return {"sweep_done_s": round(since_start + gap, 3), "sweep_s": float(swept.group(2))}


def _log_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def start_once(ns: str, kubeconfig: Path, mode: str, work: Path, run: int,
               profile: Path | None, timeout: float, idle: float = 0.0,
               endpoints_source: str = "endpointslices", ipv6: bool = False,
               deleted: Sequence[str] = (), kept: str = "", salt: str = "") -> dict[str, Any]:
    """One start of the agent; `deleted`: ClusterIPs of services deleted before it, whose
    rules its sweep must remove (`kept`: one that must stay); `salt`: it is another
    build, its ports' fingerprints made with it (`ANOTHER_BUILD`)."""
    argv = [sys.executable, "-m", "proxy", "--kubeconfig", str(kubeconfig),
            "--hostname-override", NODE, "--proxy-mode", mode,
            "--cluster-cidr", POD_CIDR_V6 if ipv6 else "198.19.0.0/16",
            "--endpoints-source", endpoints_source, "-v", "1"]
    if profile is not None:
        fmt = {".txt": "raw", ".json": "speedscope"}.get(profile.suffix, "flamegraph")
        argv = [str(Path(sys.executable).with_name("py-spy")), "record", "--rate", "250",
                "--subprocesses", "--format", fmt, "--output", str(profile), "--", *argv]
    log_path = work / f"agent-{run}.log"
    path = f"{another_build(work, salt)}:{ROOT}" if salt else str(ROOT)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(in_namespace(ns, argv), stdout=log, stderr=subprocess.STDOUT,
                                cwd=ROOT, env={**os.environ, "PYTHONPATH": path})
    began = time.monotonic()
    timeline: list[tuple[float, float]] = []  # (seconds since start, RSS MiB)
    try:
        agent: int | None = None

        def first_sync() -> re.Match[str] | None:
            """The log's first-sync line; meanwhile the RSS timeline is sampled."""
            nonlocal agent
            if match := FIRST_SYNC.search(log_path.read_text(errors="replace")):
                return match
            if proc.poll() is not None:
                raise RuntimeError(f"no first sync: {log_path}")
            agent = agent or agent_pid(proc.pid)
            rss = size_mib(agent, "VmRSS") if agent else None
            if rss is not None:
                timeline.append((round(time.monotonic() - began, 2), round(rss, 1)))
            return None

        try:
            match = wait(first_sync, timeout, "the first sync", interval=0.05)
        except TimedOut:
            raise RuntimeError(f"no first sync: {log_path}") from None
        agent = agent_pid(proc.pid)
        text = log_path.read_text(errors="replace")
        listed = LISTED.search(text)
        since_start = float(match.group(1))
        out: dict[str, Any] = {"cold_start_s": since_start,
               "listed_s": float(listed.group(1)) if listed else None,
               # A start over the tables the previous run left (runs after the first,
               # nftables mode): what it kept and wrote (restart.py).
               # (and, another build's ports rewritten a table a transaction, how many)
               "restart": [{"ports_kept": int(k), "ports_written": int(w),
                            "tables_rewritten": int(t or 0)}
                           for k, w, t in RESTART.findall(text)] or None,
               # the agent's CPU to this moment (a loaded machine stretches the wall
               # clock more than this), and the kernel's share of it
               "cpu_s": cpu_seconds(agent) if agent else None,
               "sys_s": system_seconds(agent) if agent else None,
               "peak_rss_mib": size_mib(agent, "VmHWM") if agent else None,
               "rss_timeline": timeline}
        if deleted:
            out["sweep"] = _swept(ns, log_path, proc, since_start, deleted, kept, timeout,
                                  ipv6)
            # The restart's peak until its sweep is done (the kept ports' state is
            # made, and the sweep's diff, after the first sync).
            out["sweep"]["peak_rss_mib"] = size_mib(agent, "VmHWM") if agent else None
        if idle > 0 and agent:
            # Nothing changes in the cluster now: what the agent spends doing nothing
            # (timers, watch bookmarks), per second, after the first sync has settled.
            time.sleep(1.0)
            before = cpu_seconds(agent)
            time.sleep(idle)
            out["idle_cpu_percent"] = round(100 * (cpu_seconds(agent) - before) / idle, 2)
            out["rss_after_mib"] = size_mib(agent, "VmRSS")
        return out
    finally:
        if profile is not None:  # py-spy writes its profile when its child ends
            agent = agent_pid(proc.pid)
            if agent:
                os.kill(agent, signal.SIGTERM)
            proc.wait(120)
        stop(proc)


def _swept(ns: str, log_path: Path, proc: subprocess.Popen[bytes], since_start: float,
           deleted: Sequence[str], kept: str, timeout: float, ipv6: bool) -> dict[str, Any]:
    """After a restart's first sync: its sweep awaited (if one is due), timed, and
    checked in the kernel (a sample of the deleted services' ClusterIPs)."""
    def done() -> bool:
        text = log_path.read_text(errors="replace")
        if proc.poll() is not None:
            raise RuntimeError(f"the agent exited before its sweep: {log_path}")
        return SWEEP_DUE.search(text) is None or SWEPT.search(text) is not None

    wait(done, timeout, "the restart's sweep", interval=0.1)
    sample = deleted[:: max(1, len(deleted) // 50)]
    return {**sweep_figures(log_path.read_text(errors="replace"), since_start),
            "deleted": len(deleted), "checked": len(sample),
            "deleted_held": held_cluster_ips(ns, sample, ipv6),
            "kept_held": held_cluster_ips(ns, [kept], ipv6) == 1}


def _sweep_text(sweep: dict[str, Any] | None) -> str:
    if sweep is None:
        return ""
    return (f"; {sweep['deleted']} services deleted before it: swept at "
            f"{sweep['sweep_done_s']:.3f} s (its own {sweep['sweep_s'] or 0:.3f} s), "
            f"{sweep['deleted_held']} of {sweep['checked']} deleted ClusterIPs left, "
            f"a kept one {'held' if sweep['kept_held'] else 'MISSING'}, "
            f"peak RSS by then {sweep.get('peak_rss_mib') or 0:.0f} MiB")


def markdown(summary: dict[str, Any]) -> str:
    runs = summary["runs"]
    starts = ", ".join(f"{r['cold_start_s']:.2f}" for r in runs)
    peaks = ", ".join(f"{r['peak_rss_mib'] or 0:.0f}" for r in runs)
    idle = ", ".join(f"{r['idle_cpu_percent']}" for r in runs if "idle_cpu_percent" in r)
    restarts = "; ".join(_restart_text(r) for r in runs[1:])
    return "\n".join([
        "| services x endpoints | mode | cold start, median (runs) | peak RSS MiB (runs) | "
        "idle CPU % (runs) | restarts |",
        "|---|---|---|---|---|---|",
        f"| {summary['services']:,} x {summary['endpoints']} | {summary['mode']} | "
        f"{summary['cold_start_median_s']:.2f} s ({starts}) | {peaks} | {idle or '-'} | "
        f"{restarts or '-'} |"])


def _restart_text(run: dict[str, Any]) -> str:
    """A restart's ports kept and written (IPv4 and IPv6 summed), and its sweep."""
    families = run.get("restart") or []
    kept = sum(f["ports_kept"] for f in families)
    written = sum(f["ports_written"] for f in families)
    tables = sum(f.get("tables_rewritten", 0) for f in families)
    text = f"{kept:,} kept, {written:,} written" + (f" ({tables} tables rewritten)"
                                                    if tables else "")
    if s := run.get("sweep"):
        text += (f", {s['deleted']} deleted: swept at {s['sweep_done_s']:.2f} s, "
                 f"{s['deleted_held']} of {s['checked']} left")
    return text


# ClusterIPs the simulator's default IPv4 service range (198.18.128.0/17) holds.
V4_SERVICES = 2 ** 15 - 2


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    ap = argparse.ArgumentParser(prog="python -m bench.agent_start", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=1000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--mode", default="nftables", choices=("iptables", "nftables"))
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--iptables-backend", choices=("auto", "nft", "legacy"), default="auto",
                    help="with --mode iptables: the back end the node's kubelet hint names "
                    "(auto: none planted, the agent's own detection)")
    ap.add_argument("--profile", type=Path,
                    help="py-spy profile of the first run: .svg flame graph, .txt collapsed "
                    "stacks, .json speedscope (py-spy must be installed)")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--idle", type=float, default=0.0, metavar="SECONDS",
                    help="after the first sync, measure the agent's CPU over this long")
    ap.add_argument("--no-watch-cache", action="store_true",
                    help="the simulator pages the first lists (--watch-cache=false)")
    ap.add_argument("--endpoints-source", choices=("endpointslices", "endpoints"),
                    default="endpointslices", help="what the agent reads endpoints from "
                    "(endpoints: the cluster gets an Endpoints object per service too)")
    ap.add_argument("--real-shaped", action="store_true",
                    help="objects as kube-apiserver v1.20 serves them (managedFields, "
                    "targetRefs, owners, annotations), 2.5x the bytes to list and parse")
    ap.add_argument("--ipv6", action="store_true",
                    help="a single-stack IPv6 cluster: room for more than 65,000 services")
    ap.add_argument("--delete", type=int, default=0, metavar="N",
                    help="nftables mode: before each run after the first, delete N services "
                    "(the restart's sweep is timed and checked)")
    ap.add_argument("--rewrite", choices=("ports", "all"),
                    help="nftables mode: each run after the first as another build's "
                    "restart that writes every port again: ports, the agent's ports "
                    "fingerprinted otherwise (another build renders them otherwise, its "
                    "bases alike); all, every @fingerprints of our tables flushed before "
                    "it (its bases too)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep-logs", type=Path, metavar="DIR",
                    help="keep the agent's and the simulator's logs here")
    args = ap.parse_args(argv)
    if args.services < 1 or args.endpoints < 1 or args.runs < 1:
        ap.error("--services, --endpoints and --runs must be positive")
    if args.delete and (args.mode != "nftables" or args.delete < 0
                        or args.services // args.delete < args.runs):
        ap.error("--delete needs --mode nftables, and N at most services / runs")
    if args.rewrite and args.mode != "nftables":
        ap.error("--rewrite needs --mode nftables")
    if not args.ipv6 and args.services > V4_SERVICES:
        ap.error(f"the simulator's IPv4 service range holds {V4_SERVICES:,} ClusterIPs: "
                 "use --ipv6 for more services")
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="spx-cold-") as tmp:
        work = args.keep_logs or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        manifest = work / "cluster.json"
        manifest.write_bytes(json.dumps(cluster(
            args.services, args.endpoints, args.real_shaped,
            args.endpoints_source == "endpoints", args.ipv6)).encode())
        with namespace() as ns, simulator(ns, manifest, work, not args.no_watch_cache,
                                          service_cidr_v6=SERVICE_CIDR_V6
                                          ) as kubeconfig:
            if args.iptables_backend != "auto":
                plant_backend_hint(ns, args.iptables_backend)
            plan = deletion_plan(args.services, args.delete, args.runs) if args.delete else []
            for run in range(args.runs):
                profile = args.profile if run == 0 else None
                deleted, kept = delete_services(
                    ns, kubeconfig, plan[run - 1], args.endpoints_source == "endpoints",
                    "s-0") if run and plan else ([], "")
                if run and args.rewrite == "all":
                    forget_fingerprints(ns, args.ipv6)
                salt = f"build-{run}" if run and args.rewrite == "ports" else ""
                result = start_once(ns, kubeconfig, args.mode, work, run, profile, args.timeout,
                                    args.idle, args.endpoints_source, args.ipv6, deleted, kept,
                                    salt)
                print(f"run {run + 1}: {'restart' if run else 'cold start'} "
                      f"{result['cold_start_s']:.3f} s (listed at "
                      f"{result['listed_s'] or 0:.3f} s), agent CPU {result['cpu_s'] or 0:.2f} s "
                      f"({result['sys_s'] or 0:.2f} s system), "
                      f"peak RSS {result['peak_rss_mib'] or 0:.0f} MiB"
                      + _sweep_text(result.get("sweep")), flush=True)
                results.append(result)
    starts = sorted(r["cold_start_s"] for r in results)
    summary = {"services": args.services, "endpoints": args.endpoints, "mode": args.mode,
               "ipv6": args.ipv6,
               "endpoints_source": args.endpoints_source, "real_shaped": args.real_shaped,
               "iptables_backend": args.iptables_backend,
               "runs": results, "cold_start_median_s": starts[len(starts) // 2]}
    print(json.dumps(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
