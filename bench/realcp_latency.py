"""Programming latency on a real API server: sliceproxy (iptables and nftables modes) vs
upstream kube-proxy v1.20.2.

    sudo .venv/bin/python -m bench.realcp_latency --services 1000 --changes 20 --json out.json

Starts the real-control-plane tier's kube-apiserver and kube-controller-manager v1.20.2
(built from Debian's source, labs/realcp/build.py), creates N Services each selecting
its own Pods (made ready by patching their status; no kubelet; the Pods' IPs need not
answer, nothing sends traffic), lets the real EndpointSlice and Endpoints controllers
write their objects, then starts sliceproxy in iptables mode, sliceproxy in nftables
mode and kube-proxy v1.20.2 in iptables mode, all reading EndpointSlices
(discovery.k8s.io/v1beta1), each in a lab node namespace of its own, all as node
"node-a", one after the other so that their initial syncs do not compete.

Then, K times: one Pod's readiness is flipped (not ready, then ready again, on distinct
services) by a PATCH of its status, and for each proxy the time from the moment that
PATCH was sent (over a kept-alive connection: no handshake in the timing) to the moment
the service chain's jump to that Pod's endpoint chain (whose rule DNATs to the Pod)
disappears (or appears) in that proxy's nat table. Each proxy's node namespace is
polled every `--poll-interval` with `iptables-nft -t nat -S <service chain>` (~2 ms per
poll at 1,000 services on an idle machine, more while a big restore holds the table;
`iptables-legacy-save` if that proxy's rules are in the legacy tables). The true moment
lies between the start of the last poll that did not see the change and the end of the
first that did (in nftables mode: `nft list chain` of the service port's chain, whose
rules DNAT to the Pods themselves, ~6 ms at 10,000 services): the latency reported is
the later bound, the gap is its resolution. Where the rules are in nf_tables, the
change is also dated by nf_tables' own announcement of the transaction that made it
(heard on netlink in the node's namespace; the first commit between the last poll not
showing the change and the first showing it): "commit announced", free of the polls'
resolution. A watch on the namespace's EndpointSlices,
from this process, splits that time into the controller's part (the write -> the
updated slice reaches a watcher) and the proxy's. The proxies run with their defaults
(for all: min sync period 1 s, burst 2);
changes are spaced `--spacing` seconds apart so that each is the first after a quiet
period. Also reported: each proxy's own histograms over the changes
(kubeproxy_network_programming_duration_seconds and
kubeproxy_sync_proxy_rules_duration_seconds; the two proxies define the first
differently, see bench/RESULTS.md), the sync durations each logged, the time and CPU
of each one's initial sync of everything, and RSS.

A measurement, never a pass/fail on time. `run()` is the core; tests/realcp/
test_latency_bench.py calls it at a tiny size on the tier's session control plane.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import http.client
import itertools
import json
import math
import os
import platform
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any, NoReturn
from urllib.parse import urlencode

from bench.common import cpu_times, status_mib
from labs.realcp.build import Binaries, build
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
from proxy.dataplane.common.drift_watch import NftablesListener
from proxy.dataplane.xtables.saved import target_of
from proxy.lab import Lab
from proxy.lab.netns import entered
from proxy.lab.topology import NODE_LAN4

NODE = "node-a"
# Pod IPs: they need not answer (nothing sends traffic), so they come from ranges of
# their own rather than the lab's 200 backends. Inside 198.18.0.0/15, clear of the
# lab (198.18.0-1.x), the control plane (198.18.96.0/24) and services (198.18.128/17):
# 97,534 addresses. Past that they repeat across services (10,000 x 10 needs 100,000),
# never within one (the API server does not mind; the proxy pays the same per endpoint).
POD_NETS = (IPv4Network("198.19.0.0/16"), IPv4Network("198.18.2.0/23"),
            IPv4Network("198.18.4.0/22"), IPv4Network("198.18.8.0/21"),
            IPv4Network("198.18.16.0/20"), IPv4Network("198.18.32.0/19"),
            IPv4Network("198.18.64.0/19"), IPv4Network("198.18.97.0/24"),
            IPv4Network("198.18.98.0/23"), IPv4Network("198.18.100.0/22"),
            IPv4Network("198.18.104.0/21"), IPv4Network("198.18.112.0/20"))
POD_ADDRESSES = [a for net in POD_NETS for a in net.hosts()]
TARGET_PORT = 8080
SLICES = "/apis/discovery.k8s.io/v1beta1/namespaces/{ns}/endpointslices"
# The controller manager's client QPS (default 20, burst 30) would make writing the
# Endpoints and EndpointSlices of 1,000 services take ~2 minutes. It only matters in
# bursts: every measured change is a single write after a quiet period.
KCM_FLAGS = ("--kube-api-qps=200", "--kube-api-burst=400")
PROXIES = ("sliceproxy", "sliceproxy-nftables", "kube-proxy")
# Extra flags per side: sliceproxy in its native nftables mode is a third side.
PROXY_FLAGS = {"sliceproxy-nftables": ("--proxy-mode", "nftables")}
DISPATCH = {"sliceproxy": "SPX-SERVICES", "kube-proxy": "KUBE-SERVICES"}
SERVICE_CHAIN = {"sliceproxy": "SPX-SVC-", "kube-proxy": "KUBE-SVC-"}
BACKENDS = ("nft", "legacy")
NFTABLES = "nftables"  # a side's `backend` when its rules are our own nf_tables tables
NFT_MAIN = "sliceproxy"  # the nftables mode's main table; shards are sliceproxy-0..K-1
NFT_MAX_SHARDS = 64
NFPROTO_IPV4 = 2
INITIAL_POLL = 0.25  # seconds between checks of the initial sync
Obj = dict[str, Any]


def _quiet(_: str) -> None:
    pass


@dataclass(frozen=True, slots=True)
class Settings:
    services: int = 1000
    pods_per_service: int = 2
    changes: int = 20
    poll_interval: float = 0.02  # seconds between polls of a node's nat table
    spacing: float = 3.0  # seconds between a change being seen everywhere and the next
    change_deadline: float = 60.0  # per change, per proxy
    setup_deadline: float = 900.0  # objects created, controllers done, proxies synced
    parallel: int = 16  # concurrent API requests while creating objects
    seed: int = 7
    cleanup_objects: bool = False  # delete Pods and Services at the end (shared cluster)
    proxies: tuple[str, ...] = PROXIES  # one alone: no competition for the CPU
    # The iptables back end each node uses: "auto" leaves it to each proxy (sliceproxy's
    # detection; kube-proxy runs `iptables` from PATH, Debian's being nft); "nft" or
    # "legacy" plant kubelet's hint chain there and give kube-proxy that back end's tools,
    # as kube-proxy's image's iptables-wrapper does.
    iptables_backend: str = "auto"

    def check(self) -> None:
        if self.services < 1 or self.pods_per_service < 1 or self.changes < 1:
            raise ValueError("services, pods per service and changes must be positive")
        if self.pods_per_service > len(POD_ADDRESSES):
            raise ValueError(f"at most {len(POD_ADDRESSES)} pods per service")
        if math.ceil(self.changes / 2) > self.services:
            raise ValueError("each pair of changes needs a service of its own")
        if not self.proxies or not set(self.proxies) <= set(PROXIES):
            raise ValueError(f"proxies: one or more of {PROXIES}")
        if self.iptables_backend not in ("auto", *BACKENDS):
            raise ValueError(f"iptables back end: auto or one of {BACKENDS}")


def service_name(i: int) -> str:
    return f"s-{i}"


def pod_name(i: int, j: int) -> str:
    return f"p-{i}-{j}"


def pod_ip(settings: Settings, i: int, j: int) -> str:
    return str(POD_ADDRESSES[(i * settings.pods_per_service + j) % len(POD_ADDRESSES)])


# --- reading a node's nat table (in the calling thread's network namespace) -------------


def _run(cmd: Sequence[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout,
                          check=False)


def save_nat(backend: str) -> str:
    """The nat table as iptables-save prints it. For legacy, only tables that exist are
    read (asking legacy for `-t nat` would create it)."""
    if backend == "nft":
        res = _run(["iptables-nft-save", "-t", "nat"])
        return res.stdout if res.returncode == 0 else ""
    res = _run(["iptables-legacy-save"])
    if res.returncode != 0:
        return ""
    m = re.search(r"^\*nat\n(.*?)^COMMIT", res.stdout, re.MULTILINE | re.DOTALL)
    return m.group(1) if m else ""


_MISSING = ("No chain/target/match", "incompatible", "does not exist")


def chain_rules(backend: str, chain: str) -> list[str] | None:
    """The `-A` lines of one nat chain: [] if the chain does not exist, None if the
    answer could not be read (try again). For the nftables mode, `chain` is "table
    chain" and the lines are nft's (`nft list chain` reads that chain alone: ~6 ms at
    10,000 services, where `nft list tables` reads everything, 35 s)."""
    if backend == NFTABLES:
        table, name = chain.split()
        res = _run(["nft", "list", "chain", "ip", table, name], timeout=30)
        if res.returncode == 0:
            return [ln.strip() for ln in res.stdout.splitlines() if " dnat to " in ln]
        return [] if "No such file" in res.stderr else None
    if backend == "nft":
        res = _run(["iptables-nft", "-t", "nat", "-S", chain], timeout=30)
        if res.returncode == 0:
            return [ln for ln in res.stdout.splitlines() if ln.startswith("-A ")]
        return [] if any(s in res.stderr for s in _MISSING) else None
    prefix = f"-A {chain} "
    return [ln for ln in save_nat("legacy").splitlines() if ln.startswith(prefix)]


_RULE = re.compile(r"^-A (\S+) ")
_COMMENT = re.compile(r"--comment (\"[^\"]*\"|\S+)")
_DNAT = re.compile(r"-j DNAT\b.*--to-destination (\S+)")
@dataclass
class NatView:
    """What matters in one proxy's nat table for one namespace's services."""

    # (service port "ns/name:port", "ip:port") -> (service chain, endpoint chain)
    endpoints: dict[tuple[str, str], tuple[str, str]] = field(default_factory=dict)
    rules: int = 0


def parse_nat(text: str, namespace: str, dispatch: str, svc_prefix: str) -> NatView:
    """Follow the rules from the dispatch chain's cluster-IP entries (commented with the
    service port by both proxies) to the service chains, their endpoint chains and those
    chains' DNAT targets. Comments further down are not relied on: kube-proxy v1.20 leaves
    them out of service and endpoint chains above 1,000 endpoints."""
    view = NatView()
    prefix = f"{namespace}/"
    services: dict[str, str] = {}  # service chain -> service port
    children: dict[str, list[str]] = {}  # chain -> chains it jumps to
    dnat: dict[str, str] = {}  # endpoint chain -> "ip:port"
    for line in text.splitlines():
        m = _RULE.match(line)
        if not m:
            continue
        view.rules += 1
        chain, target = m.group(1), target_of(line)
        if (d := _DNAT.search(line)) is not None:
            dnat[chain] = d.group(1)
            continue
        if target is None:
            continue
        children.setdefault(chain, []).append(target)
        comment = _COMMENT.search(line)
        if chain == dispatch and target.startswith(svc_prefix) and comment is not None:
            port = comment.group(1).strip('"').split()[0]
            if port.startswith(prefix):
                services[target] = port
    for svc_chain, port in services.items():
        for sep in children.get(svc_chain, ()):
            if sep in dnat:
                view.endpoints[(port, dnat[sep])] = (svc_chain, sep)
    return view


def dnats_to(rule: str, endpoint: str) -> bool:
    """An nft rule that DNATs to exactly `endpoint` ("ip:port")."""
    words = rule.split()
    return any(a == "to" and b == endpoint for a, b in itertools.pairwise(words))


def shows(backend: str, rules: Sequence[str], target: str) -> bool:
    """The chain's rules send to `target`: the endpoint chain (iptables) or the endpoint
    itself (the nftables mode DNATs in the service port's chain)."""
    if backend == NFTABLES:
        return any(dnats_to(r, target) for r in rules)
    return any(target_of(r) == target for r in rules)


def nft_view(namespace: str) -> tuple[NatView, float] | None:
    """The nftables mode's view, and when its tables were first seen (monotonic): every
    shard table read as JSON (~0.3 s each at 10,000 services, so only once the first
    sync is in), each DNAT rule carrying its service port as comment. None while the
    main table is not there yet: a full sync is one transaction, so once it is, all of
    it is, and the reading afterwards is not the proxy's time."""
    if _run(["nft", "list", "chain", "ip", NFT_MAIN, "nat-postrouting"]).returncode != 0:
        return None
    there = time.monotonic()
    view = NatView()
    prefix = f"{namespace}/"
    for table in [NFT_MAIN, *(f"{NFT_MAIN}-{i}" for i in range(NFT_MAX_SHARDS))]:
        res = _run(["nft", "-j", "list", "table", "ip", table])
        if res.returncode != 0:
            break  # shards are numbered from 0 without gaps
        for item in json.loads(res.stdout)["nftables"]:
            rule = item.get("rule")
            if rule is None:
                continue
            view.rules += 1
            port = str(rule.get("comment", "")).split(" ")[0]
            for expr in rule["expr"]:
                dnat = expr.get("dnat") if isinstance(expr, dict) else None
                if dnat and port.startswith(prefix):
                    endpoint = f"{dnat['addr']}:{dnat['port']}"
                    chain = f"{rule['table']} {rule['chain']}"
                    view.endpoints[(port, endpoint)] = (chain, endpoint)
    return view, there


def dispatch_count(backend: str, chain: str, namespace: str) -> int:
    """Rules of the proxy's dispatch chain that belong to this namespace's services."""
    rules = chain_rules(backend, chain) or []
    return sum(1 for r in rules if f"{namespace}/" in r)


# --- watching the controllers' output ---------------------------------------------------


def ready_addresses(obj: Obj) -> frozenset[str]:
    return frozenset(e["addresses"][0] for e in obj.get("endpoints") or []
                     if e.get("addresses")
                     and (e.get("conditions") or {}).get("ready", True) is not False)


class SliceWatch:
    """A watch on one namespace's EndpointSlices from this process: when each controller
    write reached a watcher, with the service's ready addresses after it."""

    MAX_STREAMS = 100

    def __init__(self, api: RawApi, namespace: str) -> None:
        self.api, self.namespace = api, namespace
        self.path = SLICES.format(ns=namespace)
        self._slices: dict[str, tuple[str, frozenset[str]]] = {}  # slice -> (svc, ready)
        self._events: list[tuple[float, str, frozenset[str]]] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self) -> None:
        rv = self._list()
        self._thread = threading.Thread(target=self._run, args=(rv,), name="slice-watch",
                                        daemon=True)
        self._thread.start()

    def _list(self) -> str:
        status, body = self.api.get(self.path)
        if status != 200:
            raise RuntimeError(f"listing slices: HTTP {status}: {body}")
        now = time.monotonic()
        with self._lock:
            self._slices.clear()
            for obj in body["items"]:
                self._apply("ADDED", obj, now)
        return str(body["metadata"]["resourceVersion"])

    def _apply(self, kind: str, obj: Obj, now: float) -> None:
        name = obj["metadata"]["name"]
        svc = (obj["metadata"].get("labels") or {}).get("kubernetes.io/service-name", "")
        if kind == "DELETED":
            self._slices.pop(name, None)
        else:
            self._slices[name] = (svc, ready_addresses(obj))
        ready = frozenset().union(*(r for s, r in self._slices.values() if s == svc))
        self._events.append((now, svc, ready))

    @staticmethod
    def connect(api: RawApi, timeout: float | None = None) -> http.client.HTTPConnection:
        if api.https:
            return http.client.HTTPSConnection(api.host, api.port, timeout=timeout,
                                               context=api.context)
        return http.client.HTTPConnection(api.host, api.port, timeout=timeout)

    def _run(self, rv: str) -> None:
        headers = {"Accept": "application/json"}
        if self.api.token:
            headers["Authorization"] = f"Bearer {self.api.token}"
        for _ in range(self.MAX_STREAMS):
            if self._stopping.is_set():
                return
            conn = self.connect(self.api)
            self._conn = conn
            try:
                query = urlencode({"watch": "1", "resourceVersion": rv,
                                   "timeoutSeconds": "600", "allowWatchBookmarks": "true"})
                conn.request("GET", f"{self.path}?{query}", headers=headers)
                resp = conn.getresponse()
                if resp.status != 200:
                    rv = self._list()
                    continue
                while line := resp.readline():
                    event = json.loads(line)
                    obj = event.get("object") or {}
                    if event.get("type") == "ERROR":  # 410 Gone: start over
                        rv = self._list()
                        break
                    rv = obj["metadata"]["resourceVersion"]
                    if event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                        with self._lock:
                            self._apply(event["type"], obj, time.monotonic())
            except (OSError, http.client.HTTPException, ValueError, KeyError) as exc:
                if self._stopping.is_set():
                    return
                self.error = f"{type(exc).__name__}: {exc}"
                try:
                    rv = self._list()
                except (OSError, http.client.HTTPException, RuntimeError):
                    return
            finally:
                conn.close()

    def stop(self) -> None:
        self._stopping.set()
        conn = self._conn
        if conn is not None and conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=10)

    def first(self, svc: str, ready: frozenset[str], after: float) -> float | None:
        """When the watcher first saw `svc` with exactly these ready addresses, after
        monotonic time `after`."""
        with self._lock:
            for t, s, r in self._events:
                if t >= after and s == svc and r == ready:
                    return t
        return None


