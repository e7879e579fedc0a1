"""Our IPVS netlink encoding, checked against an independent codec: pyroute2's message
classes decode what we encode, and we decode what they encode."""

from __future__ import annotations

import socket
import struct
from ipaddress import ip_address

from pyroute2.netlink.generic import ipvs as p2

from proxy.dataplane.common.netlink import replies
from proxy.dataplane.common.netlink_constants import IPVS_CMD_DEL_DEST as CMD_DEL_DEST
from proxy.dataplane.common.netlink_constants import IPVS_CMD_NEW_DEST as CMD_NEW_DEST
from proxy.dataplane.common.netlink_constants import IPVS_CMD_NEW_SERVICE as CMD_NEW_SERVICE
from proxy.dataplane.common.netlink_constants import IPVS_CMD_SET_DEST as CMD_SET_DEST
from proxy.dataplane.common.netlink_constants import NLMSG_ERROR
from proxy.dataplane.ipvs.diff import FWD_MASQ, Op, OpKind
from proxy.dataplane.ipvs.netlink import (
    GENL,
    decode_dest,
    decode_service,
    message,
    request,
)
from proxy.dataplane.ipvs.render import FLAG_PERSISTENT, RsKey, VirtualServer, VsKey, VsKind
from proxy.model.types import Protocol

V4 = VsKey(Protocol.TCP, ip_address("198.18.128.10"), 80)
V6 = VsKey(Protocol.UDP, ip_address("fd00:198:18::10"), 53)
RS4 = RsKey(ip_address("198.18.1.10"), 8080)
RS6 = RsKey(ip_address("fd00:18:1::10"), 8081)


def decoded(op: Op) -> tuple[int, dict[str, object], dict[str, object]]:
    """Encode `op` our way, decode it with pyroute2: (cmd, service attrs, dest attrs)."""
    cmd, attrs = request(op)
    msg = p2.ipvsmsg(message(0x1C, 5, 7, cmd, attrs))
    msg.decode()
    svc = msg.get_attr("IPVS_CMD_ATTR_SERVICE")
    dest = msg.get_attr("IPVS_CMD_ATTR_DEST")
    return (msg["cmd"], dict(svc["attrs"]) if svc is not None else {},
            dict(dest["attrs"]) if dest is not None else {})


def test_new_persistent_ipv4_service() -> None:
    vs = VirtualServer(V4, VsKind.CLUSTER_IP, "wrr", FLAG_PERSISTENT, 600, (), "cluster")
    cmd, svc, dest = decoded(Op(OpKind.ADD_SERVICE, V4, service=vs))
    assert cmd == CMD_NEW_SERVICE and dest == {}
    assert svc["IPVS_SVC_ATTR_AF"] == socket.AF_INET
    assert svc["IPVS_SVC_ATTR_PROTOCOL"] == socket.IPPROTO_TCP
    assert svc["IPVS_SVC_ATTR_ADDR"] == "198.18.128.10"
    assert svc["IPVS_SVC_ATTR_PORT"] == 80
    assert svc["IPVS_SVC_ATTR_SCHED_NAME"] == "wrr"
    assert svc["IPVS_SVC_ATTR_TIMEOUT"] == 600
    assert svc["IPVS_SVC_ATTR_NETMASK"] == "255.255.255.255"
    flags = svc["IPVS_SVC_ATTR_FLAGS"]
    assert (flags["flags"], flags["mask"]) == (FLAG_PERSISTENT, 0xFFFF)  # type: ignore[index]


def test_ipv6_service_netmask_is_a_prefix_length() -> None:
    vs = VirtualServer(V6, VsKind.CLUSTER_IP, "rr", 0, 0, (), "cluster")
    _cmd, attrs = request(Op(OpKind.ADD_SERVICE, V6, service=vs))
    # Inside the nested service attribute: NETMASK (9) carries 128 in host order.
    assert struct.pack("=HH", 8, 9) + struct.pack("=I", 128) in attrs
    _cmd, svc, _dest = decoded(Op(OpKind.ADD_SERVICE, V6, service=vs))
    assert (svc["IPVS_SVC_ATTR_AF"], svc["IPVS_SVC_ATTR_ADDR"]) == (
        socket.AF_INET6, "fd00:198:18::10")


