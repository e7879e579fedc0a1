"""What the kernel pays for two nftables rule layouts of N cluster-IP ports of E endpoints
each (IPv6, in SHARDS shard tables), written with nft in a lab node, without the agent:

- chains: today's layout for such a port (render.py): a chain per port, reached from the
  shard's @service-ips verdict map, counting the port, marking off-cluster clients, then
  E `numgen random mod k 0` DNAT rules;
- maps: the agent's picked ports (render.py): no chain per port; the port's @service-ips
  element goes to `pick-<n>`, one chain per endpoint count n in each shard (declared up
  to --pick-max, the agent's PICK_MAX by default), which counts the connection into the
  port's counter through @port-counters and looks the endpoint up in its protocol's
  @eps-<proto>-<n> by destination . port . `numgen random mod n`.

Measured: loading all of it (nft's wall time, and the user and system CPU of nft: the
system part is the kernel's), then the kernel's time for one batch (the `sendmsg` that
carries it, timed by strace: nf_tables takes a batch and commits it inside that call)
for two changes of a random port: one endpoint replaced, and one endpoint added (the
count moves from E to E + 1). Medians and maxima; reported, never asserted.

    python -m bench.nftables.layout_cost --services 100000 --endpoints 10
"""

from __future__ import annotations

import argparse
import json
import random
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from ipaddress import IPv6Address
from pathlib import Path
from typing import Any

from bench.common import node_namespace
from proxy.dataplane.nftables.render import PICK_MAX, PICK_PROTOCOLS

LAYOUTS = ("chains", "maps")
CHANGES = ("replace", "grow")
SHARDS = 64
SERVICES = int(IPv6Address("fd00:10::"))
PODS = int(IPv6Address("fd00:20::"))
POD_CIDR = "fd00:20::/64"
PORT, TARGET = 80, 8080


def _service(i: int) -> str:
    return str(IPv6Address(SERVICES + i))


def _pod(i: int) -> str:
    return str(IPv6Address(PODS + i))


def _table(i: int) -> str:
    return f"ip6 bench-{i % SHARDS}"


def shard_lines(shard: int, layout: str, pick_max: int) -> Iterator[str]:
    t = f"ip6 bench-{shard}"
    yield f"add table {t}"
    yield f"add chain {t} mark-for-masquerade"
    yield f"add rule {t} mark-for-masquerade meta mark set meta mark | 0x00004000"
    yield f"add map {t} service-ips {{ type ipv6_addr . inet_proto . inet_service : verdict; }}"
    yield f"add chain {t} services"
    yield f"add rule {t} services ip6 daddr . meta l4proto . th dport vmap @service-ips"
    yield (f"add chain {t} nat-prerouting {{ type nat hook prerouting priority dstnat; "
           "policy accept; }")
    yield f"add rule {t} nat-prerouting jump services"
    yield f"add chain {t} nat-output {{ type nat hook output priority -100; policy accept; }}"
    yield f"add rule {t} nat-output jump services"
    if layout == "maps":
        yield (f"add map {t} port-counters {{ type ipv6_addr . inet_proto . inet_service : "
               "counter; }")
        for n in range(1, pick_max + 1):
            for p in PICK_PROTOCOLS:
                yield (f"add map {t} eps-{p}-{n} {{ typeof ip6 daddr . {p} dport . numgen "
                       f"random mod 1 : ip6 daddr . {p} dport; }}")
            yield f"add chain {t} pick-{n}"
            yield (f"add rule {t} pick-{n} counter name ip6 daddr . meta l4proto . th dport "
                   "map @port-counters")
            yield f"add rule {t} pick-{n} ip6 saddr != {POD_CIDR} jump mark-for-masquerade"
            for p in PICK_PROTOCOLS:
                yield (f"add rule {t} pick-{n} meta l4proto {p} dnat ip6 to ip6 daddr . {p} "
                       f"dport . numgen random mod {n} map @eps-{p}-{n}")


def _chain_rules(i: int, pods: list[int]) -> list[str]:
    """The rules of port i's chain in the chains layout (render.py's cascade)."""
    t, h, ip = _table(i), f"{i:08x}", _service(i)
    out = [f'add rule {t} svc-{h} counter name "cnt-{h}"',
           f"add rule {t} svc-{h} ip6 daddr {ip} tcp dport {PORT} ip6 saddr != {POD_CIDR} "
           "jump mark-for-masquerade"]
    for k, pod in enumerate(pods):
        left = len(pods) - k
        pick = f"numgen random mod {left} 0 " if left > 1 else ""
        out.append(f"add rule {t} svc-{h} {pick}meta l4proto tcp dnat to [{_pod(pod)}]:{TARGET}"
                   f' comment "bench/svc-{i}:http"')
    return out


def _slot_elements(i: int, pods: list[int]) -> str:
    return ", ".join(f"{_service(i)} . {PORT} . {k} : {_pod(p)} . {TARGET}"
                     for k, p in enumerate(pods))


