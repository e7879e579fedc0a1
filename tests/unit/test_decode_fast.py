"""The decoder's fast path for plain endpoints (decode.py, "the common case, fast") decodes
exactly what the full decoder does, records included: every object is decoded twice,
once as shipped and once with the fast path turned off, and the two must be equal."""

from __future__ import annotations

import dataclasses
from ipaddress import IPv6Address
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.kube import decode
from proxy.kube.decode import _NotPlain, decode_endpoint_slice, decode_endpoints
from proxy.model.types import Endpoint

# Values each field may take: the plain ones and every way one can be out of the ordinary.
ADDRESSES = ["198.19.0.1", "10.1.2.3", "0.0.0.0", "127.0.0.1", "169.254.1.1", "224.0.0.1",
             "255.255.255.255", "010.1.2.3", "1.2.3.4%eth0", "fd00::1", "::ffff:1.2.3.4",
             " 1.2.3.4", "1.2.3", "", "1.2.3.4\x00", 5, None, ["1.2.3.4"]]
ADDRESSES_V6 = ["fd00:19::1", "fd00::a:2", "::", "::1", "fe80::1", "ff02::1", "::ffff:1.2.3.4",
                "::1.2.3.4", "FD00::1", "fd00:0019:0000:0000:0000:0000:0000:0001",
                "fd00::1%eth0", "fd00::1 ", "198.19.0.1", "fd00::g", 6, None]
BOOLS = [True, False, None, "true", 1]
NAMES = ["node-1", "node-a.example", None, "", "Node_1", "x" * 300, 7, {"a": 1}]
ZONES = ["zone-a", None, "", "zone a", 3]


def _mostly_plain(plain: list[Any], odd: list[Any]) -> st.SearchStrategy[Any]:
    """A plain value three times in four: most endpoints must take the fast path."""
    return st.one_of(st.sampled_from(plain), st.sampled_from(plain), st.sampled_from(plain),
                     st.sampled_from(odd))


def _endpoint(draw: st.DrawFn, beta: bool, addresses: list[Any]) -> Any:
    if draw(st.integers(0, 30)) == 0:
        return draw(st.sampled_from([None, "x", [], 4]))
    ep: dict[str, Any] = {}
    if draw(st.integers(0, 20)):
        ep["addresses"] = draw(st.lists(_mostly_plain(addresses[:2], addresses),
                                        min_size=0, max_size=2))
    else:
        ep["addresses"] = draw(st.sampled_from([None, "1.2.3.4", {}]))
    conditions = draw(st.sampled_from(["absent", "none", "dict", "dict", "dict", "list"]))
    if conditions == "none":
        ep["conditions"] = None
    elif conditions == "list":
        ep["conditions"] = []
    elif conditions == "dict":
        values = _mostly_plain([True, False, "absent"], BOOLS)
        ep["conditions"] = {k: v for k in ("ready", "serving", "terminating")
                            if (v := draw(values)) != "absent"}
    if draw(st.booleans()):
        ep["nodeName"] = draw(_mostly_plain(NAMES[:2], NAMES))
    if beta and draw(st.booleans()):
        ep["topology"] = draw(st.sampled_from([
            None, [], {}, {"kubernetes.io/hostname": draw(_mostly_plain(NAMES[:2], NAMES))},
            {"topology.kubernetes.io/zone": draw(_mostly_plain(ZONES[:1], ZONES)),
             "kubernetes.io/hostname": draw(_mostly_plain(NAMES[:2], NAMES))}]))
    if not beta and draw(st.booleans()):
        ep["zone"] = draw(_mostly_plain(ZONES[:1], ZONES))
    if draw(st.integers(0, 5)) == 0:
        ep["hints"] = draw(st.sampled_from([None, {}, {"forZones": [{"name": "zone-a"}]}]))
    ep["targetRef"] = {"kind": "Pod", "name": "p"}
    return ep


@st.composite
def slices(draw: st.DrawFn) -> dict[str, Any]:
    beta = draw(st.booleans())
    address_type = draw(st.sampled_from(["IPv4", "IPv6"]))
    addresses = ADDRESSES if address_type == "IPv4" else ADDRESSES_V6
    return {"apiVersion": "discovery.k8s.io/v1beta1" if beta else "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {"name": "s-1", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "s"}},
            "addressType": address_type,
            "ports": [{"name": "http", "port": 80, "protocol": "TCP"}],
            "endpoints": [_endpoint(draw, beta, addresses)
                          for _ in range(draw(st.integers(0, 6)))]}


