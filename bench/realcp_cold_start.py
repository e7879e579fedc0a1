"""The nftables mode's cold start on a quiet real API server (issue 29: 10,000 services x
10 endpoints, process start -> every rule <= 5 s).

    sudo .venv/bin/python -m bench.realcp_cold_start                  # 10,000 x 10, 3 runs
    sudo .venv/bin/python -m bench.realcp_cold_start --services 200 --runs 1 --json out.json
    # the most services v1.20 holds (single-stack IPv6; see below): ~8 minutes of writes
    sudo .venv/bin/python -m bench.realcp_cold_start --ipv6 --services 65000 --runs 1 \
        --sources endpointslices --json ipv6-65k.json

kube-apiserver and kube-controller-manager v1.20.2 (labs/realcp) are started as
`bench.realcp_latency` starts them, and everything (control plane, node namespaces,
processes, files) is removed on exit, SIGTERM included. Unlike `bench.realcp_latency`,
no Pod is made: N Services without a selector (one TCP port "http", 80 -> 8080) and,
for each, its endpoints are written straight to the API server (P ready addresses from
198.18.0.0/15, their nodeName spread over 50 node names, the agent's "node-a" one of
them): `--sources endpoints` an Endpoints object, `endpointslices` a
discovery.k8s.io/v1beta1 EndpointSlice managed by us
(`endpointslice.kubernetes.io/managed-by: sliceproxy-bench.example.com`, which neither
the EndpointSlice nor the mirroring controller touches). The Endpoints objects carry
`endpointslice.kubernetes.io/skip-mirror: "true"`, the endpointslicemirroring
controller's opt-out (v1.19+: it mirrors an Endpoints object only if its Service has no
selector and neither that label nor a leader-election annotation is set): nothing is
mirrored, so the controller manager has no backlog and the EndpointSlice agent sees
only our slices, one per service. The result's `mirrored_slices` counts slices managed
by the mirroring controller in the namespace at the end (0 expected). The writes go
out from a thread pool under one set-up deadline.

`--ipv6` makes it all single-stack IPv6: the control plane, the node ("node-a" at
fd00:18::1, its namespace with IPv6), every endpoint a distinct address of fd00:19::/64
(the agent's --cluster-cidr; bench/common.py's POD_CIDR_V6), slices of addressType
IPv6, and the agent's tables read in the ip6 family. Its point is size: v1.20 allocates
32,766 IPv4 ClusterIPs from the lab's range and 65,535 IPv6 ones (labs/realcp/
addressing.py: its allocator serves 2**16 addresses of an IPv6 range however wide), the
`kubernetes` Service's among them, so --services goes up to 32,765 or 65,534 (checked
before anything is written). 100,000 services do not fit a stock v1.20 API server in
either family. At 65,000 x 10 with one source the set-up writes 130,000 objects: about
8 minutes at the ~290 objects/s a 2-core machine manages (the default --setup-deadline,
25 minutes, covers it and both sources' 195,000); reading the tables back takes
seconds after they were seen live, which the figures do not include, and the start
deadline does not cut short a reading once begun.

Before each measured start the bench waits (bounded, polling /proc once a second) until
kube-apiserver and kube-controller-manager each used less than `--quiet-cpu` of a core
over the last second, and records what it saw (with etcd's and the machine's load).
Then, `--runs` times per source (sources alternating): a fresh lab node namespace
attached to the control plane, sliceproxy in nftables mode with its default flags
(`--endpoints-source` the source), and records:

* `committed_s`: process start -> the first sync's (last) transaction committed, seen
  as the moment our main table's hooked `nat-postrouting` chain first answers a lookup
  (`LiveChainAppears`, polled every 10 ms from before the start; `commit_resolution_s`
  the bracket): a first start in parts adds its hooked chains with the last part, so
  the table alone would date the first. Not by nf_tables' announcements
  (`Commits`): a listener makes the kernel announce each of the ~130,000 objects of
  the agent's commit, which cost the agent ~5 s at 10,000 x 10; `--announcements` adds
  that listener (and `committed_announced_s`) to show it;
* `seconds_to_rules`: process start -> every one of the N x P endpoints seen DNATed in
  the rules (polls every 0.25 s; reading 110,000 rules back as JSON takes about a second
  at 10,000 x 10, so this is later than the commit by that much);
* the agent's own log: "every watched resource has listed" and "first sync done"
  (`since_start`, from the process's start);
* the agent's CPU (self; user and system apart) and peak RSS (VmHWM) when the rules
  were seen.

Then the agent is stopped and its namespace deleted. A measurement, never a pass/fail on
time. `run()` is the core; tests/realcp/test_cold_start_bench.py calls it at a tiny size
on the tier's session control plane (which it leaves as it found it).
"""

