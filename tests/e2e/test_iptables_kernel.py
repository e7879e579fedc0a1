"""The iptables data plane against the real kernel, both back ends, inside throw-away
namespaces: what iptables-save reads back, partial-equals-full, cleanup, refusals and
back-end detection."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from ipaddress import ip_address
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from proxy.dataplane.base import rules_digest
from proxy.dataplane.common.nfnetlink import SCRATCH_TABLE, chain_type_unsupported, nat_unsupported
from proxy.dataplane.xtables.restore_runner import (
    Backend,
    IptablesRunner,
    RestoreError,
    detect_backend,
    encoded,
)
from proxy.dataplane.xtables.saved import RestoreText, Table, ours, parse_save
from proxy.model.types import Family
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from tests.e2e.conftest import Cluster, NodePlane
from tests.unit.builders import ep, eps_slice, service
from tests.unit.test_iptables_sync import clusters

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("host_untouched")]

# Same addresses for every plane, so both namespaces render the same rules.
ADDRESSES = [ip_address("198.18.0.1"), ip_address("fd00:18::1")]

FOREIGN = {
    Family.V4: """*nat
:CNI-HOSTPORT - [0:0]
-A PREROUTING -m addrtype --dst-type LOCAL -j CNI-HOSTPORT
-A POSTROUTING -s 198.18.1.0/24 ! -o spx-br0 -j MASQUERADE
-A CNI-HOSTPORT -p tcp -m tcp --dport 9999 -j DNAT --to-destination 198.18.1.10:8080
COMMIT
*filter
:CNI-FORWARD - [0:0]
-A FORWARD -j CNI-FORWARD
-A CNI-FORWARD -s 198.18.1.0/24 -j ACCEPT
-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT
COMMIT
""",
    Family.V6: """*nat
