"""A real Kubernetes v1.20.2 control plane in a network namespace of its own.

    control-plane ns "spx-<pid>-<hex>-cp"                   a node ns (Lab's, or any)
    lo 127.0.0.1: etcd :2379, kube-apiserver :6443,
                  kube-controller-manager healthz :10252
    spx-cpbr0 198.18.96.1/24 (bridge) --- cpv<i> ====== cp0 198.18.96.(11+i)/24
                                                     (veth; attach(ns) makes one)
    host ns: 127.0.0.1:<ephemeral> --NetnsForwarder--> 127.0.0.1:6443 in the cp ns

* etcd and the API server listen inside the namespace. Node namespaces reach the API
  server at https://198.18.96.1:6443 over a veth to the bridge (`attach`), so an agent or
  upstream kube-proxy in a node namespace talks to it over a real link; the test process
  (in the host namespace, which must never get addresses or routes) goes through a
  forwarder on the host's loopback.
* TLS is verified for real (our CA, a serving certificate naming every address used,
  and API_NAME, the name the real-node lab's nodes reach it by);
  clients authenticate with a static bearer token (system:masters), AlwaysAllow.
* The controller manager runs only the endpoint, endpointslice and
  endpointslicemirroring controllers: Pods made ready by patching their status (there is
  no kubelet) become Endpoints and EndpointSlices written by the real controllers.
* The EndpointSliceTerminatingCondition gate (alpha in v1.20) is on, in the API server
  and the controller manager: a pod being deleted stays in its slices as
  ready=false/serving/terminating, as on every cluster since 1.22.
* The API server's own periodic etcd compaction is off (`--etcd-compaction-interval=0`):
  tests compact when they mean to, so a 410 never arrives by accident.
* `with_nodes=True` makes it a control plane for real kubelets (tests/nodes/): Node and
  RBAC authorization, the ServiceAccount admission plugin and token controller (pods
  get their service account's token and CA), privileged pods allowed, every default
  controller (Deployments, DaemonSets, garbage collection ...), and kube-scheduler. Each
  component and kubelet has its own identity (`identity_kubeconfig`).
* `stack` picks the address families (labs/realcp/addressing.py): IPv4 by default;
  IPv6 alone (the API server on `::` at fd00:198:18:96::1, an IPv6 Service range, every
  attached namespace at fd00:198:18:96::(b+i)); or both, the primary first, with v1.20's
  IPv6DualStack gate on in the API server and the controller manager. Nothing allocates
  node CIDRs: the real-node lab gives each node its pod ranges itself.

Everything (processes, namespace, veths, temporary files) goes away in `stop()`, which
is safe to call after a partial start.
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import json
import logging
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from labs.realcp.addressing import IPV4, IPV4_ONLY, IPAddress, Stack, dual, url_host
from labs.realcp.build import Binaries
from labs.realcp.forward import NetnsForwarder
from labs.realcp.pki import Pki, make_pki
from proxy.netns_lab.netns import entered
from proxy.netns_lab.poll import TimedOut, wait
from proxy.netns_lab.topology import delete_namespace, ip, pid_alive, sweep_stale

log = logging.getLogger(__name__)

# The default (IPv4) cluster's addresses; every family's: labs/realcp/addressing.py.
CP_NET = IPV4.cp_net
API_ADDR = IPV4.api_addr  # the bridge address in the cp namespace
# The API server's name, as an HA load balancer's would be: in its serving certificate;
# the real-node lab's resolver answers it (tests/nodes/dns.py).
API_NAME = "api.cluster.test"
API_PORT = 6443
ETCD_URL = "http://127.0.0.1:2379"
KCM_HEALTHZ_PORT = 10252
SCHEDULER_HEALTHZ_PORT = 10251
SERVICE_CIDR = str(IPV4.services)  # the simulator's and the lab's default
KUBERNETES_SERVICE_IP = str(IPV4.kubernetes_service_ip)  # the `kubernetes` service
BRIDGE = "spx-cpbr0"
CONTROLLERS = "endpoint,endpointslice,endpointslicemirroring"
# Alpha in v1.20: slices carry serving/terminating for pods being deleted (what newer
# clusters always do), so the side-by-side test can show where we differ on purpose.
FEATURE_GATES = "--feature-gates=EndpointSliceTerminatingCondition=true"
ETCDCTL = "etcdctl"
WATCHED_PATHS = ("/api/v1/services", "/api/v1/endpoints", "/api/v1/nodes", "/api/v1/pods",
                 "/apis/discovery.k8s.io/v1beta1/endpointslices")
# Where etcd keeps its data: tmpfs when there is one (etcd 3.4 has no --unsafe-no-fsync,
# and fsync on a shared disk slows every write of every test).
SHM = Path("/dev/shm")
WORKDIR_PREFIX = "sliceproxy-realcp-"
_STALE = re.compile(rf"^{WORKDIR_PREFIX}(?:etcd-)?(\d+)-")


def _sweep_stale_dirs() -> None:
    """Remove the files of control planes whose test process was killed outright."""
    for base in (Path(tempfile.gettempdir()), SHM):
        for d in base.glob(f"{WORKDIR_PREFIX}*") if base.is_dir() else ():
            m = _STALE.match(d.name)
            if m and not pid_alive(int(m.group(1))):
                shutil.rmtree(d, ignore_errors=True)


class ControlPlaneError(RuntimeError):
    pass


def add_address(ns: str, dev: str, addr: IPAddress, prefixlen: int) -> None:
    """An address on `dev` in `ns`, usable at once: an IPv6 one skips duplicate address
    detection, which would keep it tentative (unusable) for a second or two."""
    ip("-n", ns, "addr", "add", f"{addr}/{prefixlen}", "dev", dev,
       *(["nodad"] if addr.version == 6 else []))


@dataclass
class _Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class ControlPlane:
    bins: Binaries
    # Extra kube-apiserver flags (e.g. feature gates) for a test that needs them.
    apiserver_flags: Sequence[str] = ()
    # Extra kube-controller-manager flags (e.g. a higher client QPS for a benchmark that
    # creates thousands of objects).
    controller_manager_flags: Sequence[str] = ()
    ready_timeout: float = 90.0
    # A control plane for real kubelets (module docstring); node_names get identities.
    with_nodes: bool = False
    node_names: Sequence[str] = ()
    # Its address families, the primary first (labs/realcp/addressing.py): API server,
    # Service range, every attached namespace. Two families turn on v1.20's
    # IPv6DualStack gate (alpha) in the API server and the controller manager.
    stack: Stack = IPV4_ONLY

    prefix: str = field(init=False)
    namespace: str = field(init=False)
    workdir: Path = field(init=False)
    pki: Pki = field(init=False)
    forwarder: NetnsForwarder = field(init=False)
    host_kubeconfig: Path = field(init=False)  # for the test process (via the forwarder)
    node_kubeconfig: Path = field(init=False)  # for processes in attached node namespaces
    internal_kubeconfig: Path = field(init=False)  # inside the cp namespace
    _procs: dict[str, _Proc] = field(init=False, default_factory=dict)
    _attached: dict[str, str] = field(init=False, default_factory=dict)  # ns -> cp-side veth
    _etcd_dir: Path | None = field(init=False, default=None)
    _ns_created: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        # Same naming scheme as proxy.netns_lab, so Lab's sweep removes what a killed run left.
        self.prefix = f"spx-{os.getpid()}-{secrets.token_hex(3)}"
        self.namespace = f"{self.prefix}-cp"
        self.workdir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{os.getpid()}-"))

    # --- addresses ----------------------------------------------------------------------

    @property
    def host_url(self) -> str:
        return f"https://127.0.0.1:{self.forwarder.port}"

    @property
    def api_addr(self) -> IPAddress:
        """The API server's address on the cp network (its primary family's)."""
        return self.stack[0].api_addr

    @property
    def node_url(self) -> str:
        return f"https://{url_host(self.api_addr)}:{API_PORT}"

    @property
    def token(self) -> str:
        return self.pki.token

    # --- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> ControlPlane:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        started = time.monotonic()
        sweep_stale()
        _sweep_stale_dirs()
        self._make_namespace()
        self.pki = make_pki(
            self.workdir / "pki", ips=["127.0.0.1", *(str(a) for f in self.stack for a in (
                f.api_addr, f.kubernetes_service_ip))],
            dns=["localhost", "kubernetes", "kubernetes.default", "kubernetes.default.svc",
                 API_NAME],
            identities=self._identities())
        self._start_etcd()
        self.forwarder = NetnsForwarder(self.namespace, "127.0.0.1", API_PORT)
        self.forwarder.start()
        self.host_kubeconfig = self.pki.write_kubeconfig(
            self.workdir / "host.kubeconfig", self.host_url)
        self.node_kubeconfig = self.pki.write_kubeconfig(
            self.workdir / "node.kubeconfig", self.node_url)
        self.internal_kubeconfig = self.pki.write_kubeconfig(
            self.workdir / "internal.kubeconfig", f"https://127.0.0.1:{API_PORT}")
        self._start_apiserver()
        self._start_controller_manager()
        if self.with_nodes:
            self._start_scheduler()
        log.info("control plane ready", extra={
            "namespace": self.namespace, "url": self.host_url,
            "seconds": round(time.monotonic() - started, 1)})

    def _identities(self) -> dict[str, tuple[str, ...]]:
        if not self.with_nodes:
            return {}
        out: dict[str, tuple[str, ...]] = {
            "system:kube-controller-manager": (), "system:kube-scheduler": ()}
        for name in self.node_names:
            out[f"system:node:{name}"] = ("system:nodes",)
        return out

    def identity_kubeconfig(self, user: str, path: Path, *, internal: bool = False,
                            server: str | None = None) -> Path:
        """A kubeconfig for `user` (one of the identities), for a node namespace (the
        bridge address, or `server`) or, `internal`, inside the control plane's
        namespace."""
        url = f"https://127.0.0.1:{API_PORT}" if internal else server or self.node_url
        return self.pki.write_kubeconfig(path, url, user)

    def stop(self) -> None:
        for name in ("kube-scheduler", "kube-controller-manager", "kube-apiserver", "etcd"):
            self._stop_proc(name)
        if hasattr(self, "forwarder"):
            self.forwarder.stop()
        for ns in list(self._attached):
            self.detach(ns)
        if self._ns_created:
            delete_namespace(self.namespace)
            self._ns_created = False
        if self._etcd_dir is not None:
            shutil.rmtree(self._etcd_dir, ignore_errors=True)
            self._etcd_dir = None
        if os.environ.get("SLICEPROXY_REALCP_KEEP"):
            log.warning("keeping control-plane files", extra={"dir": str(self.workdir)})
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _make_namespace(self) -> None:
        ns = self.namespace
        ip("netns", "add", ns)
        self._ns_created = True
        ip("-n", ns, "link", "set", "lo", "up")
        ip("-n", ns, "link", "add", BRIDGE, "type", "bridge")
        for family in self.stack:
            add_address(ns, BRIDGE, family.api_addr, family.cp_net.prefixlen)
        ip("-n", ns, "link", "set", BRIDGE, "up")

    # --- node namespaces ----------------------------------------------------------------

    def attach(self, node_ns: str) -> tuple[IPAddress, ...]:
        """Link `node_ns` to the control plane; returns its addresses on the cp network,
        one per family of the stack, the primary first."""
        if node_ns in self._attached:
            raise ControlPlaneError(f"{node_ns} is already attached")
        # The lowest free index: after a detach, len() would reuse a name still in use.
        used = {int(side.removeprefix("cpv")) for side in self._attached.values()}
        index = next(i for i in range(len(used) + 1) if i not in used)
        try:  # 198.18.96.11, .12, ... (fd00:198:18:96::b, ::c, ...)
            addrs = tuple(family.member(index) for family in self.stack)
        except ValueError:
            raise ControlPlaneError("too many attached namespaces") from None
        cp_side = f"cpv{index}"
        ip("-n", self.namespace, "link", "add", cp_side, "type", "veth", "peer", "name", "cp0",
           "netns", node_ns)
        ip("-n", self.namespace, "link", "set", cp_side, "master", BRIDGE, "up")
        for family, addr in zip(self.stack, addrs, strict=True):
            add_address(node_ns, "cp0", addr, family.cp_net.prefixlen)
        ip("-n", node_ns, "link", "set", "cp0", "up")
        self._attached[node_ns] = cp_side
        return addrs

    def detach(self, node_ns: str) -> None:
        cp_side = self._attached.pop(node_ns, None)
        if cp_side is not None:
            # Deleting one end deletes the pair; gone already if the node ns was deleted.
            ip("-n", self.namespace, "link", "del", cp_side, check=False)

    # --- processes ----------------------------------------------------------------------

    def _spawn(self, name: str, cmd: Sequence[str]) -> _Proc:
        logfile = self.workdir / f"{name}.log"
        out = logfile.open("ab")
        try:
            popen = subprocess.Popen(["ip", "netns", "exec", self.namespace, *cmd],
                                     stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            out.close()
        proc = _Proc(name, popen, logfile)
        self._procs[name] = proc
        return proc

    def _stop_proc(self, name: str, timeout: float = 15.0) -> None:
        proc = self._procs.pop(name, None)
        if proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.popen.pid, signal.SIGTERM)
        try:
            proc.popen.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.popen.pid, signal.SIGKILL)
            proc.popen.wait(timeout=10)

    def _wait(self, proc: _Proc, check: Callable[[], bool], what: str) -> None:
        last_err = ""

        def ready() -> bool:
            nonlocal last_err
            if proc.popen.poll() is not None:
                raise ControlPlaneError(
                    f"{proc.name} exited with {proc.popen.returncode} before {what}; "
                    f"log {proc.log}:\n{proc.tail()}")
            try:
                return check()
            except (OSError, http.client.HTTPException, ValueError) as exc:
                last_err = f"{type(exc).__name__}: {exc}"
                return False

        try:
            wait(ready, self.ready_timeout, what, interval=0.2)
        except TimedOut:
            raise ControlPlaneError(
                f"{proc.name}: no {what} within {self.ready_timeout:.0f}s (last error: "
                f"{last_err or 'not ready'}); log {proc.log}:\n{proc.tail()}") from None

    def _start_etcd(self) -> None:
        base = SHM if SHM.is_dir() else self.workdir
        self._etcd_dir = Path(tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}etcd-{os.getpid()}-",
                                               dir=base))
        proc = self._spawn("etcd", [
            "etcd", "--name", "realcp", "--data-dir", str(self._etcd_dir / "data"),
            "--listen-client-urls", ETCD_URL, "--advertise-client-urls", ETCD_URL,
            "--listen-peer-urls", "http://127.0.0.1:2380",
            "--initial-advertise-peer-urls", "http://127.0.0.1:2380",
            "--initial-cluster", "realcp=http://127.0.0.1:2380",
            "--initial-cluster-state", "new", "--log-level", "warn", "--logger", "zap",
        ])
        self._wait(proc, lambda: self.etcdctl("endpoint", "health", check=False)
                   .returncode == 0, "healthy endpoint")

    def _start_apiserver(self) -> None:
        p = self.pki
        certs = self.workdir / "apiserver-certs"
        certs.mkdir(exist_ok=True)
        proc = self._spawn("kube-apiserver", [
            str(self.bins.path("kube-apiserver")),
            f"--etcd-servers={ETCD_URL}",
            f"--bind-address={'0.0.0.0' if self.stack == IPV4_ONLY else '::'}",
            f"--secure-port={API_PORT}", "--insecure-port=0",
            f"--advertise-address={self.api_addr}",
            f"--cert-dir={certs}",
            f"--tls-cert-file={p.server_cert}", f"--tls-private-key-file={p.server_key}",
            f"--token-auth-file={p.token_file}", "--anonymous-auth=false",
            *self._apiserver_node_flags(),
            "--service-account-issuer=https://kubernetes.default.svc",
            f"--service-account-key-file={p.sa_pub}",
            f"--service-account-signing-key-file={p.sa_key}",
            f"--service-cluster-ip-range={','.join(str(f.services) for f in self.stack)}",
            "--etcd-compaction-interval=0",
            "--profiling=false", self._feature_gates(),
            *self.apiserver_flags,
        ])
        self._wait(proc, lambda: self._get_status("/readyz") == 200, "/readyz 200")
        # /readyz does not wait for the watch caches: a list at resourceVersion=0 is
        # served by a resource's cache and blocks until it is filled.
        for path in WATCHED_PATHS:
            self._wait(proc, functools.partial(self._cache_ready, path), f"{path} watch cache")

    def _feature_gates(self) -> str:
        return FEATURE_GATES + (",IPv6DualStack=true" if dual(self.stack) else "")

    def _apiserver_node_flags(self) -> list[str]:
        if not self.with_nodes:
            # No kubelet, no token controller: pods must not need a service-account token.
            return ["--authorization-mode=AlwaysAllow",
                    "--disable-admission-plugins=ServiceAccount"]
        return ["--authorization-mode=Node,RBAC", "--allow-privileged=true",
                "--kubelet-preferred-address-types=InternalIP",
                "--enable-admission-plugins=NodeRestriction"]

    def _cache_ready(self, path: str) -> bool:
        return self._get_status(f"{path}?resourceVersion=0&limit=1") == 200

    def restart_apiserver(self) -> None:
        """Stop and start the API server (its watch cache starts over from etcd)."""
        self._stop_proc("kube-apiserver")
        self._start_apiserver()
        self.ensure_controller_manager()

    def ensure_controller_manager(self) -> None:
        """Start the controller manager again if it exited, as the kubelet restarts a
        static pod: v1.20's exits for good when the API server is away at a bad moment."""
        proc = self._procs.get("kube-controller-manager")
        if proc is not None and proc.popen.poll() is None:
            return
        if proc is not None:
            log.warning("kube-controller-manager had exited; starting it again", extra={
                "code": proc.popen.returncode, "log": str(proc.log), "tail": proc.tail(600)})
            self._procs.pop("kube-controller-manager")
        self._start_controller_manager()

    def _start_controller_manager(self) -> None:
        logfile = self.workdir / "kube-controller-manager.log"
        offset = logfile.stat().st_size if logfile.exists() else 0  # the log is appended to
        if self.with_nodes:
            kubeconfig = self.identity_kubeconfig(
                "system:kube-controller-manager",
                self.workdir / "controller-manager.kubeconfig", internal=True)
            controllers = [
                "--controllers=*", "--use-service-account-credentials=true",
                f"--service-account-private-key-file={self.pki.sa_key}",
                f"--root-ca-file={self.pki.ca_cert}"]
        else:
            kubeconfig = self.internal_kubeconfig
            controllers = [f"--controllers={CONTROLLERS}",
                           "--use-service-account-credentials=false"]
        proc = self._spawn("kube-controller-manager", [
            str(self.bins.path("kube-controller-manager")),
            f"--kubeconfig={kubeconfig}", *controllers, "--leader-elect=false",
            "--secure-port=0", f"--port={KCM_HEALTHZ_PORT}", "--address=127.0.0.1",
            "--profiling=false", self._feature_gates(),
            *self.controller_manager_flags,
        ])

        self._wait(proc, functools.partial(self._local_healthz, KCM_HEALTHZ_PORT),
                   "/healthz 200")
        # /healthz answers before the controllers run. Until they do, the controller
        # manager reads the API's discovery, and an API server away then (a test's
        # restart) makes it exit for good; past this line it only retries.
        self._wait(proc, lambda: self._controllers_started(proc, offset),
                   "every controller started")

    def _start_scheduler(self) -> None:
        kubeconfig = self.identity_kubeconfig("system:kube-scheduler",
                                              self.workdir / "scheduler.kubeconfig",
                                              internal=True)
        proc = self._spawn("kube-scheduler", [
            str(self.bins.path("kube-scheduler")), f"--kubeconfig={kubeconfig}",
            f"--authentication-kubeconfig={kubeconfig}",
            f"--authorization-kubeconfig={kubeconfig}",
            "--leader-elect=false", f"--port={SCHEDULER_HEALTHZ_PORT}", "--address=127.0.0.1",
            "--secure-port=0", "--profiling=false"])
        self._wait(proc, functools.partial(self._local_healthz, SCHEDULER_HEALTHZ_PORT),
                   "/healthz 200")

    def _local_healthz(self, port: int) -> bool:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
        with entered(self.namespace):
            conn.connect()  # the socket is born in the cp namespace
        try:
            conn.request("GET", "/healthz")
            return conn.getresponse().status == 200
        finally:
            conn.close()

    def _controllers_started(self, proc: _Proc, offset: int) -> bool:
        with proc.log.open("rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
        return all(f'Started "{name}"' in text for name in CONTROLLERS.split(","))

    def logs(self) -> dict[str, Path]:
        return {p.name: p.log for p in self._procs.values()}

    # --- talking to it ------------------------------------------------------------------

    def ssl_context(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.pki.ca_cert))

    def _get_status(self, path: str) -> int:
        conn = http.client.HTTPSConnection("127.0.0.1", self.forwarder.port, timeout=5,
                                           context=self.ssl_context())
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {self.token}"})
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def get_json(self, path: str) -> Any:
        conn = http.client.HTTPSConnection("127.0.0.1", self.forwarder.port, timeout=10,
                                           context=self.ssl_context())
        try:
            conn.request("GET", path, headers={"Authorization": f"Bearer {self.token}"})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise ControlPlaneError(f"GET {path}: HTTP {resp.status}: {body[:300]!r}")
            return json.loads(body)
        finally:
            conn.close()

    def version(self) -> dict[str, Any]:
        data: dict[str, Any] = self.get_json("/version")
        return data

    def etcdctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["ip", "netns", "exec", self.namespace, ETCDCTL, f"--endpoints={ETCD_URL}", *args],
            capture_output=True, text=True, check=False, timeout=60,
            env={**os.environ, "ETCDCTL_API": "3"})
        if check and proc.returncode != 0:
            raise ControlPlaneError(f"etcdctl {' '.join(args)}: {proc.stderr.strip()}")
        return proc

    def etcd_revision(self) -> int:
        status = json.loads(self.etcdctl("endpoint", "status", "-w", "json").stdout)
        return int(status[0]["Status"]["header"]["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision; returns that revision.

        This alone does not make old watch resumes fail for resources served from the API
        server's watch cache: the cache keeps its own window of events. See `compact`."""
        rev = self.etcd_revision()
        self.etcdctl("compact", str(rev))
        return rev

    def compact(self) -> int:
        """Make every resourceVersion handed out so far unusable for a resume or a
        continue: compact etcd, then restart the API server so its watch cache, which
        would still serve the compacted window, starts over at the current revision (what
        a client sees after a long disconnection or an API server restart)."""
        rev = self.compact_etcd()
        self.restart_apiserver()
        return rev
