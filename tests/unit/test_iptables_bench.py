"""The iptables benchmark keeps working (tiny; timings reported, never asserted). It
builds its own network namespaces, so it needs root like the e2e tests."""

from __future__ import annotations

import pytest

from bench.iptables_bench import APPLIERS, markdown, run_one

pytestmark = pytest.mark.root


@pytest.mark.parametrize("applier", list(APPLIERS))
def test_iptables_bench_runs_small(applier: str) -> None:
    result = run_one(applier, services=12, endpoints=3, repeat=1)
    # Per service: a dispatch rule, 3 statistic jumps, 3 endpoint chains x 2 rules.
    assert result["rules"] - 12 * 10 == run_one(applier, 1, 3, 1)["rules"] - 10
    assert result["chains"] - 12 * 4 == run_one(applier, 1, 3, 1)["chains"] - 4
    # One endpoint replaced: its service chain rewritten, one endpoint chain added and
    # one removed (declared, flushed, deleted) - a handful of lines, not the table.
    assert 0 < result["partial"]["lines"] < 20
    assert result["full"]["lines"] > 12 * 10
    assert applier in markdown([result])
