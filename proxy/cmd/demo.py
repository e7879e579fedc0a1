"""`./run demo`: the real agent, a simulated cluster, real packets, in under a minute.

1. the cluster simulator serves the services in `examples/` (a multi-port NodePort
   service, one whose pods are all terminating, one with internalTrafficPolicy Local,
   one with a topology preference and a conflicting duplicate endpoint);
2. a lab of network namespaces plays the node, a client outside it, and the pods;
3. `python -m proxy --proxy-mode iptables` runs in the node namespace (or nftables:
   `./run demo --proxy-mode nftables`);
4. the client asks every service who answers; the agent's /debug/dump says why;
5. an endpoint changes in the simulator, and the rules and the traffic follow;
6. the agent stops (its rules stay), `--cleanup` removes them, the lab is torn down.
Nothing is added to the host's own network namespace. Needs root.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from ipaddress import ip_address
from pathlib import Path
from typing import Any, TypeVar

from proxy.dataplane import modes
from proxy.kube.manifests import load_paths
from proxy.netns_lab import BackendSpec, Lab, poll
from proxy.netns_lab.netns import entered
from proxy.netns_lab.probe import http_get
from proxy.sim import SimServer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
FIRST_POD = 10  # the lab gives backend i the address 198.18.1.(10 + i)
HEALTHZ, METRICS = 10256, 10249
ASKS = 20
T = TypeVar("T")

_TTY = sys.stdout.isatty() and not os.environ.get("NO_COLOR")


def bold(text: str) -> str:
    return f"\033[1m{text}\033[0m" if _TTY else text


def dim(text: str) -> str:
    return f"\033[2m{text}\033[0m" if _TTY else text


def step(text: str) -> None:
    print(f"\n{bold('==> ' + text)}", flush=True)


class DemoError(Exception):
    pass


# --- the cluster ---------------------------------------------------------------------


def pods_of(objects: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    """Pod address -> (name, node) for every endpoint in the examples' slices, named
    after their service: web-1, web-2, ..."""
    pods: dict[str, tuple[str, str]] = {}
    for obj in objects:
        if obj.get("kind") != "EndpointSlice":
            continue
        service = obj["metadata"]["labels"]["kubernetes.io/service-name"]
        for ep in obj.get("endpoints") or []:
            addr = ep["addresses"][0]
            if addr not in pods:
                count = sum(1 for name, _ in pods.values() if name.startswith(service + "-"))
                pods[addr] = (f"{service}-{count + 1}", ep.get("nodeName") or "node-b")
    return pods


def lab_specs(pods: dict[str, tuple[str, str]]) -> list[BackendSpec]:
    """Backends in address order; addresses the examples do not use become idle pods."""
    last = max(int(ip_address(a)) for a in pods) - int(ip_address("198.18.1.0"))
    specs = []
    for octet in range(FIRST_POD, last + 1):
        name, node = pods.get(f"198.18.1.{octet}", (f"idle-{octet}", "node-z"))
        specs.append(BackendSpec(name, node=node))
    return specs


# --- talking to the agent ------------------------------------------------------------


def wait(cond: Callable[[], T | None], seconds: float, what: str) -> T:
    """`poll.wait`, failing as the demo does: a DemoError, not a test's AssertionError."""
    try:
        return poll.wait(cond, seconds, what, interval=0.02)
    except poll.TimedOut:
        raise DemoError(f"gave up after {seconds:g}s waiting for {what}") from None


MODES = ("iptables", "nftables")  # IPVS needs a kernel with it, which a host may lack


