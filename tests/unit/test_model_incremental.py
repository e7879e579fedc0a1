"""The incremental resolve of large service ports (incremental.PortIndex) against a fresh
model, step by step, and the endpoint deltas it records (ResolvedServicePort.delta).

Random sequences (seeded, so a failure replays) of slice adds, updates and deletes,
endpoints flipping conditions, moving nodes and zones, hints, duplicates across slices
that disagree, services changing policies and topology, the node changing zone. After
every step the model's state must equal that of a fresh model fed the same objects, and
every delta must be exact: old endpoints - removed + added == new endpoints, with
nothing in removed or added that did not change.
"""

from __future__ import annotations

import random
from dataclasses import replace
from ipaddress import ip_address

import pytest

from proxy.model import incremental, tracker
from proxy.model.incremental import endpoint_changes
from proxy.model.merge import merge_port
from proxy.model.selection import NodeView, categorize
from proxy.model.snapshot import DesiredState, ResolvedServicePort, SelectedEndpoint
from proxy.model.tracker import ClusterModel
from proxy.model.types import (
    LABEL_HOSTNAME,
    LABEL_ZONE,
    Endpoint,
    EndpointSlice,
    Family,
    IPAddress,
    Node,
    Protocol,
    Service,
    ServicePort,
    ServiceType,
    SlicePort,
    TrafficPolicy,
)

NODE = "node-a"
NODES = ("node-a", "node-b", "node-c")
ZONES = ("zone-a", "zone-b", None)
V4 = [ip_address(f"198.19.0.{i}") for i in range(1, 49)]
V6 = [ip_address(f"2001:db8::{i:x}") for i in range(1, 9)]
SLICE_NAMES = [f"s{i}" for i in range(6)]
SLICE_PORTS = [
    (SlicePort("http", Protocol.TCP, 8080),),
    (SlicePort("http", Protocol.TCP, 8080), SlicePort("dns", Protocol.UDP, 53)),
    (SlicePort("http", Protocol.TCP, 8081),),  # the same address on another number
    (SlicePort("http", Protocol.UDP, 8080),),  # another protocol: not this port's
]
STEPS = 60


