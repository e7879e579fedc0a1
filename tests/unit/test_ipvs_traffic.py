"""IPVS traffic counts (proxy/dataplane/ipvs/traffic.py): a service port's total is the
sum of its virtual servers' statistics (one per frontend), and where the port is counted
per endpoint (annotation, else --traffic-per-endpoint), each endpoint's is its real
servers' summed over those virtual servers; read over the fake kernel's statistics
(tests/fakekernel/ipvs.py), and the netlink decoding of the kernel's two statistics
attributes."""

from __future__ import annotations

import socket
import struct
import time
from ipaddress import ip_address

import pytest

from proxy.dataplane.base import Counted, DataplaneOptions, PortTraffic
from proxy.dataplane.common.netlink import nested, nla
from proxy.dataplane.ipvs import netlink as ipvs_netlink
from proxy.dataplane.ipvs.apply import IpvsDataPlane
from proxy.dataplane.ipvs.render import RsKey, VsKey
from proxy.model.snapshot import DesiredState
from proxy.model.types import ANNOTATION_TRAFFIC_PER_ENDPOINT, Family, Protocol, ServicePortKey
from tests.fakekernel.ipvs import NODE_ADDRESS, FakeIpvs, FakeLinks, on_fakes
from tests.unit.builders import NODE, ep, eps_slice, model_of, node, service

TCP = Protocol.TCP
CLUSTER_IP, EXTERNAL_IP = ip_address("198.18.128.1"), ip_address("203.0.113.7")
SECOND_ADDRESS = ip_address("198.18.0.2")
EP1, EP2 = ip_address("198.18.1.1"), ip_address("198.18.1.2")
WEB = ServicePortKey("ns", "web", "http", Family.V4)
API = ServicePortKey("ns", "api", "http", Family.V4)
# The web port's frontends: its cluster IP, its external IP, both node addresses.
FRONTENDS = (VsKey(TCP, CLUSTER_IP, 80), VsKey(TCP, EXTERNAL_IP, 80),
             VsKey(TCP, NODE_ADDRESS, 30080), VsKey(TCP, SECOND_ADDRESS, 30080))


def state(web_annotation: str | None = None) -> DesiredState:
    """web: NodePort with an external IP and endpoints EP1, EP2; api: a cluster IP with
    EP1 (at 9090)."""
    notes = {ANNOTATION_TRAFFIC_PER_ENDPOINT: web_annotation} if web_annotation else {}
    web = service("web", ips=(str(CLUSTER_IP),), annotations=notes, type="NodePort",
                  externalIPs=[str(EXTERNAL_IP)],
                  ports=({"name": "http", "port": 80, "nodePort": 30080},))
    api = service("api", ips=("198.18.128.2",))
    return model_of(
        node(), web, api,
        eps_slice("web-1", [ep(str(EP1), node=NODE), ep(str(EP2), node="node-b")],
                  service_name="web"),
        eps_slice("api-1", [ep(str(EP1), node=NODE)], service_name="api",
                  ports=({"name": "http", "port": 9090},)),
    ).resolve()


def plane(desired: DesiredState, *, flag: bool = False) -> tuple[IpvsDataPlane, FakeIpvs]:
    ipvs = FakeIpvs()
    links = FakeLinks(table=[(1, NODE_ADDRESS), (2, SECOND_ADDRESS)])
    dp = on_fakes(DataplaneOptions(NODE, families=(Family.V4,), traffic_per_endpoint=flag),
                  ipvs, links)
    dp.sync(desired, full=True)
    return dp, ipvs


def count(connections: int) -> Counted:
    """`connections` connections of 3 packets, 100 bytes each way, say."""
    return Counted(connections, 6 * connections, 600 * connections)


def test_a_ports_total_is_the_sum_of_its_frontends_and_nothing_counted_is_zero() -> None:
    dp, ipvs = plane(state())
    assert set(dp.applied_rules(WEB)) >= {f"TCP {vs.address}:{vs.port} rr -> {EP1}:8080 "
                                          "weight 1" for vs in FRONTENDS}
    ipvs.counted = {vs: count(n) for vs, n in zip(FRONTENDS, (5, 1, 2, 3), strict=True)}
    ipvs.counted[VsKey(TCP, ip_address("198.18.128.9"), 80)] = count(100)  # not ours
    traffic = dp.traffic()
    assert traffic == {WEB: PortTraffic(count(11)), API: PortTraffic(Counted(0, 0, 0))}
    assert ipvs.dumps == [None]  # one dump of the virtual servers, no real servers asked


