"""The programming-latency benchmark (bench/realcp_latency/) keeps working: run tiny on
the tier's session control plane. Only that every proxy (sliceproxy in iptables and in
nftables mode, kube-proxy) programmed every change is asserted, never how long it took."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.realcp_latency import PROXIES, Settings, markdown, run
from labs.realcp.build import Binaries
from labs.realcp.controlplane import ControlPlane

pytestmark = [pytest.mark.realcp, pytest.mark.root, pytest.mark.slow]


def test_every_proxy_programs_every_readiness_change(
        control_plane: ControlPlane, realcp_binaries: Binaries, tmp_path: Path) -> None:
    settings = Settings(services=5, changes=2, spacing=1.0, change_deadline=90.0,
                        setup_deadline=300.0, cleanup_objects=True)
    result = run(control_plane, realcp_binaries, settings, tmp_path)
    assert [c["action"] for c in result["changes"]] == ["remove", "add"]
    for name in PROXIES:
        side = result["proxies"][name]
        assert side["latency"] == {**side["latency"], "n": 2, "missed": 0}, (name, side)
        assert side["initial"]["backend"] in (
            ("nftables",) if name == "sliceproxy-nftables" else ("nft", "legacy"))
        assert side["initial"]["seconds_to_rules"] > 0
        for change in result["changes"]:
            assert change[name]["seconds"] is not None, (name, change)
            if side["initial"]["backend"] in ("nft", "nftables"):
                # nf_tables announced the transaction that made the change.
                assert change[name]["commits"] >= 1, (name, change)
                assert 0 < change[name]["committed_s"] <= change[name]["seconds"]
    assert "readiness write -> rule" in markdown(result)
