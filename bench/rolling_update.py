"""A rolling update of a whole service with traffic flowing: failed connections, the lag
between the API and the kernel, the agent's CPU and memory.

    sudo .venv/bin/python -m bench.rolling_update                        # 1,000, both modes
    sudo .venv/bin/python -m bench.rolling_update --endpoints 10000 --mode nftables
    flock /tmp/spx-heavy.lock .venv/bin/python -m bench.rolling_update --endpoints 10000

The set-up, every part of it in network namespaces of a lab (`proxy.lab`) made for the
run and removed after it (also on SIGTERM):

- node: the simulator (`python -m proxy.sim`, its own process, as bench/cold_start.py
  starts it) and the real agent (`python -m proxy --proxy-mode MODE`, cold_start's
  flags, `-v 2` so that it logs every sync);
- pods: one namespace behind a veth from the node (198.18.2.0/24; the node routes
  198.19.0.0/16 there), every pod's address a /32 on its end of the veth, and ONE
  listener on 0.0.0.0:8080 (`proxy.lab.echo` answering with the address reached), so
  every endpoint really accepts connections, and stops doing so once its address goes;
- client: short TCP connections to the ClusterIP (`proxy.lab.probe.ask_once`: connect,
  one line, the answer) at `--traffic-rate` a second, from a little before the roll to
  a little after it; each one's outcome (the pod that answered, or refused, reset,
  timeout) is kept with its time.

One ClusterIP service (`bench/huge`, TCP 80 -> 8080, bench/huge_service.py's objects)
with N ready endpoints in slices of 100, as the EndpointSlice controller writes them.
The roll, as a Deployment's (maxSurge) does it, through the simulator's HTTP API, in
ticks of 100 ms, `--rate` endpoints replaced a second: each tick, `rate/10` new pods get
fresh addresses (added in the pods namespace first) and appear not ready; `--ready-delay`
later they are ready; one tick after that, as many old pods go terminating (ready=false,
serving=true, terminating=true); `--grace` later they are deleted (their endpoints leave
the slices) and `--teardown` after that delete their addresses are removed (as a kubelet
tears a sandbox down): by then the proxy must long have stopped sending them new
connections. The slices are kept as the controller keeps them: changed endpoints are
updated in place, gone ones removed, new ones placed first in slices written this tick
anyway, then in the fullest slice that takes them all, else in new slices; an emptied
slice is deleted. Each slice a tick changes is written once (PUT, POST or DELETE), over
one kept-alive connection.

The lag of a write: from the moment it was sent to the kernel holding its effect (the
endpoints it made ready among the service's DNAT targets, those it made terminating no
longer). The kernel is read (the service's chain: `nft list chain`, or `iptables -t nat
-S`) each time nf_tables announces a transaction on the agent's tables (heard on netlink
in the node's namespace, as bench/realcp_latency.py does), and a change is dated by the
announcement that preceded the read that first showed it; on legacy iptables (no
announcements) the chain is polled every 100 ms and dated by the read. Writes that change
nothing the kernel holds (a pod appearing not ready, a terminating pod deleted) have no
lag. Reported: p50/p99/max over every write of the roll and over its last 10%
("end"), and the convergence: from the last write that changes what the kernel should
hold to the kernel holding exactly the new endpoints. The agent's CPU (its own and its
children's, iptables-restore) from /proc over the roll, its peak RSS (VmHWM), its syncs
from its log. Timings are reported, never asserted. Needs root.
"""

from __future__ import annotations

import argparse
import http.client
import json
import math
import os
import re
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import ROOT, agent_pid, cpu_times, simulator, size_mib
from bench.huge_service import (
    ENDPOINTS_PER_SLICE,
    NAMESPACE,
    SERVICE,
    SERVICE_IP,
    endpoint_object,
    pct,
    pod_address,
    service_object,
    slice_object,
)
from proxy.dataplane.common.drift_watch import NftablesListener
from proxy.lab import Lab
from proxy.lab.echo import LOCAL_ADDRESS
from proxy.lab.netns import entered
from proxy.lab.probe import ask_once
from proxy.lab.topology import ip

