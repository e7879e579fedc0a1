"""ctnetlink's codec (proxy/dataplane/common/ctnetlink.py): dumps decoded from messages
laid out as the kernel writes them (the fast path) and as pyroute2 encodes them (no
nested flags: the generic path), and our requests read back by pyroute2's own codec.
The kernel's answers: tests/e2e/test_ctnetlink_kernel.py."""

from __future__ import annotations

import errno
import socket
import struct
from ipaddress import ip_address
from typing import Any

import pytest
from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple, nfct_msg

from proxy.dataplane.common import ctnetlink
from proxy.dataplane.common.ctnetlink import (
    CT_DELETE,
    CT_GET,
    CT_NEW,
    CtEntry,
    create_body,
    decode_dump,
    delete_body,
    dump_body,
    tuple_attrs,
)
from proxy.dataplane.common.netlink import NetlinkError, frame, nested, nfgen, nla
from proxy.dataplane.common.netlink_constants import (
    CTA_FILTER_FLAG_CTA_PROTO_NUM,
    CTA_ID,
    CTA_MARK,
    CTA_STATUS,
    CTA_TIMEOUT,
    CTA_TUPLE_ORIG,
    CTA_TUPLE_REPLY,
    CTA_USE,
    CTA_ZONE,
    IPS_ASSURED,
    IPS_CONFIRMED,
    IPS_DST_NAT,
    IPS_SEEN_REPLY,
    NLM_F_MULTI,
    NLMSG_DONE,
    NLMSG_ERROR,
)
from proxy.model.types import Family

UDP, TCP, SCTP = 17, 6, 132
CONFIRMED_DNAT = IPS_CONFIRMED | IPS_DST_NAT | IPS_SEEN_REPLY


def entry(family: Family, protocol: int = UDP, n: int = 1, **kw: object) -> CtEntry:
    net = "198.18.0." if family is Family.V4 else "fd00:18::"
    fields: dict[str, object] = {
        "src": ip_address(f"{net}{n}"), "sport": 40000 + n, "dst": ip_address(f"{net}200"),
        "dport": 53, "reply_src": ip_address(f"{net}100"), "reply_sport": 5353,
        "status": CONFIRMED_DNAT, "ct_id": 0xDEAD0000 + n}
    fields.update(kw)
    return CtEntry(family, protocol, **fields)  # type: ignore[arg-type]


def kernel_message(e: CtEntry, seq: int, tuple_zone: bool = False) -> bytes:
    """One dump message in the order 6.18 writes it (nests flagged NLA_F_NESTED)."""
    zone = nla(3 | 0x8000, b"") if tuple_zone else b""  # a CTA_TUPLE_ZONE after the nests
    af = {Family.V4: socket.AF_INET, Family.V6: socket.AF_INET6}[e.family]
    body = nfgen(af)
    body += nested(CTA_TUPLE_ORIG, tuple_attrs(e.family, e.protocol, e.src, e.sport, e.dst,
                                               e.dport) + zone)
    body += nested(CTA_TUPLE_REPLY, tuple_attrs(e.family, e.protocol, e.reply_src,
                                                e.reply_sport, e.src, e.sport) + zone)
    if e.zone:
        body += nla(CTA_ZONE, struct.pack("!H", e.zone))
    body += nla(CTA_STATUS, struct.pack("!I", e.status)) + nla(CTA_MARK, b"\0" * 4)
    body += nla(CTA_ID, struct.pack("!I", e.ct_id)) + nla(CTA_USE, b"\0\0\0\1")
    body += nla(CTA_TIMEOUT, b"\0\0\0\x1e")
    return frame(CT_NEW, NLM_F_MULTI, seq, body)


def done(seq: int) -> bytes:
    return frame(NLMSG_DONE, NLM_F_MULTI, seq, struct.pack("=i", 0))