from __future__ import annotations

import argparse
import compileall
import contextlib
import errno
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from ipaddress import IPv6Network, ip_address
from pathlib import Path
from typing import Any

from bench.agent_start import FIRST_SYNC, LISTED, NODES
from bench.common import CLOCK_TICKS, POD_CIDR_V6, cpu_times, quiet
from bench.realcp_latency.cli import on_control_plane
from bench.realcp_latency.measure import Commits, commit_tables, summary, wait_initial
from bench.realcp_latency.nat import live_chain_lookup
from bench.realcp_latency.proxies import Side
from bench.realcp_latency.run import begin, environment
from bench.realcp_latency.settings import (
    NFT_MAIN,
    NFTABLES,
    NODE,
    POD_ADDRESSES,
    PROXY_FLAGS,
    TARGET_PORT,
    service_name,
)
from labs.realcp.addressing import IPV4, IPV6, IPV6_ONLY
from labs.realcp.build import Binaries
from labs.realcp.clusters import Ep, endpoint_slice, service, services_path
from labs.realcp.controlplane import ControlPlane
from labs.realcp.nodes import POD_CIDR, ROOT, Sliceproxy, ensure_node
from labs.realcp.rawapi import RawApi
from proxy.dataplane.common.netlink import NetlinkSocket
from proxy.dataplane.common.netlink_constants import NETLINK_NETFILTER
from proxy.model.types import Family, format_endpoint
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from proxy.netns_lab.poll import TimedOut, wait
from proxy.netns_lab.topology import NODE_LAN4, NODE_LAN6, ip

SOURCES = ("endpoints", "endpointslices")
SIDE = "sliceproxy-nftables"  # realcp_latency's name for the mode; its flags
SLICE_API = "discovery.k8s.io/v1beta1"  # what v1.20 serves
MANAGER = "sliceproxy-bench.example.com"
MANAGED_BY = "endpointslice.kubernetes.io/managed-by"
SKIP_MIRROR = "endpointslice.kubernetes.io/skip-mirror"
MIRROR_MANAGER = "endpointslicemirroring-controller.k8s.io"
WATCHED = ("kube-apiserver", "kube-controller-manager", "etcd")  # CPU recorded
QUIET_OF = ("kube-apiserver", "kube-controller-manager")  # CPU waited for
Obj = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Settings:
    services: int = 10_000
    endpoints: int = 10  # per service
    runs: int = 3  # per source
    sources: tuple[str, ...] = SOURCES
    parallel: int = 16  # concurrent API requests while writing the objects
    setup_deadline: float = 1500.0  # every object written
    start_deadline: float = 300.0  # per run: process start -> every endpoint in the rules
    quiet_cpu: float = 0.10  # of a core, each of QUIET_OF, over the last second
    quiet_deadline: float = 180.0  # then the run starts anyway (recorded as not quiet)
    cleanup_objects: bool = False  # delete what was written (a shared control plane)
    # Also listen to nf_tables' announcements, as bench.realcp_latency does: it costs the
    # agent's commit seconds (LiveChainAppears), so only to show that.
    announcements: bool = False
    # Checkouts whose agents take turns (an A/B on one control plane); none: this one.
    agent_roots: tuple[str, ...] = ()
    ipv6: bool = False  # single-stack IPv6 (module docstring); the control plane's too

    @property
    def family(self) -> Family:
        return Family.V6 if self.ipv6 else Family.V4

    def check(self) -> None:
        if min(self.services, self.endpoints, self.runs, self.parallel) < 1:
            raise ValueError("services, endpoints, runs and parallel must be positive")
        if self.endpoints > len(POD_ADDRESSES):
            raise ValueError(f"at most {len(POD_ADDRESSES)} endpoints per service")
        plan = IPV6 if self.ipv6 else IPV4
        if self.services > plan.cluster_ips - 1:  # one is the `kubernetes` Service's
            raise ValueError(f"at most {plan.cluster_ips - 1} {plan.name} services: v1.20 "
                             f"allocates {plan.cluster_ips} ClusterIPs from {plan.services}")
        if not self.sources or not set(self.sources) <= set(SOURCES) \
                or len(set(self.sources)) != len(self.sources):
            raise ValueError(f"sources: distinct ones of {SOURCES}")


