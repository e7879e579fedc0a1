"""Running the real agent (`python -m proxy`) in a lab's node namespace, against the
simulator, for the e2e tests and the demo's checks.

The simulator runs in this process, on a thread started inside the node namespace (a
thread inherits the namespace of the thread that creates it), so it listens on the
node's own 127.0.0.1 like an API server reached over the node's network, while the test
still edits its store directly. HTTP to the agent's servers goes through sockets opened
inside the node namespace.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from proxy.netns_lab import BackendSpec, Lab
from proxy.netns_lab.netns import entered
from proxy.netns_lab.poll import wait as wait_for  # the name the e2e, fault and kernel tiers use
from proxy.netns_lab.probe import http_get
from proxy.sim import SimServer

ROOT = Path(__file__).resolve().parents[2]
HEALTHZ_PORT, METRICS_PORT = 10256, 10249
POD_CIDR = "198.18.1.0/24,fd00:18:1::/64"


def quiet_icmp_limits(lab: Lab) -> None:
    """Let the node answer every REJECT with its ICMP error. The kernel limits ICMP
    errors per destination host (1/s); this kernel starts a new peer with no tokens, so
    a test's first few connections to a service without endpoints would time out
    instead of being refused. Real clients retry; tests count each connection."""
    lab.sysctl(lab.node_ns, "net.ipv4.icmp_ratelimit", "0")
    lab.sysctl(lab.node_ns, "net.ipv6.icmp.ratelimit", "0")


@contextlib.contextmanager
def one_backend_lab() -> Iterator[Lab]:
    """A lab with one backend, web-1 (on node-a), serving, its node's ICMP limits off."""
    with Lab([BackendSpec("web-1")]) as lab:
        quiet_icmp_limits(lab)
        lab.start_backends()
        yield lab


def start_sim(lab: Lab, objects: Iterable[Any] = (), **kw: Any) -> SimServer:
    sim = SimServer(objects=objects, bookmark_interval=1.0, **kw)
    with entered(lab.node_ns):
        sim.start()
    return sim


class AgentProcess:
    """`python -m proxy` in the lab's node namespace; its log goes to `log_path`."""

    def __init__(self, lab: Lab, sim: SimServer, workdir: Path, *flags: str,
                 env: dict[str, str] | None = None, name: str = "agent") -> None:
        self.lab, self.sim = lab, sim
        self.log_path = workdir / f"{name}.log"
        kubeconfig = sim.write_kubeconfig(workdir / "kubeconfig")
        self.argv = [sys.executable, "-m", "proxy", "--kubeconfig", str(kubeconfig),
                     "--hostname-override", lab.node_name, "--cluster-cidr", POD_CIDR,
                     "-v", "2", *flags]
        self._env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc: subprocess.Popen[Any] | None = None
        self.started = 0.0

    def start(self) -> AgentProcess:
        log = self.log_path.open("ab")
        self.started = time.monotonic()
        self.proc = self.lab.popen(self.lab.node_ns, self.argv, stdout=log, stderr=log,
                                   env=self._env, cwd=str(ROOT))
        log.close()
        return self

    # --- its HTTP faces -------------------------------------------------------------

    def get(self, path: str, port: int = METRICS_PORT, host: str = "127.0.0.1",
            timeout: float = 3.0) -> tuple[int, bytes]:
        return http_get(self.lab.node_ns, host, port, path, timeout)

    def healthz(self) -> tuple[int, dict[str, Any]]:
        status, body = self.get("/healthz", HEALTHZ_PORT)
        return status, (json.loads(body) if body else {})

    def livez(self) -> int:
        return self.get("/livez", HEALTHZ_PORT)[0]

    def dump(self, service: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
        path = "/debug/dump" + (f"?service={service}" if service else "")
        status, body = self.get(path, timeout=timeout)
        assert status == 200, f"/debug/dump answered {status}: {body[:300]!r}"
        doc: dict[str, Any] = json.loads(body)
        return doc

    def metrics(self) -> dict[str, float]:
        """Samples by `name{labels}` as Prometheus prints them."""
        status, body = self.get("/metrics")
        assert status == 200
        out: dict[str, float] = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def wait_ready(self, timeout: float = 30.0) -> float:
        """Wait for /healthz 200 (the first sync is done); seconds since start."""
        try:
            wait_for(lambda: (self.alive() and self.healthz()[0] == 200) or self._dead(),
                     timeout, "the agent's first sync")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; the agent's log ends with:\n{self.log_tail()}") \
                from None
        return time.monotonic() - self.started

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _dead(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise AssertionError(f"the agent exited {self.proc.returncode}:\n"
                                 f"{self.log_tail()}")
        return False

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    def rss_kib(self) -> int:
        assert self.proc is not None
        status = Path(f"/proc/{self.proc.pid}/status").read_text()
        match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
        return int(match.group(1)) if match else 0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 15.0) -> float:
        """Signal it and wait for the exit; returns the seconds it took."""
        assert self.proc is not None
        began = time.monotonic()
        self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
            raise AssertionError(f"the agent did not stop within {timeout}s:\n"
                                 f"{self.log_tail()}") from None
        return time.monotonic() - began


BACKENDS = ("nft", "legacy")


def iptables_save(lab: Lab, family: str = "4", backends: Sequence[str] = BACKENDS) -> str:
    """The node namespace's rules from `backends` (default both: whichever the agent used)."""
    out = []
    tool = "iptables" if family == "4" else "ip6tables"
    for backend in backends:
        res = lab.exec(lab.node_ns, [f"{tool}-{backend}-save"])
        out.append(res.stdout)
    return "\n".join(out)


def our_rules(lab: Lab, backends: Sequence[str] = BACKENDS) -> list[str]:
    """Our lines in the node namespace's rules (both families), on `backends`."""
    return [ln for ln in (iptables_save(lab, "4", backends)
                          + iptables_save(lab, "6", backends)).splitlines() if "SPX-" in ln]


def run_cli(lab: Lab, args: Sequence[str], timeout: float = 60.0,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return lab.exec(lab.node_ns, [sys.executable, "-m", "proxy", *args], timeout=timeout,
                    env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, cwd=str(ROOT))


# --- objects ----------------------------------------------------------------------------

PortSpec = tuple[str, int, int, str]  # (name, service port, target port, protocol)
HTTP: tuple[PortSpec, ...] = (("http", 80, 8080, "TCP"),)


def service(name: str, ips: Sequence[str], ports: Sequence[PortSpec] = HTTP,
            namespace: str = "demo", **spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "clusterIP": ips[0], "clusterIPs": list(ips),
        "ipFamilies": ["IPv6" if ":" in ip else "IPv4" for ip in ips],
        "ipFamilyPolicy": "RequireDualStack" if len(ips) > 1 else "SingleStack",
        "ports": [{"name": n, "port": p, "targetPort": t, "protocol": proto}
                  for n, p, t, proto in ports],
    }
    body.update(spec)
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace}, "spec": body}


