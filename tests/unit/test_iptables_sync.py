"""The iptables data plane against a simulated kernel (`simulate`): partial syncs give
exactly what a full sync gives, failures leave the rules alone, cleanup leaves only
what others had. The same properties run against the real kernel, on a few examples, in
tests/e2e/test_iptables_kernel.py.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator
from ipaddress import ip_address, ip_network
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.dataplane.base import ApplyError, DataplaneOptions, rules_digest
from proxy.dataplane.iptables.apply import IptablesDataPlane
from proxy.dataplane.modes import IPTABLES_PARTIAL_RESTORE_FAILURES, IPTABLES_RESTORE_FAILURES
from proxy.dataplane.xtables.restore_runner import Backend, RunnerError
from proxy.dataplane.xtables.saved import Saved, Table, ours, parse_save
from proxy.dataplane.xtables.simulate import SimulatedRunner
from proxy.kube.ingest import apply_object, delete_object
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.model.types import Family
from tests.unit.builders import NODE, ep, eps_slice, node, service

OPTIONS = DataplaneOptions(NODE, cluster_cidrs=(ip_network("198.18.1.0/24"),
                                                ip_network("fd00:18:1::/64")))
NODE_IPS = [ip_address("198.18.0.1"), ip_address("fd00:18::1")]


def foreign() -> dict[Family, Saved]:
    """Rules somebody else owns, which we must never disturb."""
    text = (
        "*nat\n:PREROUTING ACCEPT [0:0]\n:INPUT ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
        ":POSTROUTING ACCEPT [0:0]\n:CNI-NAT - [0:0]\n-A PREROUTING -j CNI-NAT\n"
        "-A POSTROUTING -o lan0 -j MASQUERADE\n-A CNI-NAT -p tcp --dport 1 -j RETURN\nCOMMIT\n"
        "*filter\n:INPUT ACCEPT [0:0]\n:FORWARD ACCEPT [0:0]\n:OUTPUT ACCEPT [0:0]\n"
        "-A FORWARD -j ACCEPT\nCOMMIT\n")
    return {Family.V4: parse_save(text), Family.V6: parse_save(text)}


def plane(kernels: dict[Family, Saved]) -> tuple[IptablesDataPlane, dict[Family, SimulatedRunner]]:
    runners = {f: SimulatedRunner(f, kernels[f]) for f in (Family.V4, Family.V6)}
    dp = IptablesDataPlane(OPTIONS, runners=runners, addresses=lambda: NODE_IPS,
                           clear_conntrack=False)
    return dp, runners


# --- random clusters ----------------------------------------------------------------------

PORTS = {"http": {"name": "http", "port": 80}, "dns": {"name": "dns", "port": 53,
                                                        "protocol": "UDP"}}


@st.composite
def service_objects(draw: Callable[..., Any], index: int) -> list[dict[str, Any]]:
    name = f"s{index}"
    families = draw(st.sampled_from([("IPv4",), ("IPv6",), ("IPv4", "IPv6")]))
    ips = tuple(f"198.18.128.{10 + index}" if f == "IPv4" else f"fd00:198:18::{10 + index:x}"
                for f in families)
    port_names = draw(st.lists(st.sampled_from(sorted(PORTS)), min_size=1, max_size=2,
                               unique=True))
    kind = draw(st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]))
    ports = []
    for i, p in enumerate(port_names):
        port = dict(PORTS[p])
        if kind != "ClusterIP":
            port["nodePort"] = 30000 + index * 10 + i
        ports.append(port)
    spec: dict[str, Any] = {"type": kind, "ipFamilies": list(families)}
    if draw(st.booleans()):
        spec["externalIPs"] = draw(st.lists(st.sampled_from(
            ["198.18.0.50", "198.18.0.51", "fd00:18::50"]), max_size=2, unique=True))
    if draw(st.booleans()):
        spec["sessionAffinity"] = "ClientIP"
    spec["internalTrafficPolicy"] = draw(st.sampled_from(["Cluster", "Local"]))
    if kind != "ClusterIP":
        spec["externalTrafficPolicy"] = draw(st.sampled_from(["Cluster", "Local"]))
    if kind == "LoadBalancer" and draw(st.booleans()):
        spec["loadBalancerSourceRanges"] = ["198.18.0.0/24", "fd00:18::/64"]
    obj = service(name, ips=ips, ports=tuple(ports), **spec)
    if kind == "LoadBalancer":
        obj["status"] = {"loadBalancer": {"ingress": [{"ip": f"198.18.0.{200 + index}"}]}}
    out = [obj]
    for family in families:
        v4 = family == "IPv4"
        count = draw(st.integers(0, 4))
        eps = [ep(f"198.18.1.{10 + j}" if v4 else f"fd00:18:1::{10 + j:x}",
                  node=draw(st.sampled_from([NODE, "node-b"])),
                  ready=draw(st.booleans()), serving=draw(st.booleans()),
                  terminating=draw(st.booleans()))
               for j in draw(st.lists(st.integers(0, 5), max_size=count, unique=True))]
        out.append(eps_slice(f"{name}-{family.lower()}", eps, service_name=name,
                             address_type=family,
                             ports=tuple({"name": p, "port": 8000 + k, "protocol":
                                          PORTS[p].get("protocol", "TCP")}
                                         for k, p in enumerate(sorted(PORTS)))))
    return out


@st.composite
def clusters(draw: Callable[..., Any]) -> list[dict[str, Any]]:
    chosen = draw(st.lists(st.integers(0, 5), max_size=5, unique=True))
    return [obj for i in chosen for obj in draw(service_objects(i))]


class Cluster:
    """One model fed state after state, as the agent does: unchanged service ports stay
    the very same objects from one snapshot to the next."""

    def __init__(self) -> None:
        self.model = ClusterModel(NODE)
        apply_object(self.model, node())
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}

    def become(self, objects: list[dict[str, Any]]) -> DesiredState:
        wanted = {(o["kind"], o["metadata"]["name"]): o for o in objects}
        for kind, name in set(self.objects) - set(wanted):
            delete_object(self.model, kind, "ns", name)
        for obj in objects:
            apply_object(self.model, obj)
        # Generated input must be valid: a skipped slice would leave nothing to check.
        # Services may share an externalIP: the model arbitrates that (`conflict`), and
        # partial syncs must follow it as the winner comes and goes.
        odd = [s for s in self.model.skipped() if s.reason != "conflict"]
        assert not odd, odd
        self.objects = wanted
        return self.model.resolve()


def ours_only(kernels: dict[Family, Saved]) -> dict[Family, dict[Table, dict[str, list[str]]]]:
    return {f: {t: {c: r for c, r in chains.items() if ours(c)} for t, chains in k.items()}
            for f, k in kernels.items()}


# --- properties -----------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(first=clusters(), second=clusters())
def test_partial_sync_from_a_gives_exactly_the_full_sync_of_b(
        first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    cluster = Cluster()
    a = cluster.become(first)
    b = cluster.become(second)

    kernels = foreign()
    dp, _ = plane(kernels)
    dp.sync(a, full=True)
    report = dp.sync(b)
    assert not report.full

    scratch = foreign()
    fresh, _ = plane(scratch)
    fresh.sync(b, full=True)
    assert kernels == scratch  # every table, chain and rule, in order
    # The dump's rules (rendered again, not kept) are what a fresh plane reports.
    for key in b.ports:
        assert dp.applied_rules(key) == fresh.applied_rules(key) != []
    # What the data plane believes it applied is what the kernel holds.
    for family in (Family.V4, Family.V6):
        believed = dp._families[family].ruleset.digests()  # type: ignore[union-attr]
        held = ours_only(kernels)[family]
        assert believed == {(t, c): rules_digest(r) for t, chains in held.items()
                            for c, r in chains.items()}

    # A full sync over rules left by an earlier run (state A) also ends exactly there.
    leftover = foreign()
    old, _ = plane(leftover)
    old.sync(a, full=True)
    restarted, _ = plane(leftover)
    restarted.sync(b, full=True)
    assert leftover == scratch

    # Cleanup leaves what others had, and nothing of ours.
    dp.cleanup()
    assert kernels == foreign()


@settings(max_examples=100, deadline=None, suppress_health_check=[
    HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(first=clusters(), second=clusters(), batch=st.integers(1, 6))
def test_batched_full_sync_on_nf_tables_ends_exactly_where_one_restore_does(
        first: list[dict[str, Any]], second: list[dict[str, Any]], batch: int,
        monkeypatch: pytest.MonkeyPatch) -> None:
    # On nf_tables a full sync is split into restores of about `batch` chains; from
    # nothing, or over an earlier run's rules, it must end exactly where one legacy-style
    # restore does, and each restore must be accepted on its own (the simulator refuses
    # a jump to a missing chain, as the kernel does).
    monkeypatch.setattr("proxy.dataplane.iptables.apply.NFT_CHAINS_PER_RESTORE", batch)
    cluster = Cluster()
    a = cluster.become(first)
    b = cluster.become(second)
    for start in ("empty", "leftover"):
        kernels, reference = foreign(), foreign()
        if start == "leftover":
            plane(kernels)[0].sync(a, full=True)
            plane(reference)[0].sync(a, full=True)
        runners = {f: SimulatedRunner(f, kernels[f], backend=Backend.NFT)
                   for f in (Family.V4, Family.V6)}
        dp = IptablesDataPlane(OPTIONS, runners=runners, addresses=lambda: NODE_IPS,
                               clear_conntrack=False)
        report = dp.sync(b, full=True)
        plane(reference)[0].sync(b, full=True)
        assert kernels == reference, start
        for family, runner in runners.items():
            sizes = [len(r.chains) for r in dp._families[family].ruleset.ports.values()  # type: ignore[union-attr]
                     if r.chains]
            restores = report.details[family.label]["restores"]
            # Split exactly when two service ports' chains together exceed a batch (a
            # port's chains always go together).
            assert (restores > 1) == (len(sizes) > 1 and sum(sizes) > batch), sizes
            assert len(runner.restores) == restores


@settings(max_examples=60, deadline=None)
@given(first=clusters(), second=clusters())
def test_partial_sync_writes_nothing_for_unchanged_service_ports(
        first: list[dict[str, Any]], second: list[dict[str, Any]]) -> None:
    cluster = Cluster()
    a = cluster.become(first)
    b = cluster.become(second)
    dp, runners = plane(foreign())
    dp.sync(a, full=True)
    done = {f: len(r.restores) for f, r in runners.items()}
    report = dp.sync(b)
    # Per family: a dual-stack service's two ports share a name in the comments.
    text = {f: "".join(r.restores[done[f]:]) for f, r in runners.items()}
    unchanged = set(b.ports) & set(a.ports)
    unchanged = {k for k in unchanged if a.ports[k] is b.ports[k]}
    assert not unchanged & set(report.written)
    for key in unchanged:
        assert f"{key.namespace}/{key.name}:{key.port}" not in text[key.family]
    # And a second sync of the same state does nothing at all.
    before = [len(r.restores) for r in runners.values()]
    again = dp.sync(b)
    assert [len(r.restores) for r in runners.values()] == before
    assert again.operations == 0 and not again.written


# --- examples ---------------------------------------------------------------------------------


def web(*ips: str, name: str = "web") -> list[dict[str, Any]]:
    # A cluster IP each: two services on one IP:port are a conflict the model arbitrates.
    vip = {"web": "198.18.128.1", "api": "198.18.128.2"}[name]
    return [service(name, ips=(vip,), ports=({"name": "http", "port": 80},)),
            eps_slice(f"{name}-1", [ep(ip) for ip in ips], service_name=name)]


def test_one_endpoint_change_rewrites_only_that_service() -> None:
    cluster = Cluster()
    dp, runners = plane(foreign())
    dp.sync(cluster.become(web("198.18.1.10") + web("198.18.1.20", name="api")), full=True)
    report = dp.sync(cluster.become(web("198.18.1.10", "198.18.1.11")
                                    + web("198.18.1.20", name="api")))
    text = runners[Family.V4].restores[-1]
    assert [str(k) for k in report.written] == ["ns/web:http (IPv4)"]
    assert "ns/api" not in text
    # The dispatch entry did not change: no -D/-I, only the service chain and a new
    # endpoint chain.
    assert "SPX-SERVICES" not in text
    assert sum(line.startswith(":") for line in text.splitlines()) == 2
    assert len(runners[Family.V6].restores) == 1  # the full sync; no IPv6 work since


def test_several_cluster_cidrs_sync_with_their_masquerade_chain() -> None:
    # The simulator is as strict as the kernel: a rule may only jump to a chain that
    # exists, so a full and then a partial sync prove the fixed chain comes first.
    options = DataplaneOptions(NODE, cluster_cidrs=(ip_network("198.18.1.0/24"),
                                                    ip_network("198.18.64.0/18")))
    runners = {f: SimulatedRunner(f, foreign()[f]) for f in (Family.V4, Family.V6)}
    dp = IptablesDataPlane(options, runners=runners, addresses=lambda: NODE_IPS,
                           clear_conntrack=False)
    cluster = Cluster()
    dp.sync(cluster.become(web("198.18.1.10")), full=True)
    dp.sync(cluster.become(web("198.18.1.10") + web("198.18.1.20", name="api")))
    nat = runners[Family.V4].kernel[Table.NAT]
    assert nat["SPX-MASQ-UNLESS-POD"] == [
        "-s 198.18.1.0/24 -j RETURN", "-s 198.18.64.0/18 -j RETURN", "-j SPX-MARK-MASQ"]
    assert sum(rule.endswith("-j SPX-MASQ-UNLESS-POD")
               for chain, rules in nat.items() if chain.startswith("SPX-SVC-")
               for rule in rules) == 2


def test_losing_all_endpoints_swaps_the_nat_jump_for_a_filter_reject() -> None:
    cluster = Cluster()
    dp, runners = plane(foreign())
    dp.sync(cluster.become(web("198.18.1.10") + web("198.18.1.20", name="api")), full=True)
    dp.sync(cluster.become(web() + web("198.18.1.20", name="api")))
    text = runners[Family.V4].restores[-1]
    assert "-D SPX-SERVICES -d 198.18.128.1/32" in text
    assert "-I SPX-SERVICES 1 -d 198.18.128.1/32" in text and "-j REJECT" in text
    assert text.count("-X SPX-") == 2  # the service chain and the endpoint chain


def test_failed_apply_keeps_the_rules_and_the_next_sync_is_full() -> None:
    cluster = Cluster()
    kernels = foreign()
    dp, runners = plane(kernels)
    dp.sync(cluster.become(web("198.18.1.10")), full=True)
    before = copy.deepcopy(kernels)
    runners[Family.V4].fail_on = "198.18.1.11"
    with pytest.raises(ApplyError) as failed:
        dp.sync(cluster.become(web("198.18.1.10", "198.18.1.11")))
    assert failed.value.offending is not None and "198.18.1.11" in failed.value.offending
    # The mode's own counters, for the agent to add (a partial sync's restore failed).
    assert failed.value.counted == {IPTABLES_RESTORE_FAILURES.name: 1,
                                    IPTABLES_PARTIAL_RESTORE_FAILURES.name: 1}
    assert kernels == before
    runners[Family.V4].fail_on = None
    report = dp.sync(cluster.model.state)
    assert report.full
    assert "198.18.1.11:8080" in "\n".join(
        dp.applied_rules(next(k for k in cluster.model.state.ports if k.family is Family.V4)))


@pytest.mark.parametrize("backend", [Backend.LEGACY, Backend.NFT])
def test_a_refused_legacy_commit_says_the_table_may_be_past_the_kernels_limit(
        backend: Backend) -> None:
    # Legacy's whole-table replace is refused with ENOMEM at 512 MiB (30,000 services x
    # 10 endpoints), reported at COMMIT: the operator is told what can go past it.
    runners = {f: SimulatedRunner(f, foreign()[f], backend=backend)
               for f in (Family.V4, Family.V6)}
    dp = IptablesDataPlane(OPTIONS, runners=runners, addresses=lambda: NODE_IPS,
                           clear_conntrack=False)
    runners[Family.V4].fail_on = "COMMIT"
    with pytest.raises(ApplyError) as failed:
        dp.sync(Cluster().become(web("198.18.1.10")), full=True)
    assert failed.value.offending == "COMMIT"
    said = "--proxy-mode nftables" in str(failed.value)
    assert said == (backend is Backend.LEGACY), str(failed.value)


def test_full_sync_repairs_our_jumps_and_leaves_others() -> None:
    cluster = Cluster()
    kernels = foreign()
    dp, runners = plane(kernels)
    state = cluster.become(web("198.18.1.10"))
    dp.sync(state, full=True)
    good = copy.deepcopy(kernels)
    # Someone deleted one of our jumps and duplicated another.
    nat = kernels[Family.V4][Table.NAT]
    nat["OUTPUT"] = [s for s in nat["OUTPUT"] if "SPX-SERVICES" not in s]
    nat["PREROUTING"].append(nat["PREROUTING"][0])
    dp.sync(state, full=True)
    assert kernels == good
    # When all is well a full sync touches no built-in chain.
    dp.sync(state, full=True)
    assert not any(line.startswith(("-D ", "-I ")) for line in
                   runners[Family.V4].restores[-1].splitlines())


def test_unknown_applier_is_refused_with_the_choices() -> None:
    with pytest.raises(ValueError, match="restore, iptc"):
        IptablesDataPlane(OPTIONS, applier="netlink", runners={}, addresses=list)


def test_a_failing_save_stops_a_full_sync_before_any_restore() -> None:
    tried: list[Family] = []

    class Unreadable(SimulatedRunner):
        def save_lines(self) -> Iterator[str]:
            tried.append(self.family)
            yield "*nat"
            raise RunnerError("iptables-save exited 1: no table")

    cluster = Cluster()
    kernels = foreign()
    runners = {f: Unreadable(f, kernels[f]) for f in (Family.V4, Family.V6)}
    dp = IptablesDataPlane(OPTIONS, runners=runners, addresses=lambda: NODE_IPS,
                           clear_conntrack=False)
    before = copy.deepcopy(kernels)
    with pytest.raises(ApplyError, match="no table"):
        dp.sync(cluster.become(web("198.18.1.10")), full=True)
    assert kernels == before and all(not r.restores for r in runners.values())
    assert tried == [Family.V4, Family.V6]  # the other family is still tried


def test_maglev_and_source_hash_balance_at_random_said_once_per_service(
        caplog: pytest.LogCaptureFixture) -> None:
    """x_tables has no hash -> endpoint map: the rules are random's, and the log says so."""
    def state(balancing: str | None, *names: str) -> DesiredState:
        model = ClusterModel(NODE)
        for i, name in enumerate(names):
            notes = {"sliceproxy.io/balancing": balancing} if balancing else None
            apply_object(model, service(name, ips=(f"198.18.128.{i + 1}",), annotations=notes))
            apply_object(model, eps_slice(f"{name}-1", [ep("198.18.1.10")], service_name=name))
        return model.resolve()

    random_rules, at_random = plane(foreign())
    random_rules.sync(state(None, "a", "b"), full=True)
    dp, runners = plane(foreign())
    with caplog.at_level("WARNING", logger="proxy.dataplane.iptables.apply"):
        dp.sync(state("maglev", "a", "b"), full=True)
        dp.sync(state("maglev", "a", "b"), full=True)
    assert runners[Family.V4].save() == at_random[Family.V4].save()
    told = sorted(r.__dict__["service"] for r in caplog.records
                  if r.getMessage() == "balancing not available in iptables mode; random used")
    assert told == ["ns/a", "ns/b"]