-A POSTROUTING -s fd00:18:1::/64 ! -o spx-br0 -j MASQUERADE
COMMIT
*filter
:CNI-FORWARD - [0:0]
-A FORWARD -j CNI-FORWARD
-A CNI-FORWARD -s fd00:18:1::/64 -j ACCEPT
COMMIT
""",
}


def saved(ns: str, backend: Backend, tables: tuple[str, ...] = ()) -> dict[Family, str]:
    """iptables-save of both families (of `tables` only, if given), without comments
    and counters."""
    out = {}
    with entered(ns):
        for family in Family:
            runner = IptablesRunner(family, backend)
            text = "".join(runner.save(t) for t in tables) if tables else runner.save()
            lines = [re.sub(r"\[\d+:\d+\]", "[0:0]", line) for line in text.splitlines()
                     if not line.startswith("#")]
            out[family] = "\n".join(lines)
    return out


@pytest.fixture(scope="module")
def namespaces() -> Iterator[Lab]:
    with Lab([]) as lab:  # two bare namespaces: node_ns and client_ns
        yield lab


def wipe(ns: str) -> None:
    """Leave a namespace with no rules of either back end (between examples): a
    restore without --noflush empties every table it names."""
    with entered(ns):
        for family in Family:
            for backend in Backend:
                runner = IptablesRunner(family, backend)
                tables = [line for line in runner.save().splitlines() if line.startswith("*")]
                if tables:
                    runner.restore("".join(f"{t}\nCOMMIT\n" for t in tables), noflush=False)


def add_foreign(ns: str, backend: Backend) -> None:
    with entered(ns):
        for family, text in FOREIGN.items():
            IptablesRunner(family, backend).restore(text)


@settings(max_examples=10, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=clusters(), second=clusters())
@pytest.mark.parametrize(("backend", "applier"), [
    (Backend.LEGACY, "restore"), (Backend.NFT, "restore"), (Backend.LEGACY, "iptc")],
    ids=["legacy", "nft", "legacy-iptc"])
def test_partial_sync_gives_the_rules_of_a_full_sync_in_the_kernel(
        namespaces: Lab, backend: Backend, applier: str, first: list[dict[str, Any]],
        second: list[dict[str, Any]]) -> None:
    partial_ns, full_ns = namespaces.node_ns, namespaces.client_ns
    for ns in (partial_ns, full_ns):
        wipe(ns)
        add_foreign(ns, backend)
    cluster = Cluster()
    a = cluster.become(*first)
    b = cluster.become(*second)

    plane = NodePlane(partial_ns, backend, addresses=lambda: ADDRESSES, applier=applier)
    plane.sync(a, full=True)
    # The kernel prints back exactly the rules we rendered: our spelling is its spelling.
    with entered(partial_ns):
        for family in Family:
            kernel = parse_save(IptablesRunner(family, backend).save())
            ruleset = plane.dp._families[family].ruleset
            assert ruleset is not None
            ours_in_kernel = {(t, c): r for t, chains in kernel.items()
                              for c, r in chains.items() if ours(c)}
            assert {k: rules_digest(r) for k, r in ours_in_kernel.items()} == ruleset.digests()
    report = plane.sync(b)
    assert not report.full

    # The reference is always iptables-restore.
    fresh = NodePlane(full_ns, backend, addresses=lambda: ADDRESSES)
    fresh.sync(b, full=True)
    # (Importing python-iptables creates the other legacy tables, empty: compare ours.)
    tables = ("nat", "filter")
    assert saved(partial_ns, backend, tables) == saved(full_ns, backend, tables)


@settings(max_examples=6, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=clusters(), second=clusters())
def test_batched_full_sync_on_nf_tables_in_the_kernel(
        namespaces: Lab, monkeypatch: pytest.MonkeyPatch, first: list[dict[str, Any]],
        second: list[dict[str, Any]]) -> None:
    # Full syncs split into many small restores (as at thousands of services) must leave
    # the kernel exactly as one restore does, over an earlier run's rules too.
    batched_ns, single_ns = namespaces.node_ns, namespaces.client_ns
    for ns in (batched_ns, single_ns):
        wipe(ns)
        add_foreign(ns, Backend.NFT)
    cluster = Cluster()
    a = cluster.become(*first)
    b = cluster.become(*second)
    monkeypatch.setattr("proxy.dataplane.iptables.apply.NFT_CHAINS_PER_RESTORE", 3)
    batched = NodePlane(batched_ns, Backend.NFT, addresses=lambda: ADDRESSES)
    batched.sync(a, full=True)
    report = batched.sync(b, full=True)
    for family in Family:
        sizes = [len(r.chains) for r in
                 batched.dp._families[family].ruleset.ports.values() if r.chains]  # type: ignore[union-attr]
        # Split exactly when two service ports' chains together exceed a batch.
        split = len(sizes) > 1 and sum(sizes) > 3
        assert (report.details[family.label]["restores"] > 1) == split, sizes
    monkeypatch.setattr("proxy.dataplane.iptables.apply.NFT_CHAINS_PER_RESTORE", 10**9)
    single = NodePlane(single_ns, Backend.NFT, addresses=lambda: ADDRESSES)
    single.sync(a, full=True)
    single.sync(b, full=True)
    assert saved(batched_ns, Backend.NFT) == saved(single_ns, Backend.NFT)


def web(*ips: str, **spec: Any) -> list[dict[str, Any]]:
    ports = spec.pop("ports", ({"name": "http", "port": 80},))
    return [service("web", ports=ports, **spec),
            eps_slice("web-1", [ep(ip, node="node-a") for ip in ips], service_name="web")]


@pytest.mark.parametrize("backend", [Backend.LEGACY, Backend.NFT], ids=["legacy", "nft"])
def test_cleanup_leaves_iptables_save_as_it_was(namespaces: Lab, backend: Backend) -> None:
    ns = namespaces.node_ns
    other = Backend.NFT if backend is Backend.LEGACY else Backend.LEGACY
    wipe(ns)
    # Others' rules in both back ends (so both have tables before we come; cleanup
    # removes our chains, never a table).
    add_foreign(ns, backend)
    add_foreign(ns, other)
    before = {b: saved(ns, b) for b in Backend}
    cluster = Cluster()
    state = cluster.become(*web(
        "198.18.1.10", "198.18.1.11", type="LoadBalancer", externalIPs=["198.18.2.100"],
        sessionAffinity="ClientIP", loadBalancerSourceRanges=["198.18.0.0/24"],
        externalTrafficPolicy="Local", healthCheckNodePort=32000,
        ports=({"name": "http", "port": 80, "nodePort": 30080},)))
    plane = NodePlane(ns, backend)
    plane.sync(state, full=True)
    plane.sync(cluster.become(*web("198.18.1.11")))
    # A leftover of an earlier run in the other back end goes too.
    NodePlane(ns, other).sync(state, full=True)
    assert "SPX-" in saved(ns, backend)[Family.V4] and "SPX-" in saved(ns, other)[Family.V4]
    plane.cleanup()
    assert {b: saved(ns, b) for b in Backend} == before


@pytest.mark.parametrize("backend", [Backend.LEGACY, Backend.NFT], ids=["legacy", "nft"])
def test_restore_refusal_names_the_line(namespaces: Lab, backend: Backend) -> None:
    with entered(namespaces.node_ns):
        runner = IptablesRunner(Family.V4, backend)
        assert runner.available()
        text = ("*nat\n:SPX-TEST - [0:0]\n-A SPX-TEST -m nosuchmatch -j RETURN\nCOMMIT\n")
        with pytest.raises(RestoreError) as refused:
            runner.restore(text)
        assert refused.value.line == 3
        assert refused.value.offending == "-A SPX-TEST -m nosuchmatch -j RETURN"
        assert "SPX-TEST" not in runner.save("nat")  # nothing of it was committed


@pytest.mark.parametrize("backend", [Backend.LEGACY, Backend.NFT], ids=["legacy", "nft"])
def test_streamed_restore_refused_midway_names_the_line(namespaces: Lab,
                                                         backend: Backend) -> None:
    """A full sync's text goes to iptables-restore in pieces made as they are written;
    one refused in the middle (the binary stops reading, the rest cannot be written)
    is still reported with its line, and nothing of it is committed."""
    good = [f"-s 198.18.{i // 250}.{1 + i % 250}/32 -j RETURN" for i in range(20_000)]
    text = RestoreText()
    text.write_chain(Table.NAT, "SPX-BEFORE", good)
    text.write_chain(Table.NAT, "SPX-TEST", ["-m nosuchmatch -j RETURN"])
    text.write_chain(Table.NAT, "SPX-AFTER", good)
    assert sum(len(piece) for piece in encoded(text)) > 1 << 20  # more than one piece
    with entered(namespaces.node_ns):
        runner = IptablesRunner(Family.V4, backend)
        with pytest.raises(RestoreError) as refused:
            runner.restore(text)
        # *nat, three declarations, SPX-BEFORE's rules, then the refused one.
        assert refused.value.line == 1 + 3 + len(good) + 1
        assert refused.value.offending == "-A SPX-TEST -m nosuchmatch -j RETURN"
        assert "SPX-" not in runner.save("nat")
        runner.restore(text.render().replace("-m nosuchmatch ", ""))  # the same, accepted
        assert runner.save("nat").count("-A SPX-AFTER ") == len(good)


def test_backend_detection_follows_the_rules_already_there(namespaces: Lab) -> None:
    ns = namespaces.client_ns
    wipe(ns)
    with entered(ns):
        # Nothing anywhere: the flavour of the plain `iptables` binary decides.
        plain = detect_backend()
        # More rules in legacy: legacy.
        IptablesRunner(Family.V4, Backend.LEGACY).restore(
            "*filter\n-A INPUT -p tcp -m tcp --dport 22 -j ACCEPT\nCOMMIT\n")
        assert detect_backend() is Backend.LEGACY
        # kubelet's hint chain in nf_tables beats rule counts.
        IptablesRunner(Family.V4, Backend.NFT).restore(
            "*mangle\n:KUBE-IPTABLES-HINT - [0:0]\nCOMMIT\n")
        assert detect_backend() is Backend.NFT
    wipe(ns)
    flavour = subprocess.run(["iptables", "-V"], capture_output=True, text=True,
                             check=True).stdout
    assert plain is (Backend.LEGACY if "(legacy)" in flavour else Backend.NFT)


def test_nfnetlink_asks_the_kernel_and_leaves_nothing(namespaces: Lab) -> None:
    ns = namespaces.client_ns
    wipe(ns)

    def ruleset() -> str:
        return subprocess.run(["ip", "netns", "exec", ns, "nft", "list", "ruleset"],
                              capture_output=True, text=True, check=True).stdout

    before = ruleset()
    with entered(ns):
        # This kernel has the nat chain type (the kernel lab checks one without it).
        assert nat_unsupported(Family.V4) is None
        assert nat_unsupported(Family.V6) is None
        # A chain type no kernel has is refused, and said so.
        refused = chain_type_unsupported(Family.V6, "no-such-type")
        assert refused == ("nf_tables refused a no-such-type chain for IPv6 (creating the "
                           "chain: No such file or directory)")
    assert ruleset() == before  # the scratch table never outlived its transaction
    assert SCRATCH_TABLE not in before
