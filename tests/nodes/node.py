"""One real Kubernetes node: its own network namespace, mount namespace, cgroups,
containerd and kubelet v1.20.2, pods wired by the CNI bridge and host-local plugins.

    node ns "<prefix>-<name>"                               (the node's network)
      cp0 198.18.96.x/24  -- the control plane's bridge (API server, other nodes, outside)
      cni0 198.18.(64+i).1/24 -- pods of this node (veth pairs made by the bridge plugin)
      routes: every other node's pod range via that node's cp0 address
      (an IPv6 node: fd00:198:18:96::x/64 and fd00:198:18:(6400+i)::/64, forwarding on,
      no duplicate address detection; dual-stack: both, the kubelet with IPv6DualStack)
    mount ns (private, held by a `sleep` process): per-node /var/log/pods,
      /var/log/containers and /var/lib/cni over the host's, its own /etc/resolv.conf
      (the lab's resolver: tests/nodes/dns.py), and every mount containerd and kubelet
      make (overlay root file systems, volumes, the pods' netns files), all gone when
      its last process ends
    cgroups "/<prefix>-<name>" (kubelet's --cgroup-root: the pods) and
      "/<prefix>-<name>-daemons" (containerd, its shims, kubelet) under each v1 controller

Daemons start through `nsenter --net --mount` into those namespaces: `ip netns exec`
would remount /sys and hide the cgroup mounts (FINDINGS.md). Nothing is added to the
host's network namespace. `stop()` kills every process of both cgroups and the holder,
removes the cgroups and the namespace, and is safe after a partial start; `sweep_stale`
does the same for nodes whose test process was killed outright.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from labs.realcp.addressing import IPV4_ONLY, IPAddress, IPNetwork, Stack, dual
from proxy.netns_lab.poll import TimedOut, wait
from proxy.netns_lab.topology import delete_namespace, ip, pid_alive
from tests.nodes.dns import CLUSTER_DOMAIN

log = logging.getLogger(__name__)

CONTROLLERS = ("cpu", "cpuacct", "cpuset", "memory", "devices", "freezer", "blkio", "pids",
               "systemd")
CGROUP_ROOT = Path("/sys/fs/cgroup")
CNI_BIN = Path("/usr/lib/cni")
# Host paths a kubelet, containerd's shims and runc, or a CNI plugin write to whatever
# their flags say (pod logs, runc's state, v1.20's seccomp root, the CNI cache): one per
# node, gone with the node's mount namespace (nothing piles up on the host); and the
# manifests' host path where the node-settings step records what the node held.
PRIVATE_DIRS = ("/var/log/pods", "/var/log/containers", "/var/lib/cni", "/run/containerd",
                "/var/lib/kubelet", "/run/sliceproxy")
_STALE = re.compile(r"^(spx-(\d+)-[0-9a-f]+-.+?)(-daemons)?$")


class NodeError(RuntimeError):
    pass


def cgroup_pids(name: str) -> set[int]:
    """Every process in cgroup `name` and below, by the pids controller."""
    top = CGROUP_ROOT / "pids" / name
    out: set[int] = set()
    if not top.is_dir():
        return out
    for procs in top.rglob("cgroup.procs"):
        with contextlib.suppress(OSError):
            out.update(int(p) for p in procs.read_text().split())
    return out


def kill_cgroup(name: str, timeout: float = 15.0) -> None:
    """SIGKILL everything in cgroup `name` (every controller) until it is empty, then
    remove its directories, deepest first."""
    def emptied() -> bool:
        pids = cgroup_pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return not pids

    try:
        wait(emptied, timeout, f"cgroup {name} to empty", interval=0.05)
    except TimedOut:
        raise NodeError(f"cgroup {name} still has processes "
                        f"{sorted(cgroup_pids(name))}") from None
    # (runc and the kubelet make the cgroup in the unified hierarchy too, where hybrid)
    for controller in (*CONTROLLERS, "unified"):
        top = CGROUP_ROOT / controller / name
        if not top.is_dir():
            continue
        dirs = sorted((d for d in top.rglob("*") if d.is_dir()), key=lambda d: -len(d.parts))
        for d in [*dirs, top]:
            with contextlib.suppress(OSError):
                d.rmdir()


def make_cgroup(name: str) -> None:
    for controller in CONTROLLERS:
        d = CGROUP_ROOT / controller / name
        if not (CGROUP_ROOT / controller).is_dir():
            continue
        d.mkdir(exist_ok=True)
        if controller == "cpuset":  # a new cpuset has no CPUs or memory nodes until told
            for f in ("cpuset.cpus", "cpuset.mems"):
                (d / f).write_text((CGROUP_ROOT / "cpuset" / f).read_text())


def sweep_stale() -> list[str]:
    """Kill and remove the cgroups of nodes whose test process is gone."""
    removed = []
    pids_root = CGROUP_ROOT / "pids"
    for d in pids_root.iterdir() if pids_root.is_dir() else ():
        m = _STALE.match(d.name)
        if m and not pid_alive(int(m.group(2))):
            kill_cgroup(d.name)
            removed.append(d.name)
    return removed


@dataclass(frozen=True, slots=True)
class NodeSpec:
    name: str
    zone: str
    index: int  # its pod range, and its order


@dataclass
class Node:
    spec: NodeSpec
    prefix: str  # the cluster's "spx-<pid>-<hex>"
    workdir: Path
    kubeconfig: Path  # the kubelet's identity (system:node:<name>)
    kubelet: Path
    sandbox_image: str
    resolver: str  # the node's nameserver: its /etc/resolv.conf, kubelet's --resolv-conf
    cluster_dns: str  # kubelet's --cluster-dns: the cluster DNS Service's ClusterIP
    # Its address families, the primary first: addresses on the cp network, pod ranges
    # (labs/realcp/addressing.py; node i has each family's i-th pod range).
    stack: Stack = IPV4_ONLY
    addresses: tuple[IPAddress, ...] = field(init=False, default=())  # on the cp bridge
    netns: str = field(init=False)
    _holder: subprocess.Popen[bytes] | None = field(init=False, default=None)
    _procs: dict[str, subprocess.Popen[bytes]] = field(init=False, default_factory=dict)
    _ns_made: bool = field(init=False, default=False)
    kubelet_started: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        self.netns = f"{self.prefix}-{self.name}"
        self.workdir.mkdir(parents=True, exist_ok=True)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def address(self) -> IPAddress:
        """Its primary address on the control plane's bridge (its InternalIP)."""
        return self.addresses[0]

    @property
    def pod_ranges(self) -> tuple[IPNetwork, ...]:
        return tuple(family.pod_range(self.spec.index) for family in self.stack)

    @property
    def cgroup(self) -> str:
        return f"{self.prefix}-{self.name}"

    @property
    def daemons_cgroup(self) -> str:
        return f"{self.cgroup}-daemons"

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd.sock"

    @property
    def resolv_conf(self) -> Path:
        return self.workdir / "resolv.conf"

    # --- network ------------------------------------------------------------------------

    def make_namespace(self) -> None:
        ip("netns", "add", self.netns)
        self._ns_made = True
        ip("-n", self.netns, "link", "set", "lo", "up")
        for key, value in (("net.ipv4.ip_forward", "1"),
                           ("net.bridge.bridge-nf-call-iptables", "1"),
                           ("net.bridge.bridge-nf-call-ip6tables", "1")):
            self.sysctl(key, value)
        if any(family.version == 6 for family in self.stack):
            # Forward IPv6, and no duplicate address detection for the addresses made
            # here later (cni0's gateway): usable at once, not tentative for seconds.
            for key, value in (("net.ipv6.conf.all.forwarding", "1"),
                               ("net.ipv6.conf.all.accept_dad", "0"),
                               ("net.ipv6.conf.default.accept_dad", "0")):
                self.sysctl(key, value)

    def sysctl(self, key: str, value: str) -> None:
        path = "/proc/sys/" + key.replace(".", "/")
        proc = subprocess.run(["nsenter", f"--net=/run/netns/{self.netns}", "sh", "-c",
                               f"echo {value} > {path}"], capture_output=True, text=True,
                              check=False)
        if proc.returncode != 0:
            raise NodeError(f"{self.name}: cannot set {key}={value} in its namespace "
                            f"({proc.stderr.strip()}); the host kernel needs bridge "
                            "netfilter (CONFIG_BRIDGE_NETFILTER) for pods to reach services "
                            "on their own node")

    def route_to(self, other: Node) -> None:
        for pods, via in zip(other.pod_ranges, other.addresses, strict=True):
            ip("-n", self.netns, "route", "replace", str(pods), "via", str(via))

    # --- processes ----------------------------------------------------------------------

    def _enter(self) -> list[str]:
        assert self._holder is not None
        return ["nsenter", f"--net=/run/netns/{self.netns}",
                f"--mount=/proc/{self._holder.pid}/ns/mnt"]

    def _start_holder(self) -> None:
        """A process holding the node's private mount namespace, with its own copies of
        the host paths every kubelet and CNI plugin would otherwise share, and its own
        /etc/resolv.conf (the host's is never touched)."""
        self.resolv_conf.write_text(f"nameserver {self.resolver}\n")
        binds = [f"mount --bind {self.resolv_conf} /etc/resolv.conf"]
        for host in PRIVATE_DIRS:
            own = self.workdir / "host" / host.strip("/")
            own.mkdir(parents=True, exist_ok=True)
            os.makedirs(host, exist_ok=True)
            binds.append(f"mount --bind {own} {host}")
        script = " && ".join([*self._join_daemons(), *binds, "echo ready",
                              "exec sleep infinity"])
        self._holder = subprocess.Popen(
            ["nsenter", f"--net=/run/netns/{self.netns}", "unshare", "--mount",
             "--propagation", "private", "sh", "-c", script],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)
        assert self._holder.stdout is not None
        line = self._holder.stdout.readline().decode().strip()
        if line != "ready":
            raise NodeError(f"{self.name}: the mount namespace did not come up: {line}")

    def _join_daemons(self) -> list[str]:
        """Shell commands moving the shell into the daemons cgroup (what it starts
        follows, so `stop` and `sweep_stale` find every process of the node)."""
        return [f"echo $$ > {CGROUP_ROOT / c / self.daemons_cgroup}/cgroup.procs"
                for c in CONTROLLERS if (CGROUP_ROOT / c).is_dir()]

    def _spawn(self, name: str, cmd: Sequence[str]) -> subprocess.Popen[bytes]:
        """Start `cmd` in the node's namespaces and its daemons cgroup."""
        logfile = self.workdir / f"{name}.log"
        joins = " && ".join(self._join_daemons())
        with logfile.open("ab") as out:
            proc = subprocess.Popen(
                [*self._enter(), "sh", "-c", f'{joins} && exec "$@"', name, *cmd],
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        self._procs[name] = proc
        return proc

    def exited(self) -> str | None:
        """Which of containerd and kubelet has exited, with its code and log; or None."""
        for name in ("containerd", "kubelet"):
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                return f"{name} exited ({proc.returncode}):\n{self.log_tail(name)}"
        return None

    def log_tail(self, name: str, chars: int = 3000) -> str:
        try:
            return (self.workdir / f"{name}.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def _wait(self, name: str, check: Callable[[], bool], what: str, timeout: float) -> None:
        def ready() -> bool:
            if check():
                return True
            proc = self._procs.get(name)
            if proc is not None and proc.poll() is not None:
                raise NodeError(f"{self.name}: {name} exited ({proc.returncode}) before "
                                f"{what}:\n{self.log_tail(name)}")
            return False

        try:
            wait(ready, timeout, what, interval=0.1)
        except TimedOut:
            raise NodeError(f"{self.name}: no {what} within {timeout:.0f}s:\n"
                            f"{self.log_tail(name)}") from None

    # --- containerd ---------------------------------------------------------------------

    def _containerd_config(self) -> Path:
        d = self.workdir
        cni = d / "cni"
        (cni / "net.d").mkdir(parents=True, exist_ok=True)
        (cni / "net.d" / "10-spx.conflist").write_text(json.dumps({
            "cniVersion": "0.4.0", "name": "spx-pods", "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "dataDir": str(cni / "ipam"),
                          "ranges": [[{"subnet": str(pods)}] for pods in self.pod_ranges],
                          "routes": [{"dst": family.default_route}
                                     for family in self.stack]}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ]}, indent=1))
        config = d / "containerd.toml"
        config.write_text(f"""version = 2
root = "{d / 'containerd-root'}"
state = "{d / 'containerd-state'}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = "{d / 'containerd.sock.ttrpc'}"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{self.sandbox_image}"
  # Root here lacks CAP_SYS_RESOURCE: it cannot lower oom_score_adj (FINDINGS.md).
  restrict_oom_score_adj = true
  # The pods' netns files under the state dir (inside the node's mount namespace).
  netns_mounts_under_state_dir = true
  enable_selinux = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni / 'net.d'}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
    SystemdCgroup = false
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / 'containerd-opt'}"
""")
        return config

    def ctr(self, *args: str, timeout: float = 300) -> str:
        proc = subprocess.run(["ctr", "--address", str(self.socket), "-n", "k8s.io", *args],
                              capture_output=True, text=True, check=False, timeout=timeout)
        if proc.returncode != 0:
            raise NodeError(f"{self.name}: ctr {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout

    def import_image(self, archive: Path) -> None:
        # --all-platforms: the archive has one; without it ctr may skip an unnamed platform.
        self.ctr("images", "import", "--all-platforms", str(archive))

    # --- kubelet ------------------------------------------------------------------------

    def _kubelet_argv(self) -> list[str]:
        d = self.workdir
        return [
            str(self.kubelet), f"--kubeconfig={self.kubeconfig}",
            f"--hostname-override={self.name}",
            f"--node-ip={','.join(map(str, self.addresses))}",  # two: dual-stack
            f"--node-labels=topology.kubernetes.io/zone={self.spec.zone}",
            "--container-runtime=remote",
            f"--container-runtime-endpoint=unix://{self.socket}",
            "--cgroup-driver=cgroupfs", f"--cgroup-root=/{self.cgroup}",
            f"--root-dir={d / 'kubelet'}", f"--cert-dir={d / 'kubelet-pki'}",
            f"--volume-plugin-dir={d / 'volume-plugins'}",
            # The machine is shared: no swap check, no eviction, no image GC, no
            # node-allocatable enforcement (it would want the host's top cgroups).
            "--fail-swap-on=false", "--enforce-node-allocatable=", "--eviction-hard=",
            "--image-gc-high-threshold=100", "--image-gc-low-threshold=99",
            f"--cluster-dns={self.cluster_dns}", f"--cluster-domain={CLUSTER_DOMAIN}",
            f"--resolv-conf={self.resolv_conf}",
            "--read-only-port=0", "--healthz-bind-address=127.0.0.1",
            "--max-pods=30", "--serialize-image-pulls=false",
            "--node-status-update-frequency=4s", "--sync-frequency=5s",
            "--runtime-request-timeout=2m", "--v=1",
            *(["--feature-gates=IPv6DualStack=true"] if dual(self.stack) else []),
        ]

    # --- lifecycle ----------------------------------------------------------------------

    def start(self, images: Sequence[Path], timeout: float = 120.0) -> None:
        """containerd up with the images imported, then kubelet (registers the node)."""
        make_cgroup(self.cgroup)
        make_cgroup(self.daemons_cgroup)
        self._start_holder()
        self._spawn("containerd", ["containerd", "--config", str(self._containerd_config())])
        self._wait("containerd", self._containerd_ready, "containerd socket", timeout)
        for archive in images:
            self.import_image(archive)
        self.start_kubelet()

    def _containerd_ready(self) -> bool:
        if not self.socket.exists():
            return False
        proc = subprocess.run(["ctr", "--address", str(self.socket), "version"],
                              capture_output=True, check=False, timeout=10)
        return proc.returncode == 0

    def start_kubelet(self) -> None:
        self.kubelet_started = time.monotonic()
        self._spawn("kubelet", self._kubelet_argv())

    def stop(self) -> None:
        for name in ("kubelet", "containerd"):
            proc = self._procs.pop(name, None)
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(10)
        for cg in (self.cgroup, self.daemons_cgroup):
            try:
                kill_cgroup(cg)
            except NodeError as exc:
                log.warning("node cleanup", extra={"node": self.name, "error": str(exc)})
        for proc in self._procs.values():
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        self._procs.clear()
        if self._holder is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._holder.pid, signal.SIGKILL)
            self._holder.wait(10)
            self._holder = None
        if self._ns_made:
            delete_namespace(self.netns)
            self._ns_made = False
        shutil.rmtree(self.workdir, ignore_errors=True)

    # --- pods ---------------------------------------------------------------------------

    def pod_netns(self, uid: str) -> str:
        """The network namespace of pod `uid` on this node, as /proc/PID/ns/net (every
        process of a pod's cgroup shares it)."""
        top = CGROUP_ROOT / "pids" / self.cgroup / "kubepods"
        for procs in top.rglob(f"pod{uid}/*/cgroup.procs"):
            pids = procs.read_text().split()
            if pids:
                return f"/proc/{pids[0]}/ns/net"
        raise NodeError(f"{self.name}: no process of pod {uid} in {top}")

    def exec(self, cmd: Sequence[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run `cmd` in the node's network namespace (as the host would)."""
        return subprocess.run(["nsenter", f"--net=/run/netns/{self.netns}", *cmd],
                              capture_output=True, text=True, check=False, timeout=timeout)