def pyroute2_message(e: CtEntry, seq: int) -> bytes:
    af = socket.AF_INET if e.family is Family.V4 else socket.AF_INET6
    msg = nfct_msg.create_from(
        tuple_orig=NFCTAttrTuple(family=af, saddr=str(e.src), daddr=str(e.dst),
                                 proto=e.protocol, sport=e.sport, dport=e.dport),
        tuple_reply=NFCTAttrTuple(family=af, saddr=str(e.reply_src), daddr=str(e.src),
                                  proto=e.protocol, sport=e.reply_sport, dport=e.sport),
        status=e.status, id=e.ct_id)
    msg["header"]["type"], msg["header"]["sequence_number"] = CT_NEW, seq
    msg["nfgen_family"] = af
    msg.encode()
    return bytes(msg.data)


@pytest.mark.parametrize("family", [Family.V4, Family.V6])
@pytest.mark.parametrize("protocol", [UDP, SCTP])
def test_kernel_layout_round_trip(family: Family, protocol: int,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    entries = [entry(family, protocol, n) for n in range(1, 6)]
    entries.append(entry(family, protocol, 7, status=IPS_CONFIRMED, zone=3,
                         reply_src=entries[0].dst, reply_sport=53))
    # The fast path alone: the generic decoder is never asked, and the attributes after
    # the tuples are walked only for the entry in a zone.
    monkeypatch.setattr(ctnetlink.Decoder, "_message_slow", lambda *a: pytest.fail("slow path"))
    walked: list[int] = []
    rest = ctnetlink._rest

    def counted(*args: Any) -> tuple[int, int, int]:
        walked.append(1)
        return rest(*args)

    monkeypatch.setattr(ctnetlink, "_rest", counted)
    first = b"".join(kernel_message(e, 9) for e in entries[:3])
    second = b"".join(kernel_message(e, 9) for e in entries[3:]) + done(9)
    assert decode_dump(family, {protocol}, [first, second], 9) == entries
    assert walked == [1]
    assert entries[0].dnat and not entries[-1].dnat


@pytest.mark.parametrize("family", [Family.V4, Family.V6])
def test_pyroute2_encoded_messages_take_the_generic_path(family: Family) -> None:
    entries = [entry(family, UDP, 1), entry(family, SCTP, 2)]
    data = b"".join(pyroute2_message(e, 4) for e in entries) + done(4)
    assert decode_dump(family, {UDP, SCTP}, [data], 4) == entries


def test_a_tuple_zone_takes_the_generic_path() -> None:
    e = entry(Family.V4, zone=2)
    assert decode_dump(Family.V4, {UDP}, [kernel_message(e, 1, tuple_zone=True)], 1) == [e]


def test_other_protocols_families_and_requests_are_skipped() -> None:
    udp, tcp = entry(Family.V4, UDP, 1), entry(Family.V4, TCP, 2)
    v6 = entry(Family.V6, UDP, 3)
    data = (kernel_message(tcp, 5) + kernel_message(udp, 4)  # another request's reply
            + kernel_message(udp, 5) + kernel_message(v6, 5)
            + done(5) + kernel_message(udp, 5))
    assert decode_dump(Family.V4, {UDP}, [data], 5) == [udp]
    assert decode_dump(Family.V4, {TCP, UDP}, [data], 5) == [tcp, udp]


def test_a_refused_dump_raises_with_its_errno() -> None:
    refusal = frame(NLMSG_ERROR, 0, 3, struct.pack("=i", -errno.EINVAL) + b"\0" * 16)
    with pytest.raises(NetlinkError) as caught:
        decode_dump(Family.V4, {UDP}, [refusal], 3)
    assert caught.value.code == errno.EINVAL


def decoded(body: bytes, kind: int) -> nfct_msg:
    msg = nfct_msg(frame(kind, 0, 1, body))
    msg.decode()
    return msg


def tuple_of(msg: nfct_msg, name: str) -> tuple[object, ...]:
    t = msg.get_attr(name)
    ip, proto = t.get_attr("CTA_TUPLE_IP"), t.get_attr("CTA_TUPLE_PROTO")
    return (ip.get_attr("CTA_IP_V4_SRC") or ip.get_attr("CTA_IP_V6_SRC"),
            ip.get_attr("CTA_IP_V4_DST") or ip.get_attr("CTA_IP_V6_DST"),
            proto.get_attr("CTA_PROTO_NUM"), proto.get_attr("CTA_PROTO_SRC_PORT"),
            proto.get_attr("CTA_PROTO_DST_PORT"))


@pytest.mark.parametrize("family", [Family.V4, Family.V6])
def test_delete_names_the_tuple_and_the_id(family: Family) -> None:
    e = entry(family, UDP, 4, zone=7)
    msg = decoded(delete_body(e), CT_DELETE)
    assert msg["nfgen_family"] == (socket.AF_INET if family is Family.V4 else socket.AF_INET6)
    # Always a tuple: a delete without one flushes the family's whole table.
    assert tuple_of(msg, "CTA_TUPLE_ORIG") == (str(e.src), str(e.dst), UDP, e.sport, e.dport)
    assert msg.get_attr("CTA_ID") == e.ct_id
    assert msg.get_attr("CTA_ZONE") == 7
    assert decoded(delete_body(entry(family)), CT_DELETE).get_attr("CTA_ZONE") is None


@pytest.mark.parametrize("family", [Family.V4, Family.V6])
def test_create_dnat_asks_the_kernel_for_the_nat(family: Family) -> None:
    e = entry(family, SCTP, 2, status=CONFIRMED_DNAT | IPS_ASSURED)
    msg = decoded(create_body(e, 120), CT_NEW)
    assert tuple_of(msg, "CTA_TUPLE_ORIG") == (str(e.src), str(e.dst), SCTP, e.sport, e.dport)
    # The reply as if un-NATed; the kernel's NAT setup rewrites it to the target.
    assert tuple_of(msg, "CTA_TUPLE_REPLY") == (str(e.dst), str(e.src), SCTP, e.dport, e.sport)
    assert msg.get_attr("CTA_TIMEOUT") == 120
    # CONFIRMED, which the kernel requires (EBUSY without); never the NAT bits.
    assert msg.get_attr("CTA_STATUS") == IPS_SEEN_REPLY | IPS_ASSURED | IPS_CONFIRMED
    nat = msg.get_attr("CTA_NAT_DST")
    v = "V4" if family is Family.V4 else "V6"
    assert nat.get_attr(f"CTA_NAT_{v}_MINIP") == nat.get_attr(f"CTA_NAT_{v}_MAXIP") == str(
        e.reply_src)
    ports = nat.get_attr("CTA_NAT_PROTO")
    assert ports.get_attr("CTA_PROTONAT_PORT_MIN") == ports.get_attr(
        "CTA_PROTONAT_PORT_MAX") == e.reply_sport


def test_create_without_nat_gives_the_reply_tuple() -> None:
    e = entry(Family.V4, UDP, 3, status=0)
    msg = decoded(create_body(e, 30), CT_NEW)
    assert tuple_of(msg, "CTA_TUPLE_REPLY") == (str(e.reply_src), str(e.src), UDP,
                                                e.reply_sport, e.sport)
    assert msg.get_attr("CTA_STATUS") is None and msg.get_attr("CTA_NAT_DST") is None


def test_dump_request_filters_by_protocol_only() -> None:
    assert dump_body(Family.V6, None) == struct.pack("!BBH", socket.AF_INET6, 0, 0)
    msg = decoded(dump_body(Family.V4, SCTP), CT_GET)
    orig = msg.get_attr("CTA_TUPLE_ORIG")
    assert orig.get_attr("CTA_TUPLE_IP") is None
    assert orig.get_attr("CTA_TUPLE_PROTO").get_attr("CTA_PROTO_NUM") == SCTP
    assert msg.get_attr("CTA_FILTER").get_attr("CTA_FILTER_ORIG_FLAGS") == (
        CTA_FILTER_FLAG_CTA_PROTO_NUM)
