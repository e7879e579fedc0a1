"""The index a large service port keeps between resolutions (incremental.PortIndex)
changes nothing but the cost: every result equals the one computed from scratch, and an
unchanged endpoint comes out as the very same object."""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.kube.decode import decode_service
from proxy.kube.ingest import EndpointsSource, apply_object
from proxy.model import tracker
from proxy.model.incremental import PortIndex
from proxy.model.merge import merge_port
from proxy.model.selection import NodeView, categorize
from proxy.model.tracker import ClusterModel
from proxy.model.types import (
    Endpoint,
    EndpointSlice,
    Family,
    Protocol,
    Service,
    ServicePortKey,
    SlicePort,
)
from tests.unit.builders import endpoints_from, ep, eps_slice, node, service

ADDRS = [ip_address(f"198.18.1.{i}") for i in range(1, 7)]
endpoints_st = endpoints_from(ADDRS)
VIEW = NodeView("node-a", "zone-a")


@st.composite
def slice_sets(draw: st.DrawFn) -> list[EndpointSlice]:
    names = draw(st.lists(st.sampled_from("abcdef"), min_size=1, max_size=4, unique=True))
    return [
        EndpointSlice(
            namespace="ns", name=name, service_name="svc",
            family=draw(st.sampled_from([Family.V4, Family.V4, Family.V6])),
            ports=tuple(SlicePort(n, draw(st.sampled_from([Protocol.TCP, Protocol.UDP])), p)
                        for n, p in draw(st.sampled_from([
                            [("http", 8080)], [("http", 9090)], [("http", 8080), ("dns", 53)],
                            [("http", 8080), ("http", 8081)]]))),
            endpoints=tuple(draw(st.lists(endpoints_st, max_size=5))),
        )
        for name in names
    ]


def _svc(**spec: Any) -> Service:
    svc, _ = decode_service(service(ports=({"name": "http", "port": 80},
                                           {"name": "dns", "port": 53}), **spec))
    assert svc is not None
    return svc


def _fresh(slices: list[EndpointSlice], svc: Service, port: str, protocol: Protocol,
           view: NodeView = VIEW) -> tuple[object, ...]:
    merged, conflicts = merge_port(slices, port, protocol, Family.V4)
    sel = categorize(merged, svc, next(p for p in svc.ports if p.name == port), view,
                     Family.V4)
    return sel.endpoints, sel.topology, sel.uses_cluster, sel.uses_local, conflicts


@settings(max_examples=300, deadline=None)
@given(st.lists(slice_sets(), min_size=1, max_size=4),
       st.sampled_from([Protocol.TCP, Protocol.UDP]))
def test_an_index_resolves_as_merge_and_categorize_do(rounds: list[list[EndpointSlice]],
                                                      protocol: Protocol) -> None:
    svc = _svc(trafficDistribution="PreferClose")
    indexes = {port: PortIndex((port, protocol, Family.V4), VIEW) for port in ("http", "dns")}
    kept: list[EndpointSlice] = []
    for slices in rounds:
        # Keep some slice objects from the round before, as the tracker does for slices
        # that did not change, so the index has something to keep.
        current = kept[:1] + slices
        for port, index in indexes.items():
            sp = next(p for p in svc.ports if p.name == port)
            res = index.resolve(current, svc, sp, VIEW)
            assert (res.endpoints, res.topology, res.uses_cluster, res.uses_local,
                    res.conflicts) == _fresh(current, svc, port, protocol)
        kept = slices


def test_an_index_keeps_the_objects_of_unchanged_endpoints() -> None:
    a = EndpointSlice("ns", "a", "svc", Family.V4, (SlicePort("http", Protocol.TCP, 80),),
                      (Endpoint(ADDRS[0]), Endpoint(ADDRS[1])))
    b = EndpointSlice("ns", "b", "svc", Family.V4, (SlicePort("http", Protocol.TCP, 80),),
                      (Endpoint(ADDRS[2]), Endpoint(ADDRS[3])))
    svc = _svc()
    index = PortIndex(("http", Protocol.TCP, Family.V4), VIEW)
    first = index.resolve([a, b], svc, svc.ports[0], VIEW)
    assert first.added == first.endpoints and first.removed == ()
    # b rewritten, one endpoint flipped: only that one is new, even within b.
    b2 = EndpointSlice("ns", "b", "svc", Family.V4, b.ports,
                       (Endpoint(ADDRS[2], ready=False), Endpoint(ADDRS[3])))
    second = index.resolve([a, b2], svc, svc.ports[0], VIEW)
    assert [x is y for x, y in zip(second.endpoints, first.endpoints, strict=True)] \
        == [True, True, False, True]
    assert not second.endpoints[2].endpoint.ready
    assert second.removed == (first.endpoints[2],) and second.added == (second.endpoints[2],)
    # Nothing changed: the very same tuple, no changes.
    third = index.resolve([a, b2], svc, svc.ports[0], VIEW)
    assert third.endpoints is second.endpoints and not third.removed and not third.added


