"""The kernel's tables after an apply, inside the kernel lab (run by
tests/kernel/test_ipvs_table.py through scenarios/run.py; never on the host).

The central property: after any sync, reading the kernel back (IPVS table over netlink,
the dummy interface's addresses, our ipsets) gives exactly what the renderer says for
the desired state, for random states and random transitions between them, through
full and partial syncs. Plus: drift repaired by a full sync and clean-up (with the
iptables rules on either back end), schedulers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from ipaddress import ip_address
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.dataplane.base import ApplyError
from proxy.dataplane.common.netlink_constants import IPVS_CMD_ATTR_SERVICE, IPVS_CMD_GET_SERVICE
from proxy.dataplane.ipvs.diff import Op, OpKind
from proxy.dataplane.ipvs.handover import remove_kube_proxy_ipvs
from proxy.dataplane.ipvs.index import RenderIndex
from proxy.dataplane.ipvs.kernel import IpvsTable
from proxy.dataplane.ipvs.netfilter import JUMPS
from proxy.dataplane.ipvs.netlink import (
    IpvsSocket,
    decode_service_stats,
    raw_key,
    service_stats_in_place,
)
from proxy.dataplane.ipvs.render import PortRules, RsKey, VirtualServer, VsKey, VsKind
from proxy.dataplane.ipvs.sample import TableSampler
from proxy.dataplane.ipvs.traffic import TrafficReader
from proxy.dataplane.xtables.restore_runner import Backend, binary
from proxy.model.types import Family, Protocol, ServicePortKey
from proxy.netns_lab import Lab
from tests.kernel.scenario_guest import (
    Cluster,
    NodeThread,
    as_ipvsadm,
    ipvsadm_view,
    options,
    read_kernel,
    rendered_view,
)
from tests.unit.builders import ep, eps_slice, service

SCHEDULERS = ("rr", "wrr", "lc", "wlc", "lblc", "lblcr", "dh", "sh", "sed", "nq", "fo", "ovf",
              "mh")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    """No backends: nothing here sends traffic."""
    with Lab([]) as lab:
        yield lab


# --- random cluster states ------------------------------------------------------------

endpoint = st.tuples(
    st.integers(0, 5),  # which pod address
    st.sampled_from(["node-a", "node-b"]),
    st.sampled_from(["ready", "ready", "not-ready", "terminating"]),
)
service_spec = st.fixed_dictionaries({
    "type": st.sampled_from(["ClusterIP", "NodePort", "LoadBalancer"]),
    "protocol": st.sampled_from(["TCP", "UDP"]),
    "affinity": st.sampled_from([None, 60, 10800]),
    "external": st.sampled_from(["Cluster", "Local"]),
    "internal": st.sampled_from(["Cluster", "Cluster", "Local"]),
    "external_ips": st.lists(st.sampled_from(["198.18.2.60", "198.18.2.61", "198.18.0.1"]),
                             max_size=2, unique=True),
    "ranges": st.lists(st.sampled_from(["198.18.0.0/24", "0.0.0.0/0"]), max_size=1),
    "dual": st.booleans(),
    "endpoints": st.lists(endpoint, max_size=4, unique_by=lambda e: e[0]),
})
states = st.dictionaries(st.sampled_from(["s0", "s1", "s2", "s3"]), service_spec, max_size=4)


def objects(specs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for name, spec in sorted(specs.items()):
        n = int(name[1:])
        ips = (f"198.18.128.{30 + n}",) + ((f"fd00:198:18::{30 + n}",) if spec["dual"] else ())
        port: dict[str, Any] = {"name": "p", "port": 80, "protocol": spec["protocol"]}
        extra: dict[str, Any] = {"externalIPs": spec["external_ips"],
                                 "externalTrafficPolicy": spec["external"],
                                 "internalTrafficPolicy": spec["internal"]}
        if spec["type"] != "ClusterIP":
            port["nodePort"] = 30100 + n
        if spec["affinity"] is not None:
            extra["sessionAffinity"] = "ClientIP"
            extra["sessionAffinityConfig"] = {"clientIP": {"timeoutSeconds": spec["affinity"]}}
        if spec["type"] == "LoadBalancer":
            extra["loadBalancerSourceRanges"] = spec["ranges"]
        svc = service(name, ips=ips, ports=(port,), type=spec["type"], **extra)
        if spec["type"] == "LoadBalancer":
            svc["status"] = {"loadBalancer": {"ingress": [{"ip": f"198.18.3.{n}"}]}}
        out.append(svc)
        slice_ports = ({"name": "p", "port": 8080, "protocol": spec["protocol"]},)
        for family, fmt in (("IPv4", "198.18.1.{}"), ("IPv6", "fd00:18:1::{}")):
            eps = [ep(fmt.format(10 + i), node=nd, ready=cond == "ready",
                      serving=cond != "not-ready", terminating=cond == "terminating")
                   for i, nd, cond in spec["endpoints"]]
            out.append(eps_slice(f"{name}-{family.lower()}", eps, service_name=name,
                                 ports=slice_ports, address_type=family))
    return out


def load(cluster: Cluster, specs: dict[str, dict[str, Any]]) -> Any:
    """Make the model hold exactly `specs` (deleting services that are gone)."""
    for name in ("s0", "s1", "s2", "s3"):
        if name not in specs:
            cluster.delete("Service", name)
    return cluster.apply(*objects(specs))


def assert_kernel_matches(node: NodeThread, state: Any) -> None:
    got = read_kernel(node)
    want = rendered_view(state, options(), node)
    assert got.services == want.services
    assert ipvsadm_view(node) == as_ipvsadm(want)  # a reader other than ours agrees
    assert got.addresses == want.addresses
    assert got.entries == want.entries


@pytest.fixture(scope="module")
def shared(lab: Lab) -> Iterator[NodeThread]:
    """One plane for every example: each example starts from what the previous one left
    in the kernel, which is one more transition to get right."""
    thread = NodeThread(lab.node_ns)
    thread.start_plane()
    try:
        yield thread
    finally:
        try:
            if thread.plane is not None:
                thread.run(thread.plane.cleanup)
        finally:
            thread.close()


@settings(max_examples=12, deadline=None, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(first=states, second=states, full_first=st.booleans(), restart=st.booleans())
def test_kernel_table_is_the_rendered_state(shared: NodeThread, first: dict[str, Any],
                                            second: dict[str, Any], full_first: bool,
                                            restart: bool) -> None:
    node = shared
    cluster = Cluster()
    state = load(cluster, first)
    node.sync(state, full=full_first)
    assert_kernel_matches(node, state)
    state = load(cluster, second)  # a transition, applied as a partial sync
    report = node.sync(state)
    assert not report.full
    assert_kernel_matches(node, state)
    if restart:
        # A restarted plane finds nothing to change in IPVS.
        node.start_plane()
        report = node.sync(state)
        assert report.full and report.details["ipvs_changes"] == 0, report.details
        assert_kernel_matches(node, state)


@pytest.fixture
def node(lab: Lab) -> Iterator[NodeThread]:
    thread = NodeThread(lab.node_ns)
    thread.start_plane()
    try:
        yield thread
    finally:
        try:
            if thread.plane is not None:
                thread.run(thread.plane.cleanup)
        finally:
            thread.close()


SOME = {
    "s0": {"type": "NodePort", "protocol": "TCP", "affinity": None, "external": "Cluster",
           "internal": "Cluster", "external_ips": ["198.18.2.60"], "ranges": [], "dual": True,
           "endpoints": [(0, "node-a", "ready"), (1, "node-b", "ready")]},
    "s1": {"type": "LoadBalancer", "protocol": "UDP", "affinity": 60, "external": "Local",
           "internal": "Cluster", "external_ips": [], "ranges": ["198.18.0.0/24"],
           "dual": False, "endpoints": [(2, "node-b", "ready")]},
}


@pytest.mark.parametrize("backend", [Backend.NFT, Backend.LEGACY], ids=["nft", "legacy"])
def test_full_sync_repairs_drift(node: NodeThread, backend: Backend) -> None:
    cluster = Cluster()
    state = load(cluster, SOME)
    node.start_plane(backend=backend)
    node.sync(state)
    iptables, save = binary(Family.V4, backend), binary(Family.V4, backend, "save")
    for cmd in (
        ["ip", "addr", "del", "198.18.2.60/32", "dev", "spx-ipvs0"],
        ["ip", "addr", "add", "198.18.2.99/32", "dev", "spx-ipvs0"],  # stray address
        ["ipvsadm", "-e", "-t", "198.18.128.30:80", "-r", "198.18.1.10:8080", "-m", "-w", "5"],
        ["ipvsadm", "-E", "-t", "198.18.0.1:30100", "-s", "wlc"],
        ["ipvsadm", "-A", "-t", "198.18.128.30:81", "-s", "rr"],  # stray port on our VIP
        ["ipvsadm", "-d", "-t", "198.18.2.60:80", "-r", "198.18.1.11:8080"],
        ["ipset", "del", "SPX-IPVS4-EXT-MASQ", "198.18.2.60,tcp:80"],
        [iptables, "-t", "nat", "-D", "PREROUTING", "-m", "comment", "--comment",
         "sliceproxy ipvs services", "-j", "SPX-IPVS-SERVICES"],
    ):
        out = node.exec(*cmd)
        assert out.returncode == 0, (cmd, out.stderr)
    report = node.sync(state, full=True)
    assert report.details["ipvs_changes"] == 4, report.details
    assert_kernel_matches(node, state)
    saved = node.exec(save).stdout
    for jump in JUMPS:
        assert saved.count(f"-A {jump.chain} {jump.spec()}") == 1, (jump, saved)


@pytest.mark.parametrize("backend", [Backend.NFT, Backend.LEGACY], ids=["nft", "legacy"])
def test_cleanup_removes_ours_and_only_ours(node: NodeThread, backend: Backend) -> None:
    state = load(Cluster(), SOME)
    node.start_plane(backend=backend)
    node.sync(state)
    iptables = binary(Family.V4, backend)
    for cmd in (["ipvsadm", "-A", "-t", "198.18.4.1:80", "-s", "rr"],  # someone else's
                ["ipset", "create", "OTHER", "hash:ip"],
                [iptables, "-t", "nat", "-A", "POSTROUTING", "-j", "RETURN"]):
        assert node.exec(*cmd).returncode == 0, cmd
    plane = node.plane
    assert plane is not None
    node.run(plane.cleanup)
    ipvs = node.exec("ipvsadm", "-Ln").stdout
    assert "198.18.4.1:80" in ipvs
    assert "198.18.128.30" not in ipvs and "30100" not in ipvs, ipvs
    assert node.exec("ip", "link", "show", "spx-ipvs0").returncode != 0
    assert node.exec("ipset", "list", "-n").stdout.split() == ["OTHER"]
    for family in (Family.V4, Family.V6):
        saved = node.exec(binary(family, backend, "save")).stdout
        assert "SPX-IPVS" not in saved, saved
    assert "-A POSTROUTING -j RETURN" in node.exec(binary(Family.V4, backend, "save")).stdout
    node.run(plane.cleanup)  # nothing left: a second clean-up is a no-op
    for cmd in (["ipvsadm", "-D", "-t", "198.18.4.1:80"], ["ipset", "destroy", "OTHER"],
                [iptables, "-t", "nat", "-D", "POSTROUTING", "-j", "RETURN"]):
        assert node.exec(*cmd).returncode == 0, cmd


def test_every_scheduler_the_kernel_offers(node: NodeThread) -> None:
    # Which schedulers this kernel loads (straight over netlink: cheap)...
    offered = []
    probe = VsKey(Protocol.TCP, ip_address("198.18.4.2"), 80)

    def try_all() -> list[str]:
        table = IpvsTable()
        try:
            for name in SCHEDULERS:
                vs = VirtualServer(probe, VsKind.CLUSTER_IP, name, 0, 0, (), "cluster")
                if table.apply_many([Op(OpKind.ADD_SERVICE, probe, service=vs)]) == [0]:
                    offered.append(name)
                    table.apply(Op(OpKind.DEL_SERVICE, probe))
        finally:
            table.close()
        return offered

    assert node.run(try_all) == list(SCHEDULERS)
    print("schedulers offered by this kernel:", " ".join(offered))
    # ...and --ipvs-scheduler through the data plane, including a change of scheduler on
    # a running table (set in place, real servers kept).
    one = dict(SOME["s0"], type="ClusterIP", dual=False, external_ips=[])
    state = load(Cluster(), {"s0": one})  # one virtual server
    for name in ("rr", "mh", "sh"):
        node.start_plane(options(ipvs_scheduler=name))
        node.sync(state)
        services = read_kernel(node).services
        assert set(services) == set(rendered_view(state, options(), node).services)
        assert {s["scheduler"] for s in services.values()} == {name}, services
        assert all(s["dests"] for s in services.values())
        # mh also hashes the source port (flag 0x10); mh and sh fall back past a draining
        # real server (0x08); switching away clears them.
        assert services["TCP 198.18.128.30:80"]["flags"] == {"mh": 0x18, "sh": 0x08}.get(name, 0)
    node.start_plane(options(ipvs_scheduler="nope"))
    with pytest.raises(ApplyError, match="is the IPVS scheduler 'nope' available"):
        node.sync(state)


def kernel_keys(node: NodeThread) -> set[str]:
    return {ln.split()[2] for ln in node.exec("ipvsadm", "-Sn").stdout.splitlines()
            if ln.startswith("-A")}


def test_each_proxys_cleanup_leaves_what_the_other_claims(node: NodeThread) -> None:
    """Both proxies program the same keys (docs/migrate.md#ipvs-mode). kube-proxy's
    claims, imitated: its dummy interface holding one of our cluster IPs and one address
    of its own (with a virtual server), and its NodePort set listing our NodePort."""
    state = load(Cluster(), SOME)
    node.sync(state)
    ours = kernel_keys(node)
    shared = {k for k in ours if k.startswith("198.18.128.30:") or k.endswith(":30100")}
    assert shared and shared != ours
    for cmd in (["ip", "link", "add", "kube-ipvs0", "type", "dummy"],
                ["ip", "addr", "add", "198.18.128.30/32", "dev", "kube-ipvs0"],
                ["ip", "addr", "add", "198.18.4.3/32", "dev", "kube-ipvs0"],
                ["ipvsadm", "-A", "-t", "198.18.4.3:80", "-s", "rr"],  # kube-proxy's only
                ["ipset", "create", "KUBE-NODE-PORT-TCP", "bitmap:port", "range", "0-65535"],
                ["ipset", "add", "KUBE-NODE-PORT-TCP", "30100"]):
        assert node.exec(*cmd).returncode == 0, cmd
    try:
        # The switch back to kube-proxy: ours go, none of those kube-proxy claims.
        plane = node.plane
        assert plane is not None
        node.run(plane.cleanup)
        assert kernel_keys(node) == shared | {"198.18.4.3:80"}
        assert plane.cleaned["virtual servers"] == len(ours - shared)
        # The switch to sliceproxy: kube-proxy's own only, then its interface and sets.
        node.sync(state)
        assert kernel_keys(node) == ours | {"198.18.4.3:80"}
        removed = node.run(remove_kube_proxy_ipvs)
        assert removed.errors == []
        assert [str(k) for k in removed.virtual_servers] == ["TCP 198.18.4.3:80"]
        assert (removed.interfaces, removed.ipsets) == (1, ["KUBE-NODE-PORT-TCP"])
        assert kernel_keys(node) == ours
        assert_kernel_matches(node, state)
    finally:
        for cmd in (["ip", "link", "del", "kube-ipvs0"], ["ipvsadm", "-D", "-t", "198.18.4.3:80"],
                    ["ipset", "destroy", "KUBE-NODE-PORT-TCP"]):
            node.exec(*cmd)


# The size of the table the sampler's cost (and reading traffic counts) is measured at:
# 10,000 for the figures in docs/reliability.md and docs/dataplanes.md; 1,000 in the
# suite, where building it costs time under emulation.
SAMPLED_TABLE = int(os.environ.get("SLICEPROXY_SAMPLER_TABLE", "1000"))


def test_the_sampler_sees_a_flush_at_its_next_look_and_its_cost(node: NodeThread) -> None:
    """ipvs/sample.py over a table of SAMPLED_TABLE virtual servers: one look finds a
    flush; its CPU per second beside a dump of every key each second (reported, not
    asserted)."""
    keys = [VsKey(Protocol.TCP, ip_address(f"198.19.{i // 250}.{i % 250 + 1}"), 80)
            for i in range(SAMPLED_TABLE)]  # up to 64,000
    notes: list[str] = []
    sampler = TableSampler(notes.append)
    sampler.publish(keys)

    def measure() -> dict[str, float]:
        table = IpvsTable()
        try:
            codes = table.apply_many([Op(OpKind.ADD_SERVICE, k, service=VirtualServer(
                k, VsKind.CLUSTER_IP, "rr", 0, 0, (), "cluster")) for k in keys])
            assert not any(codes)
            looks, began = 0, time.thread_time()
            for _ in range(SAMPLED_TABLE // sampler.per_tick):  # once round the table
                assert sampler.look(table) == []
                looks += 1
            look = (time.thread_time() - began) / looks
            began = time.thread_time()
            for _ in range(3):
                assert len(table.service_keys()) == SAMPLED_TABLE
            dump = (time.thread_time() - began) / 3
            return {"look": look, "dump": dump}
        finally:
            table.close()

    try:
        cost = node.run(measure, timeout=600)
        assert notes == []
        assert node.exec("ipvsadm", "-C").returncode == 0

        def look_after_flush() -> list[VsKey]:
            table = IpvsTable()
            try:
                return sampler.look(table)
            finally:
                table.close()

        assert len(node.run(look_after_flush)) == sampler.per_tick
        assert len(notes) == 1 and "missing from the IPVS table" in notes[0], notes
    finally:
        node.exec("ipvsadm", "-C")
    per_second = 1 / sampler.interval
    print(f"\nIPVS table sampler at {SAMPLED_TABLE:,} virtual servers: one look "
          f"({sampler.per_tick} GETs) {cost['look'] * 1e3:.3f} ms CPU, "
          f"{cost['look'] * per_second * 1e3:.2f} ms per second at {per_second:g} looks/s; "
          f"a dump of every key {cost['dump'] * 1e3:.1f} ms CPU (at 1/s: "
          f"{cost['dump'] * 1e3:.1f} ms per second)")


def test_reading_traffic_counts_and_its_cost(node: NodeThread) -> None:
    """IPVS's statistics as ipvs/traffic.py reads them, over SAMPLED_TABLE virtual
    servers of 10 real servers each: one dump of every virtual server's (per service
    port), and a dump of each one's real servers (per endpoint, where every virtual
    server counted something); wall time reported, not asserted."""
    keys = [VsKey(Protocol.TCP, ip_address(f"198.19.{i // 250}.{i % 250 + 1}"), 80)
            for i in range(SAMPLED_TABLE)]
    real = [RsKey(ip_address(f"198.20.{k}.1"), 8080) for k in range(10)]

    def measure() -> dict[str, float]:
        table = IpvsTable()
        try:
            ops = [Op(OpKind.ADD_SERVICE, k, service=VirtualServer(
                k, VsKind.CLUSTER_IP, "rr", 0, 0, (), "cluster")) for k in keys]
            ops += [Op(OpKind.ADD_DEST, k, rs=r, weight=1) for k in keys for r in real]
            assert not any(table.apply_many(ops))
            began = time.perf_counter()
            counts = table.service_stats()
            dump = time.perf_counter() - began
            began = time.perf_counter()
            dests = [table.dest_stats(k) for k in keys]
            per_endpoint = time.perf_counter() - began
            # The whole reading (IpvsDataPlane.traffic) over these as service ports: the
            # first after a sync, then again.
            index = RenderIndex({p.key: p for p in (PortRules(
                ServicePortKey("ns", f"s{i}", "http", Family.V4),
                (VirtualServer(k, VsKind.CLUSTER_IP, "rr", 0, 0, tuple(real), "cluster"),),
                (), frozenset()) for i, k in enumerate(keys))})
            reader, reads = TrafficReader(), []
            for _ in range(2):
                began = time.perf_counter()
                traffic = reader.read(index.ports, index, table, False)
                reads.append(time.perf_counter() - began)
            assert len(traffic) == len(keys)
            assert set(counts) == {raw_key(k) for k in keys}
            assert all(set(d) == set(real) for d in dests)
            assert {c.connections for c in counts.values()} == {0}
            # This kernel lays its services out as the quick reading expects.
            sock = IpvsSocket()
            try:
                replies = sock.dump_one(IPVS_CMD_GET_SERVICE, IPVS_CMD_ATTR_SERVICE)
            finally:
                sock.close()
            assert all(service_stats_in_place(a) is not None for a in replies)
            began = time.perf_counter()
            for attrs in replies:  # the Python side of the dump alone
                decode_service_stats(attrs)
            decode = time.perf_counter() - began
            return {"dump": dump, "decode": decode, "per_endpoint": per_endpoint,
                    "first": reads[0], "again": reads[1]}
        finally:
            table.close()

    try:
        cost = node.run(measure, timeout=600)
    finally:
        node.exec("ipvsadm", "-C")
    print(f"\nIPVS statistics at {SAMPLED_TABLE:,} virtual servers x 10 real servers: "
          f"every virtual server's in one dump {cost['dump'] * 1e3:.1f} ms (of which "
          f"decoding {cost['decode'] * 1e3:.1f} ms); a reading of "
          f"as many service ports {cost['first'] * 1e3:.1f} ms (first), "
          f"{cost['again'] * 1e3:.1f} ms (again); every real server's, a dump per virtual "
          f"server, {cost['per_endpoint'] * 1e3:.0f} ms")