class Writer:
    """The measured writes, over one kept-alive connection: no TCP or TLS handshake
    (~10-20 ms through the host's forwarder) inside the timed path."""

    def __init__(self, api: RawApi) -> None:
        self.api = api
        self.conn: http.client.HTTPConnection | None = None

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.conn is not None:
            self.conn.close()

    def _connected(self) -> http.client.HTTPConnection:
        if self.conn is None:
            self.conn = SliceWatch.connect(self.api, timeout=30)
        if self.conn.sock is None:
            self.conn.connect()
        return self.conn

    def patch(self, path: str, body: Obj,
              kind: str = "application/strategic-merge-patch+json") -> tuple[float, float]:
        """PATCH; returns (monotonic time sent, time answered). A connection the server
        closed while idle is opened again (outside the timing) and the write retried."""
        headers = {"Accept": "application/json", "Content-Type": kind}
        if self.api.token:
            headers["Authorization"] = f"Bearer {self.api.token}"
        data = json.dumps(body).encode()
        for attempt in (1, 2):
            conn = self._connected()
            sent = time.monotonic()
            try:
                conn.request("PATCH", path, body=data, headers=headers)
                resp = conn.getresponse()
                answer = resp.read()
            except (OSError, http.client.HTTPException):
                conn.close()
                if attempt == 2:
                    raise
                continue
            acked = time.monotonic()
            if not 200 <= resp.status < 300:
                raise RuntimeError(f"PATCH {path}: HTTP {resp.status}: {answer[:300]!r}")
            return sent, acked
        raise AssertionError("unreachable")


