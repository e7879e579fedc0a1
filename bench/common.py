"""What the benchmarks share: the repository's root, a process's figures from /proc (CPU
seconds, sizes such as RSS, its descendants), the cluster simulator run in a lab
network namespace, the synthetic cluster of N services that several scenarios program,
and how a step is timed, a lab node made and results printed."""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from ipaddress import IPv4Address, IPv6Network
from pathlib import Path
from typing import Any, TypeVar

from proxy.kube.decode import decode_endpoint_slice, decode_service
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.netns_lab import Lab
from proxy.netns_lab.poll import TimedOut, wait

ROOT = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
T = TypeVar("T")

# The agent's sync pacing, compared side by side (issue 29). "old" is the pacing before
# it: kube-proxy's token bucket at 1 s with no CPU budget (the budget would otherwise
# still apply on top of a set period); "new" passes nothing, so it is whatever the
# agent's default is.
PACINGS: dict[str, tuple[str, ...]] = {
    "old": ("--min-sync-period", "1s", "--sync-cpu-budget", "off"),
    "new": (),
}


# --- /proc --------------------------------------------------------------------------------


def cpu_times(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of a process so far, and of the children it has reaped
    (the iptables binaries a proxy ran). OSError when the process is gone."""
    utime, stime, cutime, cstime = _ticks(pid)
    return (utime + stime) / CLOCK_TICKS, (cutime + cstime) / CLOCK_TICKS


def system_seconds(pid: int) -> float:
    """System CPU seconds of the process itself: what the kernel spent for it (netlink
    dumps and transactions, for a proxy)."""
    return _ticks(pid)[1] / CLOCK_TICKS


def _ticks(pid: int) -> tuple[int, ...]:
    """utime, stime, cutime, cstime of /proc/PID/stat: fields 11..14 after the command's
    closing parenthesis."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return tuple(int(x) for x in fields[11:15])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process itself."""
    return cpu_times(pid)[0]


def status_mib(pid: int) -> dict[str, float]:
    """The size fields of /proc/PID/status (VmRSS, VmHWM: peak RSS, ...) in MiB. OSError
    when the process is gone."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) / 1024
    return out


def size_mib(pid: int, field: str) -> float | None:
    """One size field (VmRSS, VmHWM...) in MiB; None when the process or field is gone."""
    try:
        return status_mib(pid).get(field)
    except OSError:
        return None


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in map(int, kids):
            out += [kid, *descendants(kid)]
    return out


def agent_pid(root: int) -> int | None:
    """The python process running `-m proxy` under `ip netns exec` (and py-spy)."""
    for pid in [root, *descendants(root)]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"proxy" in cmd and b"-m" in cmd and not cmd[0].endswith(b"py-spy"):
            return pid
    return None


# --- processes in a namespace -------------------------------------------------------------


def in_namespace(ns: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def exit_on_sigterm() -> None:
    """SIGTERM raises SystemExit, so that the with-blocks unwind: a benchmark stopped
    that way still removes its namespaces and processes (killed outright it left them)."""
    def on_sigterm(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_sigterm)


def stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def simulator(ns: str, manifest: Path, work: Path, watch_cache: bool,
              service_cidr: str | None = None, service_cidr_v6: str | None = None
              ) -> Iterator[Path]:
    """`python -m proxy.sim` serving `manifest` in namespace `ns`: its kubeconfig.
    `service_cidr`, `service_cidr_v6`: where ClusterIPs come from (the simulator's default
    /17 holds 32,766, its IPv6 /112 65,534)."""
    kubeconfig = work / "kubeconfig"
    # One left by an earlier run in a kept directory names that run's port: waiting for
    # "the file exists" would start the agent against it, retrying for ever.
    kubeconfig.unlink(missing_ok=True)
    log = (work / "sim.log").open("wb")
    proc = subprocess.Popen(in_namespace(ns, [
        sys.executable, "-m", "proxy.sim", "--listen", "127.0.0.1:0", "--kubeconfig-out",
        str(kubeconfig), "--history", "1000", "-f", str(manifest),
        *(() if watch_cache else ("--no-watch-cache",)),
        *(("--service-cidr", service_cidr) if service_cidr else ()),
        *(("--service-cidr-v6", service_cidr_v6) if service_cidr_v6 else ())]),
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        with contextlib.suppress(TimedOut):  # judged below: the file is there or it is not
            wait(lambda: kubeconfig.exists() or proc.poll() is not None, 600,
                 "the simulator's kubeconfig", interval=0.1)
        if not kubeconfig.exists():
            raise RuntimeError(f"the simulator did not start: {work / 'sim.log'}")
        yield kubeconfig
    finally:
        stop(proc)
        log.close()


# --- the synthetic cluster ----------------------------------------------------------------
# N services of one TCP port (80 -> 8080) with M ready endpoints each: the model
# benchmark decodes and resolves it; rule_sync, nftables/conn_cost and the IPVS
# guest program it. Addresses stay in the benchmarking range 198.18.0.0/15 (they repeat
# past its size, which the model does not mind: they belong to different services).

NODE = "node-0"  # the node the model is resolved for
SERVICE_BASE = IPv4Address("198.18.128.0")
POD_BASE = IPv4Address("198.19.0.0")
ENDPOINTS_PER_SLICE = 100  # the EndpointSlice controller's default (the API allows 1,000)

Objects = list[dict[str, Any]]

# A single-stack IPv6 cluster, as bench/agent_start.py's --ipv6 makes one: ClusterIPs from
# a simulator range far larger than its default /112 (65,534), pods from the agent's
# --cluster-cidr; both in fd00::/8, clear of the lab's fd00:18::/32 addresses.
SERVICE_CIDR_V6 = "fd00:198:18::/104"
POD_CIDR_V6 = "fd00:19::/64"
SERVICE_BASE_V6 = IPv6Network(SERVICE_CIDR_V6).network_address + 1
POD_BASE_V6 = IPv6Network(POD_CIDR_V6).network_address + 1


# How a report names that cluster, and a size in it ("100,000 x 10 IPv6").
IPV6_CLUSTER = (f"Family: IPv6, single stack (ClusterIPs in {SERVICE_CIDR_V6}, pods in "
                f"{POD_CIDR_V6}).")


def size_label(services: int, endpoints: int, family: str) -> str:
    return f"{services:,} x {endpoints}" + (" IPv6" if family == "IPv6" else "")


def single_stack_v6(service: dict[str, Any]) -> dict[str, Any]:
    """`service` asking for an IPv6 ClusterIP only (the simulator's default is IPv4)."""
    service["spec"].update(ipFamilies=["IPv6"], ipFamilyPolicy="SingleStack")
    return service


def make_objects(services: int, endpoints: int, ipv6: bool = False
                 ) -> tuple[Objects, Objects]:
    """The cluster's Services and EndpointSlices; `ipv6`: single-stack IPv6 (every
    address distinct, SERVICE_CIDR_V6 and POD_CIDR_V6)."""
    svcs, slices = [], []
    for i in range(services):
        name = f"svc-{i}"
        svc: dict[str, Any] = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": "bench", "resourceVersion": str(i)},
            "spec": {
                "clusterIP": str(SERVICE_BASE_V6 + i if ipv6 else SERVICE_BASE + i % 32768),
                "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
            },
        }
        svcs.append(single_stack_v6(svc) if ipv6 else svc)
        base = i * endpoints
        slices.append({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"{name}-x", "namespace": "bench",
                         "labels": {"kubernetes.io/service-name": name}},
            "addressType": "IPv6" if ipv6 else "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [
                {"addresses": [str(POD_BASE_V6 + base + j if ipv6
                                   else POD_BASE + (base + j) % 65536)],
                 "conditions": {"ready": True, "serving": True, "terminating": False},
                 "nodeName": f"node-{(base + j) % 50}",
                 "zone": f"zone-{(base + j) % 3}"}
                for j in range(endpoints)
            ],
        })
    return svcs, slices