def test_per_endpoint_sums_each_real_server_over_the_ports_frontends() -> None:
    dp, ipvs = plane(state("true"))
    cluster, external, node_a = FRONTENDS[:3]
    ipvs.counted = {cluster: count(5), node_a: count(2), external: Counted(0, 0, 0)}
    ipvs.dest_counted = {
        cluster: {RsKey(EP1, 8080): count(3), RsKey(EP2, 8080): count(2)},
        node_a: {RsKey(EP1, 8080): count(1), RsKey(EP2, 8080): count(1)},
        # Counts of a virtual server that says it counted nothing are not asked for.
        external: {RsKey(EP1, 8080): count(50)},
    }
    (web,) = [t for k, t in dp.traffic().items() if k == WEB]
    assert web == PortTraffic(count(7), {(EP1, 8080): count(4), (EP2, 8080): count(3)})
    assert sorted(k for k in ipvs.dumps if k is not None) == sorted([cluster, node_a])


def test_an_endpoint_nothing_reached_reads_zero_and_a_draining_one_is_still_read() -> None:
    dp, ipvs = plane(state("true"))
    cluster = FRONTENDS[0]
    gone = RsKey(ip_address("198.18.1.9"), 8080)  # left the slice, draining at weight 0
    ipvs.counted = {cluster: count(4)}
    ipvs.dest_counted = {cluster: {RsKey(EP1, 8080): count(3), gone: count(1)}}
    web = dp.traffic()[WEB]
    assert web.endpoints == {(EP1, 8080): count(3), (EP2, 8080): Counted(0, 0, 0),
                             (gone.address, 8080): count(1)}


@pytest.mark.parametrize(("annotation", "flag", "per_endpoint"), [
    (None, False, False), (None, True, True), ("true", False, True),
    ("false", True, False), ("true", True, True)])
def test_per_endpoint_by_the_annotation_else_the_nodes_flag(
        annotation: str | None, flag: bool, per_endpoint: bool) -> None:
    dp, ipvs = plane(state(annotation), flag=flag)
    ipvs.counted = {FRONTENDS[0]: count(1)}
    ipvs.dest_counted = {FRONTENDS[0]: {RsKey(EP1, 8080): count(1)}}
    traffic = dp.traffic()
    assert (traffic[WEB].endpoints is not None) is per_endpoint
    # The api service has no annotation: the flag alone decides.
    assert (traffic[API].endpoints is not None) is flag
    if per_endpoint:
        assert traffic[WEB].endpoints == {(EP1, 8080): count(1), (EP2, 8080): Counted(0, 0, 0)}


def test_the_annotation_changed_alone_takes_effect_at_the_next_sync() -> None:
    dp, ipvs = plane(state("false"), flag=True)
    ipvs.counted = {FRONTENDS[0]: count(1)}
    assert dp.traffic()[WEB].endpoints is None
    report = dp.sync(state("true"))
    assert not report.full and WEB in report.written
    assert dp.traffic()[WEB].endpoints == {(EP1, 8080): Counted(0, 0, 0),
                                           (EP2, 8080): Counted(0, 0, 0)}


def test_a_virtual_server_two_ports_claim_counts_for_the_one_programming_it() -> None:
    # api's cluster IP is web's external IP, on the same port: api's key sorts first,
    # so api programs it (index.py) and counts it.
    shared = service("api", ips=(str(EXTERNAL_IP),))
    desired = model_of(node(), shared, eps_slice("api-1", [ep(str(EP1), node=NODE)],
                                                 service_name="api")).resolve()
    merged = DesiredState({**state().ports, **desired.ports})
    dp, ipvs = plane(merged)
    ipvs.counted = {VsKey(TCP, EXTERNAL_IP, 80): count(2), FRONTENDS[0]: count(1)}
    traffic = dp.traffic()
    assert traffic[API].total == count(2) and traffic[WEB].total == count(1)


def test_nothing_applied_reads_nothing() -> None:
    dp = on_fakes(DataplaneOptions(NODE, families=(Family.V4,)))
    assert dp.traffic() == {}


# --- netlink: the kernel's statistics attributes ---------------------------------------

def stats64(conns: int, inpkts: int, outpkts: int, inbytes: int, outbytes: int) -> bytes:
    """As the kernel sends them: the five counts, then five rates."""
    return b"".join(nla(kind, struct.pack("=Q", value)) for kind, value in enumerate(
        (conns, inpkts, outpkts, inbytes, outbytes, 1, 2, 3, 4, 5), start=1))


