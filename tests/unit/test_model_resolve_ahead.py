"""Resolving ahead (ClusterModel.resolve_ahead, used while the initial lists arrive)
changes when the work is done, never the result: whatever arrives, is changed or deleted
after a port was resolved ahead, the next resolve gives the state a model resolving only
then gives, and reports every port as changed. And `select_all`, which works each
combination of verdict inputs out once, selects as `select` does endpoint by endpoint."""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.kube.ingest import apply_object, delete_object
from proxy.model.merge import merge_port
from proxy.model.selection import NodeView, Verdicts, select, select_all
from proxy.model.tracker import ClusterModel
from proxy.model.types import EndpointSlice, Family, Protocol, SlicePort
from tests.unit.builders import endpoints_from, ep, eps_slice, node, service

NODE = "node-a"
SERVICES = ("a", "b", "c")
SLICES = ("a-1", "a-2", "b-1", "c-1")


def _service(name: str, variant: int) -> dict[str, Any]:
    spec: dict[str, Any] = {"trafficDistribution": "PreferClose"} if variant else {}
    return service(name=name, ips=(f"198.18.128.{SERVICES.index(name) + 1}",),
                   ports=({"name": "http", "port": 80}, {"name": "dns", "port": 53,
                                                          "protocol": "UDP"}), **spec)


def _slice(name: str, variant: int) -> dict[str, Any]:
    base = 10 * SLICES.index(name)
    eps = [ep(f"198.18.1.{base + i}", node=f"node-{'a' if i % 2 else 'b'}",
              zone="zone-a" if i % 3 else "zone-b", ready=(i + variant) % 4 != 0)
           for i in range(1 + variant % 3)]
    ports = ({"name": "http", "port": 8080},) if variant % 2 else (
        {"name": "http", "port": 8080}, {"name": "dns", "port": 53, "protocol": "UDP"})
    return eps_slice(name, eps, service_name=name.partition("-")[0], ports=ports)


# One step: an object arrives or goes, the node's zone changes, or the model resolves
# some ports ahead.
steps = st.one_of(
    st.tuples(st.just("service"), st.sampled_from(SERVICES), st.integers(0, 1)),
    st.tuples(st.just("slice"), st.sampled_from(SLICES), st.integers(0, 5)),
    st.tuples(st.just("delete-service"), st.sampled_from(SERVICES), st.just(0)),
    st.tuples(st.just("delete-slice"), st.sampled_from(SLICES), st.just(0)),
    st.tuples(st.just("node"), st.sampled_from(["zone-a", "zone-b"]), st.just(0)),
    st.tuples(st.just("ahead"), st.just(""), st.integers(1, 3)),
)


def _apply(model: ClusterModel, step: tuple[str, str, int]) -> None:
    kind, name, n = step
    if kind == "service":
        apply_object(model, _service(name, n))
    elif kind == "slice":
        apply_object(model, _slice(name, n))
    elif kind == "delete-service":
        delete_object(model, "Service", "ns", name)
    elif kind == "delete-slice":
        delete_object(model, "EndpointSlice", "ns", name)
    elif kind == "node":
        apply_object(model, node(NODE, name))
    else:
        model.resolve_ahead(n)


@settings(max_examples=300, deadline=None)
@given(st.lists(steps, max_size=25))
def test_resolving_ahead_ends_where_resolving_once_does(history: list[tuple[str, str, int]]
                                                          ) -> None:
    ahead, once = ClusterModel(NODE), ClusterModel(NODE)
    for step in history:
        _apply(ahead, step)
        if step[0] != "ahead":
            _apply(once, step)
    got, want = ahead.resolve(), once.resolve()
    assert dict(got.ports) == dict(want.ports)
    assert got.changed == want.changed == frozenset(want.ports)
    assert ahead.resolved_ahead == 0  # handed over, and resolving ahead ended
    # Later changes resolve as usual.
    apply_object(ahead, _slice("a-1", 4))
    apply_object(once, _slice("a-1", 4))
    assert dict(ahead.resolve().ports) == dict(once.resolve().ports)


def test_only_ports_whose_endpoints_arrived_are_resolved_ahead() -> None:
    model = ClusterModel(NODE)
    apply_object(model, _service("a", 0))
    apply_object(model, _service("b", 0))
    apply_object(model, _slice("a-1", 0))
    assert len(model.resolve_ahead(10)) == 2  # a's two ports; b has no endpoints yet
    assert model.resolve_ahead(10) == []
    apply_object(model, _slice("b-1", 1))  # only http in it
    assert len(model.resolve_ahead(10)) == 1
    assert model.resolved_ahead == 3
    # b's dns port waits for the resolve: no endpoints of it arrived.
    assert [(k.name, k.port) for k in model.dirty] == [("b", "dns")]
    state = model.resolve()
    assert len(state.ports) == 4 and state.changed == frozenset(state.ports)


@settings(max_examples=200, deadline=None)
@given(st.lists(endpoints_from([ip_address(f"198.18.2.{i}") for i in range(1, 9)]),
                max_size=12),
       st.booleans(), st.booleans(),
       st.sampled_from(["cluster", "hints-node", "hints-zone", "prefer-node", "prefer-zone"]),
       st.booleans(), st.booleans())
def test_select_all_selects_as_select_does(raw: list[Any], uses_cluster: bool,
                                            uses_local: bool, mode: str, fallback: bool,
                                            local_ready: bool) -> None:
    merged, _ = merge_port([EndpointSlice("ns", "s", "svc", Family.V4,
                                          (SlicePort("http", Protocol.TCP, 80),),
                                          tuple(raw))], "http", Protocol.TCP, Family.V4)
    verdicts = Verdicts(uses_cluster, uses_local, mode, fallback, local_ready,
                        NodeView(NODE, "zone-a"))
    assert select_all(merged, verdicts) == tuple(select(e, verdicts) for e in merged)


def test_a_port_whose_resolution_failed_ahead_is_resolved_by_the_next_resolve(
        monkeypatch: pytest.MonkeyPatch) -> None:
    model = ClusterModel(NODE)
    apply_object(model, _service("a", 0))
    apply_object(model, _slice("a-1", 0))
    real = model.resolve_key

    def broken(key: Any) -> Any:
        raise RuntimeError("a bug")

    monkeypatch.setattr(model, "resolve_key", broken)
    with pytest.raises(RuntimeError):
        model.resolve_ahead(10)
    monkeypatch.setattr(model, "resolve_key", real)
    state = model.resolve()
    assert len(state.ports) == 2 and state.changed == frozenset(state.ports)
