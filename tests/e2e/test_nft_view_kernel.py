"""How the real-API-server benches read the nftables mode's tables (bench/realcp_latency/
nat.py, bench/realcp_cold_start.py's `LiveChainAppears`) in either family, against the
real kernel in a throw-away namespace: a single-stack IPv6 cluster's ports are found in
the ip6 tables, a picked port (map elements) and a port with chains of its own (rules)
alike, spelled `[address]:port`; IPv4's, the default, as before."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import pytest

from bench.realcp_cold_start import LiveChainAppears
from bench.realcp_latency.nat import PICKED, chain_rules, nft_live, nft_view, shows
from bench.realcp_latency.settings import NFT_LIVE_CHAIN, NFT_MAIN, NFTABLES
from proxy.model.types import Family
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from tests.e2e.agent_support import wait_for
from tests.e2e.conftest import Cluster, NodePlane
from tests.e2e.test_nftables_kernel import ADDRESSES
from tests.unit.builders import ep, eps_slice, service

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

NS = "ns"


def port(name: str, ip: str, endpoints: Collection[str], family: str,
         **spec: Any) -> list[dict[str, Any]]:
    return [service(name, ips=(ip,), ipFamilies=[family], **spec),
            eps_slice(f"{name}-1", [ep(a) for a in endpoints], service_name=name,
                      address_type=family)]


OBJECTS = [
    # Two endpoints, random: a picked port (its endpoints in a pick map).
    *port("picked", "fd00:198:18:128::10", ("fd00:19::1", "fd00:19::2"), "IPv6"),
    # ClientIP affinity: chains of its own, a DNAT rule per endpoint.
    *port("chained", "fd00:198:18:128::11", ("fd00:19::3",), "IPv6",
          sessionAffinity="ClientIP"),
    *port("four", "198.18.128.10", ("198.18.1.10",), "IPv4"),
]
PORTS = {f"{NS}/{name}:http" for name in ("picked", "chained", "four")}
# As the debug dump spells them (proxy.model.types.format_endpoint).
WANT_V6 = {(f"{NS}/picked:http", "[fd00:19::1]:8080"), (f"{NS}/picked:http", "[fd00:19::2]:8080"),
           (f"{NS}/chained:http", "[fd00:19::3]:8080")}
WANT_V4 = {(f"{NS}/four:http", "198.18.1.10:8080")}


def test_each_family_s_ports_are_read_from_its_own_tables() -> None:
    with Lab([]) as lab:
        ns = lab.node_ns
        appears = LiveChainAppears(ns, Family.V6)
        appears.start()
        plane = NodePlane(ns, mode="nftables", addresses=lambda: ADDRESSES)
        try:
            with entered(ns):
                assert nft_view(NS, PORTS, Family.V6) is None  # nothing live yet
            # The lookup asks the family it is told: an ip table's chain is no ip6 one's.
            lab.exec(ns, ["nft", f"add table ip {NFT_MAIN}; add chain ip {NFT_MAIN} "
                          f"{NFT_LIVE_CHAIN}; "], check=True)
            with entered(ns):
                assert nft_live() and not nft_live(Family.V6)
            lab.exec(ns, ["nft", "delete", "table", "ip", NFT_MAIN], check=True)
            plane.sync(Cluster().become(*OBJECTS), full=True)
            wait_for(lambda: appears.seen_at is not None or appears.error, 10,
                     "the ip6 main table's hooked chain to answer a lookup")
            assert appears.error is None, appears.error
            with entered(ns):
                assert nft_live(Family.V6)
                found = nft_view(NS, PORTS, Family.V6)
                assert found is not None
                view = found[0]
                assert set(view.endpoints) == WANT_V6, view.endpoints
                chains = {key: chain for key, (chain, _) in view.endpoints.items()}
                # One picked port, one read from its rules, each read back alone too.
                assert chains[(f"{NS}/picked:http", "[fd00:19::1]:8080")].startswith(PICKED)
                assert not chains[(f"{NS}/chained:http", "[fd00:19::3]:8080")].startswith(
                    PICKED)
                for (_, endpoint), chain in chains.items():
                    rules = chain_rules(NFTABLES, chain, Family.V6)
                    assert rules is not None and shows(NFTABLES, rules, endpoint), (chain, rules)
                four = nft_view(NS, PORTS)  # IPv4, the default
                assert four is not None and set(four[0].endpoints) == WANT_V4, four
        finally:
            appears.stop()
            plane.cleanup()