# --- the proxies --------------------------------------------------------------------------


@dataclass
class Side:
    name: str
    lab: Lab
    proxy: NodeProxy
    backend: str = ""
    view: NatView = field(default_factory=NatView)
    initial: dict[str, Any] = field(default_factory=dict)

    @property
    def pid(self) -> int:
        assert self.proxy.proc is not None
        return self.proxy.proc.pid

    @property
    def kind(self) -> str:
        """"sliceproxy" or "kube-proxy", whatever the mode."""
        return "kube-proxy" if self.name == "kube-proxy" else "sliceproxy"

    def chains(self, port: str, endpoint: str) -> tuple[str, str]:
        """(service chain, endpoint chain) for one endpoint of one service port; in
        nftables mode ("table chain", the endpoint itself)."""
        found = self.view.endpoints.get((port, endpoint))
        if found is None:
            raise RuntimeError(f"{self.name}: no DNAT rule to {endpoint} for {port}")
        return found


def cpu_seconds(pid: int) -> dict[str, float]:
    """CPU time of a process and of its reaped children (the iptables binaries it ran)."""
    own, children = cpu_times(pid)
    return {"self": round(own, 2), "children": round(children, 2)}


_MEMORY = {"VmHWM": "peak_rss", "VmRSS": "rss"}