# --- the objects ----------------------------------------------------------------------


# --ipv6's endpoints: the k-th of all is fd00:19::(k+1), never one twice.
POD_NET_V6 = IPv6Network(POD_CIDR_V6)


def addresses(settings: Settings, i: int) -> list[tuple[str, str]]:
    """Service i's endpoints as (address, node name). IPv4 addresses come from
    realcp_latency's pod ranges in 198.18.0.0/15 and repeat across services past their
    97,534 (never within one); IPv6 ones are distinct (POD_NET_V6); nodes are NODE and
    node-1 .. node-49 in turn."""
    out = []
    for j in range(settings.endpoints):
        k = i * settings.endpoints + j
        address = POD_NET_V6.network_address + 1 + k if settings.ipv6 \
            else POD_ADDRESSES[k % len(POD_ADDRESSES)]
        out.append((str(address), NODE if k % NODES == 0 else f"node-{k % NODES}"))
    return out


def wanted(settings: Settings, ns: str) -> set[tuple[str, str]]:
    """Every (service port, endpoint) the rules must show, spelled as nat.nft_view
    spells them (the debug dump's `format_endpoint`)."""
    return {(f"{ns}/{service_name(i)}:http", format_endpoint(ip_address(a), TARGET_PORT))
            for i in range(settings.services) for a, _ in addresses(settings, i)}


def endpoints_object(name: str, ns: str, eps: Sequence[tuple[str, str]]) -> Obj:
    return {"apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": name, "namespace": ns, "labels": {SKIP_MIRROR: "true"}},
            "subsets": [{"addresses": [{"ip": a, "nodeName": n} for a, n in eps],
                         "ports": [{"name": "http", "port": TARGET_PORT,
                                    "protocol": "TCP"}]}]}


def slice_object(name: str, ns: str, eps: Sequence[tuple[str, str]],
                 family: Family = Family.V4) -> Obj:
    obj = endpoint_slice(SLICE_API, f"{name}-bench", ns, name,
                         [Ep(a, node=n) for a, n in eps], port=TARGET_PORT,
                         address_type=family.label)
    obj["metadata"]["labels"][MANAGED_BY] = MANAGER
    return obj


def _write_service(api: RawApi, ns: str, settings: Settings, i: int) -> None:
    name = service_name(i)
    eps = addresses(settings, i)
    api.must("POST", services_path(ns), service(name, ns))  # no selector
    if "endpoints" in settings.sources:
        api.must("POST", f"/api/v1/namespaces/{ns}/endpoints",
                 endpoints_object(name, ns, eps))
    if "endpointslices" in settings.sources:
        api.must("POST", f"/apis/{SLICE_API}/namespaces/{ns}/endpointslices",
                 slice_object(name, ns, eps, settings.family))


