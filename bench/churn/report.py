"""The results as Markdown tables (bench/RESULTS.md)."""

from __future__ import annotations

from typing import Any

from bench.common import IPV6_CLUSTER, size_label

FAMILIES = {
    "IPv4": "Family: IPv4 (ClusterIPs in 198.18.128.0/17, pods in 198.19.0.0/16 and "
            "198.18.4-127.x).",
    "IPv6": IPV6_CLUSTER,
}


def _lag(lag: dict[str, Any]) -> str:
    return f"{lag.get('p50', '-')} / {lag.get('p99', '-')} / {lag.get('max', '-')}"


def markdown(result: dict[str, Any]) -> str:
    rows = ["| services | phase | pacing | changes (folded, never seen) | sent a second "
            "| lag p50 / p99 / max ms | all in | agent CPU % (max over 1 s) | peak RSS MiB "
            "| syncs |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    runs = result["runs"]
    family = result.get("family", "IPv4")  # older results: IPv4
    size = size_label(result["services"], result["endpoints"], family)
    # Phase by phase, each pacing's row beside the other's.
    for k in range(max((len(r["phases"]) for r in runs), default=0)):
        for r in runs:
            if k >= len(r["phases"]):
                continue
            p = r["phases"][k]
            phase = p["phase"] + (f" {p['rate']:g}/s" if p.get("rate") else "")
            if p["phase"] == "burst":
                phase += f" ({p['changes']:,} services)"
            all_in = (f"{p['last_write_to_all_in_s'] * 1000:.0f} ms after the last write"
                      if p["phase"] != "isolated" else "-")
            if p["phase"] == "burst":
                all_in = f"{p['all_in_s']:.2f} s from the first write; " + all_in
            rows.append(
                f"| {size} | {phase} | {r['pacing']} "
                f"| {p['changes']:,} ({p.get('superseded', 0)}, {p['never_seen']}) "
                f"| {p['sent_rate'] or '-'} "
                f"| {_lag(p['lag'])} | {all_in} "
                f"| {p['cpu_percent']} ({p['cpu_max_1s_percent']}) | {p['peak_rss_mib']} "
                f"| {p['syncs']} |")
    starts = ", ".join(f"{r['pacing']} {r['start_s']} s ({r['start_peak_rss_mib'] or 0:.0f} "
                       "MiB)" for r in runs)
    rows += ["", "pacing: old = `--min-sync-period 1s`, new = no pacing flag (the agent's "
             "default); lag: a slice write sent -> nf_tables announcing the rule or map "
             "element with its new address (or with a later write's to the same slice: "
             "folded, the agent took both in one sync); CPU: the agent and its children, "
             "% of one core from the phase's first write until its last change was in the "
             "kernel, and its highest over any 1 s window overlapping that; peak RSS: the "
             f"highest sampled in the phase. Agent start to its first sync: {starts}. "
             f"{FAMILIES[family]}"]
    restarts = [f"{r['pacing']} {r['restart_s']} s" + (f" ({r['kept_state_made']})"
                                                       if r.get("kept_state_made") else "")
                for r in runs if "restart_s" in r]
    if restarts:
        rows[-1] += (" The phases ran against an agent restarted over its tables (`--restart`), "
                     f"from its first sync: {'; '.join(restarts)}.")
    resyncs = [f"{r['pacing']}: {'; '.join(r['resyncs'])}" for r in runs if r.get("resyncs")]
    if resyncs:
        rows[-1] += f" Periodic resyncs during the phases (`--resync`): {' | '.join(resyncs)}."
    return "\n".join(rows)