def _split(slice_obj: dict[str, Any]) -> list[dict[str, Any]]:
    eps = slice_obj["endpoints"]
    if len(eps) <= ENDPOINTS_PER_SLICE:
        return [slice_obj]
    name = slice_obj["metadata"]["name"]
    return [{**slice_obj, "metadata": {**slice_obj["metadata"], "name": f"{name}-{k}"},
             "endpoints": eps[i:i + ENDPOINTS_PER_SLICE]}
            for k, i in enumerate(range(0, len(eps), ENDPOINTS_PER_SLICE))]


def cluster_model(services: int, endpoints: int, ipv6: bool = False
                  ) -> tuple[ClusterModel, list[dict[str, Any]]]:
    """The model of `services` with `endpoints` each, in slices of at most 100 as the
    controller writes them, and those slices' objects (`ipv6`: make_objects')."""
    svc_objs, whole = make_objects(services, endpoints, ipv6)
    slice_objs = [part for obj in whole for part in _split(obj)]
    model = ClusterModel(NODE)
    for obj in svc_objs:
        svc, _ = decode_service(obj)
        assert svc is not None
        model.apply_service(svc)
    for obj in slice_objs:
        sl, _ = decode_endpoint_slice(obj)
        assert sl is not None
        model.apply_slice(sl)
    model.resolve()
    return model, slice_objs


def change_one(model: ClusterModel, slice_obj: dict[str, Any], round_: int) -> DesiredState:
    """Replace the first endpoint of one service with a fresh address."""
    changed = json.loads(json.dumps(slice_obj))
    fresh = f"fd00:18:7f::{round_ % 250 + 1:x}" if slice_obj["addressType"] == "IPv6" \
        else f"198.18.127.{round_ % 250 + 1}"
    changed["endpoints"][0]["addresses"] = [fresh]
    sl, _ = decode_endpoint_slice(changed)
    assert sl is not None
    model.apply_slice(sl)
    state = model.resolve()
    assert len(state.changed) == 1
    return state


# --- timing, a lab node, results -----------------------------------------------------------


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """Seconds `fn` took, and what it returned."""
    gc.collect()  # a collection owed by the previous step is not this step's cost
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


@contextmanager
def node_namespace() -> Iterator[str]:
    """A network namespace of our own (the lab's node, never the host's), removed on the
    way out."""
    with Lab([], ipv6=False) as lab:
        yield lab.node_ns


def quiet(_: str) -> None:
    """A progress callback that says nothing."""


def print_results(runs: Iterable[dict[str, Any]],
                  markdown: Callable[[list[dict[str, Any]]], str], *, as_json: bool) -> None:
    """Take each run's result as it comes (a JSON line on stderr, unless the output is
    JSON), then print them all: as JSON, or as the scenario's Markdown table."""
    results = []
    for result in runs:
        results.append(result)
        if not as_json:
            print(json.dumps(result), file=sys.stderr, flush=True)
    if as_json:
        print(json.dumps(results, indent=2))
    else:
        print(markdown(results))
