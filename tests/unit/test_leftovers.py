"""Removing another proxy mode's leftovers at start (proxy/dataplane/leftovers.py): which
mode's things the probes' findings are, what each mode removes and keeps, and that a
failure never stops anything. No kernel: probes and clean-ups are stand-ins here (the
e2e and kernel tiers run the real ones)."""

from __future__ import annotations

import logging

import pytest

from proxy.dataplane import leftovers, modes
from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.leftovers import Chain, Found, chain_mode, clean, swept, table_mode
from proxy.dataplane.xtables.saved import cleanup_restore, parse_save
from proxy.model.types import Family

OPTIONS = DataplaneOptions("node-a")
MODES = modes.names()
# The modes that leave objects in the kernel (a mode without markers leaves none).
LEAVING = tuple(m.name for m in modes.MODES if m.markers != modes.Markers())


def test_our_tables_are_told_from_others() -> None:
    # (That these are the names the planes use: tests/unit/test_layout.py.)
    assert table_mode("sliceproxy") == table_mode("sliceproxy-63") == "nftables"
    for other in ("sliceproxy-64", "sliceproxy-", "sliceproxy-01", "sliceproxy-01x",
                  "xsliceproxy", "nat", "sliceproxy-nat-probe", "kube-proxy"):
        assert table_mode(other) is None, other


def test_iptables_mode_chains_and_ipvs_mode_chains_are_told_apart() -> None:
    assert chain_mode("SPX-SERVICES") == "iptables"
    assert chain_mode("SPX-SVC-ABCDEF0123456789") == "iptables"
    assert chain_mode("SPX-IPVS-SERVICES") == "ipvs"
    assert chain_mode("SPX-IPVS-FORWARD") == "ipvs"
    assert chain_mode("KUBE-SERVICES") is None
    assert chain_mode("PREROUTING") is None


def found_everything() -> Found:
    return Found(
        nft_tables=[("ip", "sliceproxy"), ("ip6", "sliceproxy-3")],
        chains=[Chain("nft", Family.V4, "SPX-SERVICES"),
                Chain("legacy", Family.V4, "SPX-IPVS-SERVICES")],
        dummy_interfaces=["spx-ipvs0"])


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_cleans_the_other_two_and_never_its_own(mode: str) -> None:
    found = leftovers.leftovers(mode, found_everything())
    assert set(found) == set(LEAVING) - {mode}
    # In clean-up order: the IPVS mode's chains before the sweep of every SPX- chain.
    assert list(found) == [m for m in LEAVING if m != mode]
    if mode != "ipvs":
        assert found["ipvs"] == ["chain legacy IPv4 nat SPX-IPVS-SERVICES",
                                 "dummy interface spx-ipvs0"]
    if mode != "nftables":
        assert found["nftables"] == ["table ip sliceproxy", "table ip6 sliceproxy-3"]


def test_nothing_found_is_nothing_to_do() -> None:
    for mode in MODES:
        assert leftovers.leftovers(mode, Found()) == {}
    # Foreign tables and chains are nobody's leftovers.
    foreign = Found(nft_tables=[("ip", "nat"), ("inet", "firewall")],
                    chains=[Chain("nft", Family.V4, "KUBE-SERVICES")])
    assert leftovers.leftovers("nftables", foreign) == {}


def test_probes_skip_a_mode_s_own_things() -> None:
    # iptables mode: its own nat table may hold 100,000 rules; never read it at start.
    assert leftovers.probes("iptables") == leftovers.Probes(
        nft_tables=True, nft_markers=("SPX-IPVS-SERVICES",), legacy_nat=False,
        dummy_interfaces=("spx-ipvs0",))
    assert leftovers.probes("ipvs") == leftovers.Probes(
        nft_tables=True, nft_markers=("SPX-SERVICES",), legacy_nat=True, dummy_interfaces=())
    assert leftovers.probes("nftables") == leftovers.Probes(
        nft_tables=True, nft_markers=("SPX-IPVS-SERVICES", "SPX-SERVICES"),
        legacy_nat=True, dummy_interfaces=("spx-ipvs0",))


def test_legacy_listings_are_read_for_our_chains() -> None:
    assert leftovers.table_names("filter\nnat\n") == {"filter", "nat"}
    assert leftovers.table_names("") == set()
    saved = ("# Generated\n*nat\n:PREROUTING ACCEPT [0:0]\n:SPX-SERVICES - [0:0]\n"
             ":SPX-IPVS-SERVICES - [0:0]\n:KUBE-SERVICES - [0:0]\n"
             "-A PREROUTING -j SPX-SERVICES\nCOMMIT\n")
    assert leftovers.saved_chains(saved) == ["SPX-SERVICES", "SPX-IPVS-SERVICES"]