MODES = ("nftables", "iptables")
NODE = "node-a"
TICK = 0.1
POD_PORT, SERVICE_PORT = 8080, 80
POD_CIDR = "198.19.0.0/16"  # pod i is huge_service.pod_address(i): 198.19.0.0 + i
MAX_ENDPOINTS = 32_768  # old and new pods both in 198.19.0.0/16
PODS_LINK_NODE, PODS_LINK_POD = "198.18.2.1", "198.18.2.2"
PODS_DEV = "eth0"  # the pods' end of the veth holds every pod address
SLICES_PATH = f"/apis/discovery.k8s.io/v1/namespaces/{NAMESPACE}/endpointslices"
NFPROTO_IPV4 = 2
NFT_TABLE = "sliceproxy"
NFT_MAX_SHARDS = 64
FIRST_SYNC = re.compile(r"first sync done")
SYNC_LINE = re.compile(r'msg="(?:full )?sync done".*?\bduration=([0-9.]+)s')
DNAT_NFT = re.compile(r"dnat (?:ip )?to ([0-9.]+):" + str(POD_PORT))
# A large port balances through a slot map (nftables/render.py): its endpoints are there.
DNAT_MAP_NFT = re.compile(r"dnat ip to numgen random mod \d+ map @(\S+)")
SLOT_NFT = re.compile(r"\d+ : ([0-9.]+) \. " + str(POD_PORT) + r"\b")
DNAT_IPT = re.compile(r"-> ([0-9.]+):" + str(POD_PORT) + r"\b")
Obj = dict[str, Any]
Conditions = tuple[bool, bool, bool]  # ready, serving, terminating
READY: Conditions = (True, True, False)
NOT_READY: Conditions = (False, False, False)
TERMINATING: Conditions = (False, True, True)


@dataclass(frozen=True)
class Settings:
    endpoints: int = 1000
    rate: float = 100.0  # endpoints replaced a second
    mode: str = "nftables"
    ready_delay: float = 0.5
    grace: float = 2.0  # terminating -> deleted
    teardown: float = 1.0  # deleted -> address removed
    traffic_rate: float = 200.0
    connect_timeout: float = 1.0
    before: float = 1.0  # traffic before the roll
    after: float = 3.0  # and after the last address is removed
    min_sync_period: str = ""  # the agent's --min-sync-period ("": its default, 1s)
    settle_timeout: float = 120.0  # last write -> kernel exact, at most
    start_timeout: float = 600.0


# --- the roll: what the API holds, tick by tick ----------------------------------------


@dataclass
class SliceState:
    name: str
    endpoints: dict[int, Conditions] = field(default_factory=dict)  # pod -> conditions
    rv: str | None = None  # None: not created yet


@dataclass(frozen=True)
class Write:
    """One slice write of a tick, what it does to the kernel's wanted set, and when."""

    tick: int
    op: str  # POST, PUT, DELETE
    slice: str
    adds: frozenset[int]  # pods this write made ready
    removes: frozenset[int]  # pods this write made terminating


