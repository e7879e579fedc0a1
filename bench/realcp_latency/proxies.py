"""The proxies side by side: their processes, metrics, CPU, memory and logged syncs."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bench.common import cpu_times, status_mib
from bench.realcp_latency.nat import NatView
from labs.realcp.nodes import (
    NodeProxy,
)
from proxy.netns_lab import Lab

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
    def base(self) -> str:
        """The proxy (settings.PROXIES) without its pacing ("sliceproxy-nftables/old")."""
        return self.name.split("/", 1)[0]

    @property
    def kind(self) -> str:
        """"sliceproxy" or "kube-proxy", whatever the mode."""
        return "kube-proxy" if self.base == "kube-proxy" else "sliceproxy"

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
