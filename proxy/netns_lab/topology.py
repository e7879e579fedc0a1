"""A throw-away node with pods and a client, built from network namespaces.

    client ns                 node ns (the agent and its rules)             backend ns (x N)
    eth0 198.18.0.2/24 ------ lan0 198.18.0.1/24
         fd00:18::2/64             fd00:18::1/64
                              spx-br0 198.18.1.1/24, fd00:18:1::1/64 ---- eth0 198.18.1.(10+i)/24
                                                                               fd00:18:1::(10+i)/64

The client and the backends route everything through the node; the node's default
route points at the client, so a packet for a service IP that no rule catches leaves
the node (as on a real host) instead of failing a route lookup. Interfaces are created
directly inside the namespaces (`ip -n NS link add ... peer ... netns OTHER`): nothing
is ever added to the host's own namespace, and deleting the namespaces removes
everything. Namespace names carry the creating process's pid, so namespaces left by a
test process that was killed outright are swept by the next lab.

Addresses stay in 198.18.0.0/15 and fd00::/8 (see the project's test rules).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import select
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path
from typing import Any

from proxy.netns_lab import poll, probe
from proxy.netns_lab.netns import NETNS_DIR

log = logging.getLogger(__name__)

NODE_LAN4, CLIENT4 = IPv4Address("198.18.0.1"), IPv4Address("198.18.0.2")
NODE_LAN6, CLIENT6 = IPv6Address("fd00:18::1"), IPv6Address("fd00:18::2")
POD_GW4, POD_GW6 = IPv4Address("198.18.1.1"), IPv6Address("fd00:18:1::1")
POD_CIDR4, POD_CIDR6 = IPv4Network("198.18.1.0/24"), IPv6Network("fd00:18:1::/64")
SERVICE_CIDR4, SERVICE_CIDR6 = IPv4Network("198.18.128.0/17"), IPv6Network("fd00:198:18::/112")
TCP_PORT, UDP_PORT = 8080, 8081
MAX_BACKENDS = 200
BRIDGE = "spx-br0"
_NAME = re.compile(r"^spx-(\d+)-[0-9a-f]+-")


class LabError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class BackendSpec:
    name: str  # what the backend answers with
    node: str = "node-a"  # the node written into EndpointSlices for it


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    node: str
    ns: str
    ipv4: IPv4Address
    ipv6: IPv6Address


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], check=False, capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise LabError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (the sweeps' test for a killed run)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_namespace(name: str) -> None:
    """Kill whatever still runs in the namespace, then delete it."""
    pids = ip("netns", "pids", name, check=False).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    ip("netns", "delete", name, check=False)


def sweep_stale() -> list[str]:
    """Delete lab namespaces whose creating process is gone (a test killed outright)."""
    removed = []
    names = os.listdir(NETNS_DIR) if os.path.isdir(NETNS_DIR) else []
    for name in names:
        match = _NAME.match(name)
        if match and not pid_alive(int(match.group(1))):
            delete_namespace(name)
            removed.append(name)
    return removed


class Lab:
    def __init__(self, backends: Sequence[BackendSpec] = (), *, node_name: str = "node-a",
                 ipv6: bool = True) -> None:
        if len(backends) > MAX_BACKENDS:
            raise LabError(f"at most {MAX_BACKENDS} backends")
        names = [b.name for b in backends]
        if len(set(names)) != len(names):
            raise LabError(f"backend names must be unique: {names}")
        self.prefix = f"spx-{os.getpid()}-{secrets.token_hex(3)}"
        self.node_name = node_name
        self.ipv6 = ipv6
        self.node_ns = f"{self.prefix}-node"
        self.client_ns = f"{self.prefix}-client"
        self.node_ip4, self.node_ip6 = NODE_LAN4, NODE_LAN6
        self.client_ip4, self.client_ip6 = CLIENT4, CLIENT6
        self.backends: dict[str, Backend] = {
            spec.name: Backend(spec.name, spec.node, f"{self.prefix}-b{i}",
                               POD_GW4 + 9 + i, POD_GW6 + 9 + i)
            for i, spec in enumerate(backends)
        }
        self._namespaces: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []

    # --- lifecycle ---------------------------------------------------------------------

    def __enter__(self) -> Lab:
        try:
            self.build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _netns(self, name: str) -> None:
        ip("netns", "add", name)
        self._namespaces.append(name)
        ip("-n", name, "link", "set", "lo", "up")
        if self.ipv6:
            # Duplicate address detection would hold new IPv6 addresses (link-local ones
            # included) back for a second or two; these links are private.
            self.sysctl(name, "net.ipv6.conf.default.accept_dad", "0")
            self.sysctl(name, "net.ipv6.conf.all.accept_dad", "0")

    def add_namespace(self, suffix: str) -> str:
        """Another namespace of this lab (`<prefix>-<suffix>`), deleted with it."""
        name = f"{self.prefix}-{suffix}"
        self._netns(name)
        return name

    def sysctl(self, ns: str, key: str, value: str) -> None:
        self.exec(ns, ["sysctl", "-qw", f"{key}={value}"], check=True)

    def _addr(self, ns: str, dev: str, v4: str, v6: str) -> None:
        ip("-n", ns, "addr", "add", v4, "dev", dev)
        if self.ipv6:
            ip("-n", ns, "addr", "add", v6, "dev", dev, "nodad")
        ip("-n", ns, "link", "set", dev, "up")

    def _routes(self, ns: str, gw4: IPv4Address, gw6: IPv6Address) -> None:
        ip("-n", ns, "route", "add", "default", "via", str(gw4))
        if self.ipv6:
            ip("-n", ns, "-6", "route", "add", "default", "via", str(gw6))

    def build(self) -> None:
        sweep_stale()
        node, client = self.node_ns, self.client_ns
        self._netns(node)
        self._netns(client)
        self.sysctl(node, "net.ipv4.ip_forward", "1")
        if self.ipv6:
            self.sysctl(node, "net.ipv6.conf.all.forwarding", "1")
        ip("-n", node, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0",
           "netns", client)
        self._addr(node, "lan0", f"{NODE_LAN4}/24", f"{NODE_LAN6}/64")
        self._addr(client, "eth0", f"{CLIENT4}/24", f"{CLIENT6}/64")
        self._routes(client, NODE_LAN4, NODE_LAN6)
        self._routes(node, CLIENT4, CLIENT6)
        ip("-n", node, "link", "add", BRIDGE, "type", "bridge")
        self._addr(node, BRIDGE, f"{POD_GW4}/24", f"{POD_GW6}/64")
        for i, b in enumerate(self.backends.values()):
            self._netns(b.ns)
            host_side = f"vb{i}"
            ip("-n", node, "link", "add", host_side, "type", "veth", "peer", "name", "eth0",
               "netns", b.ns)
            ip("-n", node, "link", "set", host_side, "master", BRIDGE, "up")
            # As a CNI's bridge plugin with hairpinMode: a pod reaching itself through a
            # service comes back out of the port it went in by.
            ip("-n", node, "link", "set", host_side, "type", "bridge_slave", "hairpin", "on")
            self._addr(b.ns, "eth0", f"{b.ipv4}/24", f"{b.ipv6}/64")
            self._routes(b.ns, POD_GW4, POD_GW6)
        log.info("lab built", extra={"prefix": self.prefix, "backends": len(self.backends)})

    def close(self) -> None:
        for proc in self._procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10)
        self._procs.clear()
        for name in reversed(self._namespaces):
            delete_namespace(name)
        self._namespaces.clear()

    # --- processes -----------------------------------------------------------------------

    def exec(self, ns: str, cmd: Sequence[str], *, check: bool = False,
             timeout: float = 60.0, **kw: Any) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(["ip", "netns", "exec", ns, *cmd], check=False,
                                capture_output=True, text=True, timeout=timeout, **kw)
        if check and result.returncode != 0:
            raise LabError(f"{' '.join(cmd)} in {ns}: exit {result.returncode}: "
                           f"{result.stderr.strip()}")
        return result

    def popen(self, ns: str, cmd: Sequence[str], **kw: Any) -> subprocess.Popen[Any]:
        """Start a process in `ns`; it (and its process group) dies with the lab."""
        proc: subprocess.Popen[Any] = subprocess.Popen(
            ["ip", "netns", "exec", ns, *cmd], start_new_session=True, **kw)
        self._procs.append(proc)
        return proc

    def start_backends(self, tcp_ports: Sequence[int] = (TCP_PORT,),
                       udp_ports: Sequence[int] = (UDP_PORT,), timeout: float = 20.0) -> None:
        """Echo servers on every backend (one process for all); returns once they listen."""
        if not self.backends:
            return
        cmd = [sys.executable, "-m", "proxy.netns_lab.echo",
               "--tcp", ",".join(map(str, tcp_ports)), "--udp", ",".join(map(str, udp_ports))]
        for b in self.backends.values():
            addrs = [str(b.ipv4)] + ([str(b.ipv6)] if self.ipv6 else [])
            cmd += ["--backend", f"{b.name}={b.ns}={','.join(addrs)}"]
        # Started from the node namespace; it enters each backend's namespace itself.
        proc = self.popen(self.node_ns, cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          env={**os.environ, "PYTHONPATH": _repo_root()})
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else b""
        if line.strip() != b"ready":
            proc.kill()
            err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
            raise LabError(f"echo servers did not start within {timeout}s: {err[-2000:]}")

    # --- traffic ---------------------------------------------------------------------------

    def ask(self, ns: str, ip: object, port: int, proto: str = "tcp", count: int = 20,
            timeout: float = 1.0, source: str | None = None) -> Counter[str]:
        return probe.ask(ns, str(ip), port, proto, count, timeout, source)

    @contextlib.contextmanager
    def hold(self, ns: str, ip: object, port: int, timeout: float = 2.0) -> Iterator[probe.Flow]:
        with probe.Flow(ns, str(ip), port, timeout) as flow:
            yield flow

    def wait_for(self, ns: str, ip: object, port: int, want: set[str], *, proto: str = "tcp",
                 count: int = 10, deadline: float = 15.0) -> Counter[str]:
        """Poll until `count` connections are answered only by backends in `want` and by
        every one of them; returns the last answer (raises LabError on the deadline)."""
        last: Counter[str] = Counter()

        def settled() -> tuple[Counter[str]] | None:  # a tuple: truthy even if empty
            nonlocal last
            last = self.ask(ns, ip, port, proto, count, timeout=0.5)
            return (last,) if set(last) == want else None

        try:  # no pause between rounds: each round of asks takes its own time
            return poll.wait(settled, deadline, interval=0)[0]
        except poll.TimedOut:
            raise LabError(f"{ip}:{port}/{proto} from {ns}: wanted answers from "
                           f"{sorted(want)}, last got {dict(last)}") from None


def _repo_root() -> str:
    return str(Path(__file__).resolve().parents[2])