@st.composite
def endpoints_objects(draw: st.DrawFn) -> dict[str, Any]:
    def address() -> Any:
        if draw(st.integers(0, 30)) == 0:
            return draw(st.sampled_from([None, "1.2.3.4", []]))
        raw: dict[str, Any] = {"ip": draw(_mostly_plain(
            ADDRESSES[:2] + ADDRESSES_V6[:2], ADDRESSES + ADDRESSES_V6))}
        if draw(st.booleans()):
            raw["nodeName"] = draw(_mostly_plain(NAMES[:2], NAMES))
        raw["targetRef"] = {"kind": "Pod", "name": "p"}
        return raw

    subsets = [{"addresses": [address() for _ in range(draw(st.integers(0, 4)))],
                "notReadyAddresses": [address() for _ in range(draw(st.integers(0, 2)))],
                "ports": [{"name": "http", "port": 80}]}
               for _ in range(draw(st.integers(0, 2)))]
    return {"apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": "s", "namespace": "default"}, "subsets": subsets}


def _both(decoder: Any, obj: dict[str, Any]) -> tuple[Any, Any]:
    fast = decoder(obj)
    with pytest.MonkeyPatch.context() as mp:
        def never(*_: Any) -> Endpoint:
            raise _NotPlain

        mp.setattr(decode, "_plain_slice_endpoint", never)
        mp.setattr(decode, "_plain_address", never)
        full = decoder(obj)
    return fast, full


@settings(max_examples=400, deadline=None)
@given(slices())
def test_slices_decode_the_same_with_and_without_the_fast_path(obj: dict[str, Any]) -> None:
    fast, full = _both(decode_endpoint_slice, obj)
    assert fast == full


@settings(max_examples=300, deadline=None)
@given(endpoints_objects())
def test_endpoints_decode_the_same_with_and_without_the_fast_path(obj: dict[str, Any]) -> None:
    fast, full = _both(decode_endpoints, obj)
    assert fast == full


@pytest.mark.parametrize(("address_type", "value"), [
    *(("IPv4", a) for a in ADDRESSES), *(("IPv6", a) for a in ADDRESSES_V6)])
def test_each_address_decodes_the_same_with_and_without_the_fast_path(
        address_type: str, value: Any) -> None:
    # Every odd address once, in an otherwise plain endpoint (the drawn slices above
    # may miss one).
    obj = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
           "metadata": {"name": "s-1", "namespace": "default",
                        "labels": {"kubernetes.io/service-name": "s"}},
           "addressType": address_type, "ports": [],
           "endpoints": [{"addresses": [value], "conditions": {"ready": True},
                          "nodeName": "node-1"}]}
    fast, full = _both(decode_endpoint_slice, obj)
    assert fast == full
    legacy = {"apiVersion": "v1", "kind": "Endpoints",
              "metadata": {"name": "s", "namespace": "default"},
              "subsets": [{"addresses": [{"ip": value, "nodeName": "node-1"}],
                           "ports": [{"name": "http", "port": 80}]}]}
    fast, full = _both(decode_endpoints, legacy)
    assert fast == full


def test_the_fast_path_takes_plain_endpoints_and_builds_every_field() -> None:
    raw = {"addresses": ["198.19.0.1"], "conditions": {"ready": False, "serving": True,
                                                      "terminating": True},
           "nodeName": "node-1", "zone": "zone-a", "targetRef": {"kind": "Pod"}}
    got = decode._plain_slice_endpoint(raw, False, v4=True)
    # Positional construction in the fast path: each field lands where its name says.
    assert dataclasses.asdict(got) == dataclasses.asdict(Endpoint(
        address=got.address, ready=False, serving=True, terminating=True,
        node_name="node-1", zone="zone-a"))
    assert str(got.address) == "198.19.0.1"
    raw["addresses"] = ["fd00:19::1"]
    assert decode._plain_slice_endpoint(raw, False, v4=False).address == IPv6Address("fd00:19::1")
    for odd in ("fd00::1%eth0", "::ffff:1.2.3.4", "fe80::1", "198.19.0.1"):
        raw["addresses"] = [odd]
        with pytest.raises(_NotPlain):
            decode._plain_slice_endpoint(raw, False, v4=False)
    address = decode._plain_address({"ip": "198.19.0.2", "nodeName": "n"}, False)
    assert (address.ready, address.serving, address.terminating, address.node_name) == (
        False, False, False, "n")
    assert decode._plain_address({"ip": "fd00:19::2"}, True).address == IPv6Address(
        "fd00:19::2")


def _address_texts() -> st.SearchStrategy[str]:
    """Addresses as the API may write them: canonical, exploded, upper case, IPv4 in
    IPv6 (mapped and not), and text near them."""
    v6 = st.ip_addresses(v=6)
    return st.one_of(
        st.ip_addresses().map(str), v6.map(lambda a: a.exploded), v6.map(lambda a: str(a).upper()),
        st.ip_addresses(v=4).map(lambda a: f"::ffff:{a}"),
        st.ip_addresses(v=4).map(lambda a: f"::{a}"),
        st.text(alphabet="0123456789abcdefABCDEF:.%x \x00é", max_size=45))


@settings(max_examples=3000, deadline=None)
@given(_address_texts())
def test_an_address_is_read_as_the_general_reading_reads_it(value: str) -> None:
    assert decode._parse(value) == decode._parse_general(value)