def memory_mib(pid: int) -> dict[str, float]:
    return {_MEMORY[k]: round(v, 1) for k, v in status_mib(pid).items() if k in _MEMORY}


def scrape(proxy: NodeProxy) -> dict[str, float]:
    """The proxy's /metrics as {series: value}."""
    status, body = proxy.get("/metrics")
    if status != 200:
        return {}
    out = {}
    for line in body.decode(errors="replace").splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[key] = float(value)
    return out


def histogram_delta(before: Mapping[str, float], after: Mapping[str, float],
                    name: str) -> dict[str, Any] | None:
    """Observations of histogram `name` between two scrapes: count, mean, and the
    bucket bounds holding the median and the 90th percentile."""
    if f"{name}_count" not in after:
        return None
    count = after[f"{name}_count"] - before.get(f"{name}_count", 0.0)
    total = after[f"{name}_sum"] - before.get(f"{name}_sum", 0.0)
    buckets = []
    bucket = re.compile(rf'^{re.escape(name)}_bucket\{{.*le="([^"]+)".*\}}$')
    for key, value in after.items():
        m = bucket.match(key)
        if m:
            buckets.append((float(m.group(1)), value - before.get(key, 0.0)))
    buckets.sort()
    out: dict[str, Any] = {"count": int(count),
                           "mean_s": round(total / count, 4) if count else None}
    for label, q in (("p50_bucket_le_s", 0.5), ("p90_bucket_le_s", 0.9)):
        out[label] = next((le for le, cum in buckets if count and cum >= q * count), None)
    return out


