"""The results as a Markdown table (bench/RESULTS.md)."""

from __future__ import annotations

from typing import Any

# --- output ----------------------------------------------------------------------------------


def pacing(r: dict[str, Any]) -> str:
    """old / new, or the explicit flag of a custom run (results from before: the flag)."""
    if r.get("pacing") in (None, "custom"):
        return str(r.get("agent_flags") or r.get("min_sync_period", "-"))
    return str(r["pacing"])


def markdown(results: list[dict[str, Any]]) -> str:
    rows = ["| mode | pacing | endpoints | rate | traffic | connections (failed) "
            "| lag p50 / p99 / max, roll | lag p50 / p99, last 10% | converged "
            "| agent CPU s (% of roll) | peak RSS MiB | syncs (p50 ms) |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        t, lag, a = r["traffic"], r["lag"], r["agent"]
        during, end = lag["during"], lag["end"]
        failed = f"{t['connections']:,} ({t['failed']}"
        if t["failed"]:
            failed += ": " + ", ".join(f"{k} {v}" for k, v in t["failures_by_kind"].items())
        conv = "never" if lag["converged_s"] is None else f"{lag['converged_s'] * 1000:.0f} ms"
        rows.append(
            f"| {r['mode']} | {pacing(r)} | {r['endpoints']:,} | {r['rate']:g}/s "
            f"| {r.get('traffic_rate', 0):g}/s | {failed}) "
            f"| {during.get('p50', '-')} / {during.get('p99', '-')} / {during.get('max', '-')} "
            f"| {end.get('p50', '-')} / {end.get('p99', '-')} | {conv} "
            f"| {a['cpu_s']} ({a['cpu_percent']}%) | {a['peak_rss_mib'] or 0:.0f} "
            f"| {a['syncs']} ({a['sync_ms'].get('p50', '-')}) |")
    rows.append("")
    rows.append("rate: endpoints replaced a second; traffic: new connections a second; "
                "pacing: old = `--min-sync-period 1s`, new = no pacing flag (the agent's "
                "default); lag: a slice write sent -> its effect in the kernel (ms); "
                "converged: the last such write -> the kernel holding exactly the new "
                "endpoints; CPU: the agent and its children over the roll, % of one core")
    return "\n".join(rows)
