"""Reading our named counters (proxy/dataplane/nftables/counters.py) against the real
kernel, in a namespace of the test's own: a commit between a dump's messages makes the
kernel skip counters that still exist (deleting objects before the dump's place moves
the rest back), which is why a traffic reading asks for each counter by name; those
gets, many to a datagram, answer each one asked for in its place."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator

import pytest

from proxy.dataplane.common.netlink import GET_BATCH, NetlinkError, NetlinkSocket
from proxy.dataplane.common.netlink_constants import NETLINK_NETFILTER
from proxy.dataplane.nftables.counters import read_counters, read_named
from proxy.model.types import Family
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

TABLE = "sliceproxy-7"
COUNTERS = 3_000  # many datagrams of a dump
DELETED = 100  # the first ones, deleted once the dump's first datagram is read


def _nft(lines: list[str]) -> None:
    subprocess.run(["nft", "-f", "-"], input="\n".join(lines), text=True, check=True,
                   capture_output=True)


def _packets(i: int) -> int:
    return i % 7 + 1


class _CommitDuringDump(NetlinkSocket):
    """A socket whose dumps see one commit (the first DELETED counters deleted) after the
    first datagram was read: what a sync on the data plane's thread does to a reading."""

    def dump_messages(self, kind: int, body: bytes) -> Iterator[tuple[bytes, int, int]]:
        first: bytes | None = None
        committed = False
        for message in super().dump_messages(kind, body):
            if first is None:
                first = message[0]
            elif message[0] is not first and not committed:
                _nft([f"delete counter ip {TABLE} c{i}" for i in range(DELETED)])
                committed = True
            yield message
        assert committed, "the dump took more than one datagram"


@pytest.fixture
def sock() -> Iterator[NetlinkSocket]:
    with Lab([], ipv6=False) as lab, entered(lab.node_ns):
        _nft([f"add table ip {TABLE}"]
             + [f"add counter ip {TABLE} c{i} {{ packets {_packets(i)} bytes 1 }}"
                for i in range(COUNTERS)])
        s = _CommitDuringDump(NETLINK_NETFILTER)
        try:
            yield s
        finally:
            s.close()


SURVIVING = {(TABLE, f"c{i}"): _packets(i) for i in range(DELETED, COUNTERS)}


def test_a_commit_during_the_dump_makes_the_kernel_skip_counters(sock: NetlinkSocket) -> None:
    found = read_counters(sock, Family.V4, (TABLE,))  # the commit lands after its first datagram
    skipped = SURVIVING.keys() - found.keys()
    assert skipped, "the kernel skipped none: a reading would need no gets by name"


def test_a_reading_by_name_answers_each_counter_in_its_place(sock: NetlinkSocket) -> None:
    _nft([f"delete counter ip {TABLE} c{i}" for i in range(DELETED)])
    keys = [(TABLE, "never"), *reversed(SURVIVING), (TABLE, "c0"), ("no-such-table", "c200")]
    assert len(keys) > 10 * GET_BATCH  # many datagrams of gets
    found = read_named(sock, Family.V4, keys)
    assert found == [None, *reversed(SURVIVING.values()), None, None]


def test_a_refused_get_is_an_error_and_the_socket_reads_on(sock: NetlinkSocket) -> None:
    with pytest.raises(NetlinkError) as refused:  # a table's name past the kernel's limit
        read_named(sock, Family.V4, [(TABLE, "c1"), ("t" * 300, "c1"), (TABLE, "c2")])
    assert refused.value.code != errno.ENOENT
    assert read_named(sock, Family.V4, [(TABLE, "c3")]) == [_packets(3)]
