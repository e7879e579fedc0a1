"""The netlink encoder of partial nftables scripts (proxy/dataplane/nftables/wire.py)
against the real kernel, in a namespace of the test's own: every statement it speaks,
sent once through nft and once encoded, reads back from the kernel as the very same
expressions; a refused batch names its line and changes nothing."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator

import pytest

from proxy.dataplane.common.netlink import NFGEN, NetlinkSocket, Reply, nfgen, nla_string
from proxy.dataplane.common.netlink_constants import (
    NETLINK_NETFILTER,
    NFNL_SUBSYS_NFTABLES,
    NFPROTO,
    NFT_MSG_GETCHAIN,
    NFT_MSG_GETRULE,
    NFT_MSG_GETSET,
    NFTA_ANY_TABLE,
    NFTA_CHAIN_HANDLE,
    NFTA_CHAIN_USE,
    NFTA_RULE_CHAIN,
    NFTA_RULE_EXPRESSIONS,
    NFTA_RULE_USERDATA,
    NFTA_SET_HANDLE,
)
from proxy.dataplane.nftables import wire
from proxy.dataplane.nftables.runner import NftError, NftRunner
from proxy.model.types import Family
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

REF, ENC = "ref", "enc"  # the table nft writes, the table the encoder writes

# What both tables hold before the statements under test (written by nft).
SETUP = {
    Family.V4: """
add map ip {t} service-ips {{ type ipv4_addr . inet_proto . inet_service : verdict; }}
add map ip {t} service-nodeports {{ type inet_proto . inet_service : verdict; }}
add set ip {t} cluster-ips {{ type ipv4_addr; }}
add set ip {t} hairpin {{ type ipv4_addr . ipv4_addr; }}
add set ip {t} aff-old {{ type ipv4_addr; flags dynamic,timeout; timeout 60s; }}
add chain ip {t} target
add chain ip {t} old
add rule ip {t} old goto target
""",
    Family.V6: """
add map ip6 {t} service-ips {{ type ipv6_addr . inet_proto . inet_service : verdict; }}
add map ip6 {t} service-nodeports {{ type inet_proto . inet_service : verdict; }}
add set ip6 {t} hairpin {{ type ipv6_addr . ipv6_addr; }}
add chain ip6 {t} target
""",
}

# Every statement of the dialect, in one transaction (new objects used at once).
STATEMENTS = {
    Family.V4: """
