"""What the foreign-proxy check costs (proxy/dataplane/common/foreign_proxy.py) with
kube-proxy's rules for N services on the node, one back end at a time.

    sudo .venv/bin/python -m bench.foreign_proxy_check                  # 10,000 services
    sudo .venv/bin/python -m bench.foreign_proxy_check --services 1000 --json

Each back end gets a network namespace of its own (made here, removed even on failure)
holding kube-proxy's rules as its v1.20 iptables mode or its nftables mode writes them
(labs/kube_proxy_rules.py: two endpoints a service), or the IPVS mode's kube-ipvs0 with
an address a service. Then one check (`KubeProxyReader.read` and the comparison) is
timed, CPU (the thread's and the tools' it ran) and wall clock, median of --repeat, in
the situations a node is in:
- first: the agent's first check (reads everything in full);
- steady: nothing changed since the last check;
- other-commit: another nf_tables commit happened (sliceproxy's own syncs in nftables
  or iptables-nft mode), kube-proxy's objects unchanged;
- kube-proxy-wrote: kube-proxy rewrote its rules since the last check (iptables: after
  an endpoint changed; a rewrite of the same text on iptables-legacy shows only through
  counters, docs/monitoring.md).
Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bench.common import print_results
from labs.kube_proxy_rules import hooks, iptables_restore, nftables
from proxy.dataplane.common.foreign_proxy import KubeProxyReader
from proxy.dataplane.common.kube_proxy_objects import writes
from proxy.netns_lab.netns import entered, scratch

BACKENDS = ("iptables-nft", "iptables-legacy", "nftables", "ipvs")


def _run(ns: str, argv: list[str], text: str | None = None) -> None:
    subprocess.run(["ip", "netns", "exec", ns, *argv], input=text, text=True, check=True,
                   capture_output=True, timeout=600)


def _children_cpu() -> float:
    t = os.times()
    return t.children_user + t.children_system


def _timed(fn: Callable[[], Any]) -> tuple[float, float]:
    cpu, children, wall = time.thread_time(), _children_cpu(), time.perf_counter()
    fn()
    return (time.thread_time() - cpu + _children_cpu() - children,
            time.perf_counter() - wall)


@contextmanager
def _loaded(backend: str, services: int) -> Iterator[tuple[str, Callable[[], None]]]:
    """A namespace holding kube-proxy's objects for `backend`, and what a kube-proxy
    sync does to them again."""
    with scratch("fpbench") as ns:
        if backend.startswith("iptables-"):
            # Each "sync" follows an endpoint change and writes the whole tables again,
            # as kube-proxy's restore does (without --noflush: with it,
            # iptables-nft-restore reads the tables first, minutes at this size here).
            tool = f"iptables-{backend.removeprefix('iptables-')}-restore"
            generation = itertools.count()

            def sync() -> None:
                rules = iptables_restore(services, generation=next(generation))
                head, _, _ = rules.rpartition("COMMIT\n")  # the nat section's end
                _run(ns, [tool], head + hooks_lines() + "COMMIT\n")

            sync()
            yield ns, sync
        elif backend == "nftables":
            _run(ns, ["nft", "-f", "-"], nftables(services))
            yield ns, lambda: _run(ns, ["nft", "-f", "-"], nftables(0))
        else:
            # A veth stands in for the dummy interface: the host kernel here has no
            # dummy driver, and an address dump does not care.
            _run(ns, ["ip", "link", "add", "kube-ipvs0", "type", "veth", "peer", "name",
                      "kube-ipvs0-peer"])
            batch = "".join(f"address add 198.19.{1 + i // 250}.{1 + i % 250}/32 "
                            "dev kube-ipvs0\n" for i in range(services))
            _run(ns, ["ip", "-batch", "-"], batch)
            added = itertools.count(1)  # a new service's address at each "sync"
            yield ns, lambda: _run(ns, ["ip", "address", "add",
                                        f"198.18.255.{next(added)}/32", "dev", "kube-ipvs0"])


def hooks_lines() -> str:
    """The built-in chains' jumps, as lines of a restore's nat section."""
    return "".join(line.replace("-I ", "-A ", 1).replace(" 1 ", " ", 1) + "\n"
                   for line in hooks().splitlines() if line.startswith("-I "))


def measure(backend: str, services: int, repeat: int) -> dict[str, Any]:
    with _loaded(backend, services) as (ns, rewrite), entered(ns):
        reader = KubeProxyReader(budget=None)  # every part at every check
        try:
            results: dict[str, list[tuple[float, float]]] = {}
            last: dict[Any, Any] = {}

            detected: dict[str, int] = {}
            situation = "first"

            def check() -> None:
                nonlocal last
                now = reader.read()
                if writes(last, now):
                    detected[situation] = detected.get(situation, 0) + 1
                last = now

            results["first"] = [_timed(check)]
            for situation, before in (
                    ("steady", None),
                    ("other-commit", lambda: _run(ns, ["nft", "add table ip bump; "
                                                          "delete table ip bump"])),
                    ("kube-proxy-wrote", rewrite)):
                runs = []
                detected[situation] = 0
                for _ in range(repeat):
                    if before is not None:
                        before()
                    runs.append(_timed(check))
                results[situation] = runs
            assert not reader.errors, reader.errors
            # What was read, to show the check saw kube-proxy's objects at all.
            objects = len(last)
            costs = dict(reader.costs)
        finally:
            reader.close()
    out: dict[str, Any] = {"backend": backend, "services": services, "objects": objects,
                           # checks that saw a write, per situation (a "sync": each one)
                           **{f"{s}_detected": n for s, n in detected.items()},
                           "part_cpu_ms": {p: round(c * 1e3, 2) for p, c in costs.items()}}
    for situation, runs in results.items():
        out[f"{situation}_cpu_ms"] = round(statistics.median(c for c, _ in runs) * 1e3, 2)
        out[f"{situation}_wall_ms"] = round(statistics.median(w for _, w in runs) * 1e3, 2)
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    situations = ("first", "steady", "other-commit", "kube-proxy-wrote")
    lines = ["| back end | services | objects read | " + " | ".join(
        f"{s} CPU / wall ms" for s in situations) + " |",
        "|---|---:|---:|" + "---:|" * len(situations)]
    for r in results:
        cells = [f"{r[f'{s}_cpu_ms']} / {r[f'{s}_wall_ms']}" for s in situations]
        lines.append(f"| {r['backend']} | {r['services']:,} | {r['objects']} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--services", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    print_results((measure(b, args.services, args.repeat) for b in args.backends),
                  markdown, as_json=args.json)


if __name__ == "__main__":
    main()
