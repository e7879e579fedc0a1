"""The result as a Markdown table (bench/RESULTS.md)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# --- output ---------------------------------------------------------------------------------


def markdown(result: Mapping[str, Any]) -> str:
    s = result["settings"]
    lines = [f"{result.get('server', s['server'])}; {s['services']} services x "
             f"{s['endpoints']} endpoints, {s['changes']} changes at {s['rate']}/s; "
             f"{result['machine']['cpu']}, {result['machine']['nproc']} CPUs",
             "",
             "| first list | N | start: API server CPU s | peak RSS MiB (before) | etcd CPU s | "
             "all synced s | bytes/agent | workers CPU s | churn: API server CPU s | "
             "etcd CPU s | bytes/agent/change | all received s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["runs"]:
        st, ch = r["start"], r["churn"]
        etcd = st.get("etcd", {}).get("cpu_s", "-")
        etcd_ch = ch.get("etcd", {}).get("cpu_s", "-")
        lines.append(
            f"| {r['first_list']} | {r['agents']} | {st['apiserver']['cpu_s']} | "
            f"{st['apiserver']['peak_rss_mib']} ({st['apiserver']['rss_before_mib']}) | "
            f"{etcd} | {st['all_synced_s']} | {st['bytes_per_agent']:,} | "
            f"{st['workers_cpu_s']} | {ch['apiserver']['cpu_s']} | {etcd_ch} | "
            f"{ch['bytes_per_agent_per_change']:,} | {ch['seconds_to_all_received']} |")
    enc = result.get("encodings")
    if enc:
        lines += ["", f"{enc['lists']} watch-cache lists of all Services and all "
                  "EndpointSlices, one after the other: "
                  + "; ".join(f"{name} {enc[name]['bytes_services'] + enc[name]['bytes_slices']:,}"
                              f" bytes per pair, API server CPU {enc[name]['apiserver_cpu_s']} s"
                              for name in ("json", "protobuf"))]
    return "\n".join(lines)
