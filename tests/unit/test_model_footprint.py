"""What the model keeps for each endpoint and each service stays small (a million
endpoints at 100,000 services x 10: every 8 bytes an endpoint is 8 MB), and the shapes
that make it small read back exactly what was decoded."""

from __future__ import annotations

import itertools
import sys
from ipaddress import ip_address

from proxy.model.shared import SharedValues
from proxy.model.snapshot import EndpointSet, MergedEndpoint, SelectedEndpoint
from proxy.model.types import Endpoint
from tests.unit.builders import ep, eps_slice, model_of, service

A = ip_address("198.19.0.1")
B = ip_address("198.19.0.2")


def test_an_endpoint_reads_back_every_field_it_was_made_with() -> None:
    fields = {"ready": False, "serving": True, "terminating": True, "node_name": "node-b",
              "zone": "zone-b", "zone_hints": ("zone-a", "zone-b"), "node_hints": ("node-b",)}
    e = Endpoint(A, **fields)  # type: ignore[arg-type]
    assert {name: getattr(e, name) for name in fields} == fields
    assert e.address == A
    assert Endpoint(A) == Endpoint(A, True, True, False, None, None, (), ())
    assert (Endpoint(A).ready, Endpoint(A).zone_hints) == (True, ())
    assert e.changed(ready=True) == Endpoint(A, **{**fields, "ready": True})  # type: ignore[arg-type]
    assert e.changed(node_hints=()) != e


def test_endpoints_alike_share_their_state_and_hints() -> None:
    a = Endpoint(A, node_name="node-a", zone="zone-a", zone_hints=("zone-a",))
    b = Endpoint(B, node_name="node-a", zone="zone-a", zone_hints=("zone-a",))
    assert a.state is b.state and a.hints is b.hints
    assert Endpoint(A).hints is Endpoint(B).hints
    assert sys.getsizeof(a) <= 56  # three fields: 64 bytes in pymalloc's classes


def test_a_shared_table_is_bounded_and_what_it_shared_stays_right() -> None:
    table: SharedValues[tuple[str, int]] = SharedValues(limit=3)
    first = table(("node-a", 1))
    assert table(("node-a", 1)) is first
    made = [table((f"node-{i}", i)) for i in range(10)]
    assert len(table) <= 3
    assert first == ("node-a", 1) and made[-1] == ("node-9", 9)
    assert table(("node-9", 9)) is made[-1]  # the newest are shared again


def test_a_selected_endpoint_is_one_object_that_reads_as_its_merged_endpoint() -> None:
    merged = MergedEndpoint(Endpoint(A, node_name="node-a"), 8080, ("s1",))
    sel = SelectedEndpoint.of(merged, frozenset({EndpointSet.CLUSTER}), "ready")
    assert sel.endpoint == merged
    assert (sel.address, sel.port, sel.node_name, str(sel)) == (A, 8080, "node-a",
                                                               "198.19.0.1:8080")
    assert sel.in_cluster and not sel.in_local
    assert sys.getsizeof(sel) <= 80  # six fields, where a merged and a selected took 128


def test_a_services_sources_are_kept_in_one_order_whatever_order_they_came() -> None:
    """The model's record of a service's slices is the same however they arrived (what
    a fresh model makes: tests/integration/test_watch_churn.py compares the two), and so
    is what they resolve to."""
    slices = [eps_slice(f"s{i}", [ep(f"198.19.0.{i + 1}", node="node-a"),
                                  ep("198.19.0.9", node=f"node-{i}")]) for i in range(3)]
    results = set()
    for order in itertools.permutations(slices):
        model = model_of(service(), *order)
        results.add(tuple(model.resolve().ports.items()))
        assert model._by_service == {("ns", "svc"): ("EndpointSlice/s0", "EndpointSlice/s1",
                                                    "EndpointSlice/s2")}
    assert len(results) == 1
    model = model_of(service(), *slices)
    model.delete_slice("ns", "s1")
    resolved = next(iter(model.resolve().ports.values()))
    assert sorted(str(s.address) for s in resolved.endpoints) == [
        "198.19.0.1", "198.19.0.3", "198.19.0.9"]
