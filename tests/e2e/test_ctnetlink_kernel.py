"""Our ctnetlink client against the kernel, in a network namespace of the test's own
(its conntrack table is private and goes with it): entries made, dumped back, deleted by
id, and the `conntrack` tool's view of the same table. The codec alone:
tests/unit/test_ctnetlink.py; at scale: bench/conntrack.py (tests/e2e/test_conntrack_bench.py)."""

from __future__ import annotations

import errno
import os
import re
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from ipaddress import ip_address

import pytest

from proxy.dataplane.common.ctnetlink import (
    IPPROTO_SCTP,
    IPPROTO_TCP,
    IPPROTO_UDP,
    ConntrackSocket,
    CtEntry,
)
from proxy.dataplane.common.netlink_constants import (
    IPS_ASSURED,
    IPS_CONFIRMED,
    IPS_DST_NAT,
    IPS_SEEN_REPLY,
)
from proxy.model.types import Family
from proxy.netns_lab import netns
from proxy.netns_lab.netns import entered

pytestmark = pytest.mark.root

DNAT = IPS_DST_NAT | IPS_SEEN_REPLY | IPS_ASSURED


@pytest.fixture
def ns() -> Iterator[str]:
    with netns.scratch("sp-ctnl") as name:
        yield name


@pytest.fixture
def sock(ns: str) -> Iterator[ConntrackSocket]:
    with entered(ns):
        s = ConntrackSocket()
    try:
        yield s
    finally:
        s.close()


def flow(family: Family, n: int, protocol: int = IPPROTO_UDP, dnat: bool = True,
         **kw: object) -> CtEntry:
    """Client n to the service at .200:53, answered by endpoint .100:5353 when DNATed,
    else by the service itself."""
    net = "198.18.0." if family is Family.V4 else "fd00:18::"
    dst = ip_address(f"{net}200")
    e = CtEntry(family, protocol, ip_address(f"{net}{n}"), 40000 + n, dst, 53,
                ip_address(f"{net}100") if dnat else dst, 5353 if dnat else 53,
                DNAT if dnat else 0)
    return replace(e, **kw) if kw else e  # type: ignore[arg-type]


def key(e: CtEntry) -> tuple[object, ...]:
    """What the kernel keeps of what we asked for (it adds the id and its own status bits)."""
    return (e.family, e.protocol, e.src, e.sport, e.dst, e.dport, e.reply_src, e.reply_sport,
            e.dnat, e.zone)


def conntrack_tool(ns: str, family: Family) -> set[tuple[str, ...]]:
    """(protocol, src, sport, dst, dport, reply src, reply sport, id) per entry, as
    `conntrack -L` prints them."""
    out = subprocess.run(["ip", "netns", "exec", ns, "conntrack", "-L", "-f",
                          "ipv4" if family is Family.V4 else "ipv6", "-o", "id"],
                         capture_output=True, text=True, check=True, timeout=30).stdout
    rows: set[tuple[str, ...]] = set()
    for line in out.splitlines():
        src, dst = re.findall(r"\bsrc=(\S+)", line), re.findall(r"\bdst=(\S+)", line)
        sport, dport = re.findall(r"\bsport=(\d+)", line), re.findall(r"\bdport=(\d+)", line)
        ct_id = re.search(r"\bid=(\d+)", line)
        assert ct_id, line
        rows.add((line.split()[0], src[0], sport[0], dst[0], dport[0], src[1], sport[1],
                  ct_id.group(1)))
    return rows


def tool_rows(entries: list[CtEntry]) -> set[tuple[str, ...]]:
    names = {IPPROTO_UDP: "udp", IPPROTO_TCP: "tcp", IPPROTO_SCTP: "sctp"}
    return {(names[e.protocol], str(e.src), str(e.sport), str(e.dst), str(e.dport),
             str(e.reply_src), str(e.reply_sport), str(e.ct_id)) for e in entries}


@pytest.mark.parametrize("family", [Family.V4, Family.V6])
def test_create_dump_delete_by_id(ns: str, sock: ConntrackSocket, family: Family) -> None:
    made = [flow(family, n) for n in range(1, 6)] + [flow(family, 6, dnat=False)]
    tcp = flow(family, 7, IPPROTO_TCP)
    assert sock.create([*made, tcp]) == [0] * 7
    assert sock.create(made[:1]) == [errno.EEXIST]
    for kernel_filter in (True, False):
        sock.kernel_filter = kernel_filter
        dumped = sorted(sock.dump(family, (IPPROTO_UDP,)), key=lambda e: e.sport)
        assert [key(e) for e in dumped] == [key(e) for e in made]
        assert all(e.ct_id and e.status & IPS_CONFIRMED for e in dumped)
    assert [key(e) for e in sock.dump(family, (IPPROTO_TCP,))] == [key(tcp)]
    other = Family.V6 if family is Family.V4 else Family.V4
    assert sock.dump(other, (IPPROTO_UDP, IPPROTO_TCP)) == []
    assert conntrack_tool(ns, family) == tool_rows([*dumped, *sock.dump(family, (6,))])

    assert sock.delete(dumped[:2]) == [0, 0]
    assert sock.delete(dumped[:1]) == [errno.ENOENT]
    left = sock.dump(family, (IPPROTO_UDP,))
    assert sorted(left, key=lambda e: e.sport) == dumped[2:]

    # The tuple reused by a newer flow: the old id no longer deletes it.
    assert sock.create(made[:1]) == [0]
    (newer,) = [e for e in sock.dump(family, (IPPROTO_UDP,)) if e.sport == made[0].sport]
    assert newer.ct_id != dumped[0].ct_id
    assert sock.delete(dumped[:1]) == [errno.ENOENT]
    assert newer in sock.dump(family, (IPPROTO_UDP,))
    assert sock.delete([newer]) == [0]
    assert conntrack_tool(ns, family) == tool_rows(
        [*sock.dump(family, (IPPROTO_UDP,)), *sock.dump(family, (IPPROTO_TCP,))])


@pytest.mark.parametrize("family", [Family.V4, Family.V6])
def test_sctp(ns: str, sock: ConntrackSocket, family: Family) -> None:
    e = flow(family, 1, IPPROTO_SCTP)
    codes = sock.create([e])
    if codes != [0]:  # 6.18 has it built in; a kernel without says so here
        pytest.skip(f"no SCTP conntrack in this kernel: {os.strerror(codes[0])}")
    (dumped,) = sock.dump(family, (IPPROTO_SCTP,))
    assert key(dumped) == key(e)
    assert conntrack_tool(ns, family) == tool_rows([dumped])
    assert sock.dump(family, (IPPROTO_UDP,)) == []
    assert sock.delete([dumped]) == [0]
    assert sock.dump(family, (IPPROTO_SCTP, IPPROTO_UDP)) == []


def test_status_the_kernel_takes(sock: ConntrackSocket) -> None:
    """Only SEEN_REPLY and ASSURED are asked for, with the CONFIRMED the kernel requires
    (create_body masks the rest): DST_NAT comes from the kernel's own NAT setup."""
    plain = flow(Family.V4, 1, dnat=False, status=IPS_SEEN_REPLY)
    assert sock.create([plain, flow(Family.V4, 2)]) == [0, 0]
    by_port = {e.sport: e.status for e in sock.dump(Family.V4, (IPPROTO_UDP,))}
    assert by_port[plain.sport] & (IPS_SEEN_REPLY | IPS_CONFIRMED | IPS_ASSURED | IPS_DST_NAT) \
        == IPS_SEEN_REPLY | IPS_CONFIRMED
    assert by_port[40002] & DNAT == DNAT
