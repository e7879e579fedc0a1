"""iptables and nftables data-plane benchmark: program N services, then change one
service, per applier (`nftables` is the native mode, NftablesDataPlane).

    sudo .venv/bin/python -m bench.rule_sync --sizes 1000 10000 --repeat 3

Each applier runs in a fresh network namespace of its own (never the host's). The
cluster has FINDINGS' shape: one port per service, 3 ready endpoints (no
--cluster-cidr, so no cluster-IP masquerade rule): a dispatch rule, a service chain
with 3 `statistic` jumps, 3 endpoint chains of 2 rules each (hairpin mark, DNAT).

Measured, per applier and size (medians):
- full: the first sync of everything into empty tables (`IptablesDataPlane.sync(full=True)`)
- resync: a full sync again, over the same rules (the periodic resync; before restarts
  wrote the difference alone, what every restart cost too)
- restart (nftables): a new data plane's first sync over the rules the first one left,
  as an agent started again on its node (restart.py: writes what differs, here nothing,
  and renders no port: every input mark is there, marks.py) and, `restart, one
  changed`, with one service's endpoint replaced meanwhile; "then" is what it does
  when idle right after (its housekeeping: the kept state made, input marks added)
- partial: one service's endpoint replaced, then a (partial) sync
Each figure is the whole sync (read back, render, apply) and, separately, the time in
the kernel-facing step (`SyncReport.apply_seconds`) and the system CPU the process spent
(the kernel's work for it: dumps and transactions). Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import resource
import statistics
import sys
from collections.abc import Callable, Sequence
from typing import Any

from bench.common import NODE, change_one, cluster_model, node_namespace, print_results, timed
from proxy.dataplane.base import DataplaneOptions, SyncReport, housekeep_all
from proxy.dataplane.iptables.apply import IptablesDataPlane
from proxy.dataplane.nftables.apply import NftablesDataPlane
from proxy.dataplane.xtables.restore_runner import Backend
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family
from proxy.netns_lab.netns import entered

# name -> (back end, applier)
APPLIERS: dict[str, tuple[Backend | None, str]] = {
    "legacy-restore": (Backend.LEGACY, "restore"),
    "nft-restore": (Backend.NFT, "restore"),
    "legacy-iptc": (Backend.LEGACY, "iptc"),
    "nftables": (None, "nftables"),
}


def run_one(name: str, services: int, endpoints: int, repeat: int,
            full: bool = True) -> dict[str, Any]:
    backend, applier = APPLIERS[name]
    model, slices = cluster_model(services, endpoints)
    options = DataplaneOptions(NODE, families=(Family.V4,))
    out: dict[str, Any] = {"applier": name, "services": services,
                           "endpoints_per_service": endpoints}
    with node_namespace() as ns, entered(ns):
        dp: IptablesDataPlane | NftablesDataPlane
        if applier == "nftables":
            dp = NftablesDataPlane(options, clear_conntrack=False)
        else:
            dp = IptablesDataPlane(options, backend=backend, applier=applier,
                                   clear_conntrack=False)
        seconds, report = timed(lambda: dp.sync(model.state, full=True))
        out["full"] = {"total_s": round(seconds, 3), "apply_s": round(report.apply_seconds, 3),
                       "lines": report.operations}
        out["rules"], out["chains"] = _size(dp)
        if full:
            resync = [kernel_timed(lambda: dp.sync(model.state, full=True))
                      for _ in range(repeat)]
            out["resync"] = _summary(resync)
        partial = []
        for i in range(max(repeat, 3)):
            state = change_one(model, slices[(i * 7919) % len(slices)], i)
            partial.append(timed(functools.partial(dp.sync, state)))
        assert all(not r.full for _, r in partial)
        out["partial"] = _summary(partial)
        if isinstance(dp, NftablesDataPlane):  # last: `dp` knows nothing of what they write
            housekeep_all(dp)  # idle after its syncs: its ports' input marks added
            restarts = [_restart(options, model.state) for _ in range(repeat)]
            out["restart"] = _summary([r[0] for r in restarts])
            out["restart_after"] = [round(statistics.median(r[1][i] for r in restarts), 4)
                                    for i in (0, 1)]
            changed = change_one(model, slices[len(slices) // 2], repeat + 7)
            run, after = _restart(options, changed)
            out["restart_changed"] = _summary([run])
            out["restart_changed_after"] = [round(x, 4) for x in after]
    return out


def _restart(options: DataplaneOptions, state: DesiredState
             ) -> tuple[tuple[float, SyncReport, float], tuple[float, float]]:
    """A restarted agent's first sync (kernel_timed), and the seconds and system CPU
    seconds of what it does when idle right after (housekeeping: the kept state of the
    ports it kept by their input marks, the sweep, input marks)."""
    plane = _restarted(options)
    run = kernel_timed(lambda: plane.sync(state))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    seconds = timed(lambda: housekeep_all(plane))[0]
    return run, (seconds, resource.getrusage(resource.RUSAGE_SELF).ru_stime - before)


def kernel_timed(fn: Callable[[], SyncReport]) -> tuple[float, SyncReport, float]:
    """`timed`, with the system CPU seconds the process spent meanwhile."""
    before = resource.getrusage(resource.RUSAGE_SELF).ru_stime
    seconds, report = timed(fn)
    return seconds, report, resource.getrusage(resource.RUSAGE_SELF).ru_stime - before


def _restarted(options: DataplaneOptions) -> NftablesDataPlane:
    """A data plane that has written nothing yet: an agent started again."""
    return NftablesDataPlane(options, clear_conntrack=False)


def _size(dp: IptablesDataPlane | NftablesDataPlane) -> tuple[int, int]:
    """(rules, chains) the data plane holds for IPv4."""
    if isinstance(dp, NftablesDataPlane):
        table = dp._families[Family.V4].state
        assert table is not None
        rules = sum(line.startswith("add rule ") for key in table.ports
                    for line in dp.applied_rules(key))
        base_rules = sum(len(c.rules) for b in table.bases for c in b.chains)
        return rules + base_rules, len(table.chain_names())
    fam = dp._families[Family.V4]
    assert fam.ruleset is not None
    return fam.ruleset.rule_count(), len(fam.ruleset.lengths())


def _summary(runs: Sequence[tuple[float, Any] | tuple[float, Any, float]]) -> dict[str, Any]:
    out = {"total_s": round(statistics.median(r[0] for r in runs), 4),
           "apply_s": round(statistics.median(r[1].apply_seconds for r in runs), 4),
           "lines": int(statistics.median(r[1].operations for r in runs)),
           "runs": len(runs)}
    if all(len(r) == 3 for r in runs):
        out["system_s"] = round(statistics.median(r[2] for r in runs), 4)  # type: ignore[misc]
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    rows = ["| applier | services (rules / chains) | full sync | full resync | "
            "restart | restart, one changed | one-service partial sync |",
            "|---|---|---|---|---|---|---|"]
    for r in results:
        rows.append(
            f"| {r['applier']} | {r['services']:,} ({r['rules']:,} / {r['chains']:,}) "
            f"| {_fmt(r['full'])} | {_fmt(r.get('resync'))} "
            f"| {_fmt(r.get('restart'), r.get('restart_after'))} "
            f"| {_fmt(r.get('restart_changed'), r.get('restart_changed_after'))} "
            f"| {_fmt(r['partial'])} |")
    return "\n".join(rows)


def _fmt(part: dict[str, Any] | None, then: Sequence[float] | None = None) -> str:
    if part is None:
        return "not run"
    system = f", system CPU {_time(part['system_s'])}" if "system_s" in part else ""
    after = (f"; then {_time(then[0])} idle work, system CPU {_time(then[1])}"
             if then is not None else "")
    return (f"{_time(part['total_s'])} (kernel step {_time(part['apply_s'])}, "
            f"{part['lines']:,} lines{system}{after})")


def _time(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1000, 10_000])
    p.add_argument("--endpoints", type=int, default=3)
    p.add_argument("--appliers", nargs="+", default=list(APPLIERS), choices=list(APPLIERS))
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--no-resync-above", type=int, default=10**9,
                   help="skip the full resync above this many services (slow back ends)")
    p.add_argument("--json", action="store_true", help="print JSON only")
    args = p.parse_args(argv)
    print_results((run_one(name, size, args.endpoints, args.repeat,
                           full=size <= args.no_resync_above)
                   for size in args.sizes for name in args.appliers),
                  markdown, as_json=args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
