"""The hostile corpus (tests/corpus/hostile.py) through decode -> model -> the iptables and
IPVS renderers: nothing raises, each case is recorded with the reasons it expects, no
hostile string reaches a rule, every rule is valid kernel input (tests/corpus/pipeline.py),
and the records stay bounded however large the input."""

from __future__ import annotations

import json

import pytest

from proxy.kube.ingest import EndpointsSource, apply_object
from proxy.model.tracker import RECORDS_PER_OBJECT
from proxy.server.dump import SKIPPED_SHOWN, build_dump
from tests.corpus import hostile, pipeline
from tests.corpus.hostile import CASES, Case

# The dump and every record must stay small whatever the input: a record quotes at most
# 80 characters of a value and names are cut to 253.
RECORD_CHARS = 700


def check_rendered(c: Case, rendered: pipeline.Rendered) -> None:
    found = pipeline.problems(rendered)
    assert not found, f"{c.name}: invalid kernel input:\n{pipeline.first_problems(found)}"
    text = rendered.rule_text()
    for needle in c.never:
        assert needle not in text, f"{c.name}: {needle!r} reached a rule"
    for needle in c.shown:
        assert needle in text, f"{c.name}: no rule shows {needle!r}"


@pytest.mark.parametrize("c", CASES, ids=[c.name for c in CASES])
def test_case(c: Case) -> None:
    model, rendered = pipeline.run(c.objects("hostile"), c.source)
    assert pipeline.reasons(model) == c.expect, c.name
    check_rendered(c, rendered)
    for skip in model.skipped():
        assert len(json.dumps(skip.as_dict())) < RECORD_CHARS, skip


@pytest.mark.parametrize("source", [EndpointsSource.ENDPOINT_SLICES, EndpointsSource.ENDPOINTS],
                         ids=["slices", "endpoints"])
def test_whole_corpus_at_once(source: EndpointsSource) -> None:
    """Every case in its own namespace, in one model: each reason counted as often as
    the cases together expect, in the model, the metric's counts and the dump."""
    objects = [obj for _, obj in hostile.all_objects(source)]
    model, rendered = pipeline.run(objects, source)
    want = hostile.expected(source)
    assert pipeline.reasons(model) == want
    for c in CASES:
        if c.source is source:
            check_rendered(c, rendered)

    doc = build_dump(config={}, model=model, applied=None, applied_note=None, syncs=[],
                     health={}, watch={})
    summary = doc["skipped_summary"]
    assert summary["by_reason"] == want
    assert summary["total"] == sum(want.values())
    assert len(doc["skipped"]) <= SKIPPED_SHOWN
    assert len(json.dumps(doc["skipped"])) < SKIPPED_SHOWN * RECORD_CHARS
    assert 0 < len(summary["recent"]) <= 20


def test_records_are_bounded_per_object_but_all_counted() -> None:
    model, _ = pipeline.run([
        hostile.service("ns"),
        hostile.eslice("ns", "bad", [hostile.endpoint("127.0.0.1")] * 900),
    ])
    assert model.skip_counts() == {("EndpointSlice", "special-ip"): 900}
    assert len(model.skipped()) == RECORDS_PER_OBJECT


def test_recent_records_come_newest_first_and_a_relist_does_not_reorder() -> None:
    model = pipeline.build_model([])
    older = hostile.service("ns", "older", ips=("127.0.0.1",))
    newer = hostile.service("ns", "newer", ips=("0.0.0.0",))
    for obj in (older, newer, older):  # the last one: the same object again
        apply_object(model, obj)
    assert [s.name for s in model.recent_skips(10)][:2] == ["newer", "newer"]
    apply_object(model, hostile.service("ns", "older", ips=("::1",)))  # changed
    assert model.recent_skips(1)[0].name == "older"


def test_an_object_fixed_later_loses_its_records() -> None:
    model = pipeline.build_model([hostile.service("ns", ips=("127.0.0.1",))])
    assert model.skip_counts()
    apply_object(model, hostile.service("ns"))
    assert model.skip_counts() == {} and model.skipped() == []


def test_no_two_service_ports_share_a_chain_even_with_colliding_text() -> None:
    """`ns/b:c` is both (b, port c) and (`b:c`, unnamed): the second is refused, so the
    only service port left owns its chains alone."""
    c = hostile.by_name("chain-hash-collision")
    _, rendered = pipeline.run(c.objects("ns"))
    assert [k.name for k in rendered.state.ports] == ["b"]
    assert not pipeline.chain_collisions(rendered.iptables[pipeline.Family.V4])


def test_leading_zeros_are_read_as_decimal_like_kube_proxy() -> None:
    """198.018.001.011 is 198.18.1.11 (Go's old parser, netutils.ParseIPSloppy), and
    the rules say so canonically: inet_aton, and so iptables itself, would read "011"
    as octal 9."""
    _, rendered = pipeline.run(hostile.by_name("endpoint-leading-zeros").objects("ns"))
    (rsp,) = rendered.state.ports.values()
    assert [str(e) for e in rsp.cluster_endpoints] == ["198.18.1.11:8080"]
    assert "198.18.1.9" not in rendered.rule_text()


def test_an_object_without_a_usable_name_is_recorded_under_the_reflectors_key() -> None:
    """metadata [] (or a name that is no string): ingest records the skip under the key
    the reflector passes the object on under ("?" and a hash of its content), so the
    deletion a relist finds removes the record; the same content is one object, other
    content another."""
    from proxy.kube import identity
    from proxy.kube.ingest import delete_object
    from proxy.model.tracker import ClusterModel

    objects = hostile.by_name("metadata-not-an-object").objects("ns")
    model = ClusterModel(pipeline.NODE)
    for obj in [*objects, *objects]:  # a relist: nothing new
        apply_object(model, obj)
    keys = [identity.object_key(obj) for obj in objects]
    assert len(set(keys)) == len(objects)
    assert all(ns == "" and name.startswith("?") for ns, name in keys)
    assert sorted((s.namespace, s.name, s.reason) for s in model.skipped()) == sorted(
        (ns, name, "malformed") for ns, name in keys)
    # A resourceVersion is no part of the key: a DELETED event, at a later revision
    # than the object's ADDED, names the same object.
    unnamed = {"kind": "Service", "metadata": {"namespace": "ns", "resourceVersion": "5"}}
    assert identity.object_key(unnamed) == identity.object_key(
        {**unnamed, "metadata": {"namespace": "ns", "resourceVersion": "6"}})
    for obj, (ns, name) in zip(objects, keys, strict=True):
        delete_object(model, obj["kind"], ns, name)
    assert model.skipped() == []