class Agent:
    def __init__(self, lab: Lab, kubeconfig: Path, log: Path, mode: str) -> None:
        self.lab, self.log = lab, log
        self.argv = [sys.executable, "-m", "proxy", "--kubeconfig", str(kubeconfig),
                     "--hostname-override", lab.node_name, "--proxy-mode", mode,
                     "--cluster-cidr", "198.18.1.0/24,fd00:18:1::/64", "-v", "2"]
        self.proc: subprocess.Popen[Any] | None = None

    def start(self) -> float:
        began = time.monotonic()
        with self.log.open("ab") as out:
            self.proc = self.lab.popen(self.lab.node_ns, self.argv, stdout=out, stderr=out,
                                       env={**os.environ, "PYTHONPATH": str(ROOT)})
        wait(lambda: self.check() and http_get(self.lab.node_ns, "127.0.0.1", HEALTHZ,
                                               "/healthz")[0] == 200, 60, "the first sync")
        return time.monotonic() - began

    def check(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise DemoError(f"the agent exited ({self.proc.returncode}); its log:\n"
                            + "\n".join(self.log.read_text().splitlines()[-20:]))
        return True

    def dump(self, service: str | None = None) -> dict[str, Any]:
        path = "/debug/dump" + (f"?service={service}" if service else "")
        status, body = http_get(self.lab.node_ns, "127.0.0.1", METRICS, path)
        if status != 200:
            raise DemoError(f"/debug/dump answered {status}")
        doc: dict[str, Any] = json.loads(body)
        return doc

    def metrics(self) -> dict[str, float]:
        _, body = http_get(self.lab.node_ns, "127.0.0.1", METRICS, "/metrics")
        out = {}
        for line in body.decode().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def stop(self) -> float:
        assert self.proc is not None
        began = time.monotonic()
        self.proc.terminate()
        self.proc.wait(15)
        return time.monotonic() - began


def our_rules(lab: Lab) -> int:
    """Rules of ours in the node's kernel: iptables' SPX- chains, nftables' tables."""
    total = 0
    for tool in ("iptables-save", "ip6tables-save", "iptables-legacy-save",
                 "ip6tables-legacy-save"):
        out = lab.exec(lab.node_ns, [tool]).stdout
        total += sum(1 for ln in out.splitlines()
                     if ln.startswith("-A") and modes.CHAIN_PREFIX in ln)
    tables = lab.exec(lab.node_ns, ["nft", "list", "tables"]).stdout.split("\n")
    for line in tables:
        parts = line.split()
        if len(parts) == 3 and parts[2].startswith(modes.NFTABLES.markers.table):
            out = lab.exec(lab.node_ns, ["nft", "-a", "list", "table", parts[1],
                                         parts[2]]).stdout
            total += sum(1 for ln in out.splitlines() if "# handle" in ln
                         and not ln.strip().startswith(("table", "chain", "set", "map")))
    return total


# --- the show --------------------------------------------------------------------------


def bars(counts: Counter[str]) -> str:
    return "  ".join(f"{name} {'█' * n} {n}" for name, n in sorted(counts.items()))


def ask_all(lab: Lab, dump: dict[str, Any], names: dict[str, str]) -> bool:
    """Ask every service port; True if only the endpoints the agent chose answered."""
    ok = True
    for svc in dump["services"]:
        vip, port, proto = svc["cluster_ips"][0], svc["port_number"], svc["protocol"]
        label = f"{svc['service']}{':' + svc['port'] if svc['port'] else ''}"
        local = svc["policies"]["sets"]["cluster_ip"] == "local"
        chosen = svc["local_endpoints"] if local else svc["cluster_endpoints"]
        want = {names[e.rsplit(":", 1)[0]] for e in chosen}
        got = lab.ask(lab.client_ns, vip, port, proto.lower(), count=ASKS, timeout=1.0)
        good = set(got) == want
        ok &= good
        mark = "ok" if good else f"UNEXPECTED (wanted {sorted(want)})"
        print(f"  {label:<22} {vip}:{port}/{proto:<4} {bars(got)}  {dim(mark)}")
    return ok


def explain_service(svc: dict[str, Any]) -> None:
    label = f"{svc['service']}{':' + svc['port'] if svc['port'] else ''}"
    topo = svc["topology"]
    extra = f", topology {topo['mode']}: {topo['reason']}" if topo["requested"] != "none" else ""
    pol = svc["policies"]
    print(f"  {bold(label)} ({svc['protocol']}, internal {pol['internal']}, "
          f"external {pol['external']}{extra})")
    for e in svc["endpoints"]:
        mark = "*" if e["selected_for"] else " "
        print(f"    {mark} {e['endpoint']:<18} {dim(e['reason'])}")
    for c in svc["conflicts"]:
        print(f"    ! {c['endpoint']} is listed by {', '.join(c['slices'])} with different "
              f"{', '.join(c['fields'])}: the copy from {c['chosen']} wins")
    print(f"    {len(svc['applied_rules'] or [])} rules applied for it")


@contextmanager
def simulator(lab: Lab, objects: list[dict[str, Any]]) -> Iterator[SimServer]:
    sim = SimServer(objects=objects, bookmark_interval=1.0)
    with entered(lab.node_ns):  # its thread, hence its socket, lives in the node's netns
        sim.start()
    try:
        yield sim
    finally:
        sim.stop()


def run(mode: str = "iptables") -> None:
    began = time.monotonic()
    objects = load_paths([EXAMPLES])
    pods = pods_of(objects)
    kinds = Counter(o["kind"] for o in objects)
    print(bold("sliceproxy demo") + ": a node, a simulated cluster, the real agent, "
          "real packets.")
    step(f"Cluster simulator: {kinds['Service']} services and {kinds['EndpointSlice']} "
         f"EndpointSlices from examples/, node-a in zone-a")
    with Lab(lab_specs(pods)) as lab, tempfile.TemporaryDirectory(prefix="spx-demo-") as tmp:
        lab.sysctl(lab.node_ns, "net.ipv4.icmp_ratelimit", "0")
        lab.start_backends(udp_ports=(8081, 5353))
        names = {addr: name for addr, (name, _) in pods.items()}
        print(f"  lab: node namespace {lab.node_ns}, a client outside it, "
              f"{len(pods)} pods answering with their names")
        with simulator(lab, objects) as sim:
            kubeconfig = sim.write_kubeconfig(Path(tmp) / "kubeconfig")
            agent = Agent(lab, kubeconfig, Path(tmp) / "agent.log", mode)
            step("Starting the agent in the node namespace: python -m proxy "
                 f"--proxy-mode {mode} ...")
            startup = agent.start()
            dump = agent.dump()
            print(f"  first full sync done {startup:.1f}s after start; "
                  f"{our_rules(lab)} {mode} rules in the node's tables")

            step(f"Asking each service {ASKS} times from the client (fresh connection each)")
            ok = ask_all(lab, dump, names)
            node_port = next(s["node_port"] for s in dump["services"]
                             if s["service"] == "demo/web" and s["port"] == "http")
            got = lab.ask(lab.client_ns, lab.node_ip4, node_port, count=ASKS)
            print(f"  {'NodePort':<22} {lab.node_ip4}:{node_port}/TCP  {bars(got)}")

            step("Why: the agent's /debug/dump (each endpoint and the reason it was "
                 "chosen or not)")
            for svc in dump["services"]:
                if svc["service"] != "demo/web" or svc["port"] == "http":
                    explain_service(svc)

            ok &= show_a_change(lab, sim, agent, objects, dump, mode)
            show_metrics(agent)
            stop_and_clean(lab, agent)
    print(f"\n{bold('Done')} in {time.monotonic() - began:.0f}s; the lab's namespaces are "
          "gone. Next: .venv/bin/python -m proxy explain examples/  (the same decisions, "
          "offline)")
    if not ok:
        raise DemoError("some answers did not match the agent's decisions (see above)")


def show_a_change(lab: Lab, sim: SimServer, agent: Agent, objects: list[dict[str, Any]],
                  dump: dict[str, Any], mode: str) -> bool:
    """One endpoint change written to the simulator, followed to the kernel and the
    traffic; whether the answers matched."""
    step("Changing demo/web in the simulator: web-2 stops being ready, "
         "web-3 becomes ready")
    web = next(o for o in objects if o["kind"] == "EndpointSlice"
               and o["metadata"]["name"] == "web-abc12")
    for ep in web["endpoints"]:
        ep["conditions"]["ready"] = ep["addresses"][0] != "198.18.1.12"
    synced = len(dump["syncs"])
    changed_at = time.monotonic()
    sim.apply(web)
    record = wait(lambda: (d := agent.dump()["syncs"]) and len(d) > synced and d[0],
                  15, "the agent's sync")
    applied_after = time.monotonic() - changed_at
    print(f"  sync: trigger {record['trigger']}, "
          f"{'full' if record['full'] else 'partial'}, changed "
          f"{', '.join(record['changed'])}; {record['operations']} {mode} "
          f"lines in {record['duration_seconds'] * 1000:.0f} ms "
          f"({applied_after * 1000:.0f} ms after the change was written)")
    web_http = agent.dump("demo/web")["services"]
    rules = next(s["applied_rules"] for s in web_http if s["port"] == "http")
    print(dim("  rules now applied for demo/web:http (first lines):"))
    for line in rules[:6]:
        print(dim(f"    {line}"))
    got = lab.ask(lab.client_ns, "198.18.128.10", 80, count=ASKS)
    good = set(got) == {"web-1", "web-3"}
    print(f"  {'demo/web:http':<22} 198.18.128.10:80/TCP  {bars(got)}  "
          f"{dim('ok' if good else 'UNEXPECTED')}")
    return good


def show_metrics(agent: Agent) -> None:
    """A few of the agent's metrics, as an operator would read them."""
    m = agent.metrics()
    syncs = m.get("kubeproxy_sync_proxy_rules_duration_seconds_count", 0)
    total = m.get("kubeproxy_sync_proxy_rules_duration_seconds_sum", 0)
    step("A few of its metrics (/metrics on 127.0.0.1:10249)")
    print(f"  kubeproxy_sync_proxy_rules_duration_seconds: {syncs:.0f} syncs, "
          f"{total / max(syncs, 1) * 1000:.0f} ms on average")
    print("  sliceproxy_endpoint_conflicts: "
          f"{m.get('sliceproxy_endpoint_conflicts', 0):.0f}   "
          "sliceproxy_service_ports: "
          f"{m.get('sliceproxy_service_ports', 0):.0f}")


def stop_and_clean(lab: Lab, agent: Agent) -> None:
    """SIGTERM leaves the rules serving; --cleanup removes them."""
    step("Stopping: SIGTERM leaves the rules in place, --cleanup removes them")
    stopped = agent.stop()
    left = our_rules(lab)
    print(f"  agent stopped in {stopped:.1f}s; {left} rules still serving traffic")
    cleanup = lab.exec(lab.node_ns, [sys.executable, "-m", "proxy", "--cleanup",
                                     "--hostname-override", lab.node_name],
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    if cleanup.returncode != 0:
        raise DemoError(f"--cleanup failed: {cleanup.stderr[-1000:]}")
    print(f"  python -m proxy --cleanup: {our_rules(lab)} rules left")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./run demo", description=__doc__.split("\n")[0])
    parser.add_argument("--proxy-mode", choices=MODES, default="iptables",
                        help="the agent's data plane (default: iptables)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("the demo builds network namespaces: run it as root (sudo ./run demo)",
              file=sys.stderr)
        return 2
    try:
        run(args.proxy_mode)
    except DemoError as exc:
        print(f"\ndemo failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
