"""A full sync's netlink batch is the very bytes it was before the encoder's fast paths
(wire.py, expressions.py): a large, varied cluster is rendered, encoded as the data plane
encodes it (from the script's statements, transaction.Script), and its batch compared
with the digest the encoder gave before them, with the batch of the script's text
parsed line by line, and with the generic parse of every rule (`rule_expressions` on
the rule's tokens), byte for byte."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterable
from ipaddress import ip_address, ip_network
from typing import Any

import pytest

from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.nftables import wire
from proxy.dataplane.nftables.expressions import (
    Unencodable,
    comment,
    encode_rules,
    rule_expressions,
)
from proxy.dataplane.nftables.render import (
    SLOT_MAP_MIN,
    our_tables,
    render_base,
    render_port,
    render_shard,
    shard_table,
    shards_for,
)
from proxy.dataplane.nftables.transaction import Script, full_lines
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family
from tests.unit.builders import NODE, ep, eps_slice, service
from tests.unit.test_iptables_sync import Cluster

SERVICES = 400
PROTOCOLS = ("TCP", "UDP", "SCTP")
CONTEXTS = {
    Family.V4: RenderContext(Family.V4, local_cidrs=(ip_network("198.18.0.0/17"),)),
    Family.V6: RenderContext(Family.V6, local_cidrs=(ip_network("fd00:1::/64"),),
                             nodeport_ips=(ip_address("fd00::1"),), traffic_per_endpoint=True),
}
# sha256 of each family's batch for `varied_state()`, as the encoder made it before its
# fast paths (commit 31186f7: every line parsed back in full); recorded again when the
# renderer began to count connections, when each port wrote its fingerprint, when
# each table held its own, when cluster-IP ports were picked by their shard's chains,
# and when a picked port's fingerprint spelled its pick maps as `picked`, with the
# generic parse of every line giving the same bytes
# (test_a_full_batch_is_the_bytes_of_the_generic_parse).
RECORDED = {
    Family.V4: "5ddbf895a9c04a6ce2bca39dcec63470562c1774beed55948c816177950396d8",
    Family.V6: "d0738eea7b3851a2f6a715b2845ef79293f61ad3b25948d4357ca7d103dd5523",
}


def _address(family: str, i: int) -> str:
    return f"198.19.{i // 250}.{i % 250 + 1}" if family == "IPv4" else f"fd00:19::{i + 1:x}"


def _service_objects(rng: random.Random, index: int) -> list[dict[str, Any]]:
    """One service of every kind, policy and family in turn; some ports with more
    endpoints than SLOT_MAP_MIN (a slot map), some with none."""
    name = f"s{index}"
    families = (("IPv4",), ("IPv6",), ("IPv4", "IPv6"))[index % 3]
    kind = ("ClusterIP", "NodePort", "LoadBalancer")[index // 3 % 3]
    ips = tuple(f"198.18.{128 + index // 250}.{index % 250 + 1}" if f == "IPv4"
                else f"fd00:198:18::{index + 1:x}" for f in families)
    ports = []
    for k in range(1 + index % 2):
        port: dict[str, Any] = {"name": f"p{k}", "port": 80 + k,
                                "protocol": PROTOCOLS[(index + k) % 3]}
        if kind != "ClusterIP":
            port["nodePort"] = 30000 + index * 2 + k
        ports.append(port)
    spec: dict[str, Any] = {"type": kind, "ipFamilies": list(families),
                            "internalTrafficPolicy": rng.choice(["Cluster", "Local"])}
    if index % 5 == 0:
        spec["externalIPs"] = [f"198.18.0.{50 + index % 7}", f"fd00:18::{50 + index % 7:x}"]
    if index % 7 == 0:
        spec["sessionAffinity"] = "ClientIP"
    if kind != "ClusterIP":
        spec["externalTrafficPolicy"] = rng.choice(["Cluster", "Local"])
    if kind == "LoadBalancer" and index % 2:
        spec["loadBalancerSourceRanges"] = ["198.18.0.0/24", "fd00:18::/64"]
    obj = service(name, ips=ips, ports=tuple(ports), **spec)
    if kind == "LoadBalancer":
        obj["status"] = {"loadBalancer": {"ingress": [
            {"ip": f"198.18.2.{index % 250 + 1}"}, {"ip": f"fd00:2::{index + 1:x}"}]}}
    out = [obj]
    for family in families:
        count = (0, 1, 3, 10, SLOT_MAP_MIN - 1, SLOT_MAP_MIN + 20)[rng.randrange(6)
                                                                   if index % 11 else 5]
        eps = [ep(_address(family, index * 7 + j), node=rng.choice([NODE, "node-b"]),
                  ready=rng.random() > 0.1, serving=True, terminating=rng.random() < 0.05)
               for j in range(count)]
        out.append(eps_slice(f"{name}-{family.lower()}", eps, service_name=name,
                             address_type=family,
                             ports=tuple({"name": p["name"], "port": 8000 + k,
                                          "protocol": p["protocol"]}
                                         for k, p in enumerate(ports))))
    return out


def varied_state() -> DesiredState:
    rng = random.Random(29)
    objects = [o for i in range(SERVICES) for o in _service_objects(rng, i)]
    return Cluster().become(objects)


def full_script(state: DesiredState, family: Family) -> Script:
    ctx = CONTEXTS[family]
    ports = {k: v for k, v in state.ports.items() if k.family is family}
    shards = shards_for(len(ports))
    bases = [render_base(ctx), *(render_shard(ctx, shard_table(i)) for i in range(shards))]
    script, _ = full_lines(bases, {k: render_port(v, ctx, shards) for k, v in ports.items()},
                           [("sliceproxy", "gone")], {("sliceproxy-0", "old"): "map"})
    return script


def full_batch(state: DesiredState, family: Family) -> wire.Batch:
    """As the data plane encodes a full sync: the script's statements, most of them
    standing for many lines (wire.Rules), which are never spelled."""
    return wire.encode(full_script(state, family).statements(), family, our_tables(), 1000)


def text_batch(state: DesiredState, family: Family) -> wire.Batch:
    """The script's text, each line parsed back."""
    return wire.encode(full_script(state, family).lines(), family, our_tables(), 1000)