_GO_PART = re.compile(r"([0-9.]+)(ns|us|µs|ms|s|m|h)")
_GO_UNIT = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_SYNC_LINE = {
    "kube-proxy": re.compile(r"syncProxyRules took (\S+)"),
    "sliceproxy": re.compile(r"sync done.*?\bduration=([0-9.]+s)\b"),
}


def go_duration(text: str) -> float:
    return sum(float(n) * _GO_UNIT[u] for n, u in _GO_PART.findall(text))


def logged_syncs(side: Side, start: int = 0) -> tuple[list[float], int]:
    """Sync durations the proxy logged from byte offset `start`; and the end offset."""
    try:
        with side.proxy.log_path.open("rb") as f:
            f.seek(start)
            data = f.read()
    except OSError:
        return [], start
    pattern = _SYNC_LINE[side.kind]
    durations = [go_duration(m.group(1))
                 for m in pattern.finditer(data.decode(errors="replace"))]
    return durations, start + len(data)


# --- measuring ----------------------------------------------------------------------------


class Commits:
    """nf_tables' own announcements of the transactions committed on a node's tables, as
    they reach this process (monotonic times). A poll that shows a change is then dated
    by the commit that made it rather than by the poll (whose resolution is tens of ms):
    the change was committed between the last poll that did not show it and the end of
    the first that did, and a proxy's change is one transaction."""

    def __init__(self, ns: str, tables: Iterable[str]) -> None:
        self._times: list[float] = []
        self._lock = threading.Lock()
        with entered(ns):  # the socket listens in the namespace it is made in
            self._listener = NftablesListener({(NFPROTO_IPV4, t) for t in tables},
                                              lambda _pid: False, self._heard)
        self._listener.start()

    def _heard(self, reason: str) -> None:
        now = time.monotonic()
        if reason.startswith("nf_tables transaction"):  # not "announcements were lost"
            with self._lock:
                self._times.append(now)

    def between(self, after: float, until: float) -> list[float]:
        with self._lock:
            return [t for t in self._times if after < t <= until]

    def stop(self) -> None:
        self._listener.stop()