def write_all(api: RawApi, ns: str, settings: Settings,
              progress: Callable[[str], None]) -> dict[str, Any]:
    """Every service and its endpoints, `settings.parallel` at a time; raises if the
    set-up deadline passes first."""
    started = time.monotonic()
    deadline = started + settings.setup_deadline
    with ThreadPoolExecutor(settings.parallel) as pool:
        futures = [pool.submit(_write_service, api, ns, settings, i)
                   for i in range(settings.services)]
        try:
            for k, future in enumerate(futures, 1):
                future.result(timeout=max(1.0, deadline - time.monotonic()))
                if k % 2000 == 0:
                    progress(f"{k}/{settings.services} services written "
                             f"({time.monotonic() - started:.0f} s)")
        except BaseException:  # a failure, the deadline, SIGTERM: the rest is not sent
            pool.shutdown(cancel_futures=True)
            raise
    seconds = time.monotonic() - started
    objects = settings.services * (1 + len(settings.sources))
    progress(f"{objects} objects written in {seconds:.1f}s")
    return {"seconds": round(seconds, 1), "objects": objects,
            "per_second": round(objects / seconds, 1)}


def mirrored_slices(api: RawApi, ns: str) -> int:
    status, body = api.get(f"/apis/{SLICE_API}/namespaces/{ns}/endpointslices",
                           labelSelector=f"{MANAGED_BY}={MIRROR_MANAGER}")
    if status != 200:
        raise RuntimeError(f"listing mirrored slices: HTTP {status}: {body}")
    return len(body["items"])


def _delete_objects(api: RawApi, ns: str, settings: Settings) -> None:
    """What was written goes (so that later tests' proxies do not carry it); the
    namespace stays (no namespace controller runs), as in bench.realcp_latency."""
    for path in (f"/api/v1/namespaces/{ns}/endpoints",
                 f"/apis/{SLICE_API}/namespaces/{ns}/endpointslices"):
        api.request("DELETE", path, timeout=300)
    with ThreadPoolExecutor(settings.parallel) as pool:
        list(pool.map(lambda i: api.request("DELETE", f"{services_path(ns)}/"
                                            f"{service_name(i)}"), range(settings.services)))


# --- a quiet control plane ------------------------------------------------------------


def control_plane_pids(cp: ControlPlane) -> dict[str, int]:
    """The control plane's processes by name, found in its network namespace."""
    out: dict[str, int] = {}
    for pid in ip("netns", "pids", cp.namespace, check=False).stdout.split():
        with contextlib.suppress(OSError):
            name = Path(os.readlink(f"/proc/{pid}/exe")).name
            if name in WATCHED:
                out[name] = int(pid)
    return out


def wait_quiet(cp: ControlPlane, settings: Settings) -> dict[str, Any]:
    """Until each of QUIET_OF used under `quiet_cpu` of a core over the last second (or
    the deadline: then `quiet` is false). Returns the last second's CPU of each
    (fraction of a core), how long it took and the machine's load."""
    pids = control_plane_pids(cp)
    missing = set(QUIET_OF) - set(pids)
    if missing:
        raise RuntimeError(f"control plane processes not found: {sorted(missing)}")
    started = time.monotonic()
    last = (started, {n: sum(cpu_times(p)) for n, p in pids.items()})
    seen: dict[str, float] = {}

    def quiet_now() -> bool:
        nonlocal last, seen
        now, cpu = time.monotonic(), {n: sum(cpu_times(p)) for n, p in pids.items()}
        if now - last[0] < 0.9:
            return False
        seen = {n: round((cpu[n] - last[1][n]) / (now - last[0]), 3) for n in cpu}
        last = (now, cpu)
        return all(seen[n] < settings.quiet_cpu for n in QUIET_OF)

    calm = True
    try:
        wait(quiet_now, settings.quiet_deadline, "a quiet control plane", interval=1.0)
    except TimedOut:
        calm = False
    return {"quiet": calm, "waited_s": round(time.monotonic() - started, 1),
            "cpu_last_second": seen, "threshold": settings.quiet_cpu,
            "loadavg": Path("/proc/loadavg").read_text().split()[:3]}


