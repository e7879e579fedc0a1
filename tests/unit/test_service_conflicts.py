"""Two services claiming one destination: the same IP (cluster, external or load-balancer,
in any mix), port and protocol, or the same NodePort and protocol. A real API server's
allocators never allow it; a hostile or buggy one, or our simulator's unvalidated mode,
can. The model arbitrates (the service whose namespace/name sorts first keeps it, as the
IPVS index already did), the loser loses just that claim, with a `conflict` record in
/debug/dump, and both renderers program the winner alone, whatever order the objects
came in."""

from __future__ import annotations

import itertools
import re
from typing import Any

from proxy.dataplane.common.context import context_for
from proxy.dataplane.iptables import render as ipt
from proxy.dataplane.ipvs import render as ipvs
from proxy.dataplane.ipvs.index import RenderIndex, Touched
from proxy.model.types import Family, ServicePortKey
from tests.corpus import pipeline
from tests.unit.builders import ep, eps_slice, model_of, node, service

VIP = "198.18.128.10"


def svc(name: str, ips: tuple[str, ...] = (VIP,), port: int = 80, protocol: str = "TCP",
        **spec: Any) -> dict[str, Any]:
    return service(name, ips=ips, ports=({"name": "http", "port": port, "protocol": protocol,
                                          **spec.pop("port_extra", {})},), **spec)


def balancer(name: str, ip: str) -> dict[str, Any]:
    out = svc(name, ips=(ip,), type="LoadBalancer")
    out["status"] = {"loadBalancer": {"ingress": [{"ip": "198.18.0.30"}]}}
    return out


def backends(name: str, *ips: str) -> dict[str, Any]:
    return eps_slice(f"{name}-1", [ep(ip, node="node-a") for ip in ips], service_name=name)


def key(name: str) -> ServicePortKey:
    return ServicePortKey("ns", name, "http", Family.V4)


def dispatch_owners(state: Any, dest: str) -> dict[str, list[str]]:
    """iptables: per dispatch chain, which ports' entries match `dest` (`-d IP/32 ...
    --dport N`, or `--dport N` in the NodePort chains), in kernel order."""
    ctx = context_for(Family.V4, pipeline.OPTIONS, pipeline.NODE_IPS)
    ports = {k: ipt.render_port(r, ctx) for k, r in state.ports.items() if k.family is Family.V4}
    out: dict[str, list[str]] = {}
    for k in sorted(ports):
        for table, chain, spec in ports[k].entries:
            ip, _, port = dest.rpartition(":")
            if (f"--dport {port} " in spec + " " and
                    (not ip or f"-d {ip}/32 " in spec)):
                out.setdefault(f"{table.value} {chain}", []).append(k.name)
    return out


def ipvs_owner(state: Any, vs: str) -> str | None:
    rendered = ipvs.render_all(state, ipvs.IpvsContext.build(pipeline.OPTIONS,
                                                               pipeline.NODE_IPS))
    index = RenderIndex()
    for k, rules in rendered.items():
        index.update(k, rules, Touched())
    owners = {str(vk): owner.name for vk, (owner, _) in index.virtual_servers().items()}
    assert not index.conflicts(index.virtual_servers()), "the model left a conflict"
    return owners.get(vs)


def conflicts(model: Any) -> list[tuple[str, str, str]]:
    return sorted((s.name, s.part, s.detail) for s in model.skipped() if s.reason == "conflict")


def test_same_cluster_ip_port_protocol_the_first_name_wins_in_both_renderers() -> None:
    """Before: iptables wrote both services' entries for 198.18.128.10:80 (a's REJECT,
    a having no endpoints, and b's DNAT: b got the traffic), IPVS gave the virtual
    server to a (no real servers): the renderers disagreed, and nothing was recorded."""
    objects = [node(), svc("a"), svc("b"), backends("b", "198.18.1.2")]
    for order in itertools.permutations(objects):
        model = model_of(*order)
        state = model.resolve()
        assert state.ports[key("a")].cluster_ips != ()
        assert state.ports[key("b")].cluster_ips == ()
        assert dispatch_owners(state, f"{VIP}:80") == {"filter SPX-SERVICES": ["a"]}
        assert ipvs_owner(state, f"TCP {VIP}:80") == "a"
        assert conflicts(model) == [
            ("b", "ports[http]", f"cluster IP {VIP}:80/TCP is also claimed by ns/a, "
                                 "which keeps it")]


