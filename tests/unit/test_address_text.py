"""Addresses as every renderer spells them (naming.address_text): exactly what
ipaddress writes, which the fake kernels, the read-back of our sets and nft's own
listing agree with, however many zero groups an address has and where; an IPv4 address
inside an IPv6 one as ipaddress writes it, not dotted as the C library would."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

from hypothesis import given
from hypothesis import strategies as st

from proxy.dataplane.common.naming import address_text

# Groups drawn mostly from 0 and ffff: runs of zeros of every length and position, and
# the IPv4-embedding prefixes.
GROUPS = st.lists(st.sampled_from([0, 0, 0, 1, 0xFFFF, 0x1234]) | st.integers(0, 0xFFFF),
                  min_size=8, max_size=8)


@given(GROUPS)
def test_an_ipv6_address_is_spelled_as_ipaddress_spells_it(groups: list[int]) -> None:
    ip = IPv6Address(int("".join(f"{g:04x}" for g in groups), 16))
    assert address_text(ip) == str(ip)


@given(st.integers(0, 2**32 - 1))
def test_an_ipv4_address_is_spelled_as_ipaddress_spells_it(n: int) -> None:
    assert address_text(IPv4Address(n)) == str(IPv4Address(n))


def test_an_ipv4_address_inside_an_ipv6_one_is_not_dotted() -> None:
    for text in ("::ffff:198.18.0.1", "::198.18.0.1", "::1", "::", "fd00::ffff:0:1"):
        ip = IPv6Address(text)
        assert address_text(ip) == str(ip)
        assert "." not in address_text(ip)