# --- dating the first sync's commit -----------------------------------------------------


class LiveChainAppears:
    """When our main table's hooked `nat-postrouting` chain first answers a lookup in a
    namespace: the moment the agent's first sync was committed (one transaction, or the
    last of a first start's parts, which adds every hooked chain; no lookup sees a
    transaction's objects before its commit), bracketed by polls `interval` apart
    (`seen_at` the end of the first poll that found it, `absent_since` the start of the
    last that did not).

    A lookup (NFT_MSG_GETCHAIN, lockless in the kernel) rather than nf_tables'
    announcements (bench.realcp_latency's `Commits`): while any socket listens to those,
    the kernel writes one for every object a transaction touches, in the committing
    process, even though the agent itself leaves the group for its own full sync
    (`MulticastListener.deaf`). At 10,000 x 10 that took the agent's kernel CPU from
    1.2 to 5.6-6.4 s and its first sync from 5.6 to 10-11 s (an A/B on one control
    plane)."""

    def __init__(self, ns: str, family: Family = Family.V4, interval: float = 0.01) -> None:
        with entered(ns):  # the socket belongs to the namespace it is made in
            self._sock = NetlinkSocket(NETLINK_NETFILTER)
        self._request = live_chain_lookup(family)
        self.interval = interval
        self.absent_since: float | None = None
        self.seen_at: float | None = None
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="live-chain-appears", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            start = time.monotonic()
            code = self._sock.execute_raw([self._request])[0]
            if code == 0:
                self.seen_at = time.monotonic()
                return
            if code != errno.ENOENT:
                self.error = os.strerror(code)
                return
            self.absent_since = start
            self._stop.wait(self.interval)  # the polls' spacing: the figure's resolution

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
        self._sock.close()


def machine_busy() -> float:
    """CPU seconds the whole machine has been busy (every core, all but idle and I/O
    wait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS


def user_system(pid: int) -> tuple[float, float]:
    """A process's user and system (kernel) CPU seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[11]) / CLOCK_TICKS, int(fields[12]) / CLOCK_TICKS


# --- one start --------------------------------------------------------------------------


# The agent's word for what it reads endpoints from.
SOURCE_LINE = re.compile(r'msg="(using (?:EndpointSlice API|legacy Endpoints)[^"]*)"')


def _logged(log_path: Path, pattern: re.Pattern[str]) -> str | None:
    """The first group of the pattern's first match in the agent's log."""
    match = pattern.search(log_path.read_text(errors="replace"))
    return match.group(1) if match else None


