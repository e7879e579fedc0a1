"""The render index: partial updates must end where a rendering from scratch ends, and
what they report touched must turn the old kernel objects into the new ones exactly."""

from __future__ import annotations

from ipaddress import ip_address
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs.index import RenderIndex, Touched
from proxy.dataplane.ipvs.render import IpvsContext, render_all
from proxy.kube.ingest import apply_object, delete_object
from proxy.model.tracker import ClusterModel
from proxy.model.types import Family
from tests.unit.builders import ep, eps_slice, node, service

CTX = IpvsContext.build(DataplaneOptions(node_name="node-a"),
                          [ip_address("198.18.0.1"), ip_address("fd00:18::1")])
NAMES = ("a", "b", "c")


def svc(name: str, variant: int) -> dict[str, Any]:
    """Variants share addresses between services on purpose (conflicts, shared entries)."""
    spec: dict[str, Any] = {}
    if variant % 3 == 1:
        spec = {"type": "NodePort", "externalTrafficPolicy": "Local"}
    if variant % 4 == 2:
        spec["externalIPs"] = ["198.18.2.60"]  # the same external IP in several services
    if variant % 5 == 3:
        spec["sessionAffinity"] = "ClientIP"
    port: dict[str, Any] = {"name": "http", "port": 80 + variant % 2}
    if spec.get("type") == "NodePort":
        port["nodePort"] = 30000 + NAMES.index(name)
    ips = (f"198.18.128.{NAMES.index(name) + 1}", f"fd00:198:18::{NAMES.index(name) + 1}")
    return service(name, ips=ips, ports=(port,), **spec)


def slc(name: str, members: list[int]) -> dict[str, Any]:
    return eps_slice(f"{name}-1", [ep(f"198.18.1.{10 + m}", node=f"node-{'ab'[m % 2]}",
                                      ready=m % 3 != 2) for m in members],
                     service_name=name)


op = st.one_of(
    st.tuples(st.just("svc"), st.sampled_from(NAMES), st.integers(0, 11)),
    st.tuples(st.just("slice"), st.sampled_from(NAMES),
              st.lists(st.integers(0, 5), max_size=4, unique=True)),
    st.tuples(st.just("delete"), st.sampled_from(NAMES)),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(op, min_size=1, max_size=12), st.integers(1, 4))
def test_partial_updates_equal_a_fresh_render(ops: list[tuple[Any, ...]], every: int) -> None:
    model = ClusterModel("node-a")
    apply_object(model, node())
    index = RenderIndex()
    entries, addresses = set(), set()
    vss: dict[Any, Any] = {}
    last = model.resolve()
    for i, item in enumerate(ops):
        if item[0] == "svc":
            apply_object(model, svc(item[1], item[2]))
        elif item[0] == "slice":
            apply_object(model, slc(item[1], item[2]))
        else:
            delete_object(model, "Service", "ns", item[1])
        if (i + 1) % every and i + 1 != len(ops):
            continue  # several changes folded into one sync
        state = model.resolve()
        touched = Touched()
        for key in set(state.ports) | set(last.ports):
            rsp = state.ports.get(key)
            index.update(key, None if rsp is None else render_all(state, CTX)[key], touched)
        # What was touched moves the previous kernel objects to the new ones, exactly.
        assert not touched.entries_added & entries
        assert touched.entries_removed <= entries
        entries = (entries - touched.entries_removed) | touched.entries_added
        addresses = (addresses - touched.addresses_removed) | touched.addresses_added
        assert entries == index.entries()
        assert addresses == index.addresses()
        # Every virtual server that changed owner or content was reported as touched.
        now = index.virtual_servers()
        for key in set(now) | set(vss):
            if now.get(key) != vss.get(key):
                assert key in touched.virtual_servers
        vss = now
        fresh = RenderIndex(render_all(state, CTX))
        assert fresh.virtual_servers() == now
        assert fresh.entries() == index.entries()
        assert fresh.addresses() == index.addresses()
        last = state


def test_two_ports_claiming_one_virtual_server_first_key_wins() -> None:
    """The index's own arbitration, a second line behind the model's (which gives a
    claimed destination to one service before rendering): each service rendered by a
    model of its own, so both claims reach the index."""
    rendered = {}
    for name in ("b", "a"):
        model = ClusterModel("node-a")
        apply_object(model, service(name, ips=(f"198.18.128.{ord(name)}",),
                                    ports=({"name": "http", "port": 80},),
                                    externalIPs=["198.18.2.60"]))
        rendered.update(render_all(model.resolve(), CTX))
    index = RenderIndex(rendered)
    vs_key = next(k for k in index.virtual_servers() if str(k) == "TCP 198.18.2.60:80")
    owner, _vs = index.virtual_servers()[vs_key]
    assert owner.name == "a"
    assert [k.name for k in index.conflicts([vs_key])[vs_key]] == ["a", "b"]
    # The shared address stays on the dummy interface until its last user goes.
    touched = Touched()
    a_key = next(k for k in index.ports if k.name == "a" and k.family is Family.V4)
    index.update(a_key, None, touched)
    assert ip_address("198.18.2.60") not in touched.addresses_removed
    assert index.virtual_servers()[vs_key][0].name == "b"
    assert vs_key in touched.virtual_servers