class Roll:
    """The pods of the roll and the slices holding them, as the controller keeps them.
    Old pod s (0 <= s < n) is replaced by new pod n + s."""

    def __init__(self, endpoints: int, rate: float, ready_delay: float, grace: float,
                 teardown: float) -> None:
        self.n = endpoints
        self.per_tick = max(1, round(rate * TICK))
        self.ready_ticks = max(1, round(ready_delay / TICK))
        self.grace_ticks = max(1, round(grace / TICK))
        self.teardown_ticks = max(0, round(teardown / TICK))
        self.desired: dict[int, Conditions] = dict.fromkeys(range(endpoints), READY)
        count = -(-endpoints // ENDPOINTS_PER_SLICE)
        self.slices = [SliceState(f"{SERVICE}-{i:05x}", dict.fromkeys(
            range(i * ENDPOINTS_PER_SLICE, min((i + 1) * ENDPOINTS_PER_SLICE, endpoints)),
            READY)) for i in range(count)]
        self._next_slice = count
        self.create_ticks = -(-endpoints // self.per_tick)

    @property
    def ticks(self) -> int:
        """Ticks until the last address is removed."""
        return (self.create_ticks - 1 + self.ready_ticks + 1 + self.grace_ticks
                + self.teardown_ticks + 1)

    def _slots(self, tick: int) -> range:
        if tick < 0 or tick >= self.create_ticks:
            return range(0)
        return range(tick * self.per_tick, min((tick + 1) * self.per_tick, self.n))

    def created(self, tick: int) -> list[int]:
        return [self.n + s for s in self._slots(tick)]

    def deleted(self, tick: int) -> list[int]:
        """Old pods deleted this tick (terminating `grace_ticks` ago)."""
        return list(self._slots(tick - self.ready_ticks - 1 - self.grace_ticks))

    def torn_down(self, tick: int) -> list[int]:
        """Old pods whose address goes this tick (deleted `teardown_ticks` ago)."""
        return list(self._slots(tick - self.ready_ticks - 1 - self.grace_ticks
                                - self.teardown_ticks))

    def step(self, tick: int) -> list[tuple[Write, Obj | None]]:
        """The API writes of tick `tick`: (what, the slice body; None for a DELETE)."""
        for p in self.created(tick):
            self.desired[p] = NOT_READY
        for s in self._slots(tick - self.ready_ticks):
            self.desired[self.n + s] = READY
        for s in self._slots(tick - self.ready_ticks - 1):
            self.desired[s] = TERMINATING
        for s in self._slots(tick - self.ready_ticks - 1 - self.grace_ticks):
            del self.desired[s]
        return self._reconcile(tick)

    def _reconcile(self, tick: int) -> list[tuple[Write, Obj | None]]:
        changed: dict[str, tuple[set[int], set[int]]] = {}
        placed: set[int] = set()
        for sl in self.slices:
            for p, cond in list(sl.endpoints.items()):
                want = self.desired.get(p)
                if want != cond:
                    adds, removes = changed.setdefault(sl.name, (set(), set()))
                    if want is None:
                        del sl.endpoints[p]
                    else:
                        sl.endpoints[p] = want
                        if want == READY:
                            adds.add(p)
                        elif want == TERMINATING:
                            removes.add(p)
            placed.update(sl.endpoints)
        new = [p for p in self.desired if p not in placed]
        for sl in self.slices:  # first the slices written anyway
            if sl.name in changed:
                new = self._fill(sl, new, changed)
        if new and len(new) <= ENDPOINTS_PER_SLICE:  # then the fullest that takes them all
            fits = [sl for sl in self.slices
                    if len(sl.endpoints) + len(new) <= ENDPOINTS_PER_SLICE]
            if fits:
                new = self._fill(max(fits, key=lambda s: len(s.endpoints)), new, changed)
        while new:
            sl = SliceState(f"{SERVICE}-{self._next_slice:05x}")
            self._next_slice += 1
            self.slices.append(sl)
            new = self._fill(sl, new, changed)
        out: list[tuple[Write, Obj | None]] = []
        for sl in list(self.slices):
            if sl.name not in changed:
                continue
            adds, removes = changed[sl.name]
            if not sl.endpoints:
                self.slices.remove(sl)
                if sl.rv is None:
                    continue
                out.append((Write(tick, "DELETE", sl.name, frozenset(), frozenset()), None))
                continue
            op = "POST" if sl.rv is None else "PUT"
            out.append((Write(tick, op, sl.name, frozenset(adds), frozenset(removes)),
                        self.body(sl)))
        return out

    def _fill(self, sl: SliceState, new: list[int],
              changed: dict[str, tuple[set[int], set[int]]]) -> list[int]:
        """Put as many of `new` into `sl` as it has room for; the rest."""
        room = ENDPOINTS_PER_SLICE - len(sl.endpoints)
        if room <= 0 or not new:
            return new
        adds, _ = changed.setdefault(sl.name, (set(), set()))
        for p in new[:room]:
            sl.endpoints[p] = self.desired[p]
            if self.desired[p] == READY:
                adds.add(p)
        return new[room:]

    @staticmethod
    def body(sl: SliceState) -> Obj:
        obj = slice_object(0, 0)  # huge_service's metadata, labels and owner; no endpoints
        obj["metadata"]["name"] = sl.name
        if sl.rv is None:
            obj["metadata"].pop("resourceVersion", None)
        else:
            obj["metadata"]["resourceVersion"] = sl.rv
        eps = []
        for p, (ready, serving, terminating) in sl.endpoints.items():
            ep = endpoint_object(p)
            ep["conditions"] = {"ready": ready, "serving": serving, "terminating": terminating}
            eps.append(ep)
        obj["endpoints"] = eps
        return obj

    def api_state(self) -> dict[int, Conditions]:
        return {p: c for sl in self.slices for p, c in sl.endpoints.items()}


# --- the API, from the node's namespace ------------------------------------------------


class NsConnection(http.client.HTTPConnection):
    """HTTP whose socket is made in network namespace `ns` (also when it reconnects)."""

    def __init__(self, ns: str, host: str, port: int, timeout: float = 30.0) -> None:
        super().__init__(host, port, timeout=timeout)
        self.ns = ns

    def connect(self) -> None:
        with entered(self.ns):
            self.sock = socket.create_connection((self.host, self.port), self.timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Api:
    """Requests over one kept-alive connection; (status, parsed body, sent, answered)."""

    def __init__(self, ns: str, kubeconfig: Path) -> None:
        match = re.search(r"server:\s*[\"']?http://([0-9.]+):(\d+)", kubeconfig.read_text())
        if not match:
            raise RuntimeError(f"no plain-HTTP server in {kubeconfig}")
        self.conn = NsConnection(ns, match.group(1), int(match.group(2)))

    def call(self, method: str, path: str, body: Obj | None = None
             ) -> tuple[int, Any, float, float]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Accept": "application/json"}
        if data is not None:
            headers["Content-Type"] = "application/json"
        for attempt in (1, 2):
            sent = time.monotonic()
            try:
                self.conn.request(method, path, body=data, headers=headers)
                resp = self.conn.getresponse()
                raw = resp.read()
            except (OSError, http.client.HTTPException):
                self.conn.close()  # an idle connection the server closed: once more
                if attempt == 2:
                    raise
                continue
            return resp.status, json.loads(raw) if raw else None, sent, time.monotonic()
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.conn.close()


# --- the kernel: the service's DNAT targets over time ----------------------------------


class KernelView:
    """The service's endpoints as the agent's rules in the node's namespace hold them."""

    def __init__(self, ns: str, mode: str) -> None:
        self.ns, self.mode = ns, mode
        self.backend = "nftables" if mode == "nftables" else ""
        self.chain: list[str] = []  # the command listing the service's chain

    def _run(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True,
                              text=True, check=False, timeout=120)

    def locate(self) -> bool:
        """Find the service's chain (once the agent's first sync is in)."""
        if self.mode == "nftables":
            text = self._run(["nft", "list", "ruleset"]).stdout
            table = chain = ""
            for line in text.splitlines():
                words = line.split()
                if words[:1] == ["table"] and len(words) >= 3:
                    table = f"{words[1]} {words[2]}"
                elif words[:1] == ["chain"] and len(words) >= 2:
                    chain = words[1]
                elif (DNAT_NFT.search(line) or DNAT_MAP_NFT.search(line)) and table and chain:
                    self.chain = ["nft", "list", "chain", *table.split(), chain]
                    return True
            return False
        for backend in ("nft", "legacy"):
            text = self._run([f"iptables-{backend}-save", "-t", "nat"]).stdout
            for line in text.splitlines():
                if line.startswith("-A SPX-SERVICES") and f"-d {SERVICE_IP}/32" in line:
                    target = line.split(" -j ")[-1].split()[0]
                    self.backend = backend
                    self.chain = [f"iptables-{backend}", "-w", "-t", "nat", "-S", target]
                    return True
        return False

    def read(self) -> frozenset[str] | None:
        """The addresses the service's chain DNATs to (None if it cannot be read)."""
        if not self.chain and not self.locate():
            return None
        res = self._run(self.chain)
        if res.returncode != 0:
            return None
        if self.mode != "nftables":
            return frozenset(DNAT_IPT.findall(res.stdout))
        slot_map = DNAT_MAP_NFT.search(res.stdout)
        if slot_map is None:
            return frozenset(DNAT_NFT.findall(res.stdout))
        res = self._run(["nft", "list", "map", *self.chain[3:5], slot_map[1]])
        return frozenset(SLOT_NFT.findall(res.stdout)) if res.returncode == 0 else None

    def commit_tables(self) -> set[tuple[int, str]]:
        if self.mode == "nftables":
            return {(NFPROTO_IPV4, t) for t in
                    [NFT_TABLE, *(f"{NFT_TABLE}-{i}" for i in range(NFT_MAX_SHARDS))]}
        return {(NFPROTO_IPV4, "nat")} if self.backend == "nft" else set()


class KernelWatch:
    """A thread reading the service's endpoints after each nf_tables transaction on the
    agent's tables (or every POLL seconds without announcements): (time, endpoints)
    whenever they changed, dated by the announcement before the read (or the read)."""

    POLL = 0.1

    def __init__(self, view: KernelView) -> None:
        self.view = view
        self.timeline: list[tuple[float, frozenset[str]]] = []
        self.reads = 0
        self.read_seconds = 0.0
        self._heard = threading.Event()
        self._last_commit = 0.0
        self._commits = 0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._listener: NftablesListener | None = None
        self._thread = threading.Thread(target=self._run, name="kernel-watch", daemon=True)

    def _notify(self, _reason: str) -> None:
        self._last_commit = time.monotonic()
        self._commits += 1
        self._heard.set()

    def start(self) -> None:
        self._notify("the first read")
        tables = self.view.commit_tables()
        if tables:
            with entered(self.view.ns):
                self._listener = NftablesListener(tables, lambda _pid: False, self._notify)
            self._listener.start()
        self._thread.start()

    def _run(self) -> None:
        last: frozenset[str] | None = None
        while not self._stop.is_set():
            if self._listener is not None:
                if not self._heard.wait(1.0):
                    continue
                self._heard.clear()
                dated = self._last_commit
            start = time.monotonic()
            eps = self.view.read()
            end = time.monotonic()
            self.reads += 1
            self.read_seconds += end - start
            if self._listener is None:
                dated = end
            if eps is not None and eps != last:
                with self._lock:
                    self.timeline.append((dated, eps))
                last = eps
            if self._listener is None:
                self._stop.wait(max(0.0, start + self.POLL - time.monotonic()))

    def latest(self) -> frozenset[str] | None:
        with self._lock:
            return self.timeline[-1][1] if self.timeline else None

    def wait_for(self, want: Callable[[frozenset[str]], bool], deadline: float,
                 alive: Callable[[], None]) -> float | None:
        """Poll our own record until the endpoints satisfy `want`: the time they did."""
        while time.monotonic() < deadline:
            alive()
            with self._lock:
                if self.timeline and want(self.timeline[-1][1]):
                    return self.timeline[-1][0]
            self._stop.wait(0.05)
        return None

    @property
    def commits(self) -> int:
        return self._commits

    def stop(self) -> None:
        self._stop.set()
        self._heard.set()
        self._thread.join(30)
        if self._listener is not None:
            self._listener.stop()


# --- traffic -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    due: float
    started: float
    ended: float
    answer: str  # the pod's address, or a failure kind of proxy.lab.probe


class Traffic:
    """Fresh TCP connections to the ClusterIP from the client namespace at `rate` a
    second, at most `count` of them and until `stop()`."""

    WORKERS = 64

    def __init__(self, ns: str, rate: float, timeout: float, count: int) -> None:
        self.ns, self.rate, self.timeout, self.count = ns, rate, timeout, count
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(self.WORKERS, thread_name_prefix="traffic")
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def _one(self, due: float) -> None:
        started = time.monotonic()
        answer = ask_once(self.ns, SERVICE_IP, SERVICE_PORT, "tcp", self.timeout)
        with self._lock:
            self.outcomes.append(Outcome(due, started, time.monotonic(), answer))

    def _run(self) -> None:
        t0 = time.monotonic()
        for k in range(self.count):
            due = t0 + k / self.rate
            # Pacing the connections (the rate), not synchronisation.
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            self._pool.submit(self._one, due)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._pool.shutdown(wait=True)


# --- the lab -------------------------------------------------------------------------------


def _batch(ns: str, lines: Sequence[str]) -> None:
    if not lines:
        return
    res = subprocess.run(["ip", "-n", ns, "-batch", "-"], input="\n".join(lines) + "\n",
                         capture_output=True, text=True, check=False, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"ip -batch in {ns}: {res.stderr.strip()[-500:]}")


def add_pods(ns: str, pods: Sequence[int]) -> None:
    _batch(ns, [f"address add {pod_address(p)}/32 dev {PODS_DEV}" for p in pods])


def remove_pods(ns: str, pods: Sequence[int]) -> None:
    _batch(ns, [f"address del {pod_address(p)}/32 dev {PODS_DEV}" for p in pods])


def pods_namespace(lab: Lab) -> str:
    """The pods' namespace behind a veth from the node, its end holding the pods'
    addresses, and one echo listener on 0.0.0.0 (started in the lab, it dies with it)."""
    pods = lab.add_namespace("pods")
    node = lab.node_ns
    ip("-n", node, "link", "add", "pods0", "type", "veth", "peer", "name", "eth0",
       "netns", pods)
    ip("-n", node, "addr", "add", f"{PODS_LINK_NODE}/24", "dev", "pods0")
    ip("-n", node, "link", "set", "pods0", "up")
    ip("-n", pods, "addr", "add", f"{PODS_LINK_POD}/24", "dev", "eth0")
    ip("-n", pods, "link", "set", "eth0", "up")
    ip("-n", pods, "route", "add", "default", "via", PODS_LINK_NODE)
    ip("-n", node, "route", "add", POD_CIDR, "via", PODS_LINK_POD)
    # Fresh source ports for every connection of a long run (TIME_WAIT keeps each 60 s).
    lab.sysctl(lab.client_ns, "net.ipv4.ip_local_port_range", "1024 65535")
    proc = lab.popen(node, [sys.executable, "-m", "proxy.lab.echo", "--tcp", str(POD_PORT),
                            "--backend", f"{LOCAL_ADDRESS}={pods}=0.0.0.0"],
                     stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                     env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], 20.0)
    if not ready or proc.stdout.readline().strip() != b"ready":
        raise RuntimeError("the pods' echo listener did not start")
    return pods


def manifest(roll: Roll) -> list[Obj]:
    return [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            service_object(), *(roll.body(sl) for sl in roll.slices)]


def _cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process, and of the children it has waited for (iptables-restore)."""
    own, children = cpu_times(pid)
    return {"self": own, "children": children}


def _syncs(log: Path, start: int) -> list[float]:
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return [float(m.group(1)) for m in SYNC_LINE.finditer(text)]


def _ms(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(pct(list(values), 0.5) * 1000, 1),
            "p99": round(pct(list(values), 0.99) * 1000, 1),
            "max": round(max(values) * 1000, 1)}


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
        "during": _ms(seen),
        "end": _ms([lag for _, lag in tail if lag is not None]),
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
            "start_slip_ms": _ms(starts)}


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
                           "min_sync_period": settings.min_sync_period or "1s (default)",
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
    if settings.min_sync_period:
        argv += ["--min-sync-period", settings.min_sync_period]
    with log_path.open("wb") as log:
        proc = lab.popen(lab.node_ns, argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})

    def alive() -> None:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"the agent exited {proc.returncode}:\n{tail}")

    began = time.monotonic()
    deadline = began + settings.start_timeout
    while not FIRST_SYNC.search(log_path.read_text(errors="replace")):
        alive()
        if time.monotonic() > deadline:
            raise RuntimeError(f"no first sync: {log_path}")
        time.sleep(0.05)
    agent = agent_pid(proc.pid) or proc.pid
    view = KernelView(lab.node_ns, settings.mode)
    while not view.locate():
        alive()
        if time.monotonic() > deadline:
            raise RuntimeError("the service's chain never appeared")
        time.sleep(0.05)
    watch = KernelWatch(view)
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
        cpu0, origin = _cpu(agent), time.monotonic()
        roll_through(api, pods, roll, rec, alive)
        roll_end = time.monotonic()
        final = frozenset(pod_address(n + s) for s in range(n))
        last = max((s for w, s, _ in rec.writes if w.adds or w.removes), default=origin)
        exact = watch.wait_for(lambda eps: eps == final, last + settings.settle_timeout, alive)
        converged = time.monotonic()
        cpu1 = _cpu(agent)
        # Traffic goes on `after` seconds past the last address removal and convergence.
        time.sleep(max(0.0, max(roll_end, converged) + settings.after - time.monotonic()))
    finally:
        traffic.stop()
    alive()
    syncs = _syncs(log_path, log_offset)
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
        "tick_slip_ms": _ms(rec.slips),
        "writes": dict(Counter(w.op for w, _, _ in rec.writes)),
        "write_ms": _ms([a - s for _, s, a in rec.writes]),
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
            "syncs": len(syncs), "sync_ms": _ms(syncs), "errors": errors},
        # (seconds since the roll began, old endpoints, new endpoints) at each change
        "kernel_timeline": [
            (round(t - origin, 3), sum(1 for a in eps if a not in final), len(eps & final))
            for t, eps in watch.timeline],
        "kernel_reads": {"n": watch.reads, "seconds": round(watch.read_seconds, 2),
                         "commits_heard": watch.commits,
                         "dated_by": "nf_tables commit" if watch.view.commit_tables()
                         else "poll"},
    }


# --- output ----------------------------------------------------------------------------------


def markdown(results: list[dict[str, Any]]) -> str:
    rows = ["| mode | endpoints | rate | connections (failed) | lag p50 / p99 / max, roll "
            "| lag p50 / p99, last 10% | converged | agent CPU s (% of roll) | peak RSS MiB "
            "| syncs (p50 ms) |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t, lag, a = r["traffic"], r["lag"], r["agent"]
        during, end = lag["during"], lag["end"]
        failed = f"{t['connections']:,} ({t['failed']}"
        if t["failed"]:
            failed += ": " + ", ".join(f"{k} {v}" for k, v in t["failures_by_kind"].items())
        conv = "never" if lag["converged_s"] is None else f"{lag['converged_s'] * 1000:.0f} ms"
        rows.append(
            f"| {r['mode']} | {r['endpoints']:,} | {r['rate']:g}/s | {failed}) "
            f"| {during.get('p50', '-')} / {during.get('p99', '-')} / {during.get('max', '-')} "
            f"| {end.get('p50', '-')} / {end.get('p99', '-')} | {conv} "
            f"| {a['cpu_s']} ({a['cpu_percent']}%) | {a['peak_rss_mib'] or 0:.0f} "
            f"| {a['syncs']} ({a['sync_ms'].get('p50', '-')}) |")
    rows.append("")
    rows.append("lag: a slice write sent -> its effect in the kernel (ms); converged: the "
                "last such write -> the kernel holding exactly the new endpoints; CPU: the "
                "agent and its children over the roll")
    return "\n".join(rows)


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rolling_update", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=1000)
    ap.add_argument("--rate", type=float, default=100.0, help="endpoints replaced a second")
    ap.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--traffic-rate", type=float, default=200.0,
                    help="new connections a second")
    ap.add_argument("--ready-delay", type=float, default=0.5)
    ap.add_argument("--grace", type=float, default=2.0,
                    help="seconds from terminating to deleted")
    ap.add_argument("--teardown", type=float, default=1.0,
                    help="seconds from deleted to the address removed")
    ap.add_argument("--min-sync-period", default="",
                    help="the agent's --min-sync-period (default: the agent's, 1s)")
    ap.add_argument("--out", "--json", dest="out", type=Path, help="write the JSON here")
    ap.add_argument("--keep-logs", type=Path, metavar="DIR")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    results = []
    for mode in args.mode:
        settings = Settings(endpoints=args.endpoints, rate=args.rate, mode=mode,
                            ready_delay=args.ready_delay, grace=args.grace,
                            teardown=args.teardown, traffic_rate=args.traffic_rate,
                            min_sync_period=args.min_sync_period)
        with tempfile.TemporaryDirectory(prefix="spx-roll-") as tmp:
            work = args.keep_logs or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            result = run(settings, work, lambda t: print(t, file=sys.stderr, flush=True))
        results.append(result)
        brief = {k: v for k, v in result.items() if k not in ("lag", "traffic")}
        print(json.dumps(brief), file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
