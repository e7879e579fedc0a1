"""IPVS: a service's balancing picks its virtual servers' scheduler (maglev: `mh` on the
source address and port, source-hash: `sh`, both with their fallback past a draining
real server; random: the node's --ipvs-scheduler),
with ClientIP affinity's persistence on top; a change of annotation edits the virtual
server in place. On the plane over the fake kernel handles (tests/fakekernel/ipvs.py)."""

from __future__ import annotations

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs.apply import IpvsDataPlane
from proxy.dataplane.ipvs.render import FLAG_PERSISTENT, FLAG_SCHED1, FLAG_SCHED2
from proxy.kube.ingest import apply_object
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.model.types import Balancing, Family, ServicePortKey
from tests.fakekernel.ipvs import FakeIpvs, on_fakes
from tests.unit.builders import NODE, ep, eps_slice, node, service

KEY = ServicePortKey("ns", "svc", "http", Family.V4)
VS = "TCP 198.18.128.1:80"


def plane(scheduler: str = "rr") -> tuple[IpvsDataPlane, FakeIpvs]:
    ipvs = FakeIpvs(applies=True)
    options = DataplaneOptions(NODE, families=(Family.V4,), ipvs_scheduler=scheduler)
    return on_fakes(options, ipvs), ipvs


def model(default: Balancing = Balancing.RANDOM, **spec: object) -> ClusterModel:
    m = ClusterModel(NODE, balancing=default)
    for obj in (node(), service(**spec), eps_slice("s1", [ep("10.0.0.1"), ep("10.0.0.2")])):
        apply_object(m, obj)
    return m


@pytest.mark.parametrize(("annotation", "default", "scheduler", "expected", "flags"), [
    (None, Balancing.RANDOM, "rr", "rr", 0),
    (None, Balancing.RANDOM, "wrr", "wrr", 0),
    ("maglev", Balancing.RANDOM, "rr", "mh", FLAG_SCHED1 | FLAG_SCHED2),
    ("source-hash", Balancing.RANDOM, "rr", "sh", FLAG_SCHED1),
    (None, Balancing.MAGLEV, "rr", "mh", FLAG_SCHED1 | FLAG_SCHED2),
    ("random", Balancing.SOURCE_HASH, "lc", "lc", 0),
])
def test_the_balancing_is_the_virtual_server_s_scheduler(
        annotation: str | None, default: Balancing, scheduler: str, expected: str,
        flags: int) -> None:
    annotations = {"sliceproxy.io/balancing": annotation} if annotation else None
    dp, ipvs = plane(scheduler)
    dp.sync(model(default, annotations=annotations).resolve(), full=True)
    assert ipvs.ops[0] == f"add-service {VS} {expected}"
    believed = dp._servers.believed
    assert {(k.address.exploded, vs.scheduler, vs.flags) for k, vs in believed.items()} == {
        ("198.18.128.1", expected, flags)}


def test_affinity_keeps_its_persistence_on_top_of_maglev() -> None:
    dp, ipvs = plane()
    state = model(annotations={"sliceproxy.io/balancing": "maglev"},
                  sessionAffinity="ClientIP",
                  sessionAffinityConfig={"clientIP": {"timeoutSeconds": 60}}).resolve()
    dp.sync(state, full=True)
    assert ipvs.ops[0] == f"add-service {VS} mh persistent 60"
    (vs,) = dp._servers.believed.values()
    assert vs.flags == FLAG_PERSISTENT | FLAG_SCHED1 | FLAG_SCHED2


def test_a_new_annotation_edits_the_virtual_server_and_leaves_its_real_servers() -> None:
    dp, ipvs = plane()
    m = model()
    dp.sync(m.resolve(), full=True)
    ipvs.ops.clear()
    apply_object(m, service(annotations={"sliceproxy.io/balancing": "source-hash"}))
    state: DesiredState = m.resolve()
    assert KEY in state.changed
    dp.sync(state, full=False)
    assert ipvs.ops == [f"set-service {VS} sh"]