class World:
    """The objects a model is fed, and random changes to them."""

    def __init__(self, rnd: random.Random) -> None:
        self.rnd = rnd
        self.service = Service("ns", "svc", ServiceType.CLUSTER_IP,
                               (ip_address("198.18.0.1"),),
                               (ServicePort("http", Protocol.TCP, 80),
                                ServicePort("dns", Protocol.UDP, 53)))
        self.slices: dict[str, EndpointSlice] = {}
        self.zone: str | None = "zone-a"
        for name in SLICE_NAMES[:4]:
            self.slices[name] = self.new_slice(name)

    def node(self) -> Node:
        labels = [(LABEL_HOSTNAME, NODE)]
        if self.zone:
            labels.append((LABEL_ZONE, self.zone))
        return Node(NODE, tuple(sorted(labels)))

    def feed(self, model: ClusterModel) -> None:
        model.set_node(self.node())
        model.apply_service(self.service)
        for name in SLICE_NAMES:
            if name in self.slices:
                model.apply_slice(self.slices[name])
            else:
                model.delete_slice("ns", name)

    # --- random objects ---------------------------------------------------------------

    def new_endpoint(self, family: Family, address: IPAddress | None = None) -> Endpoint:
        r = self.rnd
        ready = r.random() < 0.7
        return Endpoint(
            address=address or r.choice(V4 if family is Family.V4 else V6),
            ready=ready,
            serving=ready or r.random() < 0.5,
            terminating=not ready and r.random() < 0.6,
            node_name=r.choice(NODES),
            zone=r.choice(ZONES),
            zone_hints=self.hints(("zone-a", "zone-b")),
            node_hints=self.hints(NODES),
        )

    def hints(self, names: tuple[str, ...]) -> tuple[str, ...]:
        if self.rnd.random() < 0.5:
            return ()
        return tuple(sorted(self.rnd.sample(names, self.rnd.randint(1, 2))))

    def new_slice(self, name: str) -> EndpointSlice:
        family = Family.V6 if self.rnd.random() < 0.15 else Family.V4
        pool = V4 if family is Family.V4 else V6
        # Mostly distinct addresses, as a controller writes them; now and then one twice.
        addresses = self.rnd.sample(pool, self.rnd.randint(0, 8))
        if addresses and self.rnd.random() < 0.1:
            addresses.append(addresses[0])
        endpoints = tuple(self.new_endpoint(family, a) for a in addresses)
        return EndpointSlice("ns", name, "svc", family, self.rnd.choice(SLICE_PORTS),
                             endpoints)

    # --- changes ------------------------------------------------------------------------

    def step(self) -> str:
        r = self.rnd
        kinds = ["flip", "flip", "flip", "move", "hint", "duplicate", "new slice",
                 "delete slice", "service", "node", "all hinted", "same"]
        kind = r.choice(kinds)
        getattr(self, "do_" + kind.replace(" ", "_"))()
        return kind

    def pick(self) -> tuple[str, int] | None:
        full = [n for n, sl in self.slices.items() if sl.endpoints]
        if not full:
            return None
        name = self.rnd.choice(full)
        return name, self.rnd.randrange(len(self.slices[name].endpoints))

    def change_endpoint(self, how: str) -> None:
        got = self.pick()
        if got is None:
            return
        name, i = got
        sl = self.slices[name]
        e = sl.endpoints[i]
        r = self.rnd
        if how == "flip":
            ready = r.random() < 0.5
            e = e.changed(ready=ready, serving=ready or r.random() < 0.5,
                          terminating=not ready and r.random() < 0.7)
        elif how == "move":
            e = e.changed(node_name=r.choice(NODES), zone=r.choice(ZONES))
        else:
            e = e.changed(zone_hints=self.hints(("zone-a", "zone-b")),
                          node_hints=self.hints(NODES))
        self.slices[name] = replace(sl, endpoints=(*sl.endpoints[:i], e, *sl.endpoints[i + 1:]))

    def do_flip(self) -> None:
        self.change_endpoint("flip")

    def do_move(self) -> None:
        self.change_endpoint("move")

    def do_hint(self) -> None:
        self.change_endpoint("hint")

    def do_duplicate(self) -> None:
        """An endpoint of one slice listed by another too, its conditions changed."""
        got = self.pick()
        if got is None:
            return
        name, i = got
        source = self.slices[name]
        target = self.rnd.choice(SLICE_NAMES)
        copy = source.endpoints[i].changed(ready=not source.endpoints[i].ready)
        if target not in self.slices:
            self.slices[target] = replace(source, name=target, endpoints=(copy,))
        else:
            sl = self.slices[target]
            self.slices[target] = replace(sl, family=source.family, ports=source.ports,
                                          endpoints=(*sl.endpoints, copy))

    def do_new_slice(self) -> None:
        name = self.rnd.choice(SLICE_NAMES)
        self.slices[name] = self.new_slice(name)

    def do_delete_slice(self) -> None:
        if self.slices:
            del self.slices[self.rnd.choice(sorted(self.slices))]

    def do_all_hinted(self) -> None:
        """Every endpoint hinted (or none): the hints modes need every ready one."""
        zones = self.rnd.choice([(), ("zone-a",), ("zone-b",)])
        nodes = self.rnd.choice([(), ("node-a",), ("node-b",)])
        for name, sl in self.slices.items():
            self.slices[name] = replace(sl, endpoints=tuple(
                e.changed(zone_hints=zones, node_hints=nodes) for e in sl.endpoints))

    def do_service(self) -> None:
        r = self.rnd
        svc = self.service
        field = r.choice(["itp", "etp", "type", "td", "mode", "preference", "protocol",
                          "dual"])
        if field == "itp":
            svc = replace(svc, internal_traffic_policy=r.choice(list(TrafficPolicy)))
        elif field == "etp":
            svc = replace(svc, external_traffic_policy=r.choice(list(TrafficPolicy)))
        elif field == "type":
            node_port = r.choice([0, 30080])
            ports = (replace(svc.ports[0], node_port=node_port), svc.ports[1])
            kind = ServiceType.NODE_PORT if node_port else ServiceType.CLUSTER_IP
            svc = replace(svc, type=kind, ports=ports)
        elif field == "td":
            svc = replace(svc, traffic_distribution=r.choice(
                [None, "PreferClose", "PreferSameZone", "PreferSameNode", "Bogus"]))
        elif field == "mode":
            svc = replace(svc, topology_mode=r.choice([None, "Auto", "Disabled"]))
        elif field == "preference":
            svc = replace(svc, topology_preference=r.choice([
                None, (LABEL_HOSTNAME, LABEL_ZONE, "*"), (LABEL_ZONE,), (LABEL_HOSTNAME,),
                ("bogus", "*")]))
        elif field == "protocol":
            protocol = r.choice([Protocol.TCP, Protocol.UDP])
            svc = replace(svc, ports=(replace(svc.ports[0], protocol=protocol), svc.ports[1]))
        else:
            ips = (ip_address("198.18.0.1"),)
            if r.random() < 0.5:
                ips += (ip_address("2001:db8:ffff::1"),)
            svc = replace(svc, cluster_ips=ips)
        self.service = svc

    def do_node(self) -> None:
        self.zone = self.rnd.choice(["zone-a", "zone-b", None])

    def do_same(self) -> None:
        """A slice written again, unchanged in meaning (a new object)."""
        if self.slices:
            name = self.rnd.choice(sorted(self.slices))
            self.slices[name] = replace(self.slices[name])


