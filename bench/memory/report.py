"""The memory table: per size, mode and situation, the largest of the runs and each run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.memory.measure import SITUATIONS

Obj = dict[str, Any]


def _cell(values: Sequence[float | None]) -> str:
    shown = [v for v in values if v is not None]
    if not shown:
        return "-"
    top = f"**{max(shown):.0f}**"
    return top if len(shown) == 1 else f"{top} ({', '.join(f'{v:.0f}' for v in shown)})"


def markdown(results: list[Obj]) -> str:
    """Per size, mode and situation: the largest of the runs, bold, then each run."""
    rows = ["| services x endpoints | mode | situation | agent peak | + children | "
            "cgroup peak (kernel) | cgroup anon + kernel | steady: agent / cgroup anon + "
            "kernel | runs |", "|---|---|---|---|---|---|---|---|---|"]
    groups: dict[tuple[int, int, str], list[Obj]] = {}
    for r in results:
        groups.setdefault((r["services"], r["endpoints"], r["mode"]), []).append(r)
    for (services, endpoints, mode), runs in sorted(groups.items()):
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
                f"| {services:,} x {endpoints} | {mode} | {name} | "
                f"{_cell(col('agent_peak_mib'))} | {_cell(col('tree_peak_mib'))} | "
                f"{_cell(col('cgroup_peak_mib'))} ({kernel}) | "
                f"{_cell(col('cgroup_unreclaimable_peak_mib'))} | "
                f"{_cell(col('steady_agent_mib'))} / {_cell(steady_cg)} | {len(got)} |")
        for r in runs:
            if "error" in r:
                rows.append(f"| {services:,} x {endpoints} | {mode} | failed | "
                            f"{r['error'][:200]} | | | | | |")
    return "\n".join(rows)
