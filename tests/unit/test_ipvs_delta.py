"""IPVS: a port's change from its endpoint delta (render.render_change, diff.
diff_real_servers) makes the same netlink operations, ipset lines and book-keeping
(believed table, draining real servers, ipset entry counts) as rendering and diffing
the port whole, through random sequences of endpoints added, removed, flipped and moved
between nodes; checked on the plane itself over fake kernel handles (the kernel step is
QEMU's: docs/kernel-tests.md; the fakes: tests/fakekernel/ipvs.py)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs import apply as ipvs_apply
from proxy.dataplane.ipvs.apply import IpvsDataPlane
from proxy.dataplane.ipvs.render import render_change
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family, ServicePortKey
from tests.fakekernel.ipvs import FakeIpsets, FakeIpvs, on_fakes
from tests.unit.builders import NODE, ep, eps_slice, node, resolve_one, service
from tests.unit.test_nftables_delta import POOL, Pod, step, with_delta

KEY = ServicePortKey("ns", "svc", "http", Family.V4)


def plane() -> tuple[IpvsDataPlane, FakeIpvs, FakeIpsets]:
    ipvs, ipsets = FakeIpvs(), FakeIpsets()
    dp = on_fakes(DataplaneOptions(NODE, families=(Family.V4,)), ipvs, ipsets=ipsets)
    return dp, ipvs, ipsets


SPECS: dict[str, dict[str, Any]] = {
    "tcp": {},
    "udp": {"ports": ({"name": "http", "port": 80, "protocol": "UDP"},)},
    "local": {"type": "NodePort", "externalTrafficPolicy": "Local",
              "ports": ({"name": "http", "port": 80, "nodePort": 30080},)},
}


def resolve(pods: dict[str, Pod], spec: str) -> Any:
    proto = SPECS[spec].get("ports", ({},))[0].get("protocol", "TCP")
    eps = [ep(a, node=NODE if p.local else "node-b", ready=p.ready) for a, p in pods.items()]
    return resolve_one(node(), service(**SPECS[spec]),
                       eps_slice("s1", eps, ports=({"name": "http", "port": 8080,
                                                    "protocol": proto},)), port="http")


def book(dp: IpvsDataPlane) -> Any:
    return (dp._servers.believed, set(dp._servers.drains.draining), dp._index.entries(),
            dp._index.ports)


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("spec", sorted(SPECS))
def test_random_deltas_do_what_a_whole_render_and_diff_do(
        seed: int, spec: str, monkeypatch: pytest.MonkeyPatch) -> None:
    changes: list[bool] = []

    def counted(*args: Any) -> Any:
        change = render_change(*args)
        changes.append(change is not None)
        return change

    monkeypatch.setattr(ipvs_apply, "render_change", counted)
    rng = random.Random(seed)
    # Few endpoints on this node: the Local servers' set empties and refills.
    pods = {a: Pod(local=rng.random() < 0.1) for a in POOL[:40]}
    by_delta, delta_kernel, delta_sets = plane()
    whole, whole_kernel, whole_sets = plane()
    first = resolve(pods, spec)
    states = [DesiredState({KEY: first}), DesiredState({KEY: first})]
    for dp, state in zip((by_delta, whole), states, strict=True):
        dp.sync(state, full=True)
    for n in range(60):
        step(pods, rng, shrink=n % 20 < 10)
        new = resolve(pods, spec)
        old_delta, old_whole = states
        states = [old_delta.evolve({KEY: with_delta(old_delta.ports[KEY], new)}),
                  old_whole.evolve({KEY: new})]  # no delta: rendered and diffed whole
        for dp, kernel, state in ((by_delta, delta_kernel, states[0]),
                                  (whole, whole_kernel, states[1])):
            kernel.held = dp._servers.believed
            report = dp.sync(state)
            assert not report.full
        assert delta_kernel.ops == whole_kernel.ops, f"step {n}"
        assert delta_sets.lines == whole_sets.lines, f"step {n}"
        assert book(by_delta) == book(whole), f"step {n}"
        assert by_delta.applied_rules(KEY) == whole.applied_rules(KEY)
    assert sum(changes) > 30, changes
    assert any(line.startswith("drain-dest") or line.startswith("del-dest")
               for line in delta_kernel.ops)


def test_one_flip_touches_one_real_server_per_virtual_server() -> None:
    pods = {a: Pod(local=False) for a in POOL[:300]}
    dp, kernel, _sets = plane()
    old = resolve(pods, "local")
    state = DesiredState({KEY: old})
    dp.sync(state, full=True)
    kernel.ops.clear()
    pods[POOL[7]].ready = False
    new = with_delta(old, resolve(pods, "local"))
    kernel.held = dp._servers.believed
    dp.sync(state.evolve({KEY: new}))
    # The cluster IP's server drains the endpoint; the NodePort's (policy Local, no
    # local endpoint: the cluster set for pods and this node) is rendered whole, and
    # drains the same one.
    assert sorted(op.split(" ")[0] for op in kernel.ops) == ["drain-dest", "drain-dest"]


def test_a_delta_that_does_not_fit_the_rules_is_rendered_whole() -> None:
    pods = {a: Pod() for a in POOL[:20]}
    old = resolve(pods, "tcp")
    del pods[POOL[3]]
    new = with_delta(old, resolve(pods, "tcp"))
    delta = new.endpoint_delta(old)
    assert delta is not None
    dp, _kernel, _sets = plane()
    dp.sync(DesiredState({KEY: old}), full=True)
    rules = dp._index.ports[KEY]
    ctx = dp._ctx
    assert ctx is not None
    assert render_change(old, new, delta, ctx, rules) is not None
    # Rules that never had the endpoint the delta removes.
    (vs,) = rules.virtual_servers
    stale = replace(rules, virtual_servers=(replace(vs, real_servers=vs.real_servers[4:]),))
    assert render_change(old, new, delta, ctx, stale) is None
    # More than the endpoints changed: endpoint_delta, which the plane asks for the
    # delta, refuses it.
    other = replace(new, uses_local=True)
    assert other.delta is new.delta and other.endpoint_delta(old) is None