add set ip {t} aff-a {{ type ipv4_addr; flags dynamic,timeout; timeout 10800s; }}
add chain ip {t} svc
add chain ip {t} ep
add rule ip {t} svc ip daddr 198.18.0.1 tcp dport 80 ip saddr != 198.18.128.0/17 jump target
add rule ip {t} svc ip daddr 198.18.0.1 udp dport 53 jump target
add rule ip {t} svc ip daddr 198.18.0.1 sctp dport 9 ip saddr != 198.18.0.0/16 jump target
add rule ip {t} svc ip saddr 198.18.64.0/18 goto ep
add rule ip {t} svc ip saddr 198.0.0.0/8 goto ep
add rule ip {t} svc ip saddr 0.0.0.0/0 goto ep
add rule ip {t} svc ip saddr 198.18.3.3/32 goto ep
add rule ip {t} svc ip saddr 198.18.3.4 goto ep
add rule ip {t} svc fib saddr type local jump target
add rule ip {t} svc fib daddr type local goto ep
add rule ip {t} svc ip saddr @aff-a goto ep
add rule ip {t} svc numgen random mod 3 0 goto ep
add rule ip {t} svc numgen random mod 2 0 meta l4proto tcp dnat to 198.18.1.2:8080 \
comment "ns/web:http"
add counter ip {t} cnt-a
add counter ip {t} cep-a
add rule ip {t} svc counter name "cnt-a"
add rule ip {t} svc numgen random mod 2 0 counter name "cep-a" meta l4proto tcp \
dnat to 198.18.1.5:8080 comment "ns/web:http"
add rule ip {t} svc meta l4proto sctp dnat to 198.18.1.3:9 comment "ns/a-b_c.d:?x"
add rule ip {t} svc meta l4proto udp dnat to 198.18.1.4:53
add rule ip {t} svc drop
add rule ip {t} ep update @aff-a {{ ip saddr }}
add rule ip {t} ep return
add rule ip {t} target accept
add map ip {t} slots-a {{ typeof numgen random mod 1 : ip daddr . tcp dport; }}
add chain ip {t} big
add rule ip {t} big meta l4proto tcp dnat ip to numgen random mod 3 map @slots-a \
comment "ns/big:http"
add element ip {t} slots-a {{ 0 : 198.18.1.2 . 8080, 1 : 198.18.1.3 . 80, \
2 : 198.18.1.4 . 80 }}
add rule ip {t} big meta l4proto tcp numgen random mod 5 < 2 dnat ip to numgen random mod 2 \
map @slots-a comment "ns/big:http"
add rule ip {t} big meta l4proto tcp dnat ip to jhash ip saddr . tcp sport mod 3 \
seed 0x5a175eed map @slots-a comment "ns/maglev:http"
add rule ip {t} big meta l4proto tcp dnat ip to jhash ip saddr mod 3 seed 0x5a175eed \
map @slots-a
add map ip {t} hashv-a {{ typeof numgen random mod 1 : verdict; }}
add rule ip {t} big meta l4proto tcp jhash ip saddr . tcp sport mod 3 seed 0x5a175eed \
vmap @hashv-a comment "ns/maglev-affinity:http"
add rule ip {t} big meta l4proto tcp jhash ip saddr mod 3 seed 0x5a175eed vmap @hashv-a
add element ip {t} hashv-a {{ 0 : goto ep, 1 : goto target, 2 : goto ep }}
add map ip {t} counts-a {{ type ipv4_addr . inet_proto . inet_service : counter; }}
add map ip {t} eps-tcp-2 {{ typeof ip daddr . tcp dport . numgen random mod 1 : \
ip daddr . tcp dport; }}
add map ip {t} eps-udp-2 {{ typeof ip daddr . udp dport . numgen random mod 1 : \
ip daddr . udp dport; }}
add chain ip {t} pick-2
add rule ip {t} pick-2 counter name ip daddr . meta l4proto . th dport map @counts-a
add rule ip {t} pick-2 meta l4proto tcp dnat ip to ip daddr . tcp dport . numgen random mod 2 \
map @eps-tcp-2
add rule ip {t} pick-2 meta l4proto udp dnat ip to ip daddr . udp dport . numgen random mod 2 \
map @eps-udp-2
add element ip {t} counts-a {{ 198.18.0.1 . tcp . 80 : "cnt-a", 198.18.0.2 . udp . 53 : "cep-a" }}
add element ip {t} eps-tcp-2 {{ 198.18.0.1 . 80 . 0 : 198.18.1.2 . 8080, \
198.18.0.1 . 80 . 1 : 198.18.1.3 . 80 }}
add element ip {t} eps-udp-2 {{ 198.18.0.2 . 53 . 0 : 198.18.1.4 . 53 }}
add element ip {t} service-ips {{ 198.18.0.1 . tcp . 80 : goto svc, \
198.18.0.2 . udp . 53 : drop, 198.18.0.3 . sctp . 9 : jump target }}
add element ip {t} service-nodeports {{ tcp . 30080 : goto svc }}
add element ip {t} cluster-ips {{ 198.18.0.1, 198.18.0.2 }}
add element ip {t} hairpin {{ 198.18.1.2 . 198.18.1.2 }}
add chain ip {t} nat-pre {{ type nat hook prerouting priority dstnat; policy accept; }}
add chain ip {t} nat-out {{ type nat hook output priority -100; policy accept; }}
add chain ip {t} np-pre {{ type nat hook prerouting priority dstnat + 1; policy accept; }}
add chain ip {t} post {{ type nat hook postrouting priority srcnat; policy accept; }}
add chain ip {t} filt {{ type filter hook forward priority filter; policy accept; }}
add rule ip {t} nat-pre ip daddr . meta l4proto . th dport vmap @service-ips
add rule ip {t} nat-out jump target
add rule ip {t} np-pre fib daddr type local ip daddr != 127.0.0.0/8 \
meta l4proto . th dport vmap @service-nodeports
add rule ip {t} post ct status dnat ip saddr . ip daddr @hairpin masquerade fully-random
add rule ip {t} post meta mark & 0x00004000 == 0 return
add rule ip {t} post meta mark set meta mark ^ 0x00004000
add rule ip {t} post masquerade fully-random
add rule ip {t} ep meta mark set meta mark | 0x00004000
add rule ip {t} filt ct state new jump target
add rule ip {t} filt ip daddr @cluster-ips goto target
add rule ip {t} target reject
""",
    Family.V6: """
