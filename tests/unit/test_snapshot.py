"""`DesiredState.changed_since`: what a data plane re-renders on a partial sync.

A data plane asks which service ports differ from the snapshot it last applied. When the
new snapshot was evolved straight from that one, the answer is the snapshot's own
`changed`; across a skipped snapshot, backwards, or between unrelated snapshots it must
still be exact, or a partial sync would leave a port's old rules in the kernel.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.model.snapshot import DesiredState, EndpointDelta, ResolvedServicePort, Topology
from proxy.model.types import (
    Family,
    Protocol,
    Service,
    ServicePort,
    ServicePortKey,
    ServiceType,
)

KEYS = [ServicePortKey("ns", f"svc{i}", "http", family)
        for i in range(4) for family in (Family.V4, Family.V6)]


def entry(key: ServicePortKey, version: int) -> ResolvedServicePort:
    """A resolved port whose content depends on `version` (equal versions: equal values)."""
    port = ServicePort(name=key.port, protocol=Protocol.TCP, port=80 + version)
    service = Service(namespace=key.namespace, name=key.name, type=ServiceType.CLUSTER_IP,
                      cluster_ips=(), ports=(port,))
    return ResolvedServicePort(key=key, service=service, port=port, cluster_ips=(),
                               uses_cluster=True, uses_local=False, endpoints=(),
                               topology=Topology("cluster", "", ""))


def differing(a: DesiredState, b: DesiredState) -> frozenset[ServicePortKey]:
    """Keys whose entry is not the very same object: a data plane re-renders those (an
    equal port removed and added back is rendered again, harmlessly)."""
    return frozenset(k for k in a.ports.keys() | b.ports.keys() if a.get(k) is not b.get(k))


updates_strategy = st.dictionaries(st.sampled_from(KEYS),
                                   st.one_of(st.none(), st.integers(0, 2)), max_size=4)


@settings(max_examples=200, deadline=None)
@given(st.lists(updates_strategy, min_size=1, max_size=6), st.data())
def test_changed_since_any_earlier_snapshot_is_exactly_what_differs(
        steps: list[dict[ServicePortKey, int | None]], data: Any) -> None:
    states = [DesiredState()]
    for step in steps:
        states.append(states[-1].evolve(
            {k: (entry(k, v) if v is not None else None) for k, v in step.items()}))
    later = data.draw(st.integers(0, len(states) - 1))
    earlier = data.draw(st.integers(0, len(states) - 1))
    found = states[later].changed_since(states[earlier])
    assert found == differing(states[later], states[earlier])
    # Never fewer than the ports whose content differs.
    assert found >= {k for k in KEYS if states[later].get(k) != states[earlier].get(k)}


def test_a_state_evolved_from_the_last_applied_reports_its_own_changes() -> None:
    first = DesiredState().evolve({KEYS[0]: entry(KEYS[0], 0), KEYS[1]: entry(KEYS[1], 0)})
    second = first.evolve({KEYS[1]: entry(KEYS[1], 1), KEYS[2]: entry(KEYS[2], 0)})
    assert second.changed_since(first) == {KEYS[1], KEYS[2]}
    # An equal value is no change: the old object stays, so identity still holds.
    third = second.evolve({KEYS[0]: entry(KEYS[0], 0)})
    assert third.get(KEYS[0]) is first.get(KEYS[0])
    assert third.changed_since(second) == frozenset()
    assert third.changed_since(third) == frozenset()
    assert third.changed_since(None) == {KEYS[0], KEYS[1], KEYS[2]}


def test_a_sibling_is_compared_in_full_not_by_its_own_changes() -> None:
    base = DesiredState().evolve({KEYS[0]: entry(KEYS[0], 0)})
    left = base.evolve({KEYS[1]: entry(KEYS[1], 0)})
    right = base.evolve({KEYS[2]: entry(KEYS[2], 0)})
    # Same generation, same parent, but not each other's parent.
    assert left.generation == right.generation
    assert right.changed_since(left) == {KEYS[1], KEYS[2]}
    # One generation after `left`, but evolved from its sibling: not left's child.
    after_right = right.evolve({KEYS[3]: entry(KEYS[3], 0)})
    assert after_right.generation == left.generation + 1
    assert after_right.changed_since(left) == {KEYS[1], KEYS[2], KEYS[3]}


def test_evolve_takes_a_delta_from_the_entry_it_replaces_as_a_change() -> None:
    """A delta recorded against the old entry's token says the port changed (evolve
    does not compare 50,000 endpoints to learn it); one against another token proves
    nothing, so an equal entry carrying it changes nothing."""
    key = KEYS[0]
    old = entry(key, 0)
    state = DesiredState().evolve({key: old})
    stale = replace(entry(key, 0), delta=EndpointDelta(object(), (), ()))
    assert state.evolve({key: stale}).changed == frozenset()
    assert state.evolve({key: stale}).get(key) is old
    from_old = replace(entry(key, 0), delta=EndpointDelta(old.token, (), ()))
    assert state.evolve({key: from_old}).changed == {key}


PROTOCOLS = (Protocol.TCP, Protocol.UDP, Protocol.SCTP)


@settings(max_examples=200, deadline=None)
@given(st.lists(updates_strategy, min_size=1, max_size=12))
def test_the_datagram_ports_are_the_udp_and_sctp_ports_after_every_change(
        steps: list[dict[ServicePortKey, int | None]]) -> None:
    """What the conntrack reconcile walks (family_sync.py): every UDP and SCTP port as
    the state holds it, whichever way a port changed protocol or went, and no other."""
    def of(key: ServicePortKey, version: int) -> ResolvedServicePort:
        rsp = entry(key, version)
        port = replace(rsp.port, protocol=PROTOCOLS[version])
        return replace(rsp, port=port, service=replace(rsp.service, ports=(port,)))

    state = DesiredState()
    for step in steps:
        state = state.evolve({k: (of(k, v) if v is not None else None) for k, v in step.items()})
        wanted = {k: rsp for k, rsp in state.ports.items()
                  if rsp.port.protocol is not Protocol.TCP}
        assert dict(state.datagram_ports) == wanted
        assert all(state.datagram_ports[k] is rsp for k, rsp in wanted.items())
        assert state.evolve({}).datagram_ports == wanted