def commit_tables(backend: str) -> tuple[str, ...]:
    """The nf_tables tables a side's changes are committed to (none for legacy)."""
    if backend == NFTABLES:
        return (NFT_MAIN, *(f"{NFT_MAIN}-{i}" for i in range(NFT_MAX_SHARDS)))
    return ("nat",) if backend == "nft" else ()


@dataclass
class Seen:
    seconds: float | None  # write acknowledged -> end of the first poll showing the change
    resolution: float | None  # minus the start of the last poll not showing it
    polls: int
    # write -> the first commit announced in that window (nf_tables only), and how many
    committed: float | None = None
    commits: int = 0


def watch_rule(ns: str, backend: str, svc_chain: str, sep_chain: str, present: bool,
               sent: float, deadline: float, interval: float,
               commits: Commits | None = None) -> Seen:
    """Poll one proxy's service chain until its jump to `sep_chain` is `present`;
    times from `sent` (monotonic), when the write left."""
    polls = 0
    not_yet = sent
    with entered(ns):
        while True:
            start = time.monotonic()
            rules = chain_rules(backend, svc_chain)
            end = time.monotonic()
            polls += 1
            if rules is not None:
                if shows(backend, rules, sep_chain) == present:
                    heard = commits.between(not_yet, end) if commits is not None else []
                    return Seen(end - sent, end - not_yet, polls,
                                heard[0] - sent if heard else None, len(heard))
                not_yet = start
            if end > deadline:
                return Seen(None, None, polls)
            # The polling interval (the measurement's resolution), not synchronisation.
            time.sleep(max(0.0, start + interval - time.monotonic()))


