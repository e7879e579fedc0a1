"""What a change costs in the nftables mode per balancing algorithm (proxy/model/balancing.py):
one endpoint replaced in a service balanced at random (kube-proxy's), by Maglev, or by
source hash, among N services of E endpoints programmed in a lab node.

A random port's change edits the few elements and rules of that endpoint (port_edit.py).
A hashed port's table is a function of its whole endpoint set, so a change recomputes
Maglev's table (M slots, M from table_size) and re-renders the port; the kernel is sent
only the slots that changed. Measured per configuration: the whole partial sync (render,
diff, netlink) and its kernel step, medians over the changes; the slots written.

    python -m bench.nftables.balancing_cost --services 10000 --endpoints 10
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from typing import Any

from bench.common import NODE, change_one, make_objects, node_namespace, timed
from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.nftables.apply import NftablesDataPlane
from proxy.kube.decode import decode_endpoint_slice, decode_service
from proxy.model.balancing import table_size
from proxy.model.tracker import ClusterModel
from proxy.model.types import ANNOTATION_BALANCING, Family
from proxy.netns_lab.netns import entered

# The services of each kind among the N: the first of each is the one changed.
KINDS = ("random", "maglev", "source-hash")


def cluster(services: int, endpoints: int) -> tuple[ClusterModel, dict[str, list[Any]]]:
    """N services, every third one of each kind; the slices of each kind, by kind."""
    svcs, slices = make_objects(services, endpoints)
    model = ClusterModel(NODE)
    by_kind: dict[str, list[Any]] = {k: [] for k in KINDS}
    for i, (obj, sl) in enumerate(zip(svcs, slices, strict=True)):
        kind = KINDS[i % len(KINDS)]
        if kind != "random":
            obj["metadata"]["annotations"] = {ANNOTATION_BALANCING: kind}
        svc, _ = decode_service(obj)
        decoded, _ = decode_endpoint_slice(sl)
        assert svc is not None and decoded is not None
        model.apply_service(svc)
        model.apply_slice(decoded)
        by_kind[kind].append(sl)
    model.resolve()
    return model, by_kind


def run(services: int, endpoints: int, changes: int) -> dict[str, Any]:
    model, by_kind = cluster(services, endpoints)
    out: dict[str, Any] = {"services": services, "endpoints": endpoints,
                           "table_size": table_size(endpoints), "change": {}}
    with node_namespace() as ns, entered(ns):
        dp = NftablesDataPlane(DataplaneOptions(NODE, families=(Family.V4,)),
                               clear_conntrack=False)
        seconds, _ = timed(lambda: dp.sync(model.state, full=True))
        out["full_s"] = round(seconds, 3)
        round_ = 0
        for kind in KINDS:
            runs = []
            for i in range(changes):
                sl = by_kind[kind][(i * 7919) % len(by_kind[kind])]
                state = change_one(model, sl, round_)
                round_ += 1
                runs.append(timed(functools.partial(dp.sync, state)))
            assert all(not r.full for _, r in runs)
            out["change"][kind] = {
                "total_ms": round(statistics.median(t for t, _ in runs) * 1000, 2),
                "apply_ms": round(statistics.median(r.apply_seconds for _, r in runs) * 1000,
                                  2),
                "operations": int(statistics.median(r.operations for _, r in runs)),
                "n": len(runs)}
    return out


def markdown(result: dict[str, Any]) -> str:
    rows = [f"{result['services']:,} services x {result['endpoints']} endpoints "
            f"(Maglev's table: {result['table_size']:,} slots), full sync "
            f"{result['full_s']:.2f} s", "",
            "| balancing | one change (median) | kernel step | operations |",
            "|---|---|---|---|"]
    for kind, c in result["change"].items():
        rows.append(f"| {kind} | {c['total_ms']:.1f} ms | {c['apply_ms']:.1f} ms "
                    f"| {c['operations']:,} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--services", type=int, default=3000)
    p.add_argument("--endpoints", type=int, default=10)
    p.add_argument("--changes", type=int, default=15)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = run(args.services, args.endpoints, args.changes)
    print(json.dumps(result, indent=1) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
