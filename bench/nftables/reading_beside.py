"""How long a one-service change waits while the agent reads its traffic counters, in
the nftables mode (server/traffic.py): N services x E endpoints programmed in a lab node,
then readings taken as a scrape takes them, and one-service changes synced meanwhile.

- on the data plane's thread (how the agent read until the reading got a thread of its
  own; the iptables and IPVS modes still do): a change that comes during a reading
  waits for all of it, so the wait is the reading's length;
- on a thread of its own (`traffic_reader`): the data plane's thread is held only while
  it hands the reading the ports to read; changes are synced back to back, then paced
  (one every --pace seconds), until the reading ends. The reading's Python competes
  with them for the interpreter's lock, which a thread waiting for it gets within the
  interpreter's switch interval: the agent's (agent/main.py SWITCH_INTERVAL) unless
  --switch-interval says otherwise. As in the agent, each change is marked under way,
  and the reading gives way to it at its pauses and rests there (common/priority.py),
  unless --no-give-way: then the reading only offers the lock there.

    sudo .venv/bin/python -m bench.nftables.reading_beside --services 100000 --endpoints 10
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from bench.common import NODE, change_one, cluster_model, node_namespace
from proxy.agent.main import SWITCH_INTERVAL
from proxy.dataplane.base import DataplaneOptions, PortTraffic, housekeep_all, offer_lock
from proxy.dataplane.common import collector
from proxy.dataplane.common.priority import Priority
from proxy.dataplane.nftables.apply import NftablesDataPlane
from proxy.model.types import Family, ServicePortKey
from proxy.netns_lab.netns import entered

MAX_CHANGES = 20_000  # per reading, however long it takes


def _ms(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {"p50": round(1000 * statistics.median(ordered), 2),
            "p99": round(1000 * ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))], 2),
            "max": round(1000 * ordered[-1], 2)}


def _beside(dp: NftablesDataPlane, change: Callable[[], float], pace: float,
            priority: Priority | None) -> dict[str, Any]:
    """One reading on a thread of its own, changes synced until it ends; the reading
    gives way to them where `priority` is given."""
    began = time.perf_counter()
    reader = dp.traffic_reader(offer_lock if priority is None else priority.reading_pauses())
    held = time.perf_counter() - began
    out: dict[str, Mapping[ServicePortKey, PortTraffic]] = {}
    took: list[float] = []

    def read() -> None:
        start = time.perf_counter()
        out["ports"] = reader()
        took.append(time.perf_counter() - start)

    thread = threading.Thread(target=read, name="reading")
    thread.start()
    waits: list[float] = []
    while thread.is_alive() and len(waits) < MAX_CHANGES:
        waits.append(change())
        if pace:
            time.sleep(pace)  # the pacing under test, not synchronisation
    thread.join()
    return {"pace_s": pace, "reading_s": round(took[0], 3), "held_ms": round(1000 * held, 1),
            "ports": len(out["ports"]), "changes": len(waits),
            "change_ms": _ms(waits) if waits else None}


def run(services: int, endpoints: int, pace: float, rounds: int,
        switch_interval: float = SWITCH_INTERVAL, give_way: bool = True) -> dict[str, Any]:
    was = sys.getswitchinterval()
    sys.setswitchinterval(switch_interval)
    try:
        return {**_run(services, endpoints, pace, rounds, give_way),
                "switch_interval_s": switch_interval, "give_way": give_way}
    finally:
        sys.setswitchinterval(was)


def _run(services: int, endpoints: int, pace: float, rounds: int,
         give_way: bool) -> dict[str, Any]:
    model, slices = cluster_model(services, endpoints)
    options = DataplaneOptions(NODE, families=(Family.V4,))
    with node_namespace() as ns, entered(ns):
        dp = NftablesDataPlane(options, clear_conntrack=False)
        try:
            dp.sync(model.state, full=True)
            housekeep_all(dp)
            gc.collect()
            gc.freeze()  # as the agent does after its first sync
            n = [0]
            priority = Priority() if give_way else None

            def change() -> float:
                n[0] += 1
                with priority.change() if priority else contextlib.nullcontext():
                    state = change_one(model, slices[n[0] * 7919 % len(slices)], n[0])
                    start = time.perf_counter()
                    with collector.held():  # as the sync loop syncs (a full collection held off)
                        dp.sync(state)
                    return time.perf_counter() - start

            alone = [change() for _ in range(50)]
            on_thread = []
            for _ in range(rounds):
                start = time.perf_counter()
                dp.traffic()
                on_thread.append(round(time.perf_counter() - start, 3))
            beside = [_beside(dp, change, p, priority) for p in (0.0, pace)
                      for _ in range(rounds)]
        finally:
            dp.close()
            gc.unfreeze()
    return {"services": services, "endpoints": endpoints, "change_alone_ms": _ms(alone),
            "reading_on_the_plane_s": on_thread, "beside": beside}


def markdown(result: dict[str, Any]) -> str:
    alone = result["change_alone_ms"]
    gives = "gives way to changes and rests" if result["give_way"] else "only offers the lock"
    lines = [f"{result['services']:,} services x {result['endpoints']} (switch interval "
             f"{result['switch_interval_s'] * 1000:g} ms; the reading {gives}): a change alone "
             f"{alone['p50']} / {alone['max']} ms (p50 / max); a reading on the data "
             f"plane's thread (a change waits for all of it): "
             f"{', '.join(f'{s} s' for s in result['reading_on_the_plane_s'])}", "",
             "| changes | reading | plane held | changes during it | change p50 / p99 / max |",
             "|---|---|---|---|---|"]
    for b in result["beside"]:
        ms = b["change_ms"] or {"p50": "-", "p99": "-", "max": "-"}
        how = "back to back" if not b["pace_s"] else f"one every {b['pace_s'] * 1000:g} ms"
        lines.append(f"| {how} | {b['reading_s']} s | {b['held_ms']} ms | {b['changes']} "
                     f"| {ms['p50']} / {ms['p99']} / {ms['max']} ms |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.nftables.reading_beside",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--services", type=int, default=10000)
    parser.add_argument("--endpoints", type=int, default=10)
    parser.add_argument("--pace", type=float, default=0.01, metavar="SECONDS",
                        help="between paced changes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--switch-interval", type=float, default=SWITCH_INTERVAL,
                        metavar="SECONDS", help="sys.setswitchinterval (default: the agent's)")
    parser.add_argument("--no-give-way", action="store_true",
                        help="the reading neither waits for a change under way nor rests")
    parser.add_argument("--json", action="store_true", help="print JSON only")
    args = parser.parse_args(argv)
    if args.services < 1 or args.endpoints < 1 or args.rounds < 1 or args.pace < 0:
        parser.error("--services, --endpoints and --rounds must be positive, --pace not negative")
    if args.switch_interval <= 0:
        parser.error("--switch-interval must be positive")
    result = run(args.services, args.endpoints, args.pace, args.rounds, args.switch_interval,
                 not args.no_give_way)
    print(json.dumps(result) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