def wait_initial(side: Side, namespace: str, want: set[tuple[str, str]], services: int,
                 deadline: float) -> dict[str, Any]:
    """Until every (service port, endpoint) of the namespace is DNATed in the side's nat
    table: how long since the process started, its CPU time and memory by then."""
    polls = 0
    with entered(side.lab.node_ns):
        while True:
            side.proxy.check_alive()
            start = time.monotonic()
            polls += 1
            for backend in BACKENDS if side.name in DISPATCH else (NFTABLES,):
                seen: float | None = None
                if backend == NFTABLES:
                    found = nft_view(namespace)
                    if found is None:
                        continue
                    view, seen = found
                # The dispatch chain first (cheap); the whole table once it is complete.
                elif dispatch_count(backend, DISPATCH[side.name], namespace) < services:
                    continue
                else:
                    view = parse_nat(save_nat(backend), namespace, DISPATCH[side.name],
                                     SERVICE_CHAIN[side.name])
                if want <= set(view.endpoints):
                    seen = seen or time.monotonic()
                    side.backend, side.view = backend, view
                    return {"seconds_to_rules": round(seen - side.proxy.started, 3),
                            "resolution_s": round(seen - start + INITIAL_POLL, 3),
                            "cpu_s": cpu_seconds(side.pid), "memory_mib": memory_mib(side.pid),
                            "nat_rules": view.rules, "backend": backend, "polls": polls}
            if start > deadline:
                raise TimeoutError(f"{side.name} did not program the {len(want)} endpoints "
                                   f"in time; log:\n{side.proxy.log_tail()}")
            time.sleep(max(0.0, start + INITIAL_POLL - time.monotonic()))


def summary(values: Sequence[float | None]) -> dict[str, Any]:
    """median, p90 (nearest rank), min, max of the values seen; misses counted."""
    xs = sorted(v for v in values if v is not None)
    out: dict[str, Any] = {"n": len(xs), "missed": sum(1 for v in values if v is None)}
    if xs:
        out.update(median=round(statistics.median(xs), 4),
                   p90=round(xs[max(0, math.ceil(0.9 * len(xs)) - 1)], 4),
                   min=round(xs[0], 4), max=round(xs[-1], 4))
    return out


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
    if name != "kube-proxy":
        return Sliceproxy.make(lab, cp.node_kubeconfig, workdir, "endpointslices",
                               *PROXY_FLAGS.get(name, ()))
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


