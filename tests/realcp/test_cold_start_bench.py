"""The quiet-control-plane cold-start benchmark (bench/realcp_cold_start.py) keeps
working: run tiny on the tier's session control plane, once per endpoints source, and
with --ipv6 on a single-stack IPv6 control plane of its own. Only that each start
completed, its first transaction was dated (by the table lookups, and with
--announcements by nf_tables' announcements too) and every endpoint was programmed is
asserted, never how long it took."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.realcp_cold_start import SOURCES, Settings, markdown, run
from labs.realcp.addressing import IPV6_ONLY
from labs.realcp.build import Binaries
from labs.realcp.controlplane import ControlPlane
from labs.realcp.nodes import ROOT

pytestmark = [pytest.mark.realcp, pytest.mark.root, pytest.mark.slow]


def test_every_start_programs_every_endpoint(
        control_plane: ControlPlane, realcp_binaries: Binaries, tmp_path: Path) -> None:
    settings = Settings(services=5, endpoints=2, runs=1, setup_deadline=120.0,
                        start_deadline=120.0, quiet_deadline=60.0, cleanup_objects=True,
                        announcements=True)
    result = run(control_plane, realcp_binaries, settings, tmp_path)
    assert [r["source"] for r in result["runs"]] == list(SOURCES)
    for one in result["runs"]:
        assert one["committed_s"] > 0 and one["commit_resolution_s"] > 0, one
        assert one["committed_announced_s"] > 0, one
        assert one["endpoints_seen"] == one["endpoints_wanted"] == 10, one
        assert one["first_sync_s"] > 0 and one["listed_s"] is not None, one
        # the agent read what it was told to
        assert ("legacy Endpoints" if one["source"] == "endpoints"
                else "EndpointSlice API") in one["source_logged"], one
    # skip-mirror: the mirroring controller left the Endpoints alone
    assert result["mirrored_slices"] == 0
    assert "committed: median" in markdown(result)


def test_two_checkouts_take_turns(control_plane: ControlPlane, realcp_binaries: Binaries,
                                  tmp_path: Path) -> None:
    # Two names for this checkout: an A/B's bookkeeping, not its speed, is under test.
    for name in ("before", "after"):
        (tmp_path / name).symlink_to(ROOT)
    settings = Settings(services=3, endpoints=1, runs=1, sources=("endpoints",),
                        setup_deadline=120.0, start_deadline=120.0, quiet_deadline=60.0,
                        cleanup_objects=True,
                        agent_roots=(str(tmp_path / "before"), str(tmp_path / "after")))
    result = run(control_plane, realcp_binaries, settings, tmp_path)
    assert [r["agent"] for r in result["runs"]] == ["before", "after"]
    assert all(r["endpoints_seen"] == r["endpoints_wanted"] == 3 for r in result["runs"])
    assert set(result["sources"]) == {"before/endpoints", "after/endpoints"}
    assert "before/endpoints" in markdown(result)


def test_a_single_stack_ipv6_start_programs_every_endpoint(
        control_plane: ControlPlane, realcp_binaries: Binaries, tmp_path: Path) -> None:
    settings = Settings(services=3, endpoints=2, runs=1, setup_deadline=120.0,
                        start_deadline=120.0, quiet_deadline=60.0, announcements=True,
                        ipv6=True)
    with pytest.raises(ValueError, match="IPv4"):  # the session's IPv4 control plane
        run(control_plane, realcp_binaries, settings, tmp_path)
    with ControlPlane(realcp_binaries, stack=IPV6_ONLY) as cp:
        result = run(cp, realcp_binaries, settings, tmp_path)
    assert [r["source"] for r in result["runs"]] == list(SOURCES)
    for one in result["runs"]:
        # every endpoint read back from the ip6 tables, its first commit dated there
        assert one["endpoints_seen"] == one["endpoints_wanted"] == 6, one
        assert one["committed_s"] > 0 and one["committed_announced_s"] > 0, one
        assert "--cluster-cidr" in one["argv"] and "fd00:19::/64" in one["argv"], one
    assert result["mirrored_slices"] == 0
    assert "single-stack IPv6" in markdown(result)
