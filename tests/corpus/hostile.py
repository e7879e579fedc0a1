"""A corpus of hostile and malformed API objects, each with what the agent must record.

Every case builds its objects in a namespace of its own (`Case.objects(ns)`), so the
whole corpus can be applied to one model, or injected into one simulator, at once. A
case says which skip reasons the model must record for it and how many (`expect`),
strings that must never reach a rule (`never`), and strings a rule must show (`shown`:
what a hostile-but-usable input was turned into). The large cases (100,000 endpoints,
a megabyte of annotations) are built when asked for, never stored.

What each class does, and why (upstream: kubernetes/kubernetes pkg/apis/core/validation,
pkg/apis/discovery/validation, apimachinery's util/validation, pkg/proxy):

addresses
    zone-scoped IPv6 (`fe80::1%eth0`), IPv4-mapped IPv6 (`::ffff:198.18.0.1`), anything
    unparsable or not a string: `invalid-ip`, that address (endpoint, cluster IP,
    externalIP, load-balancer IP) skipped. Python parses zones and would print them
    into rules; strict validation refuses mapped addresses, which software reads as
    either family. A service left without a cluster IP is then `no-cluster-ip`.
    Unspecified, loopback, link-local, multicast, broadcast: `special-ip` (validation's
    ValidateNonSpecialIP refuses the first three for endpoints and externalIPs; none is
    an address a DNAT or a VIP can use). IPv4 with leading zeros: used, read as decimal
    as kube-proxy does (netutils.ParseIPSloppy; legacy validation still accepts it, so
    a real cluster may hold it), written canonically, recorded `non-canonical-ip`.
ports
    0, 65536, negative, float, string, bool: `invalid-port`, the port skipped (a bad
    nodePort or healthCheckNodePort is ignored, the port kept); missing: `missing-field`;
    a second port with the same name or protocol+number, or a repeated nodePort:
    `duplicate-port` (validation refuses them; two ports with one name would share a
    chain, two with one number would make two identical IPVS virtual servers).
names
    namespaces, service and port names must be DNS labels (63), slices, Endpoints and
    nodes DNS subdomains (253): anything else, including iptables or nft syntax,
    newlines, quotes, NUL, non-ASCII, `:` and `/` (which would make `ns/name:port`, the
    chain-name hash input, ambiguous), is `invalid-name`; node names on endpoints
    likewise (the endpoint kept, on no node), zones and hints `invalid-value` (dropped).
enums
    unknown protocol: `unknown-protocol` (port skipped); unknown traffic policy:
    `invalid-value`, Cluster used (upstream: anything but Local is Cluster); unknown
    address type: `unknown-address-type`, FQDN `unsupported-address-type`; unknown
    service type: `invalid-value` (whole service); a malformed trafficDistribution,
    topology annotation or sessionAffinity: `invalid-value`, ignored; conditions that
    are not booleans: `malformed`, the endpoint skipped (never guess "ready").
missing fields
    no metadata or name: `missing-field` (whole object); metadata that is no object
    (`[]`, a string), a name or namespace that is no string: `malformed`. The
    reflector cannot key such an object by namespace/name: it passes it on under
    "?" and a hash of its content (proxy/kube/identity.py), so it is recorded, and
    removed when a relist no longer finds it. Endpoint without addresses,
    slice without addressType: `missing-field`; slice without its service label:
    `missing-service-name-label`.
size
    a slice over the API's 1,000 endpoints or 100 ports, annotations over 256 KiB:
    `too-large` (whole object); an Endpoints subset over 1,000 addresses: `too-large`,
    the first 1,000 used (as the mirroring controller does). Records quote at most
    80 characters of a value.
collisions
    an address in two roles of one service (an externalIP or load-balancer IP that is
    its cluster IP, an externalIP that is its load-balancer IP): `invalid-value`, kept
    in the first role (cluster, then load balancer, then external). Two services with
    one destination (an IP in any role with the same port and protocol, or the same
    NodePort and protocol; the API's allocators prevent it): the model arbitrates, the
    service whose namespace/name sorts first keeps it (as the IPVS index decides), the
    other loses just that destination and is recorded `conflict`, whatever the order
    of arrival, and both renderers program the winner alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from proxy.kube.ingest import EndpointsSource

Obj = dict[str, Any]
SLICES, ENDPOINTS = EndpointsSource.ENDPOINT_SLICES, EndpointsSource.ENDPOINTS
SERVICE_LABEL = "kubernetes.io/service-name"

# Strings that would do harm in a rule: iptables options, nft commands, line breaks.
INJECTIONS = (
    "a -j ACCEPT",
    '"; flush ruleset',
    "x\n-A INPUT -j ACCEPT",
    "x'y",
    'x"y',
    "x\\y",
    "x\x00y",
    "x\ty",
    "x\r\ny",
    "wéb",
    "\uff57\uff45\uff42",  # fullwidth "web"
    "web;drop",
    "$(reboot)",
)


# --- builders ---------------------------------------------------------------------------


def port(name: str | None, number: Any, protocol: Any = "TCP", **extra: Any) -> Obj:
    out: Obj = {"port": number, "protocol": protocol, **extra}
    if name is not None:
        out["name"] = name
    return out


HTTP = (port("http", 80),)
SLICE_HTTP = (port("http", 8080),)


def service(ns: str, name: str = "web", ips: tuple[Any, ...] = ("198.18.128.10",),
            ports: tuple[Any, ...] = HTTP, **spec: Any) -> Obj:
    body: Obj = {"clusterIPs": list(ips), "ports": list(ports)}
    if ips:
        body["clusterIP"] = ips[0]
    status = spec.pop("status", None)
    annotations = spec.pop("annotations", None)
    labels = spec.pop("labels", None)
    body.update(spec)
    meta: Obj = {"name": name, "namespace": ns}
    if annotations is not None:
        meta["annotations"] = annotations
    if labels is not None:
        meta["labels"] = labels
    out: Obj = {"apiVersion": "v1", "kind": "Service", "metadata": meta, "spec": body}
    if status is not None:
        out["status"] = status
    return out


def endpoint(address: Any, node: Any = "node-a", **extra: Any) -> Obj:
    out: Obj = {"addresses": [address], "conditions": {"ready": True}}
    if node is not None:
        out["nodeName"] = node
    out.update(extra)
    return out


def eslice(ns: str, name: str, endpoints: list[Any], service_name: Any = "web",
           ports: tuple[Any, ...] = SLICE_HTTP, family: Any = "IPv4") -> Obj:
    labels = {} if service_name is None else {SERVICE_LABEL: service_name}
    out: Obj = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
                "metadata": {"name": name, "namespace": ns, "labels": labels},
                "ports": list(ports), "endpoints": endpoints}
    if family is not None:
        out["addressType"] = family
    return out


def endpoints_object(ns: str, name: str, addresses: list[Any],
                     ports: tuple[Any, ...] = SLICE_HTTP) -> Obj:
    return {"apiVersion": "v1", "kind": "Endpoints",
            "metadata": {"name": name, "namespace": ns},
            "subsets": [{"addresses": addresses, "ports": list(ports)}]}


def node(name: Any, zone: Any = "zone-a") -> Obj:
    return {"apiVersion": "v1", "kind": "Node",
            "metadata": {"name": name, "labels": {"kubernetes.io/hostname": str(name),
                                                  "topology.kubernetes.io/zone": zone}}}


def good_slice(ns: str, service_name: str = "web", family: str = "IPv4") -> Obj:
    address = "198.18.1.10" if family == "IPv4" else "fd00:18:1::10"
    return eslice(ns, f"{service_name}-good", [endpoint(address)], service_name,
                  family=family)


def many_addresses(n: int) -> Iterator[str]:
    """n distinct usable IPv4 addresses in 198.18.0.0/15."""
    for i in range(n):
        yield f"198.{18 + i // 65024}.{(i // 254) % 256}.{i % 254 + 1}"


# --- the corpus -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[str], list[Obj]]
    expect: dict[str, int]  # skip reason -> how many records the model must hold
    never: tuple[str, ...] = ()  # never in any rendered rule
    shown: tuple[str, ...] = ()  # must be in the rendered rules
    source: EndpointsSource = SLICES
    e2e: bool = True  # injected in the end-to-end test too
    note: str = ""

    def objects(self, ns: str) -> list[Obj]:
        return self.build(ns)


CASES: list[Case] = []


def case(name: str, expect: dict[str, int], *, never: tuple[str, ...] = (),
         shown: tuple[str, ...] = (), source: EndpointsSource = SLICES, e2e: bool = True,
         note: str = "") -> Callable[[Callable[[str], list[Obj]]], Callable[[str], list[Obj]]]:
    def register(build: Callable[[str], list[Obj]]) -> Callable[[str], list[Obj]]:
        CASES.append(Case(name, build, expect, never, shown, source, e2e, note))
        return build
    return register


V4_SPECIAL = ("0.0.0.0", "127.0.0.1", "169.254.169.254", "224.0.0.1", "239.255.255.250",
              "255.255.255.255")
V6_SPECIAL = ("::", "::1", "fe80::1", "ff02::1", "ff05::1:3")


# Addresses of endpoints.

@case("endpoint-ipv4-mapped", {"invalid-ip": 2}, never=("::ffff",))
def _(ns: str) -> list[Obj]:
    return [service(ns, ips=("198.18.128.10", "fd00:18:128::10")),
            good_slice(ns), good_slice(ns, family="IPv6"),
            eslice(ns, "v4", [endpoint("::ffff:198.18.1.20")]),
            eslice(ns, "v6", [endpoint("::ffff:198.18.1.21")], family="IPv6")]


@case("endpoint-leading-zeros", {"non-canonical-ip": 1}, never=("198.018",),
      shown=("198.18.1.11:8080",), note="read as decimal, like kube-proxy")
def _(ns: str) -> list[Obj]:
    return [service(ns), eslice(ns, "zeros", [endpoint("198.018.001.011")])]


@case("endpoint-zone-scoped", {"invalid-ip": 3}, never=("%", "eth0", "x -j ACCEPT"))
def _(ns: str) -> list[Obj]:
    return [service(ns, ips=("fd00:18:128::10",)), good_slice(ns, family="IPv6"),
            eslice(ns, "zones", [endpoint("fe80::1%eth0"), endpoint("fd00:18:1::20%eth0"),
                                 endpoint("fd00:18:1::21%x -j ACCEPT")], family="IPv6")]


@case("endpoint-special-v4", {"special-ip": len(V4_SPECIAL)},
      never=tuple(f"{a}:8080" for a in V4_SPECIAL))
def _(ns: str) -> list[Obj]:
    return [service(ns), good_slice(ns),
            eslice(ns, "special", [endpoint(a) for a in V4_SPECIAL])]


@case("endpoint-special-v6", {"special-ip": len(V6_SPECIAL)},
      never=tuple(f"[{a}]:8080" for a in V6_SPECIAL))
def _(ns: str) -> list[Obj]:
    return [service(ns, ips=("fd00:18:128::10",)), good_slice(ns, family="IPv6"),
            eslice(ns, "special", [endpoint(a) for a in V6_SPECIAL], family="IPv6")]


@case("endpoint-not-an-address", {"invalid-ip": 7, "missing-field": 2},
      never=("flush ruleset", "ACCEPT]"))
def _(ns: str) -> list[Obj]:
    bad = [3232236810, ["198.18.1.10"], None, True, "198.18.1.10\n-A INPUT -j ACCEPT",
           '198.18.1.10"; flush ruleset', "198.18.1.300"]
    return [service(ns), good_slice(ns),
            eslice(ns, "bad", [endpoint(a) for a in bad]
                   + [{"addresses": []}, {"conditions": {"ready": True}}])]


@case("endpoints-object-addresses", {"special-ip": 3, "invalid-ip": 2, "malformed": 1},
      source=ENDPOINTS, never=("%", "::ffff"))
def _(ns: str) -> list[Obj]:
    addresses = [{"ip": "198.18.1.10"}, {"ip": "127.0.0.1"}, {"ip": "0.0.0.0"},
                 {"ip": "ff02::1"}, {"ip": "fd00:18:1::1%eth0"}, {"ip": "::ffff:198.18.1.1"},
                 "198.18.1.12"]
    return [service(ns), endpoints_object(ns, "web", addresses)]


# Service addresses.

@case("cluster-ip-special", {"special-ip": 11, "no-cluster-ip": 11})
def _(ns: str) -> list[Obj]:
    return [service(ns, f"s{i}", ips=(a,)) for i, a in enumerate(V4_SPECIAL + V6_SPECIAL)]


@case("cluster-ip-hostile", {"invalid-ip": 4, "no-cluster-ip": 4, "malformed": 1},
      never=("%", "::ffff", "ACCEPT/"))
def _(ns: str) -> list[Obj]:
    return [service(ns, "zone", ips=("fd00:18:128::10%x -j ACCEPT",)),
            service(ns, "mapped", ips=("::ffff:198.18.128.10",)),
            service(ns, "number", ips=(3232268298,)),
            service(ns, "newline", ips=("198.18.128.10\n-A INPUT -j ACCEPT",)),
            {**service(ns, "string"), "spec": {"clusterIPs": "198.18.128.10", "ports": [
                port("http", 80)]}}]


@case("cluster-ip-leading-zeros", {"non-canonical-ip": 1}, never=("198.018",),
      shown=("-d 198.18.128.10/32",))
def _(ns: str) -> list[Obj]:
    return [service(ns, ips=("198.018.128.010",)), good_slice(ns)]


@case("cluster-ip-second-of-a-family", {"invalid-value": 1}, never=("198.18.128.99",))
def _(ns: str) -> list[Obj]:
    return [service(ns, ips=("198.18.128.10", "198.18.128.99")), good_slice(ns)]


@case("external-ips", {"special-ip": 8, "invalid-ip": 4}, never=("%", "::ffff", "ACCEPT/"))
def _(ns: str) -> list[Obj]:
    bad = ["0.0.0.0", "127.0.0.1", "169.254.169.254", "224.0.0.1", "255.255.255.255",
           "::1", "fe80::1", "ff02::1", "198.18.0.5 -j ACCEPT", "fd00:18::5%eth0",
           "::ffff:198.18.0.5", ""]
    return [service(ns, externalIPs=["198.18.0.50", *bad]), good_slice(ns)]


@case("load-balancer-ips", {"special-ip": 2, "invalid-ip": 2, "malformed": 1},
      never=("%lo",))
def _(ns: str) -> list[Obj]:
    ingress = [{"ip": "198.18.0.60"}, {"ip": "127.0.0.1"}, {"ip": "0.0.0.0"},
               {"ip": "fd00:18::1%lo"}, {"ip": 7}, "not an object", {"hostname": "lb.x"}]
    return [service(ns, type="LoadBalancer", status={"loadBalancer": {"ingress": ingress}}),
            good_slice(ns)]


@case("source-ranges", {"invalid-cidr": 6, "non-canonical-ip": 1},
      never=("%eth0", "::ffff", "010.", "ACCEPT/"), shown=("-s 10.0.0.0/8",))
def _(ns: str) -> list[Obj]:
    ranges = ["198.18.0.0/15%eth0", "::ffff:0:0/96", "010.0.0.0/8", "198.18.0.1/33",
              "198.18.0.0/15 -j ACCEPT", "0.0.0.0/0", 42, "198.18.0.0/255.255.0.0"]
    return [service(ns, type="LoadBalancer", loadBalancerSourceRanges=ranges,
                    status={"loadBalancer": {"ingress": [{"ip": "198.18.0.61"}]}}),
            good_slice(ns)]


@case("address-in-two-roles", {"invalid-value": 3},
      note="found by the fuzz test: an externalIP equal to the cluster IP made two "
           "identical IPVS virtual servers in one service port")
def _(ns: str) -> list[Obj]:
    return [service(ns, type="LoadBalancer", externalIPs=["198.18.128.10", "198.18.0.61"],
                    status={"loadBalancer": {"ingress": [{"ip": "198.18.128.10"},
                                                         {"ip": "198.18.0.61"}]}}),
            good_slice(ns)]


# Ports.

BAD_NUMBERS = (0, 65536, -1, 80.0, "80", True)


@case("service-ports", {"invalid-port": 9, "missing-field": 1})
def _(ns: str) -> list[Obj]:
    ports = [port("http", 80)]
    ports += [port(f"p{i}", n) for i, n in enumerate(BAD_NUMBERS)]
    ports += [{"name": "none", "protocol": "TCP"},
              port("np1", 81, nodePort=65536), port("np2", 82, nodePort=-5)]
    return [service(ns, ports=tuple(ports), type="NodePort", externalTrafficPolicy="Local",
                    healthCheckNodePort=70000), good_slice(ns)]


@case("slice-ports", {"invalid-port": 6, "missing-field": 1})
def _(ns: str) -> list[Obj]:
    ports = [port("http", 8080)]
    ports += [port(f"p{i}", n) for i, n in enumerate(BAD_NUMBERS)]
    ports.append({"name": "none", "protocol": "TCP"})
    return [service(ns), eslice(ns, "ports", [endpoint("198.18.1.10")], ports=tuple(ports))]


@case("endpoints-ports", {"invalid-port": 6}, source=ENDPOINTS)
def _(ns: str) -> list[Obj]:
    ports = [port("http", 8080)] + [port(f"p{i}", n) for i, n in enumerate(BAD_NUMBERS)]
    return [service(ns), endpoints_object(ns, "web", [{"ip": "198.18.1.10"}], tuple(ports))]


@case("duplicate-ports", {"duplicate-port": 5})
def _(ns: str) -> list[Obj]:
    ports = (port("http", 80), port("http", 81), port("other", 80), port("dns", 80, "UDP"),
             port("np1", 82, nodePort=30001), port("np2", 83, nodePort=30001))
    return [service(ns, ports=ports, type="NodePort"),
            service(ns, "unnamed", ips=("198.18.128.11",), ports=(port(None, 80), port(None, 81))),
            eslice(ns, "dup", [endpoint("198.18.1.10")],
                   ports=(port("http", 8080), port("http", 9090)))]


# Names.

@case("names-at-the-limits", {}, shown=("a" * 63 + "/" + "b" * 63 + ":" + "c" * 63,))
def _(ns: str) -> list[Obj]:
    # The longest names the API allows, the longest IPv6 endpoint text: every comment
    # must still fit xt_comment's 255 characters (the pipeline's checks say so).
    n_ns, n_svc, n_port = "a" * 63, "b" * 63, "c" * 63
    long_v6 = "fd00:ffff:ffff:ffff:ffff:ffff:ffff:fff1"
    svc = service(n_ns, n_svc, ips=("fd00:18:128::10",), ports=(port(n_port, 80, nodePort=30080),),
                  type="LoadBalancer", externalTrafficPolicy="Local",
                  loadBalancerSourceRanges=["fd00::/8"],
                  status={"loadBalancer": {"ingress": [{"ip": "fd00:18::60"}]}})
    svc["spec"]["sessionAffinity"] = "ClientIP"
    sl = eslice(n_ns, "s" * 253, [endpoint(long_v6)], n_svc,
                ports=(port(n_port, 65535),), family="IPv6")
    return [svc, sl, node("n" * 253)]


@case("names-over-the-limits", {"invalid-name": 5})
def _(ns: str) -> list[Obj]:
    return [service(ns, "b" * 64), service("a" * 64),
            service(ns, "web", ports=(port("http", 80), port("c" * 64, 81))),
            eslice(ns, "s" * 254, [endpoint("198.18.1.10")]), node("n" * 254)]


@case("service-names", {"invalid-name": len(INJECTIONS) + 5, "missing-field": 1,
                        "malformed": 1}, never=INJECTIONS)
def _(ns: str) -> list[Obj]:
    names: list[Any] = [*INJECTIONS, "WEB", "web:80", "a/b", "-j", "web "]
    out = [service(ns, n, ips=(f"198.18.128.{i + 20}",)) for i, n in enumerate(names)]
    out += [service(ns, "", ips=("198.18.128.60",)), service(ns, 5, ips=("198.18.128.61",))]
    out[-1]["metadata"]["name"] = 5
    return out


@case("namespaces", {"invalid-name": 4}, never=("flush ruleset", "a -j ACCEPT"),
      e2e=False, note="the namespace itself is the hostile part")
def _(ns: str) -> list[Obj]:
    return [service('"; flush ruleset'), service("a -j ACCEPT"), service("NS"),
            eslice("x\ny", "s", [endpoint("198.18.1.10")])]


@case("port-names", {"invalid-name": len(INJECTIONS) + 2, "malformed": 1},
      never=INJECTIONS)
def _(ns: str) -> list[Obj]:
    names: list[Any] = [*INJECTIONS, "http:80", "HTTP"]
    ports = [port("http", 80)] + [port(n, 81 + i) for i, n in enumerate(names)]
    ports.append(port({"x": 1}, 200))  # type: ignore[arg-type]
    return [service(ns, ports=tuple(ports)), good_slice(ns)]


@case("slice-names-and-labels", {"invalid-name": 3, "missing-service-name-label": 1},
      never=("flush ruleset",))
def _(ns: str) -> list[Obj]:
    return [service(ns), good_slice(ns),
            eslice(ns, "s -j ACCEPT", [endpoint("198.18.1.20")]),
            eslice(ns, "label", [endpoint("198.18.1.21")], service_name="web\n-A INPUT"),
            eslice(ns, "nolabel", [endpoint("198.18.1.22")], service_name=None),
            eslice(ns, "port", [endpoint("198.18.1.23")],
                   ports=(port("http", 8080), port('"; flush ruleset', 9090))),
            # Not consumed when reading slices: no record.
            endpoints_object(ns, "web x", [{"ip": "198.18.1.24"}])]


@case("endpoint-node-zone-hints", {"invalid-name": 4, "invalid-value": 6},
      shown=("198.18.1.20:8080",))
def _(ns: str) -> list[Obj]:
    eps = [endpoint("198.18.1.20", "node-a -j ACCEPT"), endpoint("198.18.1.21", "NODE-A"),
           endpoint("198.18.1.22", "n" * 254), endpoint("198.18.1.23", 5),
           endpoint("198.18.1.24", zone="zone a"), endpoint("198.18.1.25", zone="z" * 64),
           endpoint("198.18.1.26", zone=["zone-a"]),
           endpoint("198.18.1.27", hints={"forZones": [{"name": "z -j ACCEPT"}]}),
           endpoint("198.18.1.28", hints={"forNodes": "node-a"}),
           endpoint("198.18.1.29", hints=[])]
    return [service(ns), eslice(ns, "eps", eps)]


@case("chain-hash-collision", {"invalid-name": 2},
      note="`ns/b:c` would be both service b port c and service `b:c`, unnamed")
def _(ns: str) -> list[Obj]:
    return [service(ns, "b", ports=(port("c", 80),)),
            eslice(ns, "b", [endpoint("198.18.1.10")], "b", ports=(port("c", 8080),)),
            service(ns, "b:c", ips=("198.18.128.11",), ports=(port(None, 80),)),
            eslice(ns, "bc", [endpoint("198.18.1.20")], "b:c", ports=(port(None, 8080),))]


@case("node-names", {"invalid-name": 1, "invalid-value": 1}, e2e=False)
def _(ns: str) -> list[Obj]:
    return [node("node-a\n-A INPUT -j ACCEPT"), node("node-a", zone="zone a; flush")]


# Enums.

@case("protocols", {"unknown-protocol": 8})
def _(ns: str) -> list[Obj]:
    bad: list[Any] = ["ICMP", "tcp", 6, "TCP; flush ruleset"]
    ports = [port("http", 80)] + [port(f"p{i}", 81 + i, p) for i, p in enumerate(bad)]
    sports = [port("http", 8080)] + [port(f"p{i}", 81 + i, p) for i, p in enumerate(bad)]
    return [service(ns, ports=tuple(ports)),
            eslice(ns, "s", [endpoint("198.18.1.10")], ports=tuple(sports))]


@case("policies-and-affinity", {"invalid-value": 4})
def _(ns: str) -> list[Obj]:
    svc = service(ns, internalTrafficPolicy="Nearby", externalTrafficPolicy=1,
                  sessionAffinity="Sticky")
    other = service(ns, "other", ips=("198.18.128.11",), sessionAffinity="ClientIP",
                    sessionAffinityConfig={"clientIP": {"timeoutSeconds": "10"}})
    return [svc, other, good_slice(ns), good_slice(ns, "other")]


@case("address-types", {"unknown-address-type": 2, "missing-field": 1,
                        "unsupported-address-type": 1})
def _(ns: str) -> list[Obj]:
    return [service(ns), good_slice(ns),
            eslice(ns, "v7", [endpoint("198.18.1.20")], family="IPv7"),
            eslice(ns, "four", [endpoint("198.18.1.21")], family=4),
            eslice(ns, "none", [endpoint("198.18.1.22")], family=None),
            eslice(ns, "fqdn", [endpoint("web.example")], family="FQDN")]


@case("traffic-distribution-and-topology", {"invalid-value": 5})
def _(ns: str) -> list[Obj]:
    return [service(ns, "a", trafficDistribution="PreferClose; flush ruleset"),
            service(ns, "b", ips=("198.18.128.11",), trafficDistribution="x" * 64),
            service(ns, "c", ips=("198.18.128.12",), trafficDistribution={"a": 1}),
            service(ns, "d", ips=("198.18.128.13",), trafficDistribution="PreferSomewhere"),
            service(ns, "e", ips=("198.18.128.14",), annotations={
                "service.kubernetes.io/topology-mode": "Auto\n-A INPUT"}),
            service(ns, "f", ips=("198.18.128.15",), annotations={
                "sliceproxy.io/topology-preference": "kubernetes.io/hostname,;flush ruleset"}),
            *(good_slice(ns, n) for n in "abcdef")]


@case("service-types", {"invalid-value": 2})
def _(ns: str) -> list[Obj]:
    return [service(ns, "weird", type="Weird"), service(ns, "five", type=5)]


@case("conditions", {"malformed": 4})
def _(ns: str) -> list[Obj]:
    eps = [endpoint("198.18.1.20", conditions={"ready": "false"}),
           endpoint("198.18.1.21", conditions={"ready": True, "serving": 1}),
           endpoint("198.18.1.22", conditions={"terminating": "yes"}),
           endpoint("198.18.1.23", conditions=[True])]
    return [service(ns), good_slice(ns), eslice(ns, "cond", eps)]


# Missing fields and shapes.

@case("missing-fields", {"missing-field": 3, "malformed": 2, "no-cluster-ip": 1},
      e2e=False, note="objects the simulator's store could not key")
def _(ns: str) -> list[Obj]:
    return [{"apiVersion": "v1", "kind": "Service"},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"namespace": ns}},
            {"apiVersion": "v1", "kind": "EndpointSlice", "metadata": "x"},
            {"apiVersion": "v1", "kind": "Node", "metadata": {"labels": {}}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "nospec",
                                                                 "namespace": ns}},
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "list",
                                                                 "namespace": ns},
             "spec": ["clusterIP"]}]


@case("metadata-not-an-object", {"malformed": 4},
      note="the reflector cannot key them: passed on under a key of their own")
def _(ns: str) -> list[Obj]:
    # Served by a lying server (the e2e's simulator serves them as given, one in its
    # list and one in a watch event at least): each recorded once, the rest of the list
    # and the other services unharmed. Distinct content: identical objects would be one.
    svc = service(ns, "x")
    out = [{**svc, "metadata": []},
           {**svc, "metadata": [], "spec": {**svc["spec"], "clusterIP": "198.18.128.11",
                                            "clusterIPs": ["198.18.128.11"]}},
           {**svc, "metadata": "web"},
           {**eslice(ns, "x", [endpoint("198.18.1.10")]), "metadata": []}]
    return out


# Size.

@case("slice-100000-endpoints", {"too-large": 1}, never=("198.18.0.1:8080",))
def _(ns: str) -> list[Obj]:
    eps = [endpoint(a) for a in many_addresses(100_000)]
    return [service(ns), eslice(ns, "huge", eps)]


@case("slice-101-ports", {"too-large": 1})
def _(ns: str) -> list[Obj]:
    ports = tuple(port(f"p{i}", 1000 + i) for i in range(101))
    return [service(ns), eslice(ns, "ports", [endpoint("198.18.1.10")], ports=ports)]


@case("annotations-1mib", {"too-large": 2})
def _(ns: str) -> list[Obj]:
    big = {"example.com/blob": "x" * (1 << 20)}
    sl = good_slice(ns, "other")
    sl["metadata"]["annotations"] = big
    return [service(ns, annotations=big), sl]


@case("endpoints-100000-addresses", {"too-large": 1}, source=ENDPOINTS,
      shown=("198.18.3.238:8080",), note="the first 1,000 are used")
def _(ns: str) -> list[Obj]:
    return [service(ns), endpoints_object(ns, "web",
                                          [{"ip": a} for a in many_addresses(100_000)])]


@case("megabyte-strings", {"invalid-name": 2, "invalid-ip": 1, "no-cluster-ip": 1})
def _(ns: str) -> list[Obj]:
    mb = "a" * (1 << 20)
    return [service(ns, mb), service(ns, "ip", ips=(mb,)),
            service(ns, "port", ports=(port(mb, 80),))]


# Collisions between objects that are each valid.

@case("shared-vip-and-node-port", {"conflict": 2}, shown=("/a:http cluster IP",),
      note="b loses the VIP:80/TCP and NodePort 30002/TCP to a")
def _(ns: str) -> list[Obj]:
    return [service(ns, "a", ports=(port("http", 80, nodePort=30002),), type="NodePort"),
            service(ns, "b", ports=(port("http", 80, nodePort=30002),), type="NodePort"),
            good_slice(ns, "a"), good_slice(ns, "b")]


@case("shared-external-and-lb-ip", {"conflict": 3},
      note="an externalIP that is another service's cluster IP, one externalIP and one "
           "load-balancer IP in two services: the first namespace/name keeps each")
def _(ns: str) -> list[Obj]:
    lb = {"loadBalancer": {"ingress": [{"ip": "198.18.0.30"}]}}
    return [service(ns, "a", externalIPs=["198.18.0.20"]),
            service(ns, "b", ips=("198.18.128.11",), externalIPs=["198.18.128.10",
                                                                  "198.18.0.20"]),
            service(ns, "c", ips=("198.18.128.12",), type="LoadBalancer", status=lb),
            service(ns, "d", ips=("198.18.128.13",), type="LoadBalancer", status=lb),
            *(good_slice(ns, n) for n in "abcd")]


def by_name(name: str) -> Case:
    return next(c for c in CASES if c.name == name)


def namespace_of(index: int) -> str:
    return f"hostile-{index:02d}"


def all_objects(source: EndpointsSource = SLICES, e2e_only: bool = False
                ) -> Iterator[tuple[Case, Obj]]:
    """Every case's objects, each case in its own namespace and with service addresses
    of its own (relocate): cases reuse 198.18.128.10, and two services with one
    destination are a conflict the model arbitrates, whatever their namespaces."""
    for i, c in enumerate(CASES):
        if c.source is source and (c.e2e or not e2e_only):
            for obj in c.objects(namespace_of(i)):
                yield c, relocate(obj, i)


# Service address blocks the cases write, and each case's own block in the whole corpus.
# (Never the block itself: a hostile spelling of it, 198.018.128.010, is not moved.)
_BLOCKS = (("198.18.128.", lambda i: f"198.18.{129 + i}."),
           ("fd00:18:128::", lambda i: f"fd00:18:{0x129 + i:x}::"),
           ("198.18.0.", lambda i: f"198.19.{i}."))


def relocate(obj: Obj, index: int) -> Obj:
    """A Service's cluster, external and load-balancer IPs moved to case `index`'s block
    (text replaced, so hostile spellings stay hostile); the node's own address
    (198.18.0.1) stays. Anything else, and any other kind, as it is."""
    spec = obj.get("spec")
    if obj.get("kind") != "Service" or not isinstance(spec, dict):
        return obj

    def move(value: Any) -> Any:
        if not isinstance(value, str) or value == "198.18.0.1":
            return value
        for block, ours in _BLOCKS:
            value = value.replace(block, ours(index))
        return value

    def each(values: Any) -> Any:
        return [move(v) for v in values] if isinstance(values, list) else values

    spec = {**spec}
    for field in ("clusterIP", "clusterIPs", "externalIPs"):
        if field in spec:
            spec[field] = move(spec[field]) if field == "clusterIP" else each(spec[field])
    out = {**obj, "spec": spec}
    status = obj.get("status")
    balancer = status.get("loadBalancer") if isinstance(status, dict) else None
    ingress = balancer.get("ingress") if isinstance(balancer, dict) else None
    if isinstance(ingress, list):
        out["status"] = {**status, "loadBalancer": {**balancer, "ingress": [
            {**e, "ip": move(e.get("ip"))} if isinstance(e, dict) and "ip" in e else e
            for e in ingress]}}
    return out


def expected(source: EndpointsSource = SLICES, e2e_only: bool = False) -> dict[str, int]:
    total: dict[str, int] = {}
    for c in CASES:
        if c.source is source and (c.e2e or not e2e_only):
            for reason, n in c.expect.items():
                total[reason] = total.get(reason, 0) + n
    return {r: n for r, n in total.items() if n}