def start_once(cp: ControlPlane, settings: Settings, source: str, ns: str,
               want: set[tuple[str, str]], workdir: Path,
               root: Path = ROOT) -> dict[str, Any]:
    """One cold start of the agent in a fresh node namespace; everything it started is
    gone when this returns."""
    before = wait_quiet(cp, settings)
    out: dict[str, Any] = {"source": source, "control_plane_before": before,
                           "environment_before": environment()}
    family = settings.family
    # ipv6: the lab's namespaces get IPv6 addresses too (NODE_LAN6 on the node's lan0),
    # without duplicate address detection, and forward IPv6.
    with Lab([], node_name=NODE, ipv6=settings.ipv6) as lab, contextlib.ExitStack() as stack:
        cp.attach(lab.node_ns)
        stack.callback(cp.detach, lab.node_ns)
        proxy = Sliceproxy.make(lab, cp.node_kubeconfig, workdir, source,
                                *PROXY_FLAGS[SIDE], root=root,
                                cluster_cidr=POD_CIDR_V6 if settings.ipv6 else POD_CIDR)
        stack.callback(proxy.stop)
        side = Side(SIDE, lab, proxy)
        # Both from before the process starts.
        table = LiveChainAppears(lab.node_ns, family)
        table.start()
        stack.callback(table.stop)
        commits = Commits(lab.node_ns, commit_tables(NFTABLES), family) \
            if settings.announcements else None
        if commits is not None:
            stack.callback(commits.stop)
        busy = machine_busy()
        proxy.start()
        initial = wait_initial(side, ns, want, settings.services,
                               proxy.started + settings.start_deadline, family)
        # In a fresh namespace the first transaction on our tables is the first sync.
        announced = commits.between(proxy.started, time.monotonic()) if commits else []
        user, system = user_system(side.pid)
        # Everything the machine did meanwhile (the agent, the control plane, the bench's
        # polls, anyone else's work), in cores: the agent's share is `cpu_s`.
        busy_cores = (machine_busy() - busy) / (time.monotonic() - proxy.started)
        # The agent logs its first sync once the commit is back: moments later.
        first_sync = float(wait(lambda: _logged(proxy.log_path, FIRST_SYNC), 60,
                                "the agent's first-sync line", detail=proxy.log_tail))
        listed = _logged(proxy.log_path, LISTED)
        if table.seen_at is None:
            raise RuntimeError(f"the lookups never found {NFT_MAIN}'s hooked chain: {table.error}")
        out.update(
            committed_s=round(table.seen_at - proxy.started, 3),
            commit_resolution_s=round(table.seen_at - (table.absent_since or proxy.started), 3),
            committed_announced_s=round(announced[0] - proxy.started, 3) if announced
            else None,
            seconds_to_rules=initial["seconds_to_rules"], resolution_s=initial["resolution_s"],
            listed_s=float(listed) if listed else None, first_sync_s=first_sync,
            cpu_s=initial["cpu_s"]["self"], cpu_user_s=user, cpu_system_s=system,
            machine_busy_cores=round(busy_cores, 2),
            peak_rss_mib=initial["memory_mib"]["peak_rss"], rss_mib=initial["memory_mib"]["rss"],
            nft_rules=initial["nat_rules"], endpoints_wanted=len(want),
            endpoints_seen=len(want & set(side.view.endpoints)), polls=initial["polls"],
            argv=proxy.argv, source_logged=_logged(proxy.log_path, SOURCE_LINE))
    return out


# --- the whole measurement ----------------------------------------------------------------


def run(cp: ControlPlane, bins: Binaries, settings: Settings, workdir: Path,
        progress: Callable[[str], None] = quiet) -> dict[str, Any]:
    """Set-up, then the runs; returns the results (JSON-able)."""
    settings.check()
    if cp.stack[0].version != settings.family:
        raise ValueError(f"a control plane of primary family {cp.stack[0].name} for "
                         f"{settings.family.label} services")
    api, ns, result = begin(cp, bins, asdict(settings), "cold")
    ensure_node(api, NODE, str(NODE_LAN6 if settings.ipv6 else NODE_LAN4))
    want = wanted(settings, ns)
    with contextlib.ExitStack() as stack:
        if settings.cleanup_objects:
            stack.callback(_delete_objects, api, ns, settings)
        result["setup"] = write_all(api, ns, settings, progress)
        # The agent's modules as the image ships them, byte-compiled (pip does it at
        # install): a checkout without __pycache__, where PYTHONDONTWRITEBYTECODE is
        # set, would compile them at every start (up to 0.2 s of CPU).
        roots = agent_roots(settings)
        for root in roots.values():
            compileall.compile_dir(root / "proxy", quiet=1)
        runs: list[dict[str, Any]] = []
        for k in range(settings.runs):
            # Alternating sources (and checkouts): drift hits each alike.
            for label, root in roots.items():
                for source in settings.sources:
                    one = start_once(cp, settings, source, ns, want, workdir, root)
                    one.update(run=k + 1, agent=label)
                    runs.append(one)
                    cpu = one["control_plane_before"]["cpu_last_second"]
                    progress(f"{_group(label, source, roots)} run {k + 1}: committed "
                             f"{one['committed_s']} s "
                             f"(announced {one['committed_announced_s']}), rules "
                             f"seen {one['seconds_to_rules']} s, listed {one['listed_s']} s, "
                             f"first sync {one['first_sync_s']} s, CPU {one['cpu_s']} s "
                             f"(kernel {one['cpu_system_s']} s), peak "
                             f"{one['peak_rss_mib']} MiB; control plane before: {cpu}")
        result["mirrored_slices"] = mirrored_slices(api, ns)
    result["runs"] = runs
    result["environment_end"] = environment()
    result["agents"] = {label: str(root) for label, root in roots.items()}
    result["sources"] = {
        _group(label, s, roots): _summary([r for r in runs
                                           if r["source"] == s and r["agent"] == label])
        for label in roots for s in settings.sources}
    return result


