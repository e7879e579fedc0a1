"""A real cluster left running for a person: `./run cluster up`, `./run cluster down`.

    python -m tests.nodes up [--nodes N] [--ipv6 | --dual-stack]
                                           start it in the background; print how to use it
    python -m tests.nodes status           is it up; its kubeconfig
    python -m tests.nodes down             tear it down (namespaces, processes, cgroups)

The same cluster as the real-node tier (tests/nodes/cluster.py): Kubernetes v1.20.2's
control plane and kubelet + containerd nodes in network namespaces of this machine, the
image built from this checkout's Dockerfile imported into every node. No service proxy
runs on it: apply deploy/daemonset.yaml (the printed command sets the image and the API
server's address), or kube-proxy, and try it with kubectl. Everything stays in
198.18.0.0/15 (and fd00::/8: `--ipv6`, `--dual-stack`), in namespaces this command made;
nothing touches the host's own network.

The cluster lives in a background process holding it; its state (pid, kubeconfig, log)
is in /run/sliceproxy-cluster/.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

from proxy.netns_lab.poll import TimedOut, wait

STATE = Path(os.environ.get("SLICEPROXY_CLUSTER_STATE", "/run/sliceproxy-cluster"))
PIDFILE, INFO, LOG = STATE / "pid", STATE / "cluster.json", STATE / "cluster.log"
UP_TIMEOUT = 1800.0  # a first run builds Kubernetes and the image


def _running() -> int | None:
    try:
        pid = int(PIDFILE.read_text())
        os.kill(pid, 0)
    except (OSError, ValueError):
        return None
    return pid


def _hold(nodes: int, stack: str) -> int:
    """The background process: start the cluster, write its info, wait for SIGTERM."""
    from labs.realcp.addressing import STACKS
    from labs.realcp.build import build
    from tests.nodes.cluster import DEFAULT_NODES, SPARE_NODES, NodeCluster
    from tests.nodes.kubeadm import kubeadm_config
    from tests.nodes.workload import shipped_daemonset

    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    specs = (*DEFAULT_NODES, *SPARE_NODES)[:nodes]
    cluster = NodeCluster(build(), STATE / "work", specs, with_kube_proxy=True,
                          stack=STACKS[stack])
    try:
        cluster.start()
        kubeconfig = STATE / "kubeconfig"
        kubeconfig.write_bytes(cluster.kubeconfig.read_bytes())
        kubeconfig.chmod(0o600)
        (STATE / "sliceproxy.yaml").write_text(
            shipped_daemonset(cluster.image.ref, cluster.api_url))
        (STATE / "kubeadm.yaml").write_text(kubeadm_config(cluster.stack))
        INFO.write_text(json.dumps({
            "kubeconfig": str(kubeconfig), "kubectl": str(cluster.kubectl_path),
            "image": cluster.image.ref, "api_server": cluster.api_url,
            "manifest": str(STATE / "sliceproxy.yaml"),
            "kubeadm": str(cluster.bins.path("kubeadm")),
            "kubeadm_config": str(STATE / "kubeadm.yaml"),
            "nodes": {n.name: {"address": ",".join(map(str, n.addresses)), "zone": n.spec.zone,
                               "netns": n.netns} for n in cluster.nodes.values()},
            "outside_netns": cluster.outside,
            "seconds": {k: round(v, 1) for k, v in cluster.timings.items()}}, indent=1))
        signal.sigwait({signal.SIGTERM, signal.SIGINT})
    finally:
        cluster.close()
        INFO.unlink(missing_ok=True)
    return 0


def up(nodes: int, stack: str) -> int:
    if (pid := _running()) is not None:
        print(f"a cluster is already up (pid {pid}); `./run cluster down` first",
              file=sys.stderr)
        return 1
    STATE.mkdir(parents=True, exist_ok=True)
    INFO.unlink(missing_ok=True)
    with LOG.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tests.nodes", "hold", str(nodes),
                                 stack], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    PIDFILE.write_text(str(proc.pid))
    shape = {"ipv4": "", "ipv6": " IPv6", "dual": " dual-stack"}[stack]
    print(f"starting a {nodes}-node{shape} Kubernetes v1.20.2 cluster (log: {LOG}) ...",
          flush=True)
    with contextlib.suppress(TimedOut):  # judged below, by the file it writes when up
        wait(lambda: INFO.exists() or proc.poll() is not None, UP_TIMEOUT, "the cluster",
             interval=1.0)
    if not INFO.exists():
        print(LOG.read_text(errors="replace")[-4000:], file=sys.stderr)
        print("the cluster did not come up", file=sys.stderr)
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        return 1
    return status()


def status() -> int:
    if _running() is None or not INFO.exists():
        print("no cluster is up (./run cluster up)")
        return 1
    from tests.nodes.cluster import WINDOWS_NODE

    info = json.loads(INFO.read_text())
    kubectl = f"{info['kubectl']} --kubeconfig {info['kubeconfig']}"
    print(f"""cluster up: {', '.join(f'{k} {v}s' for k, v in info['seconds'].items())}
