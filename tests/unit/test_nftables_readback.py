"""Elements read back (readback.py): a dumped message, laid out as the kernel dumps a
set's elements, decodes into the keys and values the renderer wrote, by stride for a
set and one by one for a map; what does not fit the declared types is Unreadable. The
kernel's own dumps: tests/e2e/test_nftables_restart_kernel.py."""

from __future__ import annotations

import pytest

from proxy.dataplane.common.netlink import nested, nfgen, nla_string
from proxy.dataplane.common.netlink_constants import (
    NFPROTO,
    NFTA_SET_ELEM_LIST_ELEMENTS,
    NFTA_SET_ELEM_LIST_SET,
    NFTA_SET_ELEM_LIST_TABLE,
)
from proxy.dataplane.nftables import readback, wire
from proxy.dataplane.nftables.objects import Key, Value, Verdict
from proxy.model.types import Family


def message(family: Family, items: list[tuple[Key, Value]]) -> bytes:
    """One dumped message's body holding `items`, as the kernel lays it out."""
    return (nfgen(NFPROTO[family]) + nla_string(NFTA_SET_ELEM_LIST_TABLE, "sliceproxy")
            + nla_string(NFTA_SET_ELEM_LIST_SET, "s")
            + nested(NFTA_SET_ELEM_LIST_ELEMENTS,
                     b"".join(wire._element(family, k, v) for k, v in items)))


HAIRPIN = [(("198.18.1.1", "198.18.1.1"), ()), (("198.18.1.2", "198.18.1.2"), ())]
DISPATCH = [(("fd00::1", "tcp", 80), Verdict("goto", "svc-1")),
            (("fd00::2", "udp", 53), Verdict("drop"))]


def test_a_sets_keys_read_by_stride_are_the_bytes_the_encoder_writes() -> None:
    body = message(Family.V4, HAIRPIN)
    keys = readback.set_keys(body, 0, len(body), 8)
    assert keys == wire.element_keys(Family.V4, [k for k, _ in HAIRPIN])
    held = readback.read_held([(body, 0, len(body))], Family.V4, ("ipv4_addr",) * 2, False)
    assert held.raw == set(keys) and not held.decoded
    assert [readback.key_parts(Family.V4, ("ipv4_addr",) * 2, k) for k in keys] == [
        k for k, _ in HAIRPIN]


def test_a_maps_elements_decode_into_keys_and_verdicts() -> None:
    body = message(Family.V6, DISPATCH)
    types = ("ipv6_addr", "inet_proto", "inet_service")
    held = readback.read_held([(body, 0, len(body))], Family.V6, types, True)
    assert held.decoded == dict(DISPATCH) and not held.raw


def test_what_is_not_laid_out_as_declared_is_not_guessed() -> None:
    body = message(Family.V4, HAIRPIN)
    # Keys of another length than the declaration's: not by stride, and Unreadable.
    assert readback.set_keys(body, 0, len(body), 4) is None
    with pytest.raises(readback.Unreadable):
        readback.read_held([(body, 0, len(body))], Family.V4, ("ipv4_addr",), False)
    with pytest.raises(readback.Unreadable):
        readback.key_length(("ether_addr",))


PICKS = {Family.V4: [(("198.18.128.1", 80, i), (f"198.18.1.{i}", 8080)) for i in range(3)],
         Family.V6: [(("fd00::1", 80, i), (f"fd00:1::{i + 1}", 8080)) for i in range(3)]}


@pytest.mark.parametrize("family", [Family.V4, Family.V6])
def test_a_pick_maps_elements_read_by_stride_are_those_read_one_by_one(
        family: Family) -> None:
    addr = "ipv4_addr" if family is Family.V4 else "ipv6_addr"
    body = message(family, PICKS[family])
    items = readback.map_items(body, 0, len(body))
    assert items is not None and len(items) == 3
    assert items == [(k, v) for k, v in readback.decode_elements(body, 0, len(body))]
    held = readback.read_held([(body, 0, len(body))], family,
                              (addr, "inet_service", "integer"), True)
    assert held.decoded == dict(PICKS[family]) and not held.raw


def test_a_map_not_laid_out_alike_is_read_one_by_one() -> None:
    # An element with a verdict among data values: not the first one's layout.
    mixed = message(Family.V4, [*PICKS[Family.V4][:2], (("198.18.128.2", 80, 0),
                                                         Verdict("goto", "c"))])
    assert readback.map_items(mixed, 0, len(mixed)) is None
    # Verdicts (a dispatch map's) and sets' elements: never by this stride.
    for body in (message(Family.V6, DISPATCH), message(Family.V4, HAIRPIN)):
        assert readback.map_items(body, 0, len(body)) is None
