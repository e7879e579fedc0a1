"""The netlink encoder of partial nftables scripts (wire.py), without a kernel: every
script a partial sync can produce is inside its dialect (or the fast path would quietly
be the slow one), anything else is refused before a byte is sent, and messages map back
to their lines. That the kernel reads the encoding as nft's is tested in
tests/e2e/test_nftables_wire_kernel.py."""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from ipaddress import ip_address, ip_network
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.common.netlink import replies
from proxy.dataplane.nftables import wire
from proxy.dataplane.nftables.expressions import Unencodable
from proxy.dataplane.nftables.objects import (
    Chain,
    Command,
    Hook,
    Key,
    Map,
    Object,
    Priority,
    Set,
    SlotMap,
    Table,
    Value,
    Verdict,
    named,
)
from proxy.dataplane.nftables.render import (
    TABLE,
    our_tables,
    render_base,
    render_port,
    render_shard,
    shard_table,
)
from proxy.dataplane.nftables.transaction import TableState, full_script, partial_script
from proxy.dataplane.nftables.wire import (
    Chains,
    Elements,
    Rules,
    Statement,
    _address_elements,
    _element,
    _elements,
    _pick_elements,
    encode,
    statement_lines,
)
from proxy.model.types import Family
from tests.unit.test_iptables_sync import Cluster, clusters

CONTEXTS = {
    "one cluster CIDR": RenderContext(Family.V4, local_cidrs=(ip_network("198.18.0.0/17"),)),
    "two cluster CIDRs": RenderContext(Family.V4, local_cidrs=(
        ip_network("198.18.0.0/17"), ip_network("198.19.0.0/24"))),
    "masquerade all": RenderContext(Family.V4, masquerade_all=True,
                                    node_ips=(ip_address("198.18.0.1"),)),
    "nodeport addresses": RenderContext(Family.V4, local_cidrs=(ip_network("198.18.0.0/17"),),
                                        nodeport_ips=(ip_address("198.18.0.1"),)),
}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(context=st.sampled_from(sorted(CONTEXTS)), states=st.lists(clusters(), min_size=2,
                                                                  max_size=3))
def test_every_partial_script_is_inside_the_dialect(context: str,
                                                     states: list[list[dict[str, Any]]]) -> None:
    ctx = CONTEXTS[context]
    cluster = Cluster()
    shards = 4  # ports spread over tables: one transaction may touch several
    table = TableState(Family.V4, (render_base(ctx), *(render_shard(ctx, shard_table(i))
                                                       for i in range(shards))))
    applied: dict[Any, Any] = {}
    for objects in states:
        ports = {k: v for k, v in cluster.become(objects).ports.items()
                 if k.family is Family.V4}
        changed = {k for k in ports.keys() | applied.keys()
                   if ports.get(k) is not applied.get(k)}
        script = partial_script(table, {
            k: render_port(ports[k], ctx, shards) if k in ports else None for k in changed})
        batch = encode(script, Family.V4, our_tables(), 100)
        lines = script.splitlines()
        assert batch.numbers == list(range(1, len(lines) + 1))
        messages = list(replies(batch.data))
        assert len(messages) == len(lines) + 2  # framed by the batch's begin and end
        applied = ports


V6_CONTEXT = RenderContext(Family.V6, local_cidrs=(ip_network("fd00:1::/64"),),
                           nodeport_ips=(ip_address("fd00::1"),))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(context=st.sampled_from([*sorted(CONTEXTS), "ipv6"]), objects=clusters())
def test_every_full_script_is_inside_the_dialect(context: str,
                                                 objects: list[dict[str, Any]]) -> None:
    """Full syncs go through the encoder too (start, resync, repair): every table,
    base chain, map and rule they write, and what they delete of an earlier start."""
    ctx = V6_CONTEXT if context == "ipv6" else CONTEXTS[context]
    shards = 3
    ports = {k: render_port(v, ctx, shards) for k, v in Cluster().become(objects).ports.items()
             if k.family is ctx.family}
    bases = [render_base(ctx), *(render_shard(ctx, shard_table(i)) for i in range(shards))]
    stale = shard_table(shards)  # a shard of an earlier start with more services
    script, _ = full_script(bases, ports, kernel_chains=[(TABLE, "svc-OLD")],
                            kernel_sets={(TABLE, "aff-OLD"): "set"},
                            kernel_tables=[TABLE, stale])
    batch = encode(script, ctx.family, our_tables(), 100)
    lines = script.splitlines()
    assert batch.numbers == list(range(1, len(lines) + 1))
    assert any(line.startswith("add chain") and " hook " in line for line in lines)
    assert f"delete table {'ip' if ctx.family is Family.V4 else 'ip6'} {stale}" in lines


