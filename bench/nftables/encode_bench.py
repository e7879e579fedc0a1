"""The nftables mode's own work for a cold start and one change, without a kernel:
render and encode to netlink, as `NftablesDataPlane.sync` does, the batches built and
dropped instead of sent (no root, no namespace).

    .venv/bin/python -m bench.nftables.encode_bench --services 10000 --endpoints 10
    .venv/bin/python -m bench.nftables.encode_bench --services 20000 --ipv6 --changes 5

Measured in one process (the cluster as bench.common.cluster_model makes it; `--ipv6`:
single-stack IPv6, as bench.agent_start's, every address distinct):
- cold: the first sync onto no tables (transaction.first_lines, in parts), the
  collector paused as the agent pauses it for its start (agent/startup_gc.py);
- resync: a full sync over our tables (transaction.full_lines), with the collector on;
  then again as the agent's sync loop makes it (resync_held: the collector held off,
  what the sync left collected once and frozen, dataplane/common/collector.py);
- change: one service's endpoint replaced, then a partial sync (`--changes` times,
  median).
Run it several times and take medians across runs: one process's cold start is one
sample. Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Collection, Iterable
from ipaddress import ip_address
from typing import Any, TypeVar

from bench.common import NODE, change_one, cluster_model
from proxy.dataplane.base import DataplaneOptions, SyncReport
from proxy.dataplane.common import collector
from proxy.dataplane.nftables import wire
from proxy.dataplane.nftables.apply import NftablesDataPlane
from proxy.dataplane.nftables.runner import NftRunner
from proxy.dataplane.nftables.transaction import Script
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family


class EncodeOnly(NftRunner):
    """An NftRunner whose `send` encodes and drops the batch; our tables are those
    sent to before."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: set[str] = set()
        self.messages = 0

    def send(self, script: str | Script, family: Family, tables: Collection[str]) -> None:
        parts: Iterable[Iterable[wire.Statement] | str]
        if isinstance(script, Script) and script.parts:
            parts = wire.stages(script.statements())
        else:
            parts = [script.statements() if isinstance(script, Script) else script]
        for part in parts:
            self.messages += wire.encode(part, family, tables, 1).count
        self.tables.update(tables)

    def names(self, family: Family, tables: Collection[str]
              ) -> tuple[set[str], list[tuple[str, str]], dict[tuple[str, str], str]]:
        return set(self.tables) & set(tables), [], {}


T = TypeVar("T")


def timed(fn: Callable[[], T]) -> tuple[float, float, T]:
    """Wall and CPU seconds `fn` took (CPU time: other work on the machine changes it
    less), and what it returned."""
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    return time.perf_counter() - wall, time.process_time() - cpu, out


def encode_only_plane(family: Family) -> tuple[NftablesDataPlane, EncodeOnly]:
    """The nftables data plane of one family over an EncodeOnly runner (no kernel, no
    conntrack, no probe), the node holding one address of the family."""
    runner = EncodeOnly()
    node_ip = ip_address("198.18.0.1" if family is Family.V4 else "fd00:18::1")
    dp = NftablesDataPlane(DataplaneOptions(NODE, families=(family,)), runner=runner,
                           addresses=lambda: [node_ip], clear_conntrack=False, probe=False)
    return dp, runner


def _held_sync(dp: NftablesDataPlane, state: DesiredState) -> SyncReport:
    """A full sync as the agent's sync loop makes it: the collector held off, what the
    sync left collected once and frozen (dataplane/common/collector.py)."""
    with collector.held():
        return dp.sync(state, full=True)


def run(services: int, endpoints: int, changes: int, ipv6: bool = False) -> dict[str, Any]:
    model, slices = cluster_model(services, endpoints, ipv6)
    dp, runner = encode_only_plane(Family.V6 if ipv6 else Family.V4)
    gc.collect()
    gc.freeze()  # the cluster, as the agent freezes it after its lists
    gc.disable()
    try:
        cold, cold_cpu, report = timed(lambda: dp.sync(model.state, full=True))
        gc.freeze()  # what the first sync made, as the agent freezes it (startup_gc.py)
    finally:
        gc.enable()
    messages = runner.messages
    resync, resync_cpu, _ = timed(lambda: dp.sync(model.state, full=True))
    held, held_cpu, _ = timed(lambda: _held_sync(dp, model.state))
    walls, cpus = [], []
    for i in range(changes):
        state = change_one(model, slices[(i * 7919) % len(slices)], i)
        wall, cpu, r = timed(lambda: dp.sync(state))  # noqa: B023 (called at once)
        assert not r.full
        walls.append(wall)
        cpus.append(cpu)
    return {"services": services, "endpoints": endpoints, "ipv6": ipv6,
            "cold_s": round(cold, 4), "cold_cpu_s": round(cold_cpu, 4),
            "cold_messages": messages, "cold_lines": report.operations,
            "resync_s": round(resync, 4), "resync_cpu_s": round(resync_cpu, 4),
            "resync_held_s": round(held, 4), "resync_held_cpu_s": round(held_cpu, 4),
            "change_ms": round(statistics.median(walls) * 1000, 3),
            "change_cpu_ms": round(statistics.median(cpus) * 1000, 3), "changes": changes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, default=10_000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--changes", type=int, default=9)
    p.add_argument("--ipv6", action="store_true", help="a single-stack IPv6 cluster")
    args = p.parse_args(argv)
    print(json.dumps(run(args.services, args.endpoints, args.changes, args.ipv6)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