def endpoint_slice(name: str, service_name: str, endpoints: Sequence[dict[str, Any]],
                   ports: Sequence[PortSpec] = HTTP, namespace: str = "demo",
                   family: str = "IPv4") -> dict[str, Any]:
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service_name}},
        "addressType": family,
        "ports": [{"name": n, "port": t, "protocol": proto} for n, _, t, proto in ports],
        "endpoints": list(endpoints),
    }


def endpoint(address: object, node: str = "node-a", ready: bool = True,
             serving: bool | None = None, terminating: bool = False,
             zone: str | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {
        "addresses": [str(address)], "nodeName": node,
        "conditions": {"ready": ready, "serving": ready if serving is None else serving,
                       "terminating": terminating}}
    if zone:
        out["zone"] = zone
    return out


def endpoints_object(name: str, addresses: Sequence[object], ports: Sequence[PortSpec] = HTTP,
                     namespace: str = "demo", node: str = "node-a",
                     not_ready: Sequence[object] = ()) -> dict[str, Any]:
    """The legacy core/v1 Endpoints equivalent of one slice."""
    subset: dict[str, Any] = {
        "addresses": [{"ip": str(a), "nodeName": node} for a in addresses],
        "ports": [{"name": n, "port": t, "protocol": proto} for n, _, t, proto in ports]}
    if not_ready:
        subset["notReadyAddresses"] = [{"ip": str(a), "nodeName": node} for a in not_ready]
    return {"apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": name, "namespace": namespace}, "subsets": [subset]}


def namespace_object(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def node_object(name: str = "node-a", zone: str = "zone-a",
                addresses: Sequence[tuple[str, object]] = ()) -> dict[str, Any]:
    """`addresses`: status.addresses as (type, address), as a kubelet writes them (the
    Node's primary IPs come from them: `--nodeport-addresses primary`)."""
    out: dict[str, Any] = {"apiVersion": "v1", "kind": "Node",
                           "metadata": {"name": name,
                                        "labels": {"kubernetes.io/hostname": name,
                                                   "topology.kubernetes.io/zone": zone}}}
    if addresses:
        out["status"] = {"addresses": [{"type": t, "address": str(a)} for t, a in addresses]}
    return out