def _whole_messages(piece: bytes | bytearray) -> int:
    """How many netlink messages `piece` holds; fails if its last one is cut."""
    i = count = 0
    while i < len(piece):
        (size,) = struct.unpack_from("=I", piece, i)
        assert size >= 16 and i + size <= len(piece), "a message split between pieces"
        i, count = i + size, count + 1
    return count


def test_a_batch_past_sendmsgs_most_pieces_joins_them_in_pairs(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """sendmsg takes MAX_PIECES pieces (UIO_MAXIOV): a full sync of 100,000 services was
    refused whole (EMSGSIZE) and went to nft. Past it, pieces are joined in pairs, then
    made twice the size: the same bytes, every message whole in one piece."""
    script = "".join(f"add element ip sliceproxy cluster-ips {{ 198.18.{i // 250}.{i % 250} }}\n"
                     for i in range(2000))
    whole = encode(script, Family.V4, (TABLE,), 1)
    monkeypatch.setattr(wire, "PAGE", 1024)
    monkeypatch.setattr(wire, "MAX_PIECES", 8)
    pieced = encode(script, Family.V4, (TABLE,), 1)
    assert len(pieced.pages) <= 8 < len(whole.data) // 1024
    assert pieced.data == whole.data
    assert sum(_whole_messages(p) for p in pieced.pages) == 2000 + 2  # + batch begin, end
    assert pieced.numbers == whole.numbers and pieced.last_seq == whole.last_seq


def test_only_the_last_message_asks_for_an_acknowledgement() -> None:
    script = ("add chain ip sliceproxy a\nadd rule ip sliceproxy a drop\n"
              "add element ip sliceproxy cluster-ips { 198.18.0.1 }\n")
    batch = encode(script, Family.V4, (TABLE,), 7)
    assert batch.begin_seq == 7
    assert batch.numbers == [1, 2, 3] and batch.last_seq == 10
    assert [batch.line_of(s) for s in (7, 8, 10, 11)] == [None, 1, 3, None]
    raw = batch.data
    flags = {}
    i = 0
    while i < len(raw):
        size, _kind, flag, seq, _pid = struct.unpack_from("=IHHII", raw, i)
        flags[seq] = flag
        i += size
    assert [seq for seq, f in flags.items() if f & 0x4] == [10]


@pytest.mark.parametrize("line", [
    "add chain ip sliceproxy nat-prerouting { type nat hook prerouting priority dstnat; }",
    "add chain ip sliceproxy o { type route hook output priority mangle; policy accept; }",
    "add chain ip sliceproxy o { type nat hook output priority dstnat; policy drop; }",
    "add rule ip sliceproxy x ct state established jump y",
    "add rule ip sliceproxy x ct status snat jump y",
    "add rule ip sliceproxy x masquerade random",
    "add rule ip sliceproxy x meta mark set 0x4000",
    "add rule ip sliceproxy x meta mark & 0x4000 != 0 return",
    "add rule ip sliceproxy x ip daddr . tcp dport @s drop",
    "add rule ip sliceproxy x ip daddr . th dport == 1 drop",
    "add rule ip sliceproxy x ip saddr 198.18.0.1/33 drop",
    "add rule ip sliceproxy x ip saddr fd00::1 drop",  # the other family
    "add rule ip sliceproxy x meta l4proto icmp drop",
    "add rule ip sliceproxy x goto y comment \"a\"b\"",
    "add rule ip sliceproxy x drop accept",
    "add rule ip sliceproxy x numgen inc mod 2 0 drop",
    "add rule ip6 sliceproxy x drop",  # another table
    "add rule ip other x drop",
    "add set ip sliceproxy s { type ether_addr; }",
    "add map ip sliceproxy m { type ipv4_addr : ipv4_addr; }",
    "add set ip sliceproxy s { type ipv4_addr . inet_service; flags dynamic,timeout; "
    "timeout 1s; }",
    "add element ip sliceproxy m { 198.18.0.1 . tcp . 80 : queue }",
    "add element ip sliceproxy m { 198.18.0.1 . tcp . 70000 : drop }",
    "delete table ip other",
    "add table inet sliceproxy",
    "add rule ip sliceproxy x",
])
def test_anything_else_is_refused_before_sending(line: str) -> None:
    with pytest.raises(Unencodable):
        encode(line + "\n", Family.V4, our_tables(), 1)


def test_a_blank_line_has_no_message_and_the_lines_after_keep_their_numbers() -> None:
    script = ("\nadd chain ip sliceproxy a\n\nadd rule ip sliceproxy a drop\n\n\n"
              "add set ip sliceproxy s { type ipv4_addr; }\nadd rule ip sliceproxy a accept\n")
    batch = encode(script, Family.V4, (TABLE,), 0)
    assert batch.numbers == [2, 4, 7, 8] and batch.count == 4
    assert [batch.line_of(s) for s in range(6)] == [None, 2, 4, 7, 8, None]
    # A set's id is its line's number.
    assert encode(script.splitlines()[6], Family.V4, (TABLE,), 0).data != \
        encode("\n" * 6 + script.splitlines()[6], Family.V4, (TABLE,), 0).data


def test_statements_are_the_bytes_of_the_lines_they_stand_for() -> None:
    """Objects and the statements that stand for many lines encode to the batch their
    text would, line by line."""
    chains = [Chain("a", ('meta l4proto tcp dnat to 198.19.0.1:80 comment "p"', "drop")),
              Chain("b")]
    hooked = Chain("c", ("jump a",), Hook("nat", "prerouting", Priority("dstnat", 1)))
    declared: list[Object] = [
        Set("s", ("ipv4_addr",)), Set("h", ("ipv4_addr", "ipv4_addr")),
        Set("aff", ("ipv4_addr",), ("dynamic", "timeout"), 10800),
        Map("m", ("ipv4_addr", "inet_proto", "inet_service"), "verdict"),
        SlotMap("slots", Family.V4, "udp"), hooked,
        Chain("d", (), Hook("nat", "output", Priority("", -99)))]
    statements: list[Statement] = [
        Command("add", TABLE, Table(TABLE)),
        Chains([(TABLE, chains), ("sliceproxy-1", chains[:1])]),
        "", *(Command("add", TABLE, o) for o in declared),
        Rules([(TABLE, chains)]), Rules([("sliceproxy-1", chains)], flush=False),
        Elements("add", TABLE, "cluster-ips", [(("198.18.0.1",), ()), (("198.18.0.2",), ())]),
        Elements("delete", TABLE, "unserved", [(("198.18.0.1", "tcp", 80), ())]),
        Elements("add", TABLE, "m", [(("198.18.0.1", "tcp", 80), Verdict("goto", "a")),
                                     (("198.18.0.2", "udp", 53), Verdict("drop"))]),
        Elements("add", TABLE, "slots", [((0,), ("198.19.0.1", 80)), ((1,), ("198.19.0.2", 81))]),
        Command("flush", TABLE, declared[3]), Command("flush", TABLE, hooked),
        Command("delete", TABLE, hooked), Command("delete", TABLE, named("set", "s")),
        Command("delete", "sliceproxy-1", Table("sliceproxy-1"))]
    lines = [line for s in statements for line in statement_lines(s, "ip")]
    assert lines[:5] == ["add table ip sliceproxy", f"add chain ip {TABLE} a",
                         f"add chain ip {TABLE} b", "add chain ip sliceproxy-1 a", ""]
    assert lines[8:11] == [
        f"add map ip {TABLE} m {{ type ipv4_addr . inet_proto . inet_service : verdict; }}",
        f"add map ip {TABLE} slots {{ typeof numgen random mod 1 : ip daddr . udp dport; }}",
        f"add chain ip {TABLE} c {{ type nat hook prerouting priority dstnat + 1; "
        "policy accept; }"]
    assert [line for line in lines if " element " in line] == [
        f"add element ip {TABLE} cluster-ips {{ 198.18.0.1, 198.18.0.2 }}",
        f"delete element ip {TABLE} unserved {{ 198.18.0.1 . tcp . 80 }}",
        f"add element ip {TABLE} m {{ 198.18.0.1 . tcp . 80 : goto a, "
        "198.18.0.2 . udp . 53 : drop }",
        f"add element ip {TABLE} slots {{ 0 : 198.19.0.1 . 80, 1 : 198.19.0.2 . 81 }}"]
    assert lines[-5:] == [f"flush map ip {TABLE} m", f"flush chain ip {TABLE} c",
                          f"delete chain ip {TABLE} c", f"delete set ip {TABLE} s",
                          "delete table ip sliceproxy-1"]
    assert sum(1 if isinstance(s, str) else s.size for s in statements) == len(lines)
    ours = our_tables()
    batch = encode(statements, Family.V4, ours, 5)
    text = encode("\n".join(lines), Family.V4, ours, 5)
    assert (batch.data, batch.numbers) == (text.data, text.numbers)
    with pytest.raises(Unencodable):
        encode([Rules([("other", chains)])], Family.V4, ours, 1)
    with pytest.raises(Unencodable):
        encode([Elements("flush", TABLE, "cluster-ips", [(("198.18.0.1",), ())])], Family.V4,
               ours, 1)


@pytest.mark.parametrize(("family", "items", "bulk"), [
    (Family.V4, [(("198.18.0.1",), ()), (("198.18.0.2",), ())], True),
    (Family.V4, [(("198.18.0.1", "198.18.0.3"), ()), (("198.18.0.2", "198.18.0.4"), ())], True),
    (Family.V6, [(("fd00::1", "fd00::3"), ()), (("fd00::2", "fd00::4"), ())], True),
    (Family.V4, [(("198.18.0.1",), ()), (("198.18.0.1", "198.18.0.2"), ())], False),
    (Family.V4, [(("198.18.0.1", "tcp", 80), ()), (("198.18.0.2", "udp", 53), ())], False),
    (Family.V4, [(("198.18.0.1",), ()), ((7,), ())], False),
    (Family.V4, [(("198.18.0.1",), ()), (("198.18.0.2",), Verdict("drop"))], False),
    (Family.V4, [(("198.18.0.1", "tcp", 80), Verdict("goto", "svc-a")),
                 ((0,), ("198.19.0.1", 80))], False),
    (Family.V6, [(("fd00::1",), ()), (("198.18.0.1",), ())], None),
    (Family.V4, [(("198.18.0.1",), ()), (("198.18.0.1", ""), ())], None),
    (Family.V4, [(("198.18.0.1", "tcp", 70000), Verdict("drop"))], None),
    (Family.V4, [(("198.18.0.1", "tcp", 80), Verdict("goto"))], None),
    (Family.V4, [((0,), Verdict("goto", "ep-a")), ((1,), Verdict("goto", "ep-b"))], False),
    (Family.V4, [((0,), Verdict("drop"))], None),
])
def test_a_set_of_addresses_is_encoded_whole_as_element_by_element(
        family: Family, items: list[tuple[Key, Value]], bulk: bool | None) -> None:
    """The encoder reads a set's addresses in one pass (`_address_elements`); anything
    else element by element. Both ways are the same bytes; None: both refuse."""
    _same_as_element_by_element(_address_elements, family, items, bulk)


@pytest.mark.parametrize(("family", "items", "bulk"), [
    (Family.V4, [(("198.18.128.1", 80, i), (f"198.19.0.{i + 1}", 8080 + i))
                 for i in range(10)], True),
    (Family.V6, [(("fd00:198:18::1", 53, i), (f"fd00:19::{i + 1:x}", 5353))
                 for i in range(3)] + [(("fd00:198:18::2", 65535, 0xFFFFFFFF), ("::", 0))],
     True),
    # Anything else is element by element: a slot map's, a verdict, a set's element.
    (Family.V4, [(("198.18.128.1", 80, 0), Verdict("goto", "ep-a"))], False),
    (Family.V4, [((0,), ("198.19.0.1", 80))], False),
    (Family.V4, [(("198.18.128.1", "tcp", 80), ())], False),
    # Refused either way: a port or slot out of range, an address of the other family.
    (Family.V4, [(("198.18.128.1", 80, 0), ("198.19.0.1", 70000))], None),
    (Family.V4, [(("198.18.128.1", 80, 1 << 32), ("198.19.0.1", 80))], None),
    (Family.V4, [(("198.18.128.1", 80, 0), ("fd00:19::1", 80))], None),
])
def test_pick_map_elements_are_encoded_whole_as_element_by_element(
        family: Family, items: list[tuple[Key, Value]], bulk: bool | None) -> None:
    """A pick map's elements (render._pick) are framed in one pass with their shared
    headers (`_pick_elements`): the same bytes as element by element."""
    _same_as_element_by_element(_pick_elements, family, items, bulk)


def _same_as_element_by_element(
        one_pass: Callable[[Family, Sequence[tuple[Key, Value]]], bytes | None], family: Family,
        items: list[tuple[Key, Value]], bulk: bool | None) -> None:
    """`one_pass` takes `items` (`bulk`) or leaves them to the next way; `_elements`
    gives what element by element gives. None: `one_pass` leaves them, both refuse."""
    if bulk is None:
        assert one_pass(family, items) is None
        with pytest.raises(Unencodable):
            b"".join(_element(family, key, data) for key, data in items)
        with pytest.raises(Unencodable):
            _elements(family, items)
        return
    assert (one_pass(family, items) is not None) is bulk
    assert _elements(family, items) == b"".join(_element(family, key, data)
                                                for key, data in items)
