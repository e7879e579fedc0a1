"""The servers: the real API server or the simulator as a target, preloaded with objects."""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import ROOT, cpu_seconds
from bench.reflector_fleet.workload import (
    NAMESPACE,
    Obj,
    Settings,
    node_name,
    node_obj,
    service_obj,
    slice_obj,
)

# --- the servers ------------------------------------------------------------------------


@dataclass
class Target:
    """What a run needs of a server: its pids, how to write, how workers reach it."""

    name: str
    pids: Callable[[], dict[str, int]]  # "apiserver" (and "etcd")
    write: Callable[[str, str, Obj | None, str], tuple[int, Any]]  # method, path, body, type
    worker_argv: Sequence[str]  # prefix: `ip netns exec NS`, or nothing
    kubeconfig: str
    slice_group_version: str
    restart: Callable[[], None]
    describe: dict[str, Any] = field(default_factory=dict)
    # GET path with this Accept header -> (status, body bytes); None: JSON only (the sim)
    get_raw: Callable[[str, str], tuple[int, bytes]] | None = None


def preload(target: Target, settings: Settings, nodes: int,
             progress: Callable[[str], None]) -> dict[str, float]:
    gv = target.slice_group_version
    jobs: list[tuple[str, str, Obj]] = []
    jobs += [("nodes", "/api/v1/nodes", node_obj(i)) for i in range(nodes)]
    jobs += [("services", f"/api/v1/namespaces/{NAMESPACE}/services", service_obj(i))
             for i in range(settings.services)]
    jobs += [("slices", f"/apis/{gv}/namespaces/{NAMESPACE}/endpointslices",
              slice_obj(settings, i, gv)) for i in range(settings.services)]
    status, body = target.write("POST", "/api/v1/namespaces", {
        "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        "application/json")
    assert status in (201, 409), body
    seconds: dict[str, float] = {}
    for what in ("nodes", "services", "slices"):
        started = time.monotonic()
        todo = [(path, obj) for w, path, obj in jobs if w == what]

        def post(job: tuple[str, Obj]) -> None:
            status, body = target.write("POST", job[0], job[1], "application/json")
            if status not in (201, 409):
                raise RuntimeError(f"POST {job[0]}: HTTP {status}: {str(body)[:300]}")

        with ThreadPoolExecutor(settings.parallel) as pool:
            list(pool.map(post, todo))
        seconds[what] = round(time.monotonic() - started, 1)
        progress(f"{len(todo)} {what} written in {seconds[what]}s")
    return seconds


@contextlib.contextmanager
def real_target(cp: Any) -> Iterator[Target]:
    """A running labs/realcp ControlPlane as a target, with a network namespace of its
    own for the agents, linked to the control plane's (removed on the way out)."""
    from labs.realcp.rawapi import RawApi
    from proxy.netns_lab.topology import delete_namespace, ip

    api = RawApi(cp.host_url, token=cp.token, context=cp.ssl_context())
    with contextlib.ExitStack() as stack:
        # Named as the lab's namespaces, so that a killed run's is swept.
        ns = f"spx-{os.getpid()}-{secrets.token_hex(3)}-fleet"
        ip("netns", "add", ns)
        stack.callback(delete_namespace, ns)
        ip("-n", ns, "link", "set", "lo", "up")
        cp.attach(ns)
        stack.callback(cp.detach, ns)

        def pids() -> dict[str, int]:
            procs = cp._procs  # ControlPlane's processes (`ip netns exec` execs them)
            return {"apiserver": procs["kube-apiserver"].popen.pid,
                    "etcd": procs["etcd"].popen.pid}

        def write(method: str, path: str, body: Obj | None, ctype: str) -> tuple[int, Any]:
            status, data, _ = api.request(method, path, body, content_type=ctype, timeout=60)
            return status, data

        def get_raw(path: str, accept: str) -> tuple[int, bytes]:
            conn = http.client.HTTPSConnection("127.0.0.1", cp.forwarder.port, timeout=120,
                                               context=cp.ssl_context())
            try:
                conn.request("GET", path, headers={"Authorization": f"Bearer {cp.token}",
                                                   "Accept": accept})
                resp = conn.getresponse()
                return resp.status, resp.read()
            finally:
                conn.close()

        v = cp.version()
        yield Target("real", pids, write, ("ip", "netns", "exec", ns),
                     str(cp.node_kubeconfig), "discovery.k8s.io/v1beta1",
                     cp.restart_apiserver,
                     {"server": f"kube-apiserver {v.get('gitVersion')} "
                                f"({v.get('goVersion')}), etcd 3.4 in the same namespace "
                                "(data on tmpfs)",
                      "agents_reach_it": "over a veth, https://198.18.96.1:6443, TLS, "
                                         "bearer token (system:masters: APF-exempt)"},
                     get_raw)


JSON = "application/json"
PROTOBUF = "application/vnd.kubernetes.protobuf"


def encodings(target: Target, settings: Settings, lists: int = 50) -> dict[str, Any]:
    """What the encoding costs: `lists` watch-cache lists (resourceVersion=0) of every
    Service and EndpointSlice, one after the other, as JSON (what sliceproxy asks for)
    and as protobuf (kube-proxy's default content type): body bytes and the API
    server's CPU seconds for each."""
    assert target.get_raw is not None
    gv = target.slice_group_version
    paths = ["/api/v1/services?resourceVersion=0&limit=500",
             f"/apis/{gv}/endpointslices?resourceVersion=0&limit=500"]
    pid = target.pids()["apiserver"]
    out: dict[str, Any] = {"lists": lists}
    for name, accept in (("json", JSON), ("protobuf", PROTOBUF)):
        sizes = []
        for path in paths:
            status, body = target.get_raw(path, accept)
            if status != 200:
                raise RuntimeError(f"GET {path} as {accept}: HTTP {status}")
            sizes.append(len(body))
        before = cpu_seconds(pid)
        for _ in range(lists):
            for path in paths:
                target.get_raw(path, accept)
        out[name] = {"bytes_services": sizes[0], "bytes_slices": sizes[1],
                     "apiserver_cpu_s": round(cpu_seconds(pid) - before, 2)}
    return out


def delete_objects(target: Target, settings: Settings, nodes: int) -> None:
    """Remove what `preload` wrote (for a shared control plane). The namespace stays."""
    gv = target.slice_group_version
    paths = [f"/apis/{gv}/namespaces/{NAMESPACE}/endpointslices/s-{i}-0"
             for i in range(settings.services)]
    paths += [f"/api/v1/namespaces/{NAMESPACE}/services/s-{i}" for i in range(settings.services)]
    paths += [f"/api/v1/nodes/{node_name(i)}" for i in range(nodes)]
    with ThreadPoolExecutor(settings.parallel) as pool:
        list(pool.map(lambda p: target.write("DELETE", p, None, "application/json"), paths))


@contextlib.contextmanager
def sim_target(settings: Settings, nodes: int,
               progress: Callable[[str], None]) -> Iterator[Target]:
    """The simulator in a process of its own, started afresh by `restart` with the
    cluster's objects loaded from a manifest (no writes needed)."""
    from labs.realcp.rawapi import RawApi

    gv = "discovery.k8s.io/v1"  # converted to v1beta1 by --api-level 1.20
    with tempfile.TemporaryDirectory(prefix="sliceproxy-fleet-") as d:
        manifest = Path(d) / "cluster.json"
        items = [node_obj(i) for i in range(nodes)]
        items += [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
        items += [service_obj(i) for i in range(settings.services)]
        items += [slice_obj(settings, i, gv) for i in range(settings.services)]
        manifest.write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": items}))
        kubeconfig = Path(d) / "sim.kubeconfig"
        state: dict[str, Any] = {}

        def stop() -> None:
            proc = state.pop("proc", None)
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)

        def start() -> None:
            stop()
            proc = subprocess.Popen(
                [sys.executable, "-m", "proxy.sim", "--listen", "127.0.0.1:0",
                 "--api-level", "1.20", "--kubeconfig-out", str(kubeconfig),
                 "-f", str(manifest)], cwd=ROOT, stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL, text=True, start_new_session=True)
            state["proc"] = proc
            assert proc.stdout is not None
            line = proc.stdout.readline()  # "listening on URL", after the load
            if not line.startswith("listening on "):
                raise RuntimeError(f"the simulator did not start ({proc.poll()}): {line!r}")
            state["api"] = RawApi(line.split()[-1])

        def write(method: str, path: str, body: Obj | None, ctype: str) -> tuple[int, Any]:
            status, data, _ = state["api"].request(method, path, body, content_type=ctype)
            return status, data

        try:
            start()
            progress(f"simulator up with {len(items)} objects")
            yield Target("sim", lambda: {"apiserver": state["proc"].pid}, write, (),
                         str(kubeconfig), "discovery.k8s.io/v1beta1", start,
                         {"server": "python -m proxy.sim --api-level 1.20 (one process, "
                                    "plain HTTP on the host's loopback)"})
        finally:
            stop()