add set ip6 {t} aff-b {{ type ipv6_addr; flags dynamic,timeout; timeout 30s; }}
add chain ip6 {t} svc
add rule ip6 {t} svc ip6 daddr fd00::1 tcp dport 80 ip6 saddr != fd00:1::/64 jump target
add rule ip6 {t} svc ip6 saddr fd00:2::/57 goto target
add rule ip6 {t} svc ip6 saddr @aff-b goto target
add rule ip6 {t} svc update @aff-b {{ ip6 saddr }}
add rule ip6 {t} svc numgen random mod 2 0 meta l4proto tcp dnat to [fd00::5]:8080 \
comment "ns/v6:http"
add rule ip6 {t} svc meta l4proto udp dnat to [fd00::6]:53
add counter ip6 {t} cep-b
add rule ip6 {t} svc counter name "cep-b" meta l4proto udp dnat to [fd00::7]:53
add map ip6 {t} slots-b {{ typeof numgen random mod 1 : ip6 daddr . udp dport; }}
add chain ip6 {t} big
add rule ip6 {t} big meta l4proto udp dnat ip6 to numgen random mod 2 map @slots-b
add rule ip6 {t} big meta l4proto udp numgen random mod 70000 < 65536 \
dnat ip6 to numgen random mod 1 map @slots-b
add rule ip6 {t} big meta l4proto udp dnat ip6 to jhash ip6 saddr . udp sport mod 2 \
seed 0x5a175eed map @slots-b
add map ip6 {t} hashv-b {{ typeof numgen random mod 1 : verdict; }}
add rule ip6 {t} big meta l4proto udp jhash ip6 saddr . udp sport mod 2 seed 0x5a175eed \
vmap @hashv-b
add element ip6 {t} hashv-b {{ 0 : goto target, 1 : goto target }}
add map ip6 {t} counts-b {{ type ipv6_addr . inet_proto . inet_service : counter; }}
add map ip6 {t} eps-sctp-1 {{ typeof ip6 daddr . sctp dport . numgen random mod 1 : \
ip6 daddr . sctp dport; }}
add chain ip6 {t} pick-1
add rule ip6 {t} pick-1 counter name ip6 daddr . meta l4proto . th dport map @counts-b
add rule ip6 {t} pick-1 meta l4proto sctp dnat ip6 to ip6 daddr . sctp dport . \
numgen random mod 1 map @eps-sctp-1
add element ip6 {t} counts-b {{ fd00::1 . sctp . 9 : "cep-b" }}
add element ip6 {t} eps-sctp-1 {{ fd00::1 . 9 . 0 : fd00::5 . 9 }}
add element ip6 {t} slots-b {{ 0 : fd00::5 . 8080, 1 : fd00::6 . 53 }}
add element ip6 {t} service-ips {{ fd00::1 . tcp . 80 : goto svc }}
add element ip6 {t} hairpin {{ fd00::5 . fd00::5 }}
add chain ip6 {t} nat-pre {{ type nat hook prerouting priority dstnat; policy accept; }}
add chain ip6 {t} post {{ type nat hook postrouting priority srcnat; policy accept; }}
add rule ip6 {t} nat-pre ip6 daddr . meta l4proto . th dport vmap @service-ips
add rule ip6 {t} nat-pre fib daddr type local ip6 daddr != ::1 \
meta l4proto . th dport vmap @service-nodeports
add rule ip6 {t} post ct status dnat ip6 saddr . ip6 daddr @hairpin masquerade fully-random
add rule ip6 {t} target reject
""",
}

# Then what a later change does: deletions and flushes.
REMOVALS = {
    Family.V4: """
delete element ip {t} service-ips {{ 198.18.0.2 . udp . 53 }}
delete element ip {t} cluster-ips {{ 198.18.0.2 }}
delete element ip {t} hairpin {{ 198.18.1.2 . 198.18.1.2 }}
flush chain ip {t} svc
add rule ip {t} svc goto ep
flush chain ip {t} old
delete chain ip {t} old
delete set ip {t} aff-old
flush map ip {t} service-nodeports
flush set ip {t} cluster-ips
delete element ip {t} slots-a {{ 2, 0 }}
add counter ip {t} cnt-a
add element ip {t} slots-a {{ 0 : 198.18.1.9 . 80 }}
delete element ip {t} eps-tcp-2 {{ 198.18.0.1 . 80 . 1 }}
delete element ip {t} eps-udp-2 {{ 198.18.0.2 . 53 . 0 }}
add element ip {t} eps-tcp-2 {{ 198.18.0.1 . 80 . 1 : 198.18.1.9 . 80 }}
delete element ip {t} counts-a {{ 198.18.0.2 . udp . 53 }}
flush chain ip {t} big
add rule ip {t} big meta l4proto tcp dnat ip to numgen random mod 2 map @slots-a
""",
    Family.V6: """