SAVED = """*nat
:PREROUTING ACCEPT [0:0]
:OUTPUT ACCEPT [0:0]
:SPX-SERVICES - [0:0]
:SPX-SVC-AAAA - [0:0]
:SPX-IPVS-SERVICES - [0:0]
:SPX-IPVS-MARK-MASQ - [0:0]
:CNI-NAT - [0:0]
-A PREROUTING -m comment --comment "sliceproxy service portals" -j SPX-SERVICES
-A PREROUTING -m comment --comment "sliceproxy ipvs services" -j SPX-IPVS-SERVICES
-A OUTPUT -j CNI-NAT
-A SPX-SERVICES -d 198.18.128.10/32 -j SPX-SVC-AAAA
-A SPX-IPVS-SERVICES -j SPX-IPVS-MARK-MASQ
COMMIT
"""


def test_ipvs_mode_removes_the_iptables_mode_chains_but_keeps_its_own() -> None:
    text = cleanup_restore(parse_save(SAVED), swept("ipvs")).render()
    assert "-X SPX-SERVICES" in text and "-X SPX-SVC-AAAA" in text
    assert '-D PREROUTING -m comment --comment "sliceproxy service portals" ' \
           "-j SPX-SERVICES" in text
    assert "SPX-IPVS" not in text  # neither its chains nor the jumps to them
    assert "CNI-NAT" not in text


def test_nftables_mode_sweeps_every_spx_chain() -> None:
    text = cleanup_restore(parse_save(SAVED), swept("nftables")).render()
    for chain in ("SPX-SERVICES", "SPX-SVC-AAAA", "SPX-IPVS-SERVICES", "SPX-IPVS-MARK-MASQ"):
        assert f"-X {chain}" in text
    assert "-D PREROUTING" in text and "CNI-NAT" not in text
    assert text == cleanup_restore(parse_save(SAVED)).render()  # what --cleanup does


def test_clean_runs_only_what_was_found_in_order_and_says_what_it_removed(
        caplog: pytest.LogCaptureFixture) -> None:
    calls: list[str] = []

    def cleaner(mode: str) -> leftovers.Cleaner:
        def run(found: Found, running: str, options: DataplaneOptions) -> str:
            assert running == "nftables" and options is OPTIONS
            calls.append(mode)
            assert found == found_everything().of(mode)  # only its own things
            return f"{mode} things"
        return run

    cleaners = {m: cleaner(m) for m in MODES}
    with caplog.at_level(logging.INFO, logger="proxy.dataplane.leftovers"):
        removed = clean("nftables", OPTIONS, lambda mode: found_everything(), cleaners)
    assert calls == ["ipvs", "iptables"]
    assert removed == {"ipvs": "ipvs things", "iptables": "iptables things"}
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert [r.getMessage() for r in infos] == [
        "removed the ipvs mode's leftovers: ipvs things",
        "removed the iptables mode's leftovers: iptables things"]
    assert all(r.mode == "nftables" for r in infos)

    calls.clear()
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="proxy.dataplane.leftovers"):
        assert clean("iptables", OPTIONS, lambda mode: Found(), cleaners) == {}
    assert calls == []
    assert not [r for r in caplog.records if r.levelno >= logging.INFO]


def test_a_failed_probe_or_clean_up_is_a_warning_and_the_rest_still_runs(
        caplog: pytest.LogCaptureFixture) -> None:
    def broken(found: Found, running: str, options: DataplaneOptions) -> str:
        raise OSError("the kernel said no")

    def fine(found: Found, running: str, options: DataplaneOptions) -> str:
        return "tables ip sliceproxy"

    def no_probe(mode: str) -> Found:
        raise OSError("netlink is gone")

    with caplog.at_level(logging.INFO, logger="proxy.dataplane.leftovers"):
        removed = clean("iptables", OPTIONS, lambda mode: found_everything(),
                        {"ipvs": broken, "nftables": fine})
        assert clean("ipvs", OPTIONS, no_probe) == {}
    assert removed == {"nftables": "tables ip sliceproxy"}
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "cannot remove the ipvs mode's leftovers: the kernel said no" in \
        warnings[0].getMessage()
    assert warnings[0].leftovers_of == "ipvs"
    assert "cannot tell whether another proxy mode left rules behind" in \
        warnings[1].getMessage()


def test_ipvs_chains_without_ipvs_in_the_kernel_go_without_the_ipvs_plane(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from proxy.dataplane.xtables import cleanup

    seen: list[list[str]] = []

    def remove_chains(runners: object, owned: object) -> list[tuple[object, int]]:
        assert callable(owned)
        seen.append([c for c in ("SPX-SERVICES", "SPX-IPVS-INPUT", "KUBE-X") if owned(c)])
        return []

    monkeypatch.setattr(cleanup, "remove_chains", remove_chains)
    monkeypatch.setattr(cleanup, "cleanup_runners", lambda families: [])
    found = Found(chains=[Chain("nft", Family.V4, "SPX-IPVS-SERVICES")])
    said = leftovers.clean_ipvs(found, "nftables", OPTIONS, in_kernel=lambda: False)
    assert seen == [["SPX-IPVS-INPUT"]]
    assert "IPVS is not in this kernel" in said
