"""The churn benchmark (bench/churn/), small: the real agent on the simulator, old pacing
and new, isolated changes, random churn at two rates and a burst of new services; and
on a single-stack IPv6 cluster, against an agent restarted over its tables. Only
behaviour and the result's shape are asserted (every change reached the kernel, the
figures are there and sane); its timings are reported, never asserted here."""

from __future__ import annotations

import json
import os
import struct
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

import pytest

from bench import __main__ as bench_main
from bench.churn import Settings, markdown, run
from bench.churn.kernel import AddressWatch
from bench.churn.measure import Phase
from bench.churn.workload import AddressPool, AddressPool6
from bench.common import PACINGS, POD_CIDR_V6
from proxy.dataplane.common.netlink import frame, nfgen
from proxy.dataplane.common.netlink_constants import (
    NFNL_SUBSYS_NFTABLES,
    NFPROTO_IPV4,
    NFPROTO_IPV6,
    NFT_MSG_DELRULE,
    NFT_MSG_NEWRULE,
    NFT_MSG_NEWSETELEM,
)
from proxy.netns_lab.netns import NETNS_DIR


def _message(kind: int, payload: bytes, family: int = NFPROTO_IPV4) -> bytes:
    body = nfgen(family) + payload  # then what the attributes would hold
    message = frame(NFNL_SUBSYS_NFTABLES << 8 | kind, 0, 0, body)
    return message + b"\0" * (-len(message) % 4)


def _watch() -> AddressWatch:
    """The watch's parsing and records, without its socket (no namespace needed)."""
    watch = object.__new__(AddressWatch)
    watch.wanted, watch.seen, watch.lost, watch.messages = {}, {}, 0, 0
    return watch


def test_a_write_is_seen_by_the_rule_that_adds_its_address_and_folded_writes_count() -> None:
    watch = _watch()
    phase = Phase("random", watch, 0)
    addresses = [AddressPool.packed(k) for k in (5, 70_000, 9)]
    for i, (packed, svc) in enumerate(zip(addresses, ("a", "a", "b"), strict=True)):
        write = phase.new_id(packed)
        phase.groups.append([write])
        phase.slice_of[write] = svc
        phase.sent[write] = 10.0 + i
    assert AddressPool.address(70_000) == "198.18.21.112"  # past 198.19.0.0/16
    # A deleted rule carries old addresses: not a sign of anything added.
    watch._feed(_message(NFT_MSG_DELRULE, b"\x00\x08" + addresses[2]))
    assert not watch.seen and not phase.all_seen()
    # One transaction: write 1's rule (the later write of slice "a", so write 0 is
    # folded into it) and write 2's, in one datagram.
    watch._feed(_message(NFT_MSG_NEWRULE, b"\x08\x00\x01\x00" + addresses[1])
                + _message(NFT_MSG_NEWRULE, struct.pack("!I", 7) + addresses[2]))
    assert set(watch.seen) == {1, 2} and phase.all_seen()
    first, second, third = phase.lags()
    assert first is not None and second is not None and third is not None
    assert first == pytest.approx(second + 1.0)  # sent a second earlier, in with it
    assert phase.superseded() == 1


def test_an_ipv6_write_is_seen_by_its_dnat_or_its_set_element() -> None:
    """The attributes as the agent's IPv6 transactions announce them (read in a run): a
    DNAT's immediate (NFTA_DATA_VALUE of 16 bytes), a hairpin set element holding the
    address twice, and the masquerade rule's bare /64 prefix, which marks no write."""
    watch = _watch()
    phase = Phase("burst", watch, 0)
    assert AddressPool6.address(0) == "fd00:19::1"  # as bench/agent_start.py's pods
    packed = [AddressPool6.packed(k) for k in (0, 2**40)]
    assert all(ip_address(a) in ip_network(POD_CIDR_V6) for a in packed)
    for i, address in enumerate(packed):
        write = phase.new_id(address)
        phase.groups.append([write])
        phase.sent[write] = 10.0 + i
    prefix = packed[0][:8]
    watch._feed(_message(NFT_MSG_NEWRULE, b"\x10\x00\x03\x00\x0c\x00\x01\x00" + prefix
                         + b"\x48\x00\x01\x00\x0e\x00\x01\x00", NFPROTO_IPV6))
    assert not watch.seen
    watch._feed(_message(NFT_MSG_NEWRULE, b"\x18\x00\x02\x00\x14\x00\x01\x00" + packed[1],
                         NFPROTO_IPV6))
    assert set(watch.seen) == {1} and not phase.all_seen()
    watch._feed(_message(NFT_MSG_NEWSETELEM, b"\x24\x00\x01\x00" + packed[0] * 2,
                         NFPROTO_IPV6))
    assert set(watch.seen) == {0, 1} and phase.all_seen()


