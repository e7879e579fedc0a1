"""The lab: the pods' namespace and addresses, the manifest, the agent's CPU and syncs."""

from __future__ import annotations

import os
import select
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import ROOT, cpu_times
from bench.huge_service import (
    NAMESPACE,
    pct,
    service_object,
)
from bench.rolling_update.workload import (
    POD_NETS,
    POD_PORT,
    PODS_DEV,
    PODS_LINK_NODE,
    PODS_LINK_POD,
    SYNC_LINE,
    Obj,
    Roll,
    pod_address,
)
from proxy.netns_lab import Lab
from proxy.netns_lab.echo import LOCAL_ADDRESS
from proxy.netns_lab.topology import ip

# --- the lab -------------------------------------------------------------------------------


def _batch(ns: str, lines: Sequence[str]) -> None:
    if not lines:
        return
    res = subprocess.run(["ip", "-n", ns, "-batch", "-"], input="\n".join(lines) + "\n",
                         capture_output=True, text=True, check=False, timeout=120)
    if res.returncode != 0:
        raise RuntimeError(f"ip -batch in {ns}: {res.stderr.strip()[-500:]}")


# A pod's address is a local route in the pods' namespace, not an address on the device:
# the same to the echo listener on 0.0.0.0 (it accepts, and answers with the address
# reached; once the route goes, nothing answers), but adding 50,000 addresses to one
# device takes minutes (the kernel keeps a device's addresses in a list), routes 1 s.
def add_pods(ns: str, pods: Sequence[int]) -> None:
    _batch(ns, [f"route add local {pod_address(p)}/32 dev {PODS_DEV} table local"
                for p in pods])


def remove_pods(ns: str, pods: Sequence[int]) -> None:
    _batch(ns, [f"route del local {pod_address(p)}/32 dev {PODS_DEV} table local"
                for p in pods])


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
    for net in POD_NETS:
        ip("-n", node, "route", "add", str(net), "via", PODS_LINK_POD)
    # Fresh source ports for every connection of a long run (TIME_WAIT keeps each 60 s).
    lab.sysctl(lab.client_ns, "net.ipv4.ip_local_port_range", "1024 65535")
    proc = lab.popen(node, [sys.executable, "-m", "proxy.netns_lab.echo", "--tcp", str(POD_PORT),
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


def agent_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process, and of the children it has waited for (iptables-restore)."""
    own, children = cpu_times(pid)
    return {"self": own, "children": children}


def logged_syncs(log: Path, start: int) -> list[float]:
    with log.open("rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    return [float(m.group(1)) for m in SYNC_LINE.finditer(text)]


def ms_summary(values: Sequence[float]) -> dict[str, Any]:
    if not values:
        return {"n": 0}
    return {"n": len(values), "p50": round(pct(list(values), 0.5) * 1000, 1),
            "p99": round(pct(list(values), 0.99) * 1000, 1),
            "max": round(max(values) * 1000, 1)}
