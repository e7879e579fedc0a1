"""`python -m bench --size small` keeps working for the scenarios that need no real
control plane (tests/realcp/test_bench_main_realcp.py runs the others): each scenario's table
and plot land in RESULTS.md, the hand-written record after it is kept, and a failing
scenario is reported, not fatal to the rest. Nothing is asserted on time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import __main__ as bench_main
from tests.e2e.test_memory_bench import check_cold_start_and_resync

pytestmark = pytest.mark.root

RECORD = "# Benchmark results\n\nHand-written record, kept.\n"


def test_small_run_writes_tables_and_plots(tmp_path: Path) -> None:
    (tmp_path / "RESULTS.md").write_text(RECORD)
    status = bench_main.main(["--size", "small", "--only", "agent-start", "huge-service",
                              "memory", "restart", "--out", str(tmp_path)])
    assert status == 0
    text = (tmp_path / "RESULTS.md").read_text()
    assert text.startswith("# Benchmark results\n") and "Hand-written record, kept." in text
    assert text.count(bench_main.BEGIN) == 1 and "commit " in text and "CPUs" in text
    assert "| 200 x 5 | nftables |" in text  # the agent's cold start table
    assert "| nftables | 500 (5) |" in text and "| iptables | 500 (5) |" in text
    assert "| nftables | 200 (" in text  # restarts beside a full resync
    # The memory table: every situation, with the cgroup's figures beside the agent's.
    for situation in ("cold_start", "burst_new", "burst_replace", "resync", "restart"):
        assert f"| 200 x 5 | nftables | {situation} | **" in text
    for name in ("agent-start", "huge-service"):
        plot = tmp_path / "plots" / f"{name}-small.png"
        assert f"]({plot.relative_to(tmp_path)})" in text
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    saved = json.loads((tmp_path / "results-small.json").read_text())
    runs = saved["results"]["agent-start"][0]["result"]["runs"]
    assert len(runs) == 2 and all(r["cold_start_s"] > 0 and r["rss_timeline"] for r in runs)
    assert all(r["idle_cpu_percent"] >= 0 and r["rss_after_mib"] > 0 for r in runs)
    # 20 services deleted before the restart: its sweep left none of their ClusterIPs.
    sweep = runs[1]["sweep"]
    assert sweep["deleted"] == 20 and sweep["checked"] == 20
    assert sweep["deleted_held"] == 0 and sweep["kept_held"]
    assert sweep["sweep_done_s"] >= runs[1]["cold_start_s"]
    # Another build's restart over 1,000 ports it renders otherwise: every port written
    # again, a table a transaction.
    rewrite = saved["results"]["agent-start"][1]["result"]["runs"][1]["restart"]
    assert [(f["ports_kept"], f["ports_written"]) for f in rewrite if f["ports_written"]] \
        == [(0, 1000)] and sum(f["tables_rewritten"] for f in rewrite) >= 2
    assert "1,000 x 2 | nftables |" in text and "(2 tables rewritten)" in text
    check_cold_start_and_resync(saved["results"]["memory"][0]["result"][0])
    # A second run replaces its section, and only it.
    assert bench_main.main(["--size", "small", "--only", "agent-start",
                            "--out", str(tmp_path)]) == 0
    again = (tmp_path / "RESULTS.md").read_text()
    assert again.count(bench_main.BEGIN) == 1 and "huge-service" not in again
    assert "Hand-written record, kept." in again


def test_a_failing_scenario_is_reported_and_the_status_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    broken = bench_main.Scenario("agent-start", "bench.agent_start", "broken", {
        "small": (bench_main.Run("no services", ("--services", "0")),)})
    monkeypatch.setattr(bench_main, "SCENARIOS", (broken,))
    assert bench_main.main(["--size", "small", "--out", str(tmp_path)]) == 1
    text = (tmp_path / "RESULTS.md").read_text()
    assert "failed: exit 2" in text and "--runs must be positive" in text
