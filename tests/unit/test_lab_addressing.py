"""The real-node lab's address plans (labs/realcp/addressing.py): the IPv4 cluster keeps
the addresses docs/lab.md shows, and every plan stays inside the test ranges."""

from __future__ import annotations

from ipaddress import ip_address, ip_network

import pytest

from labs.realcp.addressing import IPV4, IPV6, STACKS, Family, IPNetwork, url_host

TEST_RANGES = (ip_network("198.18.0.0/15"), ip_network("fd00::/8"))


def test_the_ipv4_cluster_keeps_its_documented_addresses() -> None:
    assert str(IPV4.api_addr) == "198.18.96.1"
    assert [str(IPV4.member(i)) for i in range(4)] == [
        "198.18.96.11", "198.18.96.12", "198.18.96.13", "198.18.96.14"]
    assert [str(IPV4.pod_range(i)) for i in range(3)] == [
        "198.18.64.0/24", "198.18.65.0/24", "198.18.66.0/24"]
    assert str(IPV4.kubernetes_service_ip) == "198.18.128.1"


def inside(net: IPNetwork, outer: IPNetwork) -> bool:
    return net.network_address in outer and net.broadcast_address in outer


@pytest.mark.parametrize("family", [IPV4, IPV6], ids=lambda f: f.name)
def test_every_address_is_in_a_test_range_and_ranges_do_not_overlap(family: Family) -> None:
    (home,) = [r for r in TEST_RANGES if r.version == family.version]
    nets = [family.cp_net, family.services, family.pods]
    assert all(inside(n, home) for n in nets)
    assert not any(a.overlaps(b) for i, a in enumerate(nets) for b in nets[i + 1:])
    ranges = [family.pod_range(i) for i in range(8)]
    assert len(set(ranges)) == 8 and all(inside(r, family.pods) for r in ranges)
    assert family.member(0) != family.api_addr and family.member(0) in family.cp_net


def test_addresses_beyond_a_network_are_refused() -> None:
    with pytest.raises(ValueError):
        IPV4.member(244)  # .255 is the broadcast address
    with pytest.raises(ValueError):
        IPV4.pod_range(32)  # a /19 holds 32 /24s


def test_ipv6_is_written_in_brackets_in_urls() -> None:
    assert url_host(ip_address("fd00:198:18:96::1")) == "[fd00:198:18:96::1]"
    assert url_host("198.18.96.1") == "198.18.96.1"
    assert [f.name for f in STACKS["dual"]] == ["IPv4", "IPv6"]


def test_the_ipv6_service_range_is_as_wide_as_v1_20_accepts() -> None:
    # kube-apiserver v1.20 refuses more than 20 host bits; its allocator then serves
    # 2**16 addresses of it, the network address aside.
    assert IPV6.services.max_prefixlen - IPV6.services.prefixlen == 20
    assert (IPV4.cluster_ips, IPV6.cluster_ips) == (32_766, 65_535)
    assert str(IPV6.kubernetes_service_ip) == "fd00:198:18:128::1"
    assert str(IPV6.services[10]) == "fd00:198:18:128::a"  # kube-dns (tests/nodes/dns.py)