@pytest.fixture(scope="module")
def state() -> DesiredState:
    return varied_state()


@pytest.mark.parametrize("family", [Family.V4, Family.V6], ids=["ipv4", "ipv6"])
def test_a_full_batch_is_the_bytes_recorded_before_the_fast_paths(
        state: DesiredState, family: Family) -> None:
    assert hashlib.sha256(full_batch(state, family).data).hexdigest() == RECORDED[family]


@pytest.mark.parametrize("family", [Family.V4, Family.V6], ids=["ipv4", "ipv6"])
def test_a_full_batch_is_the_batch_of_its_lines(state: DesiredState, family: Family) -> None:
    """Every statement encodes as the lines it stands for, and each message maps back
    to its line's number (an error names the line, `Script.line`)."""
    fast, text = full_batch(state, family), text_batch(state, family)
    assert fast.data == text.data
    assert fast.numbers == text.numbers == list(range(1, fast.count + 1))


def _generic_rule(family: Family, body: str) -> bytes:
    return rule_expressions(family, body.split())


def _generic_rules(family: Family, texts: Iterable[str]) -> list[bytes]:
    """`encode_rules` without its shortcuts: each rule's tokens parsed whole."""
    out = []
    for text in texts:
        body, mark, note = text.partition(' comment "')
        assert not mark or (note.endswith('"') and '"' not in note[:-1])
        out.append(_generic_rule(family, body) + (comment(note[:-1]) if mark else b""))
    return out


@pytest.mark.parametrize("family", [Family.V4, Family.V6], ids=["ipv4", "ipv6"])
def test_a_full_batch_is_the_bytes_of_the_generic_parse(
        state: DesiredState, family: Family, monkeypatch: pytest.MonkeyPatch) -> None:
    fast = full_batch(state, family).data
    monkeypatch.setattr(wire, "encode_rules", _generic_rules)
    assert fast == text_batch(state, family).data