def test_an_index_follows_services_and_nodes_as_categorize_does() -> None:
    slices = [EndpointSlice("ns", f"s{i}", "svc", Family.V4,
                            (SlicePort("http", Protocol.TCP, 80),),
                            tuple(Endpoint(ip_address(f"198.19.{i}.{j}"), ready=j % 3 != 0,
                                           serving=j % 2 == 0, terminating=j % 3 == 0,
                                           node_name=f"node-{j % 4}", zone=f"zone-{j % 2}")
                                  for j in range(1, 40)))
              for i in range(4)]
    index = PortIndex(("http", Protocol.TCP, Family.V4), VIEW)
    for spec in ({}, {"internalTrafficPolicy": "Local"}, {"trafficDistribution": "PreferClose"},
                 {"trafficDistribution": "PreferSameNode", "type": "NodePort",
                  "externalTrafficPolicy": "Local"}):
        for view in (NodeView("node-1", "zone-1"), NodeView("node-2", "zone-0"),
                     NodeView("node-9")):
            svc = _svc(**spec)
            for drop in range(3):  # one slice changes each time: the rest is kept
                current = slices[:drop] + slices[drop + 1:]
                res = index.resolve(current, svc, svc.ports[0], view)
                assert (res.endpoints, res.topology, res.uses_cluster, res.uses_local,
                        res.conflicts) == _fresh(current, svc, "http", Protocol.TCP, view)


def _slice(index: int, not_ready: int | None = None, size: int = 100) -> dict[str, Any]:
    return eps_slice(f"svc-{index:03d}", [
        ep(f"198.19.{index}.{j}", node=f"node-{chr(97 + j % 3)}", zone=f"zone-{chr(97 + j % 2)}",
           ready=j != not_ready)
        for j in range(1, size + 1)])


def test_a_large_service_resolves_as_a_fresh_model_would() -> None:
    """One endpoint of a 600-endpoint service goes not ready and back, slice by slice;
    after each change the memoed model's state equals a model built from scratch."""
    objects: dict[str, dict[str, Any]] = {"svc": service(), "node": node()}
    objects.update({f"s{i}": _slice(i) for i in range(6)})
    model = ClusterModel("node-a")
    for obj in objects.values():
        apply_object(model, obj, EndpointsSource.ENDPOINT_SLICES)
    before = model.resolve()
    key = ServicePortKey("ns", "svc", "http", Family.V4)
    assert key in model._memos
    for step, (index, down) in enumerate([(2, 7), (2, None), (5, 100), (0, 1), (5, None)]):
        objects[f"s{index}"] = _slice(index, down)
        apply_object(model, objects[f"s{index}"], EndpointsSource.ENDPOINT_SLICES)
        state = model.resolve()
        assert state.changed == {key}, step
        fresh = ClusterModel("node-a")
        for obj in objects.values():
            apply_object(fresh, obj, EndpointsSource.ENDPOINT_SLICES)
        assert state.ports == fresh.resolve().ports
        # Endpoints of slices that did not change are the objects resolved before.
        old = {str(s.endpoint): s for s in before.ports[key].endpoints}
        new = {str(s.endpoint): s for s in state.ports[key].endpoints}
        untouched = "198.19.3.50:8080"
        assert new[untouched] is old[untouched]
        # The delta names the one endpoint that flipped, and nothing else.
        delta = state.ports[key].endpoint_delta(before.ports[key])
        assert delta is not None and len(delta.removed) == len(delta.added) == 1, step
        assert str(delta.removed[0].endpoint) == str(delta.added[0].endpoint)
        before = state
    # The service gone: its memo goes with it.
    model.delete_service("ns", "svc")
    model.resolve()
    assert key not in model._memos


def test_small_ports_keep_no_memo() -> None:
    model = ClusterModel("node-a")
    for obj in (service(), node(), _slice(1, size=tracker.MEMO_MIN_ENDPOINTS - 1)):
        apply_object(model, obj, EndpointsSource.ENDPOINT_SLICES)
    model.resolve()
    assert model._memos == {}