def stats32(conns: int, inpkts: int, outpkts: int, inbytes: int, outbytes: int) -> bytes:
    return (nla(1, struct.pack("=I", conns)) + nla(2, struct.pack("=I", inpkts))
            + nla(3, struct.pack("=I", outpkts)) + nla(4, struct.pack("=Q", inbytes))
            + nla(5, struct.pack("=Q", outbytes)) + nla(6, struct.pack("=I", 99)))


def service_reply(stats: bytes) -> bytes:
    key = ipvs_netlink.service_key_attrs(VsKey(TCP, CLUSTER_IP, 80))
    return key + nla(ipvs_netlink.SVC_SCHED_NAME, b"rr\0") + stats


def test_statistics_are_read_from_the_64_bit_attribute_else_the_older_one() -> None:
    big = 2**40
    both = (nested(ipvs_netlink.SVC_STATS, stats32(1, 2, 3, 4, 5))
            + nested(ipvs_netlink.SVC_STATS64, stats64(big, 2, 3, 4, 5)))
    assert ipvs_netlink.decode_service_stats(service_reply(both)) == (
        ipvs_netlink.raw_key(VsKey(TCP, CLUSTER_IP, 80)), Counted(big, 5, 9))
    old = nested(ipvs_netlink.SVC_STATS, stats32(7, 10, 8, 1000, 800))
    assert ipvs_netlink.decode_service_stats(service_reply(old)) == (
        ipvs_netlink.raw_key(VsKey(TCP, CLUSTER_IP, 80)), Counted(7, 18, 1800))
    assert ipvs_netlink.decode_service_stats(service_reply(b"")) is None
    # Laid out as the kernel lays a service out (address in 16 bytes, the 64-bit
    # statistics last), read in place, IPv4 and IPv6.
    for address in (CLUSTER_IP, ip_address("fd00::10")):
        af = socket.AF_INET if address.version == 4 else socket.AF_INET6
        kernel = (nla(1, struct.pack("=H", af)) + nla(2, struct.pack("=H", 17))
                  + nla(3, address.packed.ljust(16, b"\0")) + nla(4, struct.pack("!H", 53))
                  + nla(ipvs_netlink.SVC_SCHED_NAME, b"rr\0")
                  + nested(ipvs_netlink.SVC_STATS, stats32(1, 2, 3, 4, 5))
                  + nested(ipvs_netlink.SVC_STATS64, stats64(big, 2, 3, 4, 5)))
        want = (ipvs_netlink.raw_key(VsKey(Protocol.UDP, address, 53)), Counted(big, 5, 9))
        assert ipvs_netlink.service_stats_in_place(kernel) == want
        assert ipvs_netlink.decode_service_stats(kernel) == want
        # Laid out otherwise (no 64-bit statistics here): read attribute by attribute.
        assert ipvs_netlink.service_stats_in_place(kernel + nla(11, b"x\0")) is None
        assert ipvs_netlink.decode_service_stats(kernel + nla(11, b"x\0")) == want
    dest = (ipvs_netlink.dest_attrs(RsKey(EP1, 8080), 1)
            + nested(ipvs_netlink.DEST_STATS64, stats64(3, 4, 5, 6, 7)))
    assert ipvs_netlink.decode_dest_stats(dest, socket.AF_INET) == (
        RsKey(EP1, 8080), Counted(3, 9, 13))


@pytest.mark.slow
def test_reading_10000_ports_with_10_endpoints_each() -> None:
    """Speed of one traffic() over the fake kernel (reported, not asserted): the agent's
    side of a read; the kernel's dump is measured in the kernel lab."""
    objects = [node()]
    for n in range(10_000):
        objects.append(service(f"s{n}", ips=(f"198.18.{128 + n // 250}.{n % 250 + 1}",)))
        objects.append(eps_slice(f"s{n}-1", [ep(f"198.19.{k}.{n % 250 + 1}", node=NODE)
                                             for k in range(10)], service_name=f"s{n}"))
    desired = model_of(*objects).resolve()
    for flag in (False, True):
        dp, ipvs = plane(desired, flag=flag)
        ipvs.counted = {vs: count(1) for vs in dp._servers.believed}
        started = time.perf_counter()
        traffic = dp.traffic()
        seconds = time.perf_counter() - started
        assert len(traffic) == 10_000
        print(f"\ntraffic() at 10,000 ports x 10 endpoints, per endpoint {flag}: "
              f"{seconds * 1000:.0f} ms")