delete element ip6 {t} service-ips {{ fd00::1 . tcp . 80 }}
flush chain ip6 {t} svc
delete chain ip6 {t} svc
delete element ip6 {t} counts-b {{ fd00::1 . sctp . 9 }}
flush map ip6 {t} eps-sctp-1
delete counter ip6 {t} cep-b
delete set ip6 {t} aff-b
flush set ip6 {t} hairpin
flush chain ip6 {t} big
delete chain ip6 {t} big
delete map ip6 {t} slots-b
delete map ip6 {t} hashv-b
""",
}


def script(template: str, table: str) -> str:
    return template.format(t=table).replace(" \\\n", " ").lstrip("\n")


@pytest.fixture(scope="module")
def namespaces() -> Iterator[Lab]:
    with Lab([]) as lab:
        yield lab


def nft(ns: str, *args: str, stdin: str | None = None) -> str:
    return subprocess.run(["ip", "netns", "exec", ns, "nft", *args], input=stdin,
                          capture_output=True, text=True, check=True).stdout


# What the kernel says of itself rather than of what it was sent: handles, use counts.
KERNEL_OWN = {NFT_MSG_GETCHAIN: {NFTA_CHAIN_HANDLE, NFTA_CHAIN_USE},
              NFT_MSG_GETSET: {NFTA_SET_HANDLE}}


def _dump(family: Family, kind: int, table: str) -> list[Reply]:
    sock = NetlinkSocket(NETLINK_NETFILTER)
    try:
        body = nfgen(NFPROTO[family]) + nla_string(NFTA_ANY_TABLE, table)
        return sock.dump_raw(NFNL_SUBSYS_NFTABLES << 8 | kind, body)
    finally:
        sock.close()


def kernel_rules(family: Family, table: str) -> list[tuple[bytes, bytes, bytes | None]]:
    """(chain, expressions, user data) of every rule of `table`, as the kernel dumps
    them: its own encoding, so two ways of adding a rule compare byte for byte."""
    return [(a[NFTA_RULE_CHAIN], a[NFTA_RULE_EXPRESSIONS], a.get(NFTA_RULE_USERDATA))
            for a in (r.attrs(NFGEN.size) for r in _dump(family, NFT_MSG_GETRULE, table))]


def kernel_objects(family: Family, kind: int, table: str) -> list[list[tuple[int, bytes]]]:
    """Every chain or set of `table` with all its attributes as the kernel dumps them
    (hooks, priorities, key types, flags, user data), but those the kernel makes up."""
    out = []
    for reply in _dump(family, kind, table):
        attrs = reply.attrs(NFGEN.size)
        if attrs.get(NFTA_ANY_TABLE, b"").rstrip(b"\0").decode() != table:
            continue  # a dump by table name still lists every table's sets
        out.append(sorted((k, v) for k, v in attrs.items() if k not in KERNEL_OWN[kind]
                          and k != NFTA_ANY_TABLE))
    return sorted(out)


def listing(ns: str, family: Family, table: str) -> list[str]:
    """nft's reading of `table` (JSON, without handles, named as the other table)."""
    fam = "ip" if family is Family.V4 else "ip6"
    out = []
    for item in json.loads(nft(ns, "-j", "list", "table", fam, table))["nftables"]:
        kind, obj = next(iter(item.items()))
        if kind in ("metainfo", "table"):
            continue
        obj = {k: v for k, v in obj.items() if k not in ("handle", "table")}
        if "elem" in obj:
            obj["elem"] = sorted(json.dumps(e, sort_keys=True) for e in obj["elem"])
        out.append(json.dumps([kind, obj], sort_keys=True))
    return sorted(out)


