"""The result as a Markdown table (bench/RESULTS.md)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from bench.realcp_latency.measure import summary

# --- reporting ----------------------------------------------------------------------------


def _cell(s: Mapping[str, Any] | None, key: str) -> str:
    if not s or s.get(key) is None:
        return "-"
    v = float(s[key])
    return f"{v * 1000:.0f} ms" if v < 10 else f"{v:.1f} s"


def markdown(result: Mapping[str, Any]) -> str:
    proxies: Mapping[str, Any] = result["proxies"]
    names = list(proxies)
    head = "| | " + " | ".join(names) + " |"
    rows = [head, "|---" * (len(names) + 1) + "|"]

    def line(label: str, pick: Callable[[Mapping[str, Any]], str]) -> None:
        rows.append(f"| {label} | " + " | ".join(pick(proxies[n]) for n in names) + " |")

    def stats(key: str) -> Callable[[Mapping[str, Any]], str]:
        def pick(p: Mapping[str, Any]) -> str:
            s = p[key]
            missed = f", {s['missed']} missed" if s.get("missed") else ""
            return (f"{_cell(s, 'median')} / {_cell(s, 'p90')} / {_cell(s, 'min')} / "
                    f"{_cell(s, 'max')} (n={s['n']}{missed})")
        return pick

    line("readiness write -> rule, median / p90 / min / max", stats("latency"))
    line("... rule removed (pod not ready)", stats("latency_remove"))
    line("... rule added (pod ready again)", stats("latency_add"))
    line("... after the watcher saw the slice", stats("after_slice_seen"))
    line("poll resolution (median / p90 / min / max)", stats("resolution"))
    line("readiness write -> commit announced by nf_tables", stats("committed"))
    line("... after the watcher saw the slice", stats("committed_after_slice_seen"))
    line("syncs logged during the changes", stats("syncs_logged_during_changes"))

    def initial(p: Mapping[str, Any]) -> str:
        i = p["initial"]
        own = i.get("first_sync_logged_s")
        own_text = f"; its first sync {own * 1000:.0f} ms" if own is not None else ""
        return (f"{i['seconds_to_rules']:.2f} s from start, CPU {i['cpu_s']['self']:.2f} s "
                f"+ {i['cpu_s']['children']:.2f} s children{own_text}")
    line("initial sync of everything", initial)
    line("nat rules / back end", lambda p: f"{p['initial']['nat_rules']:,} / "
                                           f"{p['initial']['backend']}")
    line("RSS after initial sync / at end (peak)",
         lambda p: f"{p['initial']['memory_mib'].get('rss', 0):.0f} MiB / "
                   f"{p['memory_end_mib'].get('rss', 0):.0f} MiB "
                   f"({p['memory_end_mib'].get('peak_rss', 0):.0f} MiB)")
    line("CPU during the changes (self + children)",
         lambda p: f"{p['cpu_during_changes_s']['self']:.2f} s + "
                   f"{p['cpu_during_changes_s']['children']:.2f} s")

    def metric(key: str) -> Callable[[Mapping[str, Any]], str]:
        def pick(p: Mapping[str, Any]) -> str:
            h = p["metrics_during_changes"][key]
            if not h or not h["count"]:
                return "none observed"
            return (f"n={h['count']}, mean {_cell(h, 'mean_s')}, median <= "
                    f"{_cell(h, 'p50_bucket_le_s')}, p90 <= {_cell(h, 'p90_bucket_le_s')}")
        return pick

    line("own network_programming_duration (changes)", metric("network_programming_duration"))
    line("own sync_proxy_rules_duration (changes)", metric("sync_proxy_rules_duration"))
    slices = summary([c["slice_seen_s"] for c in result["changes"]])
    rtt = summary([c["patch_rtt_s"] for c in result["changes"]])
    return "\n".join(rows) + (
        f"\n\nController part (PATCH sent -> the updated EndpointSlice reached a watcher in "
        f"this process): "
        f"median {_cell(slices, 'median')}, max {_cell(slices, 'max')}; "
        f"PATCH round trip median {_cell(rtt, 'median')}.")