def test_only_ipv4_is_held_to_the_address_pool() -> None:
    big = Settings(services=100_000, endpoints=10)
    with pytest.raises(ValueError, match="--ipv6"):
        big.check()
    Settings(services=100_000, endpoints=10, ipv6=True).check()


def _ours() -> set[str]:
    """This process's lab namespaces."""
    return {n for n in os.listdir(NETNS_DIR) if n.startswith(f"spx-{os.getpid()}-")}


@pytest.mark.root
@pytest.mark.slow
def test_churn_small(tmp_path: Path) -> None:
    before = _ours()
    settings = Settings(services=100, endpoints=3, isolated=3, spacing=0.2,
                        rates=(10.0, 50.0), duration=2.0, burst=20, gap=0.5)
    try:
        result = run(settings, tmp_path)
    finally:
        assert _ours() == before, "the bench left namespaces behind"
    assert [r["pacing"] for r in result["runs"]] == ["old", "new"]
    assert result["runs"][0]["agent_flags"] == " ".join(PACINGS["old"])
    assert result["runs"][1]["agent_flags"] == ""
    for r in result["runs"]:
        assert not r["errors"] and r["watch"]["lost"] == 0
        assert r["start_s"] > 0 and r["peak_rss_mib"] > 0
        phases: list[dict[str, Any]] = r["phases"]
        assert [(p["phase"], p["rate"]) for p in phases] == [
            ("isolated", None), ("random", 10.0), ("random", 50.0), ("burst", None)]
        assert [p["changes"] for p in phases] == [3, 20, 100, 20]
        for p in phases:
            # Every change reached the kernel, by its own address or a later write's.
            assert p["never_seen"] == 0, (r["pacing"], p["phase"], p["rate"])
            assert p["lag"]["n"] == p["changes"] and len(p["lag"]["samples_ms"]) == p["changes"]
            assert 0 < p["lag"]["p50"] <= p["lag"]["p99"] <= p["lag"]["max"]
            assert p["cpu_percent"] is not None and p["cpu_percent"] >= 0
            assert p["cpu_max_1s_percent"] is not None and p["cpu_max_1s_percent"] >= 0
            assert p["peak_rss_mib"] > 0 and p["syncs"] >= 1
        burst = phases[-1]
        assert burst["all_in_s"] >= burst["last_write_to_all_in_s"] >= 0 and burst["cpu_1s"]
    text = markdown(result)
    assert "| 100 x 3 | burst (20 services) | new |" in text and "random 50/s" in text
    png = tmp_path / "churn.png"
    assert bench_main.plot("churn", [{"label": "small", "result": result}], png)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.root
@pytest.mark.slow
def test_churn_small_ipv6(tmp_path: Path) -> None:
    before = _ours()
    settings = Settings(services=5, endpoints=3, pacing=("new",),
                        phases=("isolated", "burst"), isolated=3, spacing=0.2, burst=4,
                        gap=0.5, ipv6=True, restart=True, resync=1.0)
    try:
        result = run(settings, tmp_path)
    finally:
        assert _ours() == before, "the bench left namespaces behind"
    assert result["family"] == "IPv6" and result["settings"]["ipv6"]
    slices = [o for o in json.loads((tmp_path / "new" / "cluster.json").read_text())
              if o["kind"] == "EndpointSlice"]
    assert {s["addressType"] for s in slices} == {"IPv6"}
    assert all(ip_address(a) in ip_network(POD_CIDR_V6)
               for s in slices for e in s["endpoints"] for a in e["addresses"])
    [r] = result["runs"]
    assert not r["errors"] and r["watch"]["lost"] == 0
    phases: list[dict[str, Any]] = r["phases"]
    assert [(p["phase"], p["changes"]) for p in phases] == [("isolated", 3), ("burst", 4)]
    for p in phases:
        # Every change reached the kernel, by its own IPv6 address.
        assert p["never_seen"] == 0, p["phase"]
        assert p["lag"]["n"] == p["changes"] and len(p["lag"]["samples_ms"]) == p["changes"]
        assert 0 < p["lag"]["p50"] <= p["lag"]["p99"] <= p["lag"]["max"]
        assert p["syncs"] >= 1
    text = markdown(result)
    assert "| 5 x 3 IPv6 | burst (4 services) | new |" in text and "Family: IPv6" in text
    # The phases ran against an agent restarted over the first one's tables, which
    # kept every port by its input mark and made their state afterwards.
    assert r["restart_s"] > 0 and "ports=5" in r["kept_state_made"]
    assert "restarted over its tables" in text
    # With --sync-period 1s (`resync`), resyncs went a table a part meanwhile.
    assert any("family=IPv6 ports=5" in line for line in r["resyncs"]), r["resyncs"]
    assert "Periodic resyncs during the phases" in text