def same_tables(ns: str, family: Family) -> None:
    with entered(ns):
        ref, enc = kernel_rules(family, REF), kernel_rules(family, ENC)
        assert enc == ref
        for kind in (NFT_MSG_GETCHAIN, NFT_MSG_GETSET):
            assert kernel_objects(family, kind, ENC) == kernel_objects(family, kind, REF)
    assert listing(ns, family, ENC) == listing(ns, family, REF)


@pytest.mark.parametrize("family", [Family.V4, Family.V6], ids=lambda f: f.label)
def test_every_statement_reads_back_as_nft_writes_it(namespaces: Lab, family: Family) -> None:
    ns = namespaces.node_ns
    fam = "ip" if family is Family.V4 else "ip6"
    nft(ns, "flush", "ruleset")
    with entered(ns):
        runner = NftRunner()
    try:
        setup = f"add table {fam} {{t}}\n" + SETUP[family]
        for template in (setup, STATEMENTS[family], REMOVALS[family]):
            nft(ns, "-f", "-", stdin=script(template, REF))
            with entered(ns):
                runner.send(script(template, ENC), family, (ENC,))
            same_tables(ns, family)
            if template is STATEMENTS[family]:  # not vacuous: the rules are there
                assert "dnat to" in nft(ns, "list", "table", fam, ENC)
                assert "map @slots-" in nft(ns, "list", "table", fam, ENC)
                assert "hook prerouting" in nft(ns, "list", "table", fam, ENC)
        with entered(ns):
            runner.send(f"delete table {fam} {ENC}\n", family, (ENC,))
        assert f"table {fam} {ENC}" not in nft(ns, "list", "tables")
        assert f"table {fam} {REF}" in nft(ns, "list", "tables")
    finally:
        with entered(ns):
            runner.close()
        nft(ns, "flush", "ruleset")


def test_a_refused_batch_names_its_line_and_changes_nothing(namespaces: Lab) -> None:
    ns = namespaces.node_ns
    nft(ns, "flush", "ruleset")
    nft(ns, "-f", "-", stdin=f"add table ip {ENC}\n" + script(SETUP[Family.V4], ENC))
    before = listing(ns, Family.V4, ENC)
    bad = (f"add chain ip {ENC} fresh\n"
           f"add rule ip {ENC} fresh goto target\n"
           f"add rule ip {ENC} old jump no-such-chain\n"
           f"add element ip {ENC} cluster-ips {{ 198.18.0.9 }}\n")
    with entered(ns):
        runner = NftRunner()
    try:
        with entered(ns), pytest.raises(NftError) as refused:
            runner.send(bad, Family.V4, (ENC,))
        assert refused.value.line == 3
        assert refused.value.offending == f"add rule ip {ENC} old jump no-such-chain"
        assert "No such file or directory" in str(refused.value)
        assert listing(ns, Family.V4, ENC) == before  # all or nothing
        # The socket stays usable: the next batch is answered, not an old refusal.
        with entered(ns):
            runner.send(bad.replace("no-such-chain", "target"), Family.V4, (ENC,))
        assert "198.18.0.9" in nft(ns, "list", "set", "ip", ENC, "cluster-ips")
    finally:
        with entered(ns):
            runner.close()
        nft(ns, "flush", "ruleset")



def test_a_batch_of_joined_pieces_is_taken_whole(namespaces: Lab,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch past sendmsg's most pieces (MAX_PIECES: 1,500 messages, one a piece at
    first) has its pieces joined: the kernel takes it in one transaction. Not joined,
    sendmsg refused it (EMSGSIZE) and a full sync of 100,000 services went to nft."""
    ns = namespaces.node_ns
    nft(ns, "flush", "ruleset")
    nft(ns, "-f", "-", stdin=f"add table ip {ENC}\n" + script(SETUP[Family.V4], ENC))
    monkeypatch.setattr(wire, "PAGE", 64)
    wanted = {f"198.18.{i // 250}.{i % 250 + 1}" for i in range(1500)}
    lines = "".join(f"add element ip {ENC} cluster-ips {{ {a} }}\n" for a in sorted(wanted))
    with entered(ns):
        runner = NftRunner()
    try:
        with entered(ns):
            runner.send(lines, Family.V4, (ENC,))
        held = json.loads(nft(ns, "-j", "list", "set", "ip", ENC, "cluster-ips"))
        elements = next(o["set"] for o in held["nftables"] if "set" in o).get("elem", [])
        assert set(elements) == wanted
    finally:
        with entered(ns):
            runner.close()
        nft(ns, "flush", "ruleset")