nodes: {', '.join(f"{n} {v['address']} ({v['zone']})" for n, v in info['nodes'].items())}
  and {WINDOWS_NODE}: a Windows Node with no kubelet (NotReady), as on a mixed cluster
API server: {info['api_server']} (the name only the nodes' resolver knows; pods resolve
  cluster names through kube-system/kube-dns)
kubeconfig: {info['kubeconfig']}   (any kubectl; the server's own v1.20.2: {info['kubectl']})

  export KUBECONFIG={info['kubeconfig']}
  {kubectl} get nodes -o wide
  # sliceproxy as shipped, with the API server's address set for this cluster: the image
  # built from this checkout is on every node as sliceproxy:0.1.0 (and {info['image']})
  sed 's|https://API-SERVER-ADDRESS:6443|{info['api_server']}|' deploy/daemonset.yaml \\
    | {kubectl} apply -f -
  # (the same, written out: {info['manifest']})
  {kubectl} -n sliceproxy rollout status ds/sliceproxy
  # or kube-proxy v1.20.2 as kubeadm installs it, to try docs/migrate.md:
  {info['kubeadm']} init phase addon kube-proxy \\
    --config {info['kubeadm_config']} --kubeconfig {info['kubeconfig']}
  # a shell in a node's network namespace (iptables-save, nft list ruleset, curl a ClusterIP):
  nsenter --net=/run/netns/{next(iter(info['nodes'].values()))['netns']} bash

./run cluster down   tears it all down""")
    return 0


def down() -> int:
    pid = _running()
    if pid is None:
        print("no cluster is up")
        return 0
    os.kill(pid, signal.SIGTERM)
    try:
        wait(lambda: _running() is None, 120, f"pid {pid} to stop", interval=0.5)
    except TimedOut:
        print(f"pid {pid} did not stop; see {LOG}", file=sys.stderr)
        return 1
    PIDFILE.unlink(missing_ok=True)
    print("cluster down")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="./run cluster", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="start a cluster in the background")
    p_up.add_argument("--nodes", type=int, default=3, choices=range(1, 5),
                      help="how many nodes (default 3: two in zone-a, one in zone-b)")
    family = p_up.add_mutually_exclusive_group()
    family.add_argument("--ipv6", dest="stack", action="store_const", const="ipv6",
                        default="ipv4", help="single-stack IPv6: nodes, pods, Services and "
                        "the API server in fd00::/8 (docs/lab.md)")
    family.add_argument("--dual-stack", dest="stack", action="store_const", const="dual",
                        help="IPv4 and IPv6 (primary IPv4), v1.20's IPv6DualStack gate on")
    sub.add_parser("status", help="print how to reach the running cluster")
    sub.add_parser("down", help="tear the running cluster down")
    p_hold = sub.add_parser("hold")  # internal: the background process
    p_hold.add_argument("nodes", type=int)
    p_hold.add_argument("stack", nargs="?", default="ipv4")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("./run cluster needs root (network namespaces, cgroups); try sudo",
              file=sys.stderr)
        return 2
    if args.cmd == "up":
        return up(args.nodes, args.stack)
    if args.cmd == "hold":
        return _hold(args.nodes, args.stack)
    if args.cmd == "status":
        return status()
    return down()


if __name__ == "__main__":
    sys.exit(main())