def test_the_state_is_varied(state: DesiredState) -> None:
    """What the digests cover: every shape the renderer makes."""
    text = "\n".join(line for family in (Family.V4, Family.V6)
                     for line in full_script(state, family).lines())
    for shape in ("dnat ip to numgen", "dnat ip6 to numgen", "dnat to [fd00:19::",
                  "dnat to 198.19.", "update @", "reject", "fib daddr type local",
                  "masquerade", "meta mark set", "sctp", "udp", "goto fw-", "goto svl-",
                  "jump mark-for-masquerade"):
        assert shape in text, shape


@pytest.mark.parametrize("body", [
    "meta l4proto tcp dnat to 198.19.0.1:8080 drop",
    "dnat to 198.19.0.1:8080 dnat to 198.19.0.2:8080",
    "meta l4proto tcp dnat to 198.19.0.1",
    "meta l4proto tcp dnat to 198.19.0.1:99999",
    "numgen random mod 2 dnat to 198.19.0.1:80",
    "jump x dnat to 198.19.0.1:80",
    "meta l4proto tcp  dnat to [fd00::1]:80",
    "ip daddr 198.18.0.1 drop accept",
    "ip daddr 198.18.0.1 jump x tcp dport 80",
    "ip daddr 198.18.0.1/33 drop",
    "ip daddr fd00::1 drop",
    "ip6 daddr fd00::1 drop",
    "ip daddr 198.18.0.1 ip saddr",
])
def test_what_the_generic_parse_refuses_the_fast_path_refuses(body: str) -> None:
    with pytest.raises(Unencodable):
        _generic_rule(Family.V4, body)
    with pytest.raises(Unencodable):
        encode_rules(Family.V4, [body])
    with pytest.raises(Unencodable):  # with a comment, and after a rule it encodes
        encode_rules(Family.V4, ['dnat to 198.19.0.1:80 comment "a"', body + ' comment "a"'])


@pytest.mark.parametrize("rule", [
    'meta l4proto tcp dnat to 198.19.0.1:8080 comment "a"b"',
    'meta l4proto tcp dnat to 198.19.0.1:8080 comment "a',
    'meta l4proto tcp dnat to 198.19.0.1:8080 comment "a" drop',
])
def test_a_comment_is_one_quoted_text_at_the_end(rule: str) -> None:
    with pytest.raises(Unencodable):
        encode_rules(Family.V4, [rule])


@pytest.mark.parametrize(("family", "body"), [
    (Family.V4, "ip saddr != 198.18.0.0/17 jump mark-for-masquerade"),
    (Family.V4, "ip daddr @cluster-ips goto reject-chain"),
    (Family.V4, "ip daddr . meta l4proto . th dport vmap @unserved"),
    (Family.V4, "ip daddr 198.18.0.0/17 drop"),
    (Family.V6, "ip6 saddr fd00::/64 ip6 daddr != fd00::1 accept"),
    (Family.V6, "dnat to [fd00::1]:80"),
    (Family.V6, "ip6 saddr @aff-1 meta l4proto tcp dnat to [fd00::1]:80"),
])
def test_rules_outside_a_full_sync_are_the_bytes_of_the_generic_parse(family: Family,
                                                                       body: str) -> None:
    assert encode_rules(family, [body]) == [_generic_rule(family, body)]
    labelled = [f'{body} comment "x dnat to 198.19.0.9:1"', f'{body} comment "b:c"']
    assert encode_rules(family, labelled) == _generic_rules(family, labelled)


def test_a_refused_message_names_its_line(state: DesiredState) -> None:
    """The runner turns a refused message's sequence number into its line's number
    (`Batch.line_of`) and the line's text (`Script.line`), which are never held."""
    script = full_script(state, Family.V4)
    lines = list(script.lines())
    assert script.count == len(lines)
    batch = full_batch(state, Family.V4)
    for number in sorted({1, 2, len(lines), *range(1, len(lines), 97)}):
        assert batch.line_of(batch.begin_seq + number) == number
        assert script.line(number) == lines[number - 1]
    assert script.line(0) == script.line(len(lines) + 1) == ""