def _fresh_state(world: World) -> DesiredState:
    model = ClusterModel(NODE)
    world.feed(model)
    return model.resolve()


def _check_delta(old: ResolvedServicePort, new: ResolvedServicePort, indexed: bool) -> bool:
    """Whether `new` carries a delta from `old`; if it does, that it is exact."""
    delta = new.endpoint_delta(old)
    if delta is None:
        return False
    # The topology's reason (dump text) may differ; its mode may not.
    assert (new.service, new.port, new.cluster_ips, new.uses_cluster, new.uses_local,
            new.topology.mode, new.topology.requested, new.conflicts) == (
        old.service, old.port, old.cluster_ips, old.uses_cluster, old.uses_local,
        old.topology.mode, old.topology.requested, old.conflicts)
    before, after = set(old.endpoints), set(new.endpoints)
    removed, added = set(delta.removed), set(delta.added)
    assert len(removed) == len(delta.removed) and len(added) == len(delta.added)
    assert removed == before - after
    assert added == after - before
    # removed are old objects, added new ones: a data plane may hold either.
    old_ids, new_ids = {id(s) for s in old.endpoints}, {id(s) for s in new.endpoints}
    assert all(id(s) in old_ids for s in delta.removed)
    assert all(id(s) in new_ids for s in delta.added)
    if indexed:
        _check_kept(old.endpoints, new.endpoints, delta.added)
    return True


def _check_kept(old: tuple[SelectedEndpoint, ...], new: tuple[SelectedEndpoint, ...],
                added: tuple[SelectedEndpoint, ...]) -> None:
    """An endpoint that did not change is the very object it was."""
    old_ids = {id(s) for s in old}
    added_ids = {id(s) for s in added}
    assert all(id(s) in old_ids for s in new if id(s) not in added_ids)


# threshold 0: every port keeps an index; 12: ports cross it both ways; huge: none does.
# rebuild_over 2: the index's lists are rebuilt in one pass for 3 changes or more.
@pytest.mark.parametrize(("threshold", "rebuild_over"),
                         [(0, 256), (0, 2), (12, 2), (10**9, 256)])
@pytest.mark.parametrize("seed", range(8))
def test_incremental_resolve_equals_a_fresh_model(seed: int, threshold: int, rebuild_over: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tracker, "MEMO_MIN_ENDPOINTS", threshold)
    monkeypatch.setattr(incremental, "REBUILD_OVER", rebuild_over)
    world = World(random.Random(seed))
    model = ClusterModel(NODE)
    world.feed(model)
    state = model.resolve()
    deltas = 0
    for step in range(STEPS):
        kind = world.step()
        world.feed(model)
        before, state = state, model.resolve()
        assert dict(state.ports) == dict(_fresh_state(world).ports), (step, kind)
        for key, new in state.ports.items():
            old = before.get(key)
            if old is not None and new is not old:
                deltas += _check_delta(old, new, key in model._memos)
            if old is new:
                assert key not in state.changed
    assert deltas > 0  # not vacuous


def test_a_small_ports_changes_are_exact_when_its_endpoints_shift() -> None:
    """One endpoint gone at the front, one new at the back: the same length, every
    place shifted; only those two are changes, not the ones that moved up."""
    svc = Service("ns", "svc", ServiceType.CLUSTER_IP, (ip_address("198.18.0.1"),),
                  (ServicePort("http", Protocol.TCP, 80),))

    def endpoints(first: int) -> tuple[SelectedEndpoint, ...]:
        sl = EndpointSlice("ns", "s", "svc", Family.V4, SLICE_PORTS[0],
                           tuple(Endpoint(V4[i]) for i in range(first, first + 4)))
        merged, _ = merge_port([sl], "http", Protocol.TCP, Family.V4)
        return categorize(merged, svc, svc.ports[0], NodeView(NODE), Family.V4).endpoints

    old, new = endpoints(0), endpoints(1)
    removed, added = endpoint_changes(old, new)
    assert removed == (old[0],) and added == (new[-1],)
    assert endpoint_changes(old, old) == ((), ())
