"""API JSON (already parsed into dicts) -> model types. Pure; never raises.

Every decoder returns `(value, skips)`: `value` is None when the whole object is
unusable, and `skips` says what was dropped and why (the whole object, or one endpoint,
port or address where the rest is still usable). Unexpected shapes are caught at the
top of each decoder and reported as `malformed`, so a surprise in the API's JSON costs
one object, never the agent.

The API server validates what it stores, but the agent does not rely on it (an old
server, a bug, a compromised or fake one): everything that can reach a rule is checked
here against the API's own rules, so the data planes only ever see

- names that are DNS labels or subdomains (they end up in rule comments and in the
  hashes that name chains, which must not collide: `ns/name:port` is unambiguous only
  because none of the three may contain `/` or `:`);
- addresses in canonical form that a packet can be sent to: no zone (`fe80::1%eth0`
  would be written verbatim into a rule), no IPv4-mapped IPv6, nothing unspecified,
  loopback, link-local, multicast or broadcast. IPv4 with leading zeros is read as
  decimal, as kube-proxy (netutils.ParseIPSloppy) and the API server read it, and
  recorded (`non-canonical-ip`);
- ports in 1..65535, each name and each number once per object;
- objects within the API's size limits (1,000 endpoints and 100 ports per slice,
  256 KiB of annotations).

Values that only steer selection (node names, zones, hints, topology settings) are
checked too, so the model and the debug dump never hold a megabyte of hostile text; a
bad one is dropped with a record and the endpoint or service kept, on the safe side
(no node: not local; no hints: the whole cluster).
"""

from __future__ import annotations

import functools
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network
from socket import AF_INET, AF_INET6, inet_pton
from typing import Any, TypeVar

from proxy.kube import identity
from proxy.model import skips as why
from proxy.model.skips import Skip, clip, shown
from proxy.model.types import (
    ANNOTATION_BALANCING,
    ANNOTATION_FAIL_FAST,
    ANNOTATION_TOPOLOGY_HINTS,
    ANNOTATION_TOPOLOGY_MODE,
    ANNOTATION_TOPOLOGY_PREFERENCE,
    ANNOTATION_TRAFFIC_PER_ENDPOINT,
    DEFAULT_AFFINITY_TIMEOUT,
    LABEL_HEADLESS,
    LABEL_HOSTNAME,
    LABEL_SERVICE_NAME,
    LABEL_SERVICE_PROXY_NAME,
    LABEL_ZONE,
    Balancing,
    Endpoint,
    EndpointSlice,
    Family,
    IPAddress,
    IPNetwork,
    Node,
    NodeAddress,
    Protocol,
    Service,
    ServicePort,
    ServiceType,
    SlicePort,
    TrafficPolicy,
)

T = TypeVar("T")
Decoded = tuple[T | None, list[Skip]]

_PROTOCOLS = {p.value: p for p in Protocol}
_FAMILIES = {"IPv4": Family.V4, "IPv6": Family.V6}
_SERVICE_TYPES = {t.value: t for t in ServiceType}
_POLICIES = {p.value: p for p in TrafficPolicy}

# Limits the API server enforces (pkg/apis/discovery/validation, apimachinery's
# ValidateAnnotations): an object beyond them cannot come from a real API server.
MAX_SLICE_ENDPOINTS = 1000
MAX_SLICE_PORTS = 100
MAX_ANNOTATION_BYTES = 256 * 1024
# Endpoints objects have no such limit, but the EndpointSlice mirroring controller
# mirrors at most this many addresses per subset, so kube-proxy (reading slices) never
# uses more; in Endpoints mode the rest are dropped, counted in one record per subset.
MAX_SUBSET_ADDRESSES = 1000
MAX_PREFERENCE_KEYS = 16
# IP addresses read from a Node's status (a real node has a few).
MAX_NODE_ADDRESSES = 64
NODE_IP_TYPES = ("InternalIP", "ExternalIP")

# Names, as apimachinery's validation spells them (ASCII only; matched whole).
_DNS_LABEL = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
                            r"(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*")
