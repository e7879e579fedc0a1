"""The IPVS benchmark keeps working (python -m bench.ipvs): tiny and one round, in the kernel
lab. Its timings are reported, never asserted; what is asserted is that pyroute2, our
client and the data plane built, and read back, the very same table, so the benchmark
compares like with like."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.ipvs.run import failed_checks, markdown, run

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

CLIENT_OPERATIONS = ("program", "dump", "swap", "addresses_add", "addresses_dump")
OURS_ONLY = ("encode", "sync_full", "sync_resync", "sync_partial", "sync_partial_ipset")


def test_ipvs_bench_runs_small(tmp_path: Path) -> None:
    result = run(5, 2, 1, swaps=2, partials=2, workdir=tmp_path, timeout=240)
    print(markdown([result]))
    assert not failed_checks(result)
    assert result["tables_match"]
    # Every comparison was made: each client's table read by both readers, after the
    # swaps, the addresses, and the data plane's table.
    assert len(result["checks"]) == 2 * 5 + 3
    for op in CLIENT_OPERATIONS:
        assert set(result["operations"][op]) == {"pyroute2", "ours"}, op
    for op in OURS_ONLY:
        assert set(result["operations"][op]) == {"ours"}, op
    assert result["operations"]["program"]["ours"]["samples"] == 1
    assert result["operations"]["swap"]["pyroute2"]["samples"] == 2
    # The first change is to an endpoint on this node (hairpin ipset entries too), the
    # second to one elsewhere (netlink only).
    assert result["operations"]["sync_partial_ipset"]["ours"]["samples"] == 1
    assert result["operations"]["sync_partial"]["ours"]["samples"] == 1
    assert result["sync_details"]["sync_full"]["ipvs_changes"] == result["objects"] == 15
    assert "program 15 objects" in markdown([result])