def agent_roots(settings: Settings) -> dict[str, Path]:
    """Label -> checkout of the agents measured: this one, or each of --agent-root
    (labelled by its directory's name)."""
    if not settings.agent_roots:
        return {"": ROOT}
    roots = [Path(r).absolute() for r in settings.agent_roots]
    for root in roots:
        if not (root / "proxy" / "__main__.py").is_file():
            raise ValueError(f"{root} is not a sliceproxy checkout (no proxy/__main__.py)")
    labels = [r.name for r in roots]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--agent-root directories need distinct names: {labels}")
    return dict(zip(labels, roots, strict=True))


def _group(label: str, source: str, roots: Mapping[str, Path]) -> str:
    """A row's name: the source, after the checkout's label when there are several."""
    return f"{label}/{source}" if len(roots) > 1 or label else source


def _summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    def of(key: str) -> dict[str, Any]:
        return summary([r.get(key) for r in runs])

    return {"committed_s": of("committed_s"), "commit_resolution_s": of("commit_resolution_s"),
            "committed_announced_s": of("committed_announced_s"),
            "seconds_to_rules": of("seconds_to_rules"), "listed_s": of("listed_s"),
            "first_sync_s": of("first_sync_s"), "cpu_s": of("cpu_s"),
            "cpu_system_s": of("cpu_system_s"), "peak_rss_mib": of("peak_rss_mib"),
            "machine_busy_cores": of("machine_busy_cores"),
            "control_plane_cpu_before": {
                name: summary([r["control_plane_before"]["cpu_last_second"].get(name)
                               for r in runs]) for name in WATCHED},
            "all_quiet": all(r["control_plane_before"]["quiet"] for r in runs)}


# --- the report ---------------------------------------------------------------------------


def _s(stats: dict[str, Any], key: str = "median", unit: str = "s") -> str:
    v = stats.get(key)
    return "-" if v is None else f"{v:.2f} {unit}" if unit == "s" else f"{v:.0f} {unit}"


def _cores(stats: dict[str, Any]) -> str:
    if stats.get("median") is None:
        return "-"
    return f"{stats['median']:.2f} ({stats['min']:.2f}-{stats['max']:.2f})"