_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?")
# A label key ("prefix/name") or "*": the keys of the topology-preference annotation.
_LABEL_KEY = re.compile(r"\*|(?:[a-z0-9](?:[-a-z0-9.]*[a-z0-9])?/)?"
                        r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?")
# IPv4 as Go's old net.ParseIP (and netutils.ParseIPSloppy) accepts it: decimal octets,
# leading zeros allowed.
_SLOPPY_V4 = re.compile(r"([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})\.([0-9]{1,3})")


# Node names, zones and hint names repeat across every endpoint: their checks are
# remembered (bounded, so hostile input cannot grow the cache).
@functools.lru_cache(maxsize=4096)
def dns_label(value: str) -> bool:
    return len(value) <= 63 and _DNS_LABEL.fullmatch(value) is not None


@functools.lru_cache(maxsize=4096)
def dns_subdomain(value: str) -> bool:
    return len(value) <= 253 and _DNS_SUBDOMAIN.fullmatch(value) is not None


@functools.lru_cache(maxsize=4096)
def label_value(value: str) -> bool:
    return len(value) <= 63 and _LABEL_VALUE.fullmatch(value) is not None


class _Bad(Exception):
    """Raised inside a decoder for a problem that costs the whole object."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
        self.detail = detail


@dataclass(slots=True)
class _Ctx:
    kind: str
    namespace: str
    name: str
    skips: list[Skip]

    def skip(self, reason: str, detail: str, part: str = "") -> None:
        self.skips.append(Skip(self.kind, self.namespace, self.name, reason, detail, part))


def _meta(obj: Any, kind: str, namespaced: bool, valid_name: Callable[[str], bool]) -> _Ctx:
    if not isinstance(obj, dict):
        raise _Bad(why.MALFORMED, f"expected an object, got {type(obj).__name__}")
    meta = obj.get("metadata")
    if meta is None:
        raise _Bad(why.MISSING_FIELD, "metadata is missing")
    if not isinstance(meta, dict):
        raise _Bad(why.MALFORMED, "metadata is not an object")
    name = meta.get("name")
    if name is None or name == "":
        raise _Bad(why.MISSING_FIELD, "metadata.name is missing")
    if not isinstance(name, str):
        raise _Bad(why.MALFORMED, f"metadata.name {shown(name)} is not a string")
    if not valid_name(name):
        raise _Bad(why.INVALID_NAME, f"metadata.name {shown(name)} is not a valid "
                   f"{'DNS label' if valid_name is dns_label else 'DNS subdomain'}")
    namespace: Any = ""
    if namespaced:
        namespace = meta.get("namespace") or "default"
        if not isinstance(namespace, str):
            raise _Bad(why.MALFORMED, "metadata.namespace is not a string")
        if not dns_label(namespace):
            raise _Bad(why.INVALID_NAME,
                       f"metadata.namespace {shown(namespace)} is not a valid DNS label")
        namespace = _intern(namespace)
    annotations = meta.get("annotations")
    if isinstance(annotations, dict):
        size = sum(len(str(k)) + len(str(v)) for k, v in annotations.items())
        if size > MAX_ANNOTATION_BYTES:
            raise _Bad(why.TOO_LARGE, f"annotations hold {size} characters; the API "
                       f"allows {MAX_ANNOTATION_BYTES}")
    return _Ctx(kind, namespace, name, [])


def _guard(
    kind: str, namespaced: bool, valid_name: Callable[[str], bool], obj: Any,
    body: Callable[[_Ctx, dict[str, Any]], T | None],
) -> Decoded[T]:
    """Run a decoder body; turn any failure into a whole-object skip."""
    try:
        ctx = _meta(obj, kind, namespaced, valid_name)
    except _Bad as bad:
        namespace, name = _safe_name(obj, namespaced)
        return None, [Skip(kind, namespace, name, bad.reason, bad.detail)]
    try:
        return body(ctx, obj), ctx.skips
    except _Bad as bad:
        ctx.skip(bad.reason, bad.detail)
    except Exception as exc:  # the decoder's promise is "never raises"
        ctx.skip(why.MALFORMED, f"{type(exc).__name__}: {shown(str(exc))}")
    return None, ctx.skips


def _safe_name(obj: Any, namespaced: bool) -> tuple[str, str]:
    """(namespace, name) for the record of an object whose metadata did not decode: as
    ingest keys the object (a missing namespace is "default"; no usable name: the key
    the reflector passed it on under), cut to a sane length."""
    found = identity.key(obj)
    if found is None:
        return identity.unkeyed_key(obj) if isinstance(obj, dict) else ("", "")
    namespace = (found[0] or "default") if namespaced else ""
    return clip(namespace), clip(found[1])


def _dict(value: Any, what: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _Bad(why.MALFORMED, f"{what} is not an object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if value is None:
        return []
    if not isinstance(value, list):
        raise _Bad(why.MALFORMED, f"{what} is not a list")
    return value


def _str_map(value: Any, what: str) -> dict[str, str]:
    return {str(k): str(v) for k, v in _dict(value, what).items()}


# --- addresses -----------------------------------------------------------------------


def special(ip: IPAddress) -> str | None:
    """What makes an address useless as a service or endpoint address, or None.
    Validation refuses unspecified, loopback and link-local ones (ValidateNonSpecialIP);
    a DNAT to multicast or broadcast makes no more sense. (On the integer: ipaddress's
    properties cost a network membership test each, for every endpoint.)"""
    return _special_kind(int(ip), ip.version == 4)


def _special_kind(n: int, v4: bool) -> str | None:
    """`special` of the address whose integer is `n` (`v4`: IPv4, else IPv6)."""
    if v4:
        return ("unspecified" if n == 0 else "loopback" if n >> 24 == 127
                else "link-local" if n >> 16 == 0xA9FE else "multicast" if n >> 28 == 0xE
                else "broadcast" if n == 0xFFFFFFFF else None)
    return ("unspecified" if n == 0 else "loopback" if n == 1
            else "link-local" if n >> 118 == 0x3FA else "multicast" if n >> 120 == 0xFF
            else None)


def _parse(value: str) -> tuple[IPAddress | None, bool]:
    """(address, read from leading zeros) or (None, False). Rejects zones and
    IPv4-mapped IPv6 (the strict validation's rules: both are read differently by
    different software)."""
    # The common cases, 3x (IPv4) and 8x (IPv6: 0.5 against 4.3 us) faster than
    # ip_address(): inet_pton takes exactly the strict forms (an IPv4 address without
    # leading zeros, no spaces, no zone), anything else goes to the general reading.
    try:
        if ":" not in value:
            return IPv4Address(int.from_bytes(inet_pton(AF_INET, value))), False
        n = int.from_bytes(inet_pton(AF_INET6, value))
        if n >> 32 != 0xFFFF:  # IPv4-mapped: the general reading refuses it
            return IPv6Address(n), False
    except (OSError, ValueError):
        pass
    return _parse_general(value)


def _parse_general(value: str) -> tuple[IPAddress | None, bool]:
    """`_parse` without its fast paths: what they must agree with."""
    if "%" in value:
        return None, False
    try:
        ip = ip_address(value)
    except ValueError:
        m = _SLOPPY_V4.fullmatch(value)
        if m is None:
            return None, False
        octets = [int(o) for o in m.groups()]
        if any(o > 255 for o in octets):
            return None, False
        return IPv4Address(".".join(map(str, octets))), True
    if isinstance(ip, IPv6Address) and (ip.ipv4_mapped is not None or ip.scope_id):
        return None, False
    return ip, False


def parse_ip(value: Any) -> IPAddress | None:
    """An IP address as the API writes it, or None: no zone, no IPv4-mapped IPv6; IPv4
    with leading zeros read as decimal. Special addresses are not refused here."""
    if not isinstance(value, str):
        return None
    return _parse(value)[0]


def _ip(ctx: _Ctx, value: Any, where: str, family: Family | None = None) -> IPAddress | None:
    """An address that may reach a rule, or None with a record saying why not."""
    ip, sloppy = _parse(value) if isinstance(value, str) else (None, False)
    wanted = f"an {family.label} address" if family is not None else "an IP address"
    if ip is None:
        hint = ""
        if isinstance(value, str) and "%" in value:
            hint = " (zone-scoped addresses are not allowed)"
        elif isinstance(value, str) and value.lower().startswith("::ffff:"):
            hint = " (IPv4-mapped IPv6 is not allowed: use the IPv4 address)"
        ctx.skip(why.INVALID_IP, f"{shown(value)} is not {wanted}{hint}", where)
        return None
    if family is not None and Family.of(ip) is not family:
        ctx.skip(why.INVALID_IP, f"{shown(value)} is not {wanted}", where)
        return None
    kind = special(ip)
    if kind is not None:
        ctx.skip(why.SPECIAL_IP, f"{ip} is a {kind} address", where)
        return None
    if sloppy:
        ctx.skip(why.NON_CANONICAL_IP, f"{shown(value)} has leading zeros; used as {ip} "
                 "(decimal, as kube-proxy reads it)", where)
    return ip


def _cidr(ctx: _Ctx, value: Any, where: str) -> IPNetwork | None:
    """A source range: `address/prefix` (spaces around it trimmed, as upstream does)."""
    net = None
    if isinstance(value, str) and value.count("/") == 1:
        text = value.strip()
        addr_text, _, prefix = text.partition("/")
        ip, sloppy = _parse(addr_text)
        if ip is not None and prefix.isascii() and prefix.isdigit() and len(prefix) <= 3:
            try:
                net = ip_network(f"{ip}/{int(prefix)}", strict=False)
            except ValueError:
                net = None
            if net is not None and sloppy:
                ctx.skip(why.NON_CANONICAL_IP, f"{shown(value)} has leading zeros; used as "
                         f"{net} (decimal, as kube-proxy reads it)", where)
    if net is None:
        ctx.skip(why.INVALID_CIDR, f"{shown(value)} is not a CIDR", where)
    return net


# --- small values --------------------------------------------------------------------


def _protocol(value: Any) -> Protocol | None:
    if value is None:
        return Protocol.TCP
    return _PROTOCOLS.get(value) if isinstance(value, str) else None


def _port_number(value: Any) -> int | None:
    if isinstance(value, bool) or not isinstance(value, int):
        return None
    return value if 1 <= value <= 65535 else None


def _port_name(ctx: _Ctx, raw: dict[str, Any], where: str) -> str | None:
    """A port's name ("" for none), or None with a record when it is not a DNS label."""
    name = raw.get("name")
    if name is None or name == "":
        return ""
    if not isinstance(name, str):
        ctx.skip(why.MALFORMED, f"port name {shown(name)} is not a string", where)
        return None
    if not dns_label(name):
        ctx.skip(why.INVALID_NAME, f"port name {shown(name)} is not a valid DNS label", where)
        return None
    return _intern(name)


def _intern(value: str) -> str:
    # Node names, zones, namespaces and port names repeat across every endpoint or
    # object: share one string each.
    return sys.intern(value)


def _selector_value(
    valid: Callable[[str], bool], reason: str, what: str, wanted: str,
) -> Callable[[_Ctx, Any, str], str | None]:
    """A check for a value that only steers selection (a node name, a zone): the value,
    shared, when valid; else None, with a record unless there is none ("" or absent)."""
    def check(ctx: _Ctx, value: Any, where: str) -> str | None:
        if isinstance(value, str) and valid(value):
            return _intern(value)
        if value is not None and value != "":
            ctx.skip(reason, f"{what} {shown(value)} is not {wanted}", where)
        return None
    return check


_node_name = _selector_value(dns_subdomain, why.INVALID_NAME, "node name",
                             "a valid DNS subdomain; treated as on no node")
_zone = _selector_value(label_value, why.INVALID_VALUE, "zone",
                        "a valid label value; treated as in no zone")


# --- Service -------------------------------------------------------------------------


def decode_service(obj: Any) -> Decoded[Service]:
    return _guard("Service", True, dns_label, obj, _service_body)


def _service_body(ctx: _Ctx, obj: dict[str, Any]) -> Service:
    meta = obj["metadata"]
    labels = _str_map(meta.get("labels"), "metadata.labels")
    annotations = _str_map(meta.get("annotations"), "metadata.annotations")
    spec = _dict(obj.get("spec"), "spec")
    status = _dict(obj.get("status"), "status")

    raw_type = spec.get("type") or "ClusterIP"
    svc_type = _SERVICE_TYPES.get(raw_type) if isinstance(raw_type, str) else None
    if svc_type is None:
        raise _Bad(why.INVALID_VALUE, f"spec.type {shown(raw_type)} is not a known service type")

    raw_ips = spec.get("clusterIPs") or ([spec["clusterIP"]] if spec.get("clusterIP") else [])
    raw_ips = _list(raw_ips, "spec.clusterIPs")
    headless = any(ip == "None" for ip in raw_ips)
    cluster_ips = () if headless else _cluster_ips(ctx, raw_ips)
    # The order of these calls is the order of their records (ctx.skips).
    ports = _service_ports(ctx, _list(spec.get("ports"), "spec.ports"))
    # Most services have no status: no walk through it then (decode is hot).
    lb_ips = _load_balancer_ips(ctx, status, cluster_ips) if status else []
    ranges = _source_ranges(ctx, spec)
    affinity = _affinity(ctx, spec)
    hc_port = _health_check_node_port(ctx, spec)
    external_ips = _external_ips(ctx, spec, cluster_ips, lb_ips)

    return Service(
        namespace=ctx.namespace,
        name=ctx.name,
        type=svc_type,
        cluster_ips=cluster_ips,
        ports=ports,
        headless=headless,
        external_ips=tuple(external_ips),
        load_balancer_ips=tuple(lb_ips),
        load_balancer_source_ranges=tuple(ranges),
        affinity_timeout=affinity,
        internal_traffic_policy=_policy(ctx, spec, "internalTrafficPolicy"),
        external_traffic_policy=_policy(ctx, spec, "externalTrafficPolicy"),
        health_check_node_port=hc_port,
        traffic_distribution=_traffic_distribution(ctx, spec.get("trafficDistribution")),
        topology_mode=_topology_mode(ctx, annotations),
        topology_preference=_preference(ctx, annotations.get(ANNOTATION_TOPOLOGY_PREFERENCE)),
        balancing=_balancing(ctx, annotations.get(ANNOTATION_BALANCING)),
        fail_fast=_boolean(ctx, annotations, ANNOTATION_FAIL_FAST, "--fail-fast"),
        traffic_per_endpoint=_boolean(ctx, annotations, ANNOTATION_TRAFFIC_PER_ENDPOINT,
                                      "--traffic-per-endpoint"),
        proxy_name=labels.get(LABEL_SERVICE_PROXY_NAME),
        uid=clip(str(meta.get("uid") or "")),
        resource_version=clip(str(meta.get("resourceVersion") or "")),
    )


def _load_balancer_ips(ctx: _Ctx, status: dict[str, Any],
                       cluster_ips: tuple[IPAddress, ...]) -> list[IPAddress]:
    lb_ips: list[IPAddress] = []
    load_balancer = _dict(status.get("loadBalancer"), "status.loadBalancer")
    ingress = _list(load_balancer.get("ingress"), "status.loadBalancer.ingress")
    for i, ing in enumerate(ingress):
        where = f"status.loadBalancer.ingress[{i}]"
        if not isinstance(ing, dict):
            ctx.skip(why.MALFORMED, "ingress entry is not an object", where)
            continue
        if "ip" not in ing:
            continue  # hostname-only ingress: nothing for a node to program
        if ing.get("ipMode") == "Proxy":
            continue  # the load balancer proxies; upstream does not capture this IP
        ip = _ip(ctx, ing["ip"], where)
        if (ip is not None and _not_again(ctx, ip, cluster_ips, "cluster", where)
                and ip not in lb_ips):
            lb_ips.append(ip)
    return lb_ips


def _source_ranges(ctx: _Ctx, spec: dict[str, Any]) -> list[IPNetwork]:
    ranges: list[IPNetwork] = []
    for i, raw in enumerate(_list(spec.get("loadBalancerSourceRanges"), "sourceRanges")):
        net = _cidr(ctx, raw, f"spec.loadBalancerSourceRanges[{i}]")
        if net is not None and net not in ranges:
            ranges.append(net)
    return ranges


def _affinity(ctx: _Ctx, spec: dict[str, Any]) -> int | None:
    """The ClientIP affinity timeout in seconds, or None for no affinity."""
    raw_affinity = spec.get("sessionAffinity")
    if raw_affinity == "ClientIP":
        cfg = _dict(_dict(spec.get("sessionAffinityConfig"), "sessionAffinityConfig")
                    .get("clientIP"), "sessionAffinityConfig.clientIP")
        timeout = cfg.get("timeoutSeconds", DEFAULT_AFFINITY_TIMEOUT)
        if isinstance(timeout, bool) or not isinstance(timeout, int) or not 0 < timeout <= 86400:
            ctx.skip(why.INVALID_VALUE, f"timeoutSeconds {shown(timeout)} is not in 1..86400; "
                     f"using {DEFAULT_AFFINITY_TIMEOUT}",
                     "spec.sessionAffinityConfig.clientIP.timeoutSeconds")
            timeout = DEFAULT_AFFINITY_TIMEOUT
        return timeout
    if raw_affinity not in (None, "", "None"):
        ctx.skip(why.INVALID_VALUE, f"{shown(raw_affinity)} is not None or ClientIP; "
                 "no affinity", "spec.sessionAffinity")
    return None


def _health_check_node_port(ctx: _Ctx, spec: dict[str, Any]) -> int:
    hc_port = spec.get("healthCheckNodePort") or 0
    if hc_port and _port_number(hc_port) is None:
        ctx.skip(why.INVALID_PORT, f"{shown(hc_port)} is not a port", "spec.healthCheckNodePort")
        hc_port = 0
    return int(hc_port)


def _external_ips(ctx: _Ctx, spec: dict[str, Any], cluster_ips: tuple[IPAddress, ...],
                  lb_ips: list[IPAddress]) -> list[IPAddress]:
    external_ips: list[IPAddress] = []
    for i, raw in enumerate(_list(spec.get("externalIPs"), "spec.externalIPs")):
        where = f"spec.externalIPs[{i}]"
        ip = _ip(ctx, raw, where)
        if (ip is not None and _not_again(ctx, ip, cluster_ips, "cluster", where)
                and _not_again(ctx, ip, lb_ips, "load-balancer", where)
                and ip not in external_ips):
            external_ips.append(ip)
    return external_ips


def _cluster_ips(ctx: _Ctx, raw: list[Any]) -> tuple[IPAddress, ...]:
    """At most one per family, as the API allows (a second one of a family would
    capture any address the writer liked)."""
    out: list[IPAddress] = []
    for i, value in enumerate(raw):
        where = f"spec.clusterIPs[{i}]"
        ip = _ip(ctx, value, where)
        if ip is None:
            continue
        if any(Family.of(have) is Family.of(ip) for have in out):
            ctx.skip(why.INVALID_VALUE, f"{ip} is a second {Family.of(ip).label} cluster IP; "
                     "only the first of each family is used", where)
            continue
        out.append(ip)
    return tuple(out)


def _not_again(ctx: _Ctx, ip: IPAddress, taken: Sequence[IPAddress], role: str,
               where: str) -> bool:
    """False, with a record, when `ip` is already the service's address in another role:
    the same address and port twice would be two rules for one destination (and two
    identical IPVS virtual servers). Cluster IPs come first, then load-balancer IPs
    (their source ranges then still apply), then externalIPs."""
    if ip not in taken:
        return True
    ctx.skip(why.INVALID_VALUE, f"{ip} is also the service's {role} IP; served as that",
             where)
    return False


def _service_ports(ctx: _Ctx, raw_ports: list[Any]) -> tuple[ServicePort, ...]:
    ports: list[ServicePort] = []
    node_ports: set[tuple[int, Protocol]] = set()
    for i, raw in enumerate(raw_ports):
        where = f"spec.ports[{i}]"
        port = _service_port(ctx, raw, where)
        if port is None:
            continue
        clash = next((p for p in ports if p.name == port.name), None)
        if clash is not None:
            ctx.skip(why.DUPLICATE_PORT, f"a second port named {port.name!r}", where)
            continue
        clash = next((p for p in ports if (p.port, p.protocol) == (port.port, port.protocol)),
                     None)
        if clash is not None:
            ctx.skip(why.DUPLICATE_PORT, f"{port.protocol.value} {port.port} is already "
                     f"port {clash.name!r}", where)
            continue
        if port.node_port and (port.node_port, port.protocol) in node_ports:
            ctx.skip(why.DUPLICATE_PORT, f"nodePort {port.node_port} ({port.protocol.value}) "
                     "is already used by another port; ignored", where)
            port = ServicePort(port.name, port.protocol, port.port)
        if port.node_port:
            node_ports.add((port.node_port, port.protocol))
        ports.append(port)
    return tuple(ports)


def _named_port(ctx: _Ctx, raw: Any, where: str) -> tuple[str, Protocol, int] | None:
    """Name, protocol and number: what service ports and endpoint ports share."""
    if not isinstance(raw, dict):
        ctx.skip(why.MALFORMED, "port is not an object", where)
        return None
    name = _port_name(ctx, raw, where)
    if name is None:
        return None
    protocol = _protocol(raw.get("protocol"))
    if protocol is None:
        ctx.skip(why.UNKNOWN_PROTOCOL, f"protocol {shown(raw.get('protocol'))}", where)
        return None
    if raw.get("port") is None:
        ctx.skip(why.MISSING_FIELD, "port number is missing", where)
        return None
    number = _port_number(raw.get("port"))
    if number is None:
        ctx.skip(why.INVALID_PORT, f"port {shown(raw.get('port'))} is not in 1..65535", where)
        return None
    return name, protocol, number


def _service_port(ctx: _Ctx, raw: Any, where: str) -> ServicePort | None:
    named = _named_port(ctx, raw, where)
    if named is None:
        return None
    name, protocol, port = named
    node_port = raw.get("nodePort") or 0
    if node_port and _port_number(node_port) is None:
        ctx.skip(why.INVALID_PORT, f"nodePort {shown(node_port)} is not in 1..65535; ignored",
                 where)
        node_port = 0
    return ServicePort(name=name, protocol=protocol, port=port, node_port=node_port)


def _policy(ctx: _Ctx, spec: dict[str, Any], field: str) -> TrafficPolicy:
    raw = spec.get(field)
    if raw is None:
        return TrafficPolicy.CLUSTER
    policy = _POLICIES.get(raw) if isinstance(raw, str) else None
    if policy is None:
        ctx.skip(why.INVALID_VALUE, f"{shown(raw)} is not Cluster or Local; using Cluster",
                 f"spec.{field}")
        return TrafficPolicy.CLUSTER
    return policy


def _traffic_distribution(ctx: _Ctx, raw: Any) -> str | None:
    """Passed on when well formed (topology says what it makes of an unknown value)."""
    if raw is None or raw == "":
        return None
    if isinstance(raw, str) and label_value(raw):
        return raw
    ctx.skip(why.INVALID_VALUE, f"{shown(raw)} is not a valid value; ignored",
             "spec.trafficDistribution")
    return None


def _topology_mode(ctx: _Ctx, annotations: dict[str, str]) -> str | None:
    for key in (ANNOTATION_TOPOLOGY_MODE, ANNOTATION_TOPOLOGY_HINTS):
        value = annotations.get(key)
        if not value:
            continue
        if label_value(value):
            return value
        ctx.skip(why.INVALID_VALUE, f"{shown(value)} is not a valid value; ignored",
                 f"metadata.annotations[{key}]")
    return None


def _preference(ctx: _Ctx, raw: str | None) -> tuple[str, ...] | None:
    if raw is None:
        return None
    keys = tuple(k.strip() for k in raw.split(",", MAX_PREFERENCE_KEYS + 1) if k.strip())
    if len(keys) <= MAX_PREFERENCE_KEYS and all(
            len(k) <= 317 and _LABEL_KEY.fullmatch(k) for k in keys):
        return keys
    ctx.skip(why.INVALID_VALUE, f"{shown(raw)} is not a list of at most "
             f"{MAX_PREFERENCE_KEYS} label keys or '*'; ignored",
             f"metadata.annotations[{ANNOTATION_TOPOLOGY_PREFERENCE}]")
    return None


_BALANCINGS = {b.value: b for b in Balancing}


def _boolean(ctx: _Ctx, annotations: dict[str, str], name: str, flag: str) -> bool | None:
    """A true/false annotation; None (the node's `flag`) when absent or not a boolean (a
    skip record)."""
    raw = annotations.get(name)
    if raw is None:
        return None
    found = {"true": True, "false": False}.get(raw.strip().lower())
    if found is None:
        ctx.skip(why.INVALID_VALUE, f"{shown(raw)} is not true or false; using the "
                 f"node's {flag}", f"metadata.annotations[{name}]")
    return found


def _balancing(ctx: _Ctx, raw: str | None) -> Balancing | None:
    """None (the node's --default-balancing) when absent, or when not one we know: a
    skip record names the service and the value, logged once (ingest.py)."""
    if raw is None:
        return None
    found = _BALANCINGS.get(raw.strip().lower())
    if found is None:
        ctx.skip(why.INVALID_VALUE, f"{shown(raw)} is not one of "
                 f"{', '.join(_BALANCINGS)}; using the node's --default-balancing",
                 f"metadata.annotations[{ANNOTATION_BALANCING}]")
    return found


# --- EndpointSlice -------------------------------------------------------------------


def decode_endpoint_slice(obj: Any) -> Decoded[EndpointSlice]:
    """discovery.k8s.io/v1, or v1beta1 (topology map instead of nodeName/zone)."""
    return _guard("EndpointSlice", True, dns_subdomain, obj, _slice_body)


def _slice_body(ctx: _Ctx, obj: dict[str, Any]) -> EndpointSlice | None:
    meta = obj["metadata"]
    labels = _str_map(meta.get("labels"), "metadata.labels")
    service_name = labels.get(LABEL_SERVICE_NAME)
    if not service_name:
        raise _Bad(why.MISSING_SERVICE_NAME, f"no {LABEL_SERVICE_NAME} label")
    if not label_value(service_name):
        raise _Bad(why.INVALID_NAME, f"{LABEL_SERVICE_NAME} {shown(service_name)} is not a "
                   "valid label value")
    if LABEL_HEADLESS in labels:
        raise _Bad(why.HEADLESS, f"labelled {LABEL_HEADLESS}")
    address_type = obj.get("addressType")
    if address_type == "FQDN":
        raise _Bad(why.UNSUPPORTED_ADDRESS_TYPE, "FQDN slices are not proxied")
    if address_type is None:
        raise _Bad(why.MISSING_FIELD, "addressType is missing")
    family = _FAMILIES.get(address_type) if isinstance(address_type, str) else None
    if family is None:
        raise _Bad(why.UNKNOWN_ADDRESS_TYPE, f"addressType {shown(address_type)}")
    beta = str(obj.get("apiVersion", "")).endswith("/v1beta1")
    raw_ports = _list(obj.get("ports"), "ports")
    raw_endpoints = _list(obj.get("endpoints"), "endpoints")
    if len(raw_endpoints) > MAX_SLICE_ENDPOINTS:
        raise _Bad(why.TOO_LARGE, f"{len(raw_endpoints)} endpoints; the API allows "
                   f"{MAX_SLICE_ENDPOINTS} per slice")
    if len(raw_ports) > MAX_SLICE_PORTS:
        raise _Bad(why.TOO_LARGE, f"{len(raw_ports)} ports; the API allows "
                   f"{MAX_SLICE_PORTS} per slice")

    ports: list[SlicePort] = []
    for i, raw in enumerate(raw_ports):
        port = _endpoint_port(ctx, raw, f"ports[{i}]", ports)
        if port is not None:
            ports.append(port)

    endpoints: list[Endpoint] = []
    v4 = family is Family.V4
    for i, raw in enumerate(raw_endpoints):
        try:
            endpoints.append(_plain_slice_endpoint(raw, beta, v4))
            continue
        except _NotPlain:
            pass
        ep = _slice_endpoint(ctx, raw, family, beta, f"endpoints[{i}]")
        if ep is not None:
            endpoints.append(ep)

    return EndpointSlice(
        namespace=ctx.namespace,
        name=ctx.name,
        service_name=service_name,
        family=family,
        ports=tuple(ports),
        endpoints=tuple(endpoints),
        resource_version=clip(str(meta.get("resourceVersion") or "")),
    )


def _endpoint_port(ctx: _Ctx, raw: Any, where: str, have: list[SlicePort]) -> SlicePort | None:
    """A port of a slice or of an Endpoints subset (each name once, as validation says)."""
    named = _named_port(ctx, raw, where)
    if named is None:
        return None
    name, protocol, number = named
    if any(p.name == name for p in have):
        ctx.skip(why.DUPLICATE_PORT, f"a second port named {name!r}", where)
        return None
    return SlicePort(name=name, protocol=protocol, port=number)


def _conditions(ctx: _Ctx, raw: Any, where: str) -> tuple[bool, bool, bool] | None:
    """(ready, serving, terminating) with the API's defaults; None, with a record, when
    they are not booleans: guessing "true" from a string "false" could send traffic to
    an endpoint that said it was not ready."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        ctx.skip(why.MALFORMED, "conditions is not an object", where)
        return None
    for key in ("ready", "serving", "terminating"):
        value = raw.get(key)
        if value is not None and not isinstance(value, bool):
            ctx.skip(why.MALFORMED, f"conditions.{key} {shown(value)} is not a boolean", where)
            return None
    # Defaults: ready nil = ready; serving nil = ready's value; terminating nil = false.
    ready = raw.get("ready") is not False
    serving_raw = raw.get("serving")
    serving = ready if serving_raw is None else serving_raw
    return ready, serving, raw.get("terminating") is True


# --- the common case, fast --------------------------------------------------------------
#
# A cold start decodes every endpoint of the cluster (100,000 at 10,000 services x 10)
# before its first sync. The functions below decode the endpoint every real cluster sends
# (one valid address, boolean conditions, a valid node name and zone, no hints)
# without the full decoders' record keeping, and raise _NotPlain at the first thing out
# of the ordinary: the full decoder then decodes that endpoint again and records what was
# wrong. Whatever they accept, they decode exactly as the full decoder does
# (tests/unit/test_decode_fast.py compares the two).


class _NotPlain(Exception):
    """Leave this one to the full decoder."""


def _plain_packed(value: Any, v4: bool) -> bytes:
    """The packed bytes of a strict address of the family (`v4`: IPv4, else IPv6) that
    may reach a rule: what `_ip` takes for that family without a record. inet_pton
    refuses zones, an IPv4 address's leading zeros and IPv4 text where IPv6 is read."""
    if type(value) is not str:
        raise _NotPlain
    try:
        packed = inet_pton(AF_INET if v4 else AF_INET6, value)
    except (OSError, ValueError):
        raise _NotPlain from None
    n = int.from_bytes(packed)
    if _special_kind(n, v4) is not None or (not v4 and n >> 32 == 0xFFFF):
        raise _NotPlain  # special or IPv4-mapped: recorded by the full decoder
    return packed


def _plain_name(value: Any, valid: Callable[[str], bool]) -> str | None:
    """A node name or zone as `_selector_value` reads it when it records nothing: the
    value (shared) when valid ("" is a valid zone), else None when absent or ""."""
    if type(value) is str and valid(value):
        return _intern(value)
    if value is None or value == "":
        return None
    raise _NotPlain


def _plain_conditions(raw: Any) -> tuple[bool, bool, bool]:
    """`_conditions` where it records nothing."""
    if raw is None:
        return True, True, False
    if type(raw) is not dict:
        raise _NotPlain
    ready, serving, terminating = raw.get("ready"), raw.get("serving"), raw.get("terminating")
    for value in (ready, serving, terminating):
        if value is not None and type(value) is not bool:
            raise _NotPlain
    is_ready = ready is not False
    return is_ready, is_ready if serving is None else serving, terminating is True


def _plain_slice_endpoint(raw: Any, beta: bool, v4: bool) -> Endpoint:
    """A slice's endpoint (`v4`: of an IPv4 slice, else of an IPv6 one) as
    `_slice_endpoint` decodes it, if it is plain."""
    if type(raw) is not dict:
        raise _NotPlain
    addresses = raw.get("addresses")
    if type(addresses) is not list or not addresses or raw.get("hints") is not None:
        raise _NotPlain
    packed = _plain_packed(addresses[0], v4)
    ready, serving, terminating = _plain_conditions(raw.get("conditions"))
    if beta:
        topology = raw.get("topology")
        if topology is None:
            topology = {}
        elif type(topology) is not dict:
            raise _NotPlain
        node_name = _plain_name(raw.get("nodeName") or topology.get(LABEL_HOSTNAME),
                                dns_subdomain)
        zone = _plain_name(topology.get(LABEL_ZONE), label_value)
    else:
        node_name = _plain_name(raw.get("nodeName"), dns_subdomain)
        zone = _plain_name(raw.get("zone"), label_value)
    return Endpoint.of_packed(packed, ready, serving, terminating, node_name, zone)


def _plain_address(raw: Any, ready: bool) -> Endpoint:
    """An Endpoints subset's address as `_endpoints_body` decodes it, if it is plain
    (the caller files it under its address's family)."""
    if type(raw) is not dict:
        raise _NotPlain
    ip = raw.get("ip")
    packed = _plain_packed(ip, not (type(ip) is str and ":" in ip))
    return Endpoint.of_packed(packed, ready, ready, False,
                              _plain_name(raw.get("nodeName"), dns_subdomain))


def _slice_endpoint(ctx: _Ctx, raw: Any, family: Family, beta: bool, where: str) -> Endpoint | None:
    if not isinstance(raw, dict):
        ctx.skip(why.MALFORMED, "endpoint is not an object", where)
        return None
    addresses = raw.get("addresses")
    if not isinstance(addresses, list) or not addresses:
        ctx.skip(why.MISSING_FIELD, "endpoint has no addresses", where)
        return None
    address = _ip(ctx, addresses[0], where, family)  # upstream uses only the first address
    if address is None:
        return None
    conditions = _conditions(ctx, raw.get("conditions"), where)
    if conditions is None:
        return None
    ready, serving, terminating = conditions
    if beta:
        topology = raw.get("topology")
        if topology is not None and not isinstance(topology, dict):
            ctx.skip(why.MALFORMED, "topology is not an object; ignored", f"{where}.topology")
            topology = None
        topology = topology or {}
        node_name = _node_name(ctx, raw.get("nodeName") or topology.get(LABEL_HOSTNAME),
                               f"{where}.nodeName")
        zone = _zone(ctx, topology.get(LABEL_ZONE), f"{where}.topology")
    else:
        node_name = _node_name(ctx, raw.get("nodeName"), f"{where}.nodeName")
        zone = _zone(ctx, raw.get("zone"), f"{where}.zone")
    zone_hints, node_hints = _hints(ctx, raw.get("hints"), f"{where}.hints")
    return Endpoint(
        address=address,
        ready=ready,
        serving=serving,
        terminating=terminating,
        node_name=node_name,
        zone=zone,
        zone_hints=zone_hints,
        node_hints=node_hints,
    )


def _hints(ctx: _Ctx, raw: Any, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(zone hints, node hints), sorted. Any bad part drops all of the endpoint's hints
    (with a record): an endpoint without hints turns hint-based topology off for its
    service, which then uses the whole cluster, never less."""
    if raw is None:
        return (), ()
    problem = "" if isinstance(raw, dict) else "hints is not an object"
    found: list[tuple[str, ...]] = []
    for field, valid in (("forZones", label_value), ("forNodes", dns_subdomain)):
        entries = raw.get(field) if isinstance(raw, dict) else None
        names: set[str] = set()
        if entries is not None and not problem:
            if not isinstance(entries, list) or len(entries) > 8:
                problem = f"{field} is not a list of at most 8 hints"
            for h in entries if not problem else ():
                name = h.get("name") if isinstance(h, dict) else None
                if not isinstance(name, str) or not valid(name):
                    problem = f"{field} holds {shown(h)}, not a hint with a valid name"
                    break
                names.add(_intern(name))
        found.append(tuple(sorted(names)))
    if problem:
        ctx.skip(why.INVALID_VALUE, f"{problem}; hints ignored", where)
        return (), ()
    return found[0], found[1]


# --- Endpoints (legacy) -------------------------------------------------------------


def decode_endpoints(obj: Any) -> Decoded[tuple[EndpointSlice, ...]]:
    """A core/v1 Endpoints object as pseudo-slices: one per subset and IP family.

    `addresses` are ready; `notReadyAddresses` are neither ready nor serving. Endpoints
    carry no terminating condition, zone or hints. Pseudo-slice names are
    `<name>#<subset>/<family>` so explain shows where an endpoint came from.
    """
    return _guard("Endpoints", True, dns_subdomain, obj, _endpoints_body)


def _endpoints_body(ctx: _Ctx, obj: dict[str, Any]) -> tuple[EndpointSlice, ...]:
    rv = clip(str(obj["metadata"].get("resourceVersion") or ""))
    labels = _str_map(obj["metadata"].get("labels"), "metadata.labels")
    if LABEL_HEADLESS in labels:
        raise _Bad(why.HEADLESS, f"labelled {LABEL_HEADLESS}")
    out: list[EndpointSlice] = []
    for s, subset in enumerate(_list(obj.get("subsets"), "subsets")):
        where = f"subsets[{s}]"
        if not isinstance(subset, dict):
            ctx.skip(why.MALFORMED, "subset is not an object", where)
            continue
        ports: list[SlicePort] = []
        for p, raw in enumerate(_list(subset.get("ports"), f"{where}.ports")):
            port = _endpoint_port(ctx, raw, f"{where}.ports[{p}]", ports)
            if port is not None:
                ports.append(port)
        by_family: dict[Family, list[Endpoint]] = {Family.V4: [], Family.V6: []}
        listed = [(field, ready, a, raw)
                  for field, ready in (("addresses", True), ("notReadyAddresses", False))
                  for a, raw in enumerate(_list(subset.get(field), f"{where}.{field}"))]
        if len(listed) > MAX_SUBSET_ADDRESSES:
            ctx.skip(why.TOO_LARGE, f"{len(listed)} addresses; only the first "
                     f"{MAX_SUBSET_ADDRESSES} are used (as the EndpointSlice mirroring "
                     "controller does)", where)
            del listed[MAX_SUBSET_ADDRESSES:]
        v4, v6 = by_family[Family.V4], by_family[Family.V6]
        for field, ready, a, raw in listed:
            try:
                ep = _plain_address(raw, ready)
                (v4 if len(ep.packed) == 4 else v6).append(ep)
                continue
            except _NotPlain:
                pass
            addr_where = f"{where}.{field}[{a}]"
            if not isinstance(raw, dict):
                ctx.skip(why.MALFORMED, "address is not an object", addr_where)
                continue
            ip = _ip(ctx, raw.get("ip"), addr_where)
            if ip is None:
                continue
            by_family[Family.of(ip)].append(Endpoint(
                address=ip, ready=ready, serving=ready, terminating=False,
                node_name=_node_name(ctx, raw.get("nodeName"), f"{addr_where}.nodeName"),
            ))
        for family, endpoints in by_family.items():
            if endpoints:
                out.append(EndpointSlice(
                    namespace=ctx.namespace,
                    name=f"{ctx.name}#{s}/{family.label}",
                    service_name=ctx.name,
                    family=family,
                    ports=tuple(ports),
                    endpoints=tuple(endpoints),
                    resource_version=rv,
                ))
    return tuple(out)


# --- Node ------------------------------------------------------------------------------


def decode_node(obj: Any) -> Decoded[Node]:
    return _guard("Node", False, dns_subdomain, obj, _node_body)


def _node_body(ctx: _Ctx, obj: dict[str, Any]) -> Node:
    labels = _str_map(obj["metadata"].get("labels"), "metadata.labels")
    # Only the zone steers anything (topology): an invalid one is dropped, not trusted.
    zone = labels.get(LABEL_ZONE)
    if zone is not None and not label_value(zone):
        ctx.skip(why.INVALID_VALUE, f"zone {shown(zone)} is not a valid label value; "
                 "ignored", f"metadata.labels[{LABEL_ZONE}]")
        del labels[LABEL_ZONE]
    addresses: tuple[NodeAddress, ...] = ()
    if obj.get("status"):
        try:  # a broken status costs its addresses, never the labels
            addresses = _node_addresses(ctx, _dict(obj["status"], "status"))
        except _Bad as bad:
            ctx.skip(bad.reason, bad.detail, "status.addresses")
    return Node(name=ctx.name, labels=tuple(sorted(labels.items())), addresses=addresses)


def _node_addresses(ctx: _Ctx, status: dict[str, Any]) -> tuple[NodeAddress, ...]:
    """status.addresses that are IPs (InternalIP, ExternalIP), in order: they steer which
    addresses accept NodePorts under `primary`. Any IP counts, as upstream reads them (a
    loopback one is left out later, as upstream does)."""
    out: list[NodeAddress] = []
    for i, entry in enumerate(_list(status.get("addresses"), "status.addresses")):
        where = f"status.addresses[{i}]"
        if not isinstance(entry, dict):
            ctx.skip(why.MALFORMED, "not an object", where)
            continue
        kind = entry.get("type")
        if kind not in NODE_IP_TYPES:
            continue  # Hostname, InternalDNS, ExternalDNS: names, not addresses
        if len(out) == MAX_NODE_ADDRESSES:
            ctx.skip(why.TOO_LARGE, f"more than {MAX_NODE_ADDRESSES} IP addresses; the "
                     "rest are ignored", where)
            break
        value = entry.get("address")
        ip, sloppy = _parse(value) if isinstance(value, str) else (None, False)
        if ip is None:
            ctx.skip(why.INVALID_IP, f"{shown(value)} is not an IP address", where)
            continue
        if sloppy:
            ctx.skip(why.NON_CANONICAL_IP, f"{shown(value)} has leading zeros; used as {ip} "
                     "(decimal, as kube-proxy reads it)", where)
        out.append(NodeAddress(kind, ip))
    return tuple(out)