def run(cp: ControlPlane, bins: Binaries, settings: Settings, workdir: Path,
        progress: Callable[[str], None] = _quiet) -> dict[str, Any]:
    """The whole measurement on a running control plane; returns the results (JSON-able).
    Everything it starts (namespaces, processes, the watch) is gone when it returns."""
    settings.check()
    api = RawApi(cp.host_url, token=cp.token, context=cp.ssl_context())
    ns = f"lat-{int(time.time() * 1000) % 10**8}"
    result: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "settings": asdict(settings), "namespace": ns, "versions": versions(cp, bins),
        "environment_start": environment()}
    api.must("POST", "/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                            "metadata": {"name": ns}})
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
        for name in settings.proxies:
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


# --- reporting ----------------------------------------------------------------------------


def _cell(s: Mapping[str, Any] | None, key: str) -> str:
    if not s or s.get(key) is None:
        return "-"
    v = float(s[key])
    return f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def markdown(result: Mapping[str, Any]) -> str:
    proxies: Mapping[str, Any] = result["proxies"]
    names = list(proxies)
    head = "| | " + " | ".join(names) + " |"
    rows = [head, "|---" * (len(names) + 1) + "|"]

    def line(label: str, pick: Callable[[Mapping[str, Any]], str]) -> None:
        rows.append(f"| {label} | " + " | ".join(pick(proxies[n]) for n in names) + " |")

    def stats(key: str) -> Callable[[Mapping[str, Any]], str]:
        def pick(p: Mapping[str, Any]) -> str:
            s = p[key]
            missed = f", {s['missed']} missed" if s.get("missed") else ""
            return (f"{_cell(s, 'median')} / {_cell(s, 'p90')} / {_cell(s, 'min')} / "
                    f"{_cell(s, 'max')} (n={s['n']}{missed})")
        return pick

    line("readiness write -> rule, median / p90 / min / max", stats("latency"))
    line("... rule removed (pod not ready)", stats("latency_remove"))
    line("... rule added (pod ready again)", stats("latency_add"))
    line("... after the watcher saw the slice", stats("after_slice_seen"))
    line("poll resolution (median / p90 / min / max)", stats("resolution"))
    line("readiness write -> commit announced by nf_tables", stats("committed"))
    line("... after the watcher saw the slice", stats("committed_after_slice_seen"))
    line("syncs logged during the changes", stats("syncs_logged_during_changes"))

    def initial(p: Mapping[str, Any]) -> str:
        i = p["initial"]
        own = i.get("first_sync_logged_s")
        own_text = f"; its first sync {own * 1000:.0f} ms" if own is not None else ""
        return (f"{i['seconds_to_rules']:.2f} s from start, CPU {i['cpu_s']['self']:.2f} s "
                f"+ {i['cpu_s']['children']:.2f} s children{own_text}")
    line("initial sync of everything", initial)
    line("nat rules / back end", lambda p: f"{p['initial']['nat_rules']:,} / "
                                           f"{p['initial']['backend']}")
    line("RSS after initial sync / at end (peak)",
         lambda p: f"{p['initial']['memory_mib'].get('rss', 0):.0f} MiB / "
                   f"{p['memory_end_mib'].get('rss', 0):.0f} MiB "
                   f"({p['memory_end_mib'].get('peak_rss', 0):.0f} MiB)")
    line("CPU during the changes (self + children)",
         lambda p: f"{p['cpu_during_changes_s']['self']:.2f} s + "
                   f"{p['cpu_during_changes_s']['children']:.2f} s")

    def metric(key: str) -> Callable[[Mapping[str, Any]], str]:
        def pick(p: Mapping[str, Any]) -> str:
            h = p["metrics_during_changes"][key]
            if not h or not h["count"]:
                return "none observed"
            return (f"n={h['count']}, mean {_cell(h, 'mean_s')}, median <= "
                    f"{_cell(h, 'p50_bucket_le_s')}, p90 <= {_cell(h, 'p90_bucket_le_s')}")
        return pick

    line("own network_programming_duration (changes)", metric("network_programming_duration"))
    line("own sync_proxy_rules_duration (changes)", metric("sync_proxy_rules_duration"))
    slices = summary([c["slice_seen_s"] for c in result["changes"]])
    rtt = summary([c["patch_rtt_s"] for c in result["changes"]])
    return "\n".join(rows) + (
        f"\n\nController part (PATCH sent -> the updated EndpointSlice reached a watcher in "
        f"this process): "
        f"median {_cell(slices, 'median')}, max {_cell(slices, 'max')}; "
        f"PATCH round trip median {_cell(rtt, 'median')}.")


def _on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds the with-blocks: everything is cleaned up


@contextlib.contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="sliceproxy-latency-") as d:
        yield Path(d)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.realcp_latency",
                                description=__doc__.splitlines()[0])
    d = Settings()
    p.add_argument("--services", type=int, default=d.services)
    p.add_argument("--pods-per-service", type=int, default=d.pods_per_service)
    p.add_argument("--changes", type=int, default=d.changes)
    p.add_argument("--poll-interval", type=float, default=d.poll_interval,
                   help="seconds between polls of each node's nat table")
    p.add_argument("--spacing", type=float, default=d.spacing,
                   help="seconds of quiet between one change being seen and the next")
    p.add_argument("--change-deadline", type=float, default=d.change_deadline)
    p.add_argument("--setup-deadline", type=float, default=d.setup_deadline)
    p.add_argument("--parallel", type=int, default=d.parallel)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--proxies", nargs="+", choices=PROXIES, default=list(d.proxies),
                   help="run only these (default both, side by side)")
    p.add_argument("--iptables-backend", choices=("auto", *BACKENDS), default=d.iptables_backend,
                   help="the iptables back end of every node (default: each proxy's own "
                   "choice)")
    p.add_argument("--json", type=Path, help="write the full results here")
    p.add_argument("--keep-logs", type=Path,
                   help="a directory for the proxies' logs (kept); default: a temporary one")
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    settings = Settings(
        services=args.services, pods_per_service=args.pods_per_service, changes=args.changes,
        poll_interval=args.poll_interval, spacing=args.spacing,
        change_deadline=args.change_deadline, setup_deadline=args.setup_deadline,
        parallel=args.parallel, seed=args.seed, proxies=tuple(args.proxies),
        iptables_backend=args.iptables_backend)
    settings.check()
    signal.signal(signal.SIGTERM, _on_sigterm)

    def progress(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    progress("building (or reusing) Kubernetes v1.20.2")
    bins = build()
    with ControlPlane(bins, controller_manager_flags=KCM_FLAGS) as cp, \
            _workdir(args.keep_logs) as workdir:
        progress(f"control plane up in namespace {cp.namespace}")
        result = run(cp, bins, settings, workdir, progress)
    result["command"] = "python -m bench.realcp_latency " + " ".join(
        sys.argv[1:] if argv is None else argv)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