def markdown(result: dict[str, Any]) -> str:
    st = result["settings"]
    cpus = result["versions"].get("cpus", "?")
    rows = [
        "| source | committed: median (min-max) | every endpoint seen in the rules | "
        "listed (agent's log) | first sync done (agent's log) | agent CPU (of it kernel) | "
        f"peak RSS | machine busy during the start, cores (of {cpus}) | "
        "control plane before, % of a core: apiserver / controller-manager (max) |",
        "|---|---|---|---|---|---|---|---|---|"]
    for source, s in result["sources"].items():
        cp = s["control_plane_cpu_before"]
        rows.append(
            f"| {source} | **{_s(s['committed_s'])}** ({_s(s['committed_s'], 'min')}-"
            f"{_s(s['committed_s'], 'max')}, n={s['committed_s']['n']}) | "
            f"{_s(s['seconds_to_rules'])} | {_s(s['listed_s'])} | {_s(s['first_sync_s'])} | "
            f"{_s(s['cpu_s'])} ({_s(s['cpu_system_s'])}) | "
            f"{_s(s['peak_rss_mib'], unit='MiB')} | "
            f"{_cores(s['machine_busy_cores'])} | "
            f"{100 * cp['kube-apiserver'].get('max', 0):.0f} / "
            f"{100 * cp['kube-controller-manager'].get('max', 0):.0f}"
            f"{'' if s['all_quiet'] else ' (not quiet)'} |")
    setup = result["setup"]
    return "\n".join(rows) + (
        f"\n\n{st['services']:,} services x {st['endpoints']} endpoints"
        f"{' (single-stack IPv6)' if st.get('ipv6') else ''} written straight "
        f"to kube-apiserver {result['versions']['kube-apiserver'].split()[0]} "
        f"({setup['objects']:,} objects in {setup['seconds']:.0f} s); medians of "
        f"{st['runs']} run(s) per source, from the agent process's start; "
        f"{result['mirrored_slices']} slice(s) mirrored."
        + (" With nf_tables' announcements listened to (they slow the commit)."
           if st.get("announcements") else ""))


# --- the command ----------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.realcp_cold_start", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Settings()
    p.add_argument("--services", type=int, default=d.services)
    p.add_argument("--endpoints", type=int, default=d.endpoints, help="per service")
    p.add_argument("--runs", type=int, default=d.runs, help="per source")
    p.add_argument("--sources", nargs="+", choices=SOURCES, default=list(d.sources))
    p.add_argument("--parallel", type=int, default=d.parallel)
    p.add_argument("--setup-deadline", type=float, default=d.setup_deadline)
    p.add_argument("--start-deadline", type=float, default=d.start_deadline)
    p.add_argument("--quiet-cpu", type=float, default=d.quiet_cpu,
                   help="fraction of a core each of kube-apiserver and "
                   "kube-controller-manager must stay under before a start")
    p.add_argument("--quiet-deadline", type=float, default=d.quiet_deadline)
    p.add_argument("--announcements", action="store_true",
                   help="also listen to nf_tables' announcements (bench.realcp_latency's "
                   "committed_s): costs the agent's commit seconds at 10,000 services")
    p.add_argument("--agent-root", action="append", default=[], metavar="DIR",
                   help="a checkout whose agent is measured (repeat for an A/B on one "
                        "control plane: the checkouts take turns); default: this one")
    p.add_argument("--ipv6", action="store_true",
                   help="single-stack IPv6: control plane, node, endpoints and rules "
                   "(up to 65,534 services on v1.20, where IPv4 holds 32,765)")
    p.add_argument("--json", type=Path, help="write the full results here")
    p.add_argument("--keep-logs", type=Path, help="a directory for the agents' logs")
    args = p.parse_args(argv)
    settings = Settings(
        services=args.services, endpoints=args.endpoints, runs=args.runs,
        sources=tuple(args.sources), parallel=args.parallel,
        setup_deadline=args.setup_deadline, start_deadline=args.start_deadline,
        quiet_cpu=args.quiet_cpu, quiet_deadline=args.quiet_deadline,
        announcements=args.announcements, agent_roots=tuple(args.agent_root),
        ipv6=args.ipv6)
    try:
        settings.check()
        agent_roots(settings)
    except ValueError as exc:
        p.error(str(exc))
    return on_control_plane(
        p.prog, argv, lambda cp, bins, workdir, progress: run(cp, bins, settings, workdir,
                                                              progress),
        markdown, args.json, args.keep_logs, **({"stack": IPV6_ONLY} if args.ipv6 else {}))

if __name__ == "__main__":
    sys.exit(main())
