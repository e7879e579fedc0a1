"""The rule-based modes' sync benchmark (bench/rule_sync.py: iptables back ends and the
nftables mode) keeps working (tiny; timings reported, never asserted). It builds its own
network namespaces, so it needs root like the e2e tests."""

from __future__ import annotations

import pytest

from bench.rule_sync import APPLIERS, markdown, run_one

pytestmark = pytest.mark.root


@pytest.mark.parametrize("applier", list(APPLIERS))
def test_rule_sync_bench_runs_small(applier: str) -> None:
    result = run_one(applier, services=12, endpoints=3, repeat=1)
    # Per service, iptables: a dispatch rule, the port's traffic count, 3 statistic
    # jumps, 3 endpoint chains x 2 rules; nftables: none (a picked port is map elements:
    # its dispatch, its counter and its endpoints by slot).
    rules, chains = (0, 0) if applier == "nftables" else (11, 4)
    one = run_one(applier, 1, 3, 1)
    assert result["rules"] - 12 * rules == one["rules"] - rules
    assert result["chains"] - 12 * chains == one["chains"] - chains
    # One endpoint replaced: its service chain rewritten, one endpoint chain added and
    # one removed (declared, flushed, deleted) - a handful of lines, not the table.
    assert 0 < result["partial"]["lines"] < 20
    assert result["full"]["lines"] > 12 * max(rules, 1)
    if applier == "nftables":
        # A restart over the same rules writes nothing (every port's input mark is
        # there); with one changed meanwhile, that one (a few lines beside the tables'
        # and sets' declarations, @fingerprints in each table).
        assert result["restart"]["lines"] == 0
        assert 0 < result["restart_changed"]["lines"] < 21 < result["full"]["lines"]
    assert applier in markdown([result])