def test_loser_keeps_what_is_not_contested_and_regains_the_rest_when_the_winner_goes() -> None:
    """b shares a's VIP only on port 80; its own second IP and port 443 stay. Deleting
    a gives b the VIP back (its ports are re-resolved) and drops the record."""
    from proxy.kube.ingest import delete_object

    b = service("b", ips=(VIP,), ports=({"name": "http", "port": 80},
                                        {"name": "https", "port": 443}))
    model = model_of(node(), svc("a"), b, backends("a", "198.18.1.1"),
                     backends("b", "198.18.1.2"))
    state = model.resolve()
    assert state.ports[key("b")].cluster_ips == ()
    assert [str(i) for i in state.ports[ServicePortKey("ns", "b", "https", Family.V4)]
            .cluster_ips] == [VIP]
    assert len(conflicts(model)) == 1
    delete_object(model, "Service", "ns", "a")
    state = model.resolve()
    assert [str(i) for i in state.ports[key("b")].cluster_ips] == [VIP]
    assert key("b") in state.changed
    assert conflicts(model) == []


def test_external_ip_node_port_and_cross_role_claims() -> None:
    """An externalIP equal to another service's cluster IP (same port), two services
    with one externalIP, one load-balancer IP, one NodePort: each time the first name
    keeps it; another protocol or port is no conflict."""
    ext = "198.18.0.20"
    objects = [
        node(),
        svc("a", externalIPs=[ext]),
        svc("b", ips=("198.18.128.11",), externalIPs=[VIP, ext]),
        svc("c", ips=("198.18.128.12",), type="NodePort", port_extra={"nodePort": 30080}),
        svc("d", ips=("198.18.128.13",), type="NodePort", port_extra={"nodePort": 30080}),
        svc("e", ips=("198.18.128.14",), type="NodePort", protocol="UDP",
            port_extra={"nodePort": 30080}),
        svc("f", ips=("198.18.128.15",), port=81, externalIPs=[ext]),
        balancer("g", "198.18.128.16"),
        balancer("h", "198.18.128.17"),
        *(backends(n, "198.18.1.1") for n in "abcdefgh"),
    ]
    for order in (objects, objects[::-1]):
        model = model_of(*order)
        state = model.resolve()
        assert conflicts(model) == [
            ("b", "ports[http]", f"external IP {ext}:80/TCP is also claimed by ns/a, "
                                 "which keeps it"),
            ("b", "ports[http]", f"external IP {VIP}:80/TCP is also claimed by ns/a, "
                                 "which keeps it"),
            ("d", "ports[http]", "NodePort 30080/TCP is also claimed by ns/c, which keeps it"),
            ("h", "ports[http]", "load-balancer IP 198.18.0.30:80/TCP is also claimed by ns/g, "
                                 "which keeps it"),
        ]
        assert [str(i) for i in state.ports[key("b")].service.external_ips] == []
        assert state.ports[key("d")].port.node_port == 0
        assert state.ports[key("e")].port.node_port == 30080
        assert [str(i) for i in state.ports[key("f")].service.external_ips] == [ext]
        assert state.ports[key("h")].service.load_balancer_ips == ()
        for dest, owner in ((f"{VIP}:80", "a"), (f"{ext}:80", "a"), ("198.18.0.30:80", "g")):
            got = dispatch_owners(state, dest)
            assert got and all(names == [owner] for names in got.values()), (dest, got)
            assert ipvs_owner(state, f"TCP {dest}") == owner
        nodeports = dispatch_owners(state, ":30080")
        # e (UDP) keeps 30080; it has no UDP endpoints, so it rejects in filter.
        assert nodeports["nat SPX-NODEPORTS"] == ["c"]
        assert nodeports["filter SPX-EXTERNAL-SERVICES"] == ["e"]
        assert ipvs_owner(state, "TCP 198.18.0.1:30080") == "c"


def test_conflict_records_are_in_the_dump_and_every_one_counted() -> None:
    from proxy.server.dump import build_dump

    model = model_of(node(), svc("a"), svc("b"), svc("c"))
    model.resolve()
    doc = build_dump(config={}, model=model, applied=None, applied_note=None, syncs=[],
                     health={}, watch={})
    assert doc["skipped_summary"]["by_reason"] == {"conflict": 2}
    assert model.skip_counts() == {("Service", "conflict"): 2}
    assert model.skip_objects() == 2
    assert {r["name"] for r in doc["skipped"] if r["reason"] == "conflict"} == {"b", "c"}
    assert re.search("claimed by ns/a", str(doc["skipped"]))
