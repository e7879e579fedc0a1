"""iptables and nftables data-plane benchmark: program N services, then change one
service, per applier (`nftables` is the native mode, NftablesDataPlane).

    sudo .venv/bin/python -m bench.iptables_bench --sizes 1000 10000 --repeat 3

Each applier runs in a fresh network namespace of its own (never the host's). The
cluster has FINDINGS' shape: one port per service, 3 ready endpoints (no
--cluster-cidr, so no cluster-IP masquerade rule): a dispatch rule, a service chain
with 3 `statistic` jumps, 3 endpoint chains of 2 rules each (hairpin mark, DNAT).

Measured, per applier and size (medians):
- full: the first sync of everything into empty tables (`IptablesDataPlane.sync(full=True)`)
- resync: a full sync again, over the same rules (the periodic resync)
- partial: one service's endpoint replaced, then a (partial) sync
Each figure is the whole sync (read back, render, apply) and, separately, the time in
the kernel-facing step (`SyncReport.apply_seconds`). Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from bench.model_bench import make_objects
from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.iptables.apply import IptablesDataPlane
from proxy.dataplane.nftables.apply import NftablesDataPlane
from proxy.dataplane.xtables.restore_runner import Backend
from proxy.kube.decode import decode_endpoint_slice, decode_service
from proxy.lab import Lab
from proxy.lab.netns import entered
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.model.types import Family

NODE = "node-0"
# name -> (back end, applier)
APPLIERS: dict[str, tuple[Backend | None, str]] = {
    "legacy-restore": (Backend.LEGACY, "restore"),
    "nft-restore": (Backend.NFT, "restore"),
    "legacy-iptc": (Backend.LEGACY, "iptc"),
    "nftables": (None, "nftables"),
}


ENDPOINTS_PER_SLICE = 100  # the EndpointSlice controller's default (the API allows 1,000)


def _split(slice_obj: dict[str, Any]) -> list[dict[str, Any]]:
    eps = slice_obj["endpoints"]
    if len(eps) <= ENDPOINTS_PER_SLICE:
        return [slice_obj]
    name = slice_obj["metadata"]["name"]
    return [{**slice_obj, "metadata": {**slice_obj["metadata"], "name": f"{name}-{k}"},
             "endpoints": eps[i:i + ENDPOINTS_PER_SLICE]}
            for k, i in enumerate(range(0, len(eps), ENDPOINTS_PER_SLICE))]


def build(services: int, endpoints: int) -> tuple[ClusterModel, list[dict[str, Any]]]:
    """The model of `services` with `endpoints` each, in slices of at most 100 as the
    controller writes them, and those slices' objects."""
    svc_objs, whole = make_objects(services, endpoints)
    slice_objs = [part for obj in whole for part in _split(obj)]
    model = ClusterModel(NODE)
    for obj in svc_objs:
        svc, _ = decode_service(obj)
        assert svc is not None
        model.apply_service(svc)
    for obj in slice_objs:
        sl, _ = decode_endpoint_slice(obj)
        assert sl is not None
        model.apply_slice(sl)
    model.resolve()
    return model, slice_objs


def change_one(model: ClusterModel, slice_obj: dict[str, Any], round_: int) -> DesiredState:
    """Replace the first endpoint of one service with a fresh address."""
    changed = json.loads(json.dumps(slice_obj))
    changed["endpoints"][0]["addresses"] = [f"198.18.127.{round_ % 250 + 1}"]
    sl, _ = decode_endpoint_slice(changed)
    assert sl is not None
    model.apply_slice(sl)
    state = model.resolve()
    assert len(state.changed) == 1
    return state


@contextmanager
def namespace() -> Iterator[str]:
    with Lab([], ipv6=False) as lab:
        yield lab.node_ns


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    gc.collect()
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def run_one(name: str, services: int, endpoints: int, repeat: int,
            full: bool = True) -> dict[str, Any]:
    backend, applier = APPLIERS[name]
    model, slices = build(services, endpoints)
    options = DataplaneOptions(NODE, families=(Family.V4,))
    out: dict[str, Any] = {"applier": name, "services": services,
                           "endpoints_per_service": endpoints}
    with namespace() as ns, entered(ns):
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
            resync = [timed(lambda: dp.sync(model.state, full=True)) for _ in range(repeat)]
            out["resync"] = _summary(resync)
        partial = []
        for i in range(max(repeat, 3)):
            state = change_one(model, slices[(i * 7919) % len(slices)], i)
            partial.append(timed(functools.partial(dp.sync, state)))
        assert all(not r.full for _, r in partial)
        out["partial"] = _summary(partial)
    return out


def _size(dp: IptablesDataPlane | NftablesDataPlane) -> tuple[int, int]:
    """(rules, chains) the data plane holds for IPv4."""
    if isinstance(dp, NftablesDataPlane):
        table = dp._families[Family.V4].state
        assert table is not None
        rules = sum(line.startswith("add rule ") for key in table.ports
                    for line in dp.applied_rules(key))
        base_rules = sum(len(r) for b in table.bases for _n, _b, r in b.chains)
        return rules + base_rules, len(table.chain_names())
    fam = dp._families[Family.V4]
    assert fam.ruleset is not None
    return fam.ruleset.rule_count(), len(fam.ruleset.lengths())


def _summary(runs: list[tuple[float, Any]]) -> dict[str, Any]:
    return {"total_s": round(statistics.median(t for t, _ in runs), 4),
            "apply_s": round(statistics.median(r.apply_seconds for _, r in runs), 4),
            "lines": int(statistics.median(r.operations for _, r in runs)),
            "runs": len(runs)}


def markdown(results: list[dict[str, Any]]) -> str:
    rows = ["| applier | services (rules / chains) | full sync | full resync | "
            "one-service partial sync |", "|---|---|---|---|---|"]
    for r in results:
        resync = r.get("resync")
        rows.append(
            f"| {r['applier']} | {r['services']:,} ({r['rules']:,} / {r['chains']:,}) "
            f"| {_fmt(r['full'])} | {_fmt(resync) if resync else 'not run'} "
            f"| {_fmt(r['partial'])} |")
    return "\n".join(rows)


def _fmt(part: dict[str, Any]) -> str:
    return (f"{_time(part['total_s'])} (kernel step {_time(part['apply_s'])}, "
            f"{part['lines']:,} lines)")


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
    results = []
    for size in args.sizes:
        for name in args.appliers:
            result = run_one(name, size, args.endpoints, args.repeat,
                             full=size <= args.no_resync_above)
            results.append(result)
            if not args.json:
                print(json.dumps(result), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
