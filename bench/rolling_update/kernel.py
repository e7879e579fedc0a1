"""The kernel: the service's DNAT targets over time."""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable, Sequence

from bench.huge_service import (
    SERVICE_IP,
)
from bench.rolling_update.workload import (
    DNAT_IPT,
    DNAT_MAP_NFT,
    DNAT_NFT,
    NFPROTO_IPV4,
    NFT_MAX_SHARDS,
    NFT_TABLE,
    SLOT_NFT,
)
from proxy.dataplane.common.drift_watch import NftablesListener
from proxy.lab.netns import entered

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
