"""The real agent (`python -m proxy`) in a lab node namespace, served the hostile corpus
(tests/corpus/hostile.py) by a simulator that does not validate it, as a lying or broken
API server would: objects the real API server would refuse go straight into the store
(`Store.insert_unvalidated`), half of them before the agent starts (its first list),
half while it runs (watch events).

The agent must stay up (the same process, healthy), record every skipped thing with the
reason the in-process model gives for the same objects (the model's own expectations
are pinned by tests/unit/test_hostile_corpus.py), keep every hostile string and every
unusable address out of the kernel's rules, and go on serving a normal service.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from proxy.kube import identity
from proxy.kube.ingest import EndpointsSource
from proxy.netns_lab import Lab
from proxy.sim import SimServer
from proxy.sim.store import type_of
from tests.corpus import hostile, pipeline
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    iptables_save,
    namespace_object,
    node_object,
    one_backend_lab,
    our_rules,
    service,
    start_sim,
    wait_for,
)

pytestmark = pytest.mark.root

NORMAL_VIP = "198.18.200.10"  # in the simulator's service range, used by no case


@pytest.fixture
def lab() -> Iterator[Lab]:
    with one_backend_lab() as lab:
        yield lab


def corpus() -> list[tuple[hostile.Case, dict[str, Any]]]:
    """The slice-mode cases meant for the e2e, without Node objects (the agent only
    watches its own Node, so other Nodes never reach it)."""
    return [(c, obj) for c, obj in hostile.all_objects(EndpointsSource.ENDPOINT_SLICES,
                                                        e2e_only=True)
            if obj.get("kind") != "Node"]


def inject(sim: SimServer, objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        # metadata that is no object (metadata: []) gives the store no key: it is stored
        # under the agent's own key for it and served as given.
        name = None if isinstance(obj.get("metadata"), dict) else identity.object_key(obj)[1]
        sim.call(sim.store.insert_unvalidated, type_of(obj, sim.store.surface), obj, name)


def unusable_metadata(objects: list[dict[str, Any]]) -> bool:
    return any(not isinstance(obj.get("metadata"), dict) for obj in objects)


def test_hostile_objects_are_skipped_shown_and_kept_out_of_the_kernel(
        lab: Lab, tmp_path: Path) -> None:
    cases = corpus()
    objects = [obj for _, obj in cases]
    want = pipeline.reasons(pipeline.build_model(objects))
    assert want, "the corpus must skip something"
    first, later = objects[::2], objects[1::2]
    # Objects with metadata [] both in the agent's first list and in watch events.
    assert unusable_metadata(first) and unusable_metadata(later)

    with start_sim(lab, [node_object(), namespace_object("demo")]) as sim:
        inject(sim, first)
        agent = AgentProcess(lab, sim, tmp_path).start()
        try:
            agent.wait_ready(timeout=60)
            inject(sim, later)
            b = lab.backends["web-1"]
            sim.apply(service("web", [NORMAL_VIP]))
            sim.apply(endpoint_slice("web-1", "web", [endpoint(b.ipv4)]))
            lab.wait_for(lab.client_ns, NORMAL_VIP, 80, {"web-1"}, deadline=60)

            def summary() -> dict[str, Any]:
                got: dict[str, Any] = agent.dump(timeout=30)["skipped_summary"]
                return got
            wait_for(lambda: summary()["by_reason"] == want, 60,
                     f"the dump to count {want}; last {summary()['by_reason']}", interval=0.5)

            # Alive all along (one process, never restarted) and healthy.
            assert agent.alive(), agent.log_tail()
            status, body = agent.healthz()
            assert status == 200, body
            assert "Traceback" not in agent.log_text()

            doc = agent.dump(timeout=30)
            check_dump(doc, cases, want)
            metrics = agent.metrics()
            counted = sum(v for k, v in metrics.items()
                          if k.startswith("sliceproxy_skipped_objects{"))
            assert counted == sum(want.values())

            check_kernel(lab, cases)
            # The normal service still gets traffic, after everything was injected.
            assert set(lab.ask(lab.client_ns, NORMAL_VIP, 80, count=10)) == {"web-1"}
            assert agent.alive()
        finally:
            if agent.alive():
                agent.stop()


def check_dump(doc: dict[str, Any], cases: list[tuple[hostile.Case, dict[str, Any]]],
               want: dict[str, int]) -> None:
    """Each case's skipped objects are listed, with reasons the case expects."""
    summary = doc["skipped_summary"]
    assert summary["total"] == sum(want.values())
    records = doc["skipped"]
    assert len(records) == summary["records_shown"] and summary["records_omitted"] == 0
    # Records by namespace; those of objects without a usable name by their key's name
    # ("?" and a hash: proxy/kube/identity.py), which is all that tells them apart.
    by_place: dict[str, set[str]] = {}
    for r in records:
        assert r["reason"] and r["detail"], r
        place = r["name"] if r["name"].startswith(identity.UNKEYED_PREFIX) else r["namespace"]
        by_place.setdefault(place, set()).add(r["reason"])
    places: dict[str, set[str]] = {}
    for c, obj in cases:
        key = identity.key(obj)
        places.setdefault(c.name, set()).add(
            identity.unkeyed_key(obj)[1] if key is None else key[0] or "default")
    for c in {c.name: c for c, _ in cases}.values():
        if not c.expect:
            continue
        shown = set().union(*(by_place.get(p, set()) for p in places[c.name]))
        assert shown, f"{c.name}: nothing in the dump's skipped list"
        assert shown <= set(c.expect), f"{c.name}: {shown} not all in {set(c.expect)}"


def check_kernel(lab: Lab, cases: list[tuple[hostile.Case, dict[str, Any]]]) -> None:
    """Our rules, as iptables-save prints them from the kernel: no hostile string, every
    address canonical and usable."""
    rules = our_rules(lab)
    assert rules, "the agent wrote no rules"
    text = "\n".join(rules)
    for c, _ in cases:
        for needle in c.never:
            assert needle not in text, f"{c.name}: {needle!r} is in the kernel's rules"
    for needle in ("%", "flush ruleset", "a -j ACCEPT", "::ffff:"):
        assert needle not in text, needle
    saved = iptables_save(lab, "4") + iptables_save(lab, "6")
    found = pipeline.addresses_in_save(saved)
    assert not found, pipeline.first_problems(found)