def test_destinations_masquerade_and_delete_carries_only_the_key() -> None:
    cmd, svc, dest = decoded(Op(OpKind.ADD_DEST, V4, rs=RS4, weight=1))
    assert cmd == CMD_NEW_DEST
    assert set(svc) == {"IPVS_SVC_ATTR_AF", "IPVS_SVC_ATTR_PROTOCOL", "IPVS_SVC_ATTR_ADDR",
                        "IPVS_SVC_ATTR_PORT"}
    assert dest["IPVS_DEST_ATTR_ADDR"] == "198.18.1.10"
    assert dest["IPVS_DEST_ATTR_PORT"] == 8080
    assert dest["IPVS_DEST_ATTR_FWD_METHOD"] == FWD_MASQ
    assert dest["IPVS_DEST_ATTR_WEIGHT"] == 1
    assert (dest["IPVS_DEST_ATTR_U_THRESH"], dest["IPVS_DEST_ATTR_L_THRESH"]) == (0, 0)
    cmd, _svc, dest = decoded(Op(OpKind.DRAIN_DEST, V6, rs=RS6, weight=0))
    assert (cmd, dest["IPVS_DEST_ATTR_WEIGHT"], dest["IPVS_DEST_ATTR_ADDR"]) == (
        CMD_SET_DEST, 0, "fd00:18:1::10")
    cmd, _svc, dest = decoded(Op(OpKind.DEL_DEST, V4, rs=RS4))
    assert cmd == CMD_DEL_DEST
    assert set(dest) == {"IPVS_DEST_ATTR_ADDR", "IPVS_DEST_ATTR_PORT"}


def test_we_decode_what_pyroute2_encodes() -> None:
    msg = p2.ipvsmsg()
    msg["cmd"], msg["version"] = 4, 1
    msg["attrs"] = [("IPVS_CMD_ATTR_SERVICE", {"attrs": [
        ("IPVS_SVC_ATTR_AF", socket.AF_INET6), ("IPVS_SVC_ATTR_PROTOCOL", 17),
        ("IPVS_SVC_ATTR_ADDR", "fd00:198:18::10"), ("IPVS_SVC_ATTR_PORT", 53),
        ("IPVS_SVC_ATTR_SCHED_NAME", "sh"),
        ("IPVS_SVC_ATTR_FLAGS", {"flags": 0x3, "mask": 0xFFFFFFFF}),
        ("IPVS_SVC_ATTR_TIMEOUT", 60)]})]
    msg.encode()
    (reply,) = replies(bytes(msg.data))
    svc = decode_service(reply.attrs(GENL.size)[1])
    assert svc is not None
    assert (str(svc.key), svc.scheduler, svc.flags, svc.timeout) == (
        "UDP [fd00:198:18::10]:53", "sh", FLAG_PERSISTENT, 60)  # HASHED (0x2) dropped

    msg = p2.ipvsmsg()
    msg["cmd"], msg["version"] = 8, 1
    msg["attrs"] = [("IPVS_CMD_ATTR_DEST", {"attrs": [
        ("IPVS_DEST_ATTR_ADDR_FAMILY", socket.AF_INET), ("IPVS_DEST_ATTR_ADDR", "198.18.1.10"),
        ("IPVS_DEST_ATTR_PORT", 8080), ("IPVS_DEST_ATTR_FWD_METHOD", 0),
        ("IPVS_DEST_ATTR_WEIGHT", 0), ("IPVS_DEST_ATTR_ACTIVE_CONNS", 2),
        ("IPVS_DEST_ATTR_INACT_CONNS", 5)]})]
    msg.encode()
    (reply,) = replies(bytes(msg.data))
    found = decode_dest(reply.attrs(GENL.size)[2], socket.AF_INET)
    assert found is not None
    rs, dest = found
    assert (str(rs), dest.weight, dest.active, dest.inactive, dest.connections) == (
        "198.18.1.10:8080", 0, 2, 5, 7)


def test_acknowledgements_carry_the_errno() -> None:
    ack = struct.pack("=IHHII", 36, NLMSG_ERROR, 0, 9, 0) + struct.pack("=i", -17) + bytes(16)
    ok = struct.pack("=IHHII", 36, NLMSG_ERROR, 0, 10, 0) + struct.pack("=i", 0) + bytes(16)
    got = [(r.seq, r.error) for r in replies(ack + ok)]
    assert got == [(9, 17), (10, 0)]


def test_address_messages_match_pyroute2s_codec() -> None:
    from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg

    from proxy.dataplane.common.netlink_constants import IFA_F_NODAD, RTM_NEWADDR
    from proxy.dataplane.common.rtnetlink import address_body, decode_address

    for address in (ip_address("198.18.128.10"), ip_address("fd00:198:18::10")):
        body = address_body(7, address)
        msg = ifaddrmsg(struct.pack("=IHHII", 16 + len(body), RTM_NEWADDR, 0, 1, 0) + body)
        msg.decode()
        assert msg["index"] == 7 and msg["prefixlen"] == address.max_prefixlen
        assert msg["flags"] == IFA_F_NODAD
        assert msg.get_attr("IFA_ADDRESS") == str(address)
        if address.version == 4:
            assert msg.get_attr("IFA_LOCAL") == str(address)
        assert decode_address(body) == (7, address)
