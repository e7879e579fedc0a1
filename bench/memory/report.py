"""The memory table: per size, family, mode and situation, the largest of the runs and
each run, then the families the runs had."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.common import IPV6_CLUSTER, size_label
from bench.memory.measure import POD_CIDR, SERVICE_CIDR, SITUATIONS

Obj = dict[str, Any]
FAMILIES = {
    "IPv4": f"Family: IPv4 (ClusterIPs in {SERVICE_CIDR}, pods in {POD_CIDR}).",
    "IPv6": IPV6_CLUSTER,
}


def _cell(values: Sequence[float | None]) -> str:
    shown = [v for v in values if v is not None]
    if not shown:
        return "-"
    top = f"**{max(shown):.0f}**"
    return top if len(shown) == 1 else f"{top} ({', '.join(f'{v:.0f}' for v in shown)})"


def markdown(results: list[Obj]) -> str:
    """Per size, family, mode and situation: the largest of the runs, bold, then each
    run; then which families ran."""
    rows = ["| services x endpoints | mode | situation | agent peak | + children | "
            "cgroup peak (kernel) | cgroup anon + kernel | steady: agent / cgroup anon + "
            "kernel | runs |", "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[int, int, str, str], list[Obj]] = {}
    for r in results:  # results from before the flag were IPv4
        key = (r["services"], r["endpoints"], r.get("family", "IPv4"), r["mode"])
        groups.setdefault(key, []).append(r)
    for (services, endpoints, family, mode), runs in sorted(groups.items()):
        size = size_label(services, endpoints, family)
        for name in SITUATIONS:
            got = [r["situations"][name] for r in runs if name in r.get("situations", {})]
            if not got:
                continue

            def col(key: str, got: list[Obj] = got) -> list[float | None]:
                return [g.get(key) for g in got]

            steady_cg = [g["steady_cgroup"]["anon"] + g["steady_cgroup"]["kernel"]
                         if g.get("steady_cgroup") else None for g in got]
            kernel = _cell(col("cgroup_kernel_peak_mib"))
            rows.append(
                f"| {size} | {mode} | {name} | "
                f"{_cell(col('agent_peak_mib'))} | {_cell(col('tree_peak_mib'))} | "
                f"{_cell(col('cgroup_peak_mib'))} ({kernel}) | "
                f"{_cell(col('cgroup_unreclaimable_peak_mib'))} | "
                f"{_cell(col('steady_agent_mib'))} / {_cell(steady_cg)} | {len(got)} |")
        for r in runs:
            if "error" in r:
                rows.append(f"| {size} | {mode} | failed | "
                            f"{r['error'][:200]} | | | | | |")
    families = sorted({family for (_, _, family, _) in groups})
    if families:
        rows += ["", " ".join(FAMILIES[f] for f in families)]
    return "\n".join(rows)