def port_lines(i: int, layout: str, pods: list[int]) -> Iterator[str]:
    t, h, ip = _table(i), f"{i:08x}", _service(i)
    if layout == "chains":
        yield f"add counter {t} cnt-{h}"
        yield f"add chain {t} svc-{h}"
        yield f"add element {t} service-ips {{ {ip} . tcp . {PORT} : goto svc-{h} }}"
        yield from _chain_rules(i, pods)
    else:
        yield f"add counter {t} cnt-{h}"
        yield f"add element {t} service-ips {{ {ip} . tcp . {PORT} : goto pick-{len(pods)} }}"
        yield f'add element {t} port-counters {{ {ip} . tcp . {PORT} : "cnt-{h}" }}'
        yield f"add element {t} eps-tcp-{len(pods)} {{ {_slot_elements(i, pods)} }}"


def change_lines(i: int, layout: str, old: list[int], new: list[int]) -> list[str]:
    """The batch that moves port i from endpoints `old` to `new`."""
    t, h, ip = _table(i), f"{i:08x}", _service(i)
    if layout == "chains":
        return [f"flush chain {t} svc-{h}", *_chain_rules(i, new)]
    if len(old) == len(new):
        changed = [k for k in range(len(new)) if old[k] != new[k]]
        return [line for k in changed for line in (
            f"delete element {t} eps-tcp-{len(old)} {{ {ip} . {PORT} . {k} }}",
            f"add element {t} eps-tcp-{len(new)} {{ {ip} . {PORT} . {k} : {_pod(new[k])}"
            f" . {TARGET} }}")]
    keys = ", ".join(f"{ip} . {PORT} . {k}" for k in range(len(old)))
    return [f"delete element {t} service-ips {{ {ip} . tcp . {PORT} }}",
            f"add element {t} service-ips {{ {ip} . tcp . {PORT} : goto pick-{len(new)} }}",
            f"delete element {t} eps-tcp-{len(old)} {{ {keys} }}",
            f"add element {t} eps-tcp-{len(new)} {{ {_slot_elements(i, new)} }}"]


def _nft(ns: str, lines: list[str], work: Path, trace: bool) -> dict[str, float]:
    """nft -f of `lines` in `ns`: wall time, nft's user and system CPU and, traced, the
    longest sendmsg (the batch)."""
    script, log = work / "script.nft", work / "strace.log"
    script.write_text("\n".join(lines) + "\n")
    argv = ["nft", "-f", str(script)]
    if trace:
        argv = ["strace", "-T", "-e", "trace=sendmsg", "-o", str(log), *argv]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(["ip", "netns", "exec", ns, *argv], check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = {"wall_s": wall, "user_s": after.ru_utime - before.ru_utime,
           "system_s": after.ru_stime - before.ru_stime}
    if trace:
        out["batch_ms"] = 1000 * max(float(t) for t in re.findall(r"<([\d.]+)>",
                                                                   log.read_text()))
    return out


def run_layout(layout: str, services: int, endpoints: int, changes: int,
               pick_max: int) -> dict[str, Any]:
    rng = random.Random(1)
    pods = {i: list(range(i * endpoints, (i + 1) * endpoints)) for i in range(services)}
    fresh = iter(range(services * endpoints, sys.maxsize))
    out: dict[str, Any] = {"layout": layout}
    with node_namespace() as ns, tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        lines = [line for s in range(min(SHARDS, services))
                 for line in shard_lines(s, layout, pick_max)]
        lines += [line for i in range(services) for line in port_lines(i, layout, pods[i])]
        out["lines"] = len(lines)
        out["load"] = _nft(ns, lines, work, trace=False)
        for kind in CHANGES:
            batches = []
            for _ in range(changes):
                i = rng.randrange(services)
                old = pods[i]
                new = [*old[:-1], next(fresh)] if kind == "replace" or len(old) >= pick_max \
                    else [*old, next(fresh)]
                batches.append(_nft(ns, change_lines(i, layout, old, new), work,
                                    trace=True)["batch_ms"])
                pods[i] = new
            out[kind] = {"median_ms": statistics.median(batches), "max_ms": max(batches)}
    return out


def run(services: int, endpoints: int, changes: int, pick_max: int) -> dict[str, Any]:
    if not 1 <= endpoints < pick_max:
        raise ValueError(f"--endpoints must be 1 to {pick_max - 1} (--pick-max)")
    return {"services": services, "endpoints": endpoints, "shards": SHARDS,
            "pick_max": pick_max,
            "layouts": [run_layout(layout, services, endpoints, changes, pick_max)
                        for layout in LAYOUTS]}


def markdown(result: dict[str, Any]) -> str:
    rows = ["| layout | lines | load: wall | nft user | nft system (kernel) | "
            "replace one endpoint: batch p50 / max | add one: p50 / max |",
            "|---|---|---|---|---|---|---|"]
    for r in result["layouts"]:
        load = r["load"]
        rows.append(f"| {r['layout']} | {r['lines']:,} | {load['wall_s']:.1f} s | "
                    f"{load['user_s']:.1f} s | {load['system_s']:.1f} s | "
                    f"{r['replace']['median_ms']:.2f} / {r['replace']['max_ms']:.2f} ms | "
                    f"{r['grow']['median_ms']:.2f} / {r['grow']['max_ms']:.2f} ms |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--services", type=int, default=10000)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--changes", type=int, default=15)
    ap.add_argument("--pick-max", type=int, default=PICK_MAX,
                    help="pick chains (and maps, per protocol) declared per shard in the "
                         "maps layout (default: the agent's)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    result = run(args.services, args.endpoints, args.changes, args.pick_max)
    print(json.dumps(result, indent=2) if args.json else markdown(result))


if __name__ == "__main__":
    main()
