"""Object validation: the subset of upstream's `ValidateService`, `ValidateEndpointSlice`,
`ValidateEndpoints` and name rules that the agent relies on, with upstream's field paths
and messages so a 422 here reads like a 422 from a real cluster.

Each function returns the list of causes (empty = valid); the caller raises `invalid`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator
from typing import Any

from proxy.sim.errors import Cause
from proxy.sim.resources import (
    ENDPOINTS,
    NAMESPACES,
    SERVICES,
    ResourceType,
    is_endpoint_slice,
)

_DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
_DNS1123_SUBDOMAIN = re.compile(
    r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
)
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_QUALIFIED_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")

DNS1123_LABEL_MSG = (
    "a lowercase RFC 1123 label must consist of lower case alphanumeric characters or '-', "
    "and must start and end with an alphanumeric character (e.g. 'my-name',  or '123-abc', "
    "regex used for validation is '[a-z0-9]([-a-z0-9]*[a-z0-9])?')"
)
DNS1035_LABEL_MSG = (
    "a DNS-1035 label must consist of lower case alphanumeric characters or '-', start with "
    "an alphabetic character, and end with an alphanumeric character (e.g. 'my-name',  or "
    "'abc-123', regex used for validation is '[a-z]([-a-z0-9]*[a-z0-9])?')"
)
DNS1123_SUBDOMAIN_MSG = (
    "a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' "
    "or '.', and must start and end with an alphanumeric character (e.g. 'example.com', "
    "regex used for validation is "
    "'[a-z0-9]([-a-z0-9]*[a-z0-9])?(\\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*')"
)
PROTOCOLS = ("SCTP", "TCP", "UDP")


def go_value(value: Any) -> str:
    """Render a value the way Go's `%#v` does in field errors: strings quoted."""
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def invalid(path: str, value: Any, detail: str) -> Cause:
    return Cause("FieldValueInvalid", f"Invalid value: {go_value(value)}: {detail}", path)


def required(path: str, detail: str = "") -> Cause:
    return Cause("FieldValueRequired", "Required value" + (f": {detail}" if detail else ""), path)


def not_supported(path: str, value: Any, supported: tuple[str, ...]) -> Cause:
    allowed = ", ".join(go_value(s) for s in sorted(supported))
    return Cause(
        "FieldValueNotSupported",
        f"Unsupported value: {go_value(value)}: supported values: {allowed}",
        path,
    )


def duplicate(path: str, value: Any) -> Cause:
    return Cause("FieldValueDuplicate", f"Duplicate value: {go_value(value)}", path)


def forbidden(path: str, detail: str) -> Cause:
    return Cause("FieldValueForbidden", f"Forbidden: {detail}", path)


def too_many(path: str, have: int, most: int) -> Cause:
    return Cause("FieldValueTooMany", f"Too many: {have}: must have at most {most} items", path)


def _port_range(path: str, value: Any, lowest: int = 1) -> list[Cause]:
    if isinstance(value, bool) or not isinstance(value, int) or not lowest <= value <= 65535:
        return [invalid(path, value, f"must be between {lowest} and 65535, inclusive")]
    return []


def _objects(out: list[Cause], items: list[Any],
             where: str) -> Iterator[tuple[str, dict[str, Any]]]:
    """(path, item) for each object in `items`; anything else is a cause, added to `out`
    in its turn."""
    for i, item in enumerate(items):
        path = f"{where}[{i}]"
        if isinstance(item, dict):
            yield path, item
        else:
            out.append(invalid(path, item, "must be an object"))


def _name_causes(rt: ResourceType, name: Any) -> list[Cause]:
    if not name:
        return [required("metadata.name", "name or generateName is required")]
    if not isinstance(name, str):
        return [invalid("metadata.name", name, "must be a string")]
    if rt is SERVICES:
        ok, msg, most = bool(_DNS1035_LABEL.match(name)), DNS1035_LABEL_MSG, 63
    elif rt is NAMESPACES:
        ok, msg, most = bool(_DNS1123_LABEL.match(name)), DNS1123_LABEL_MSG, 63
    else:
        ok, msg, most = bool(_DNS1123_SUBDOMAIN.match(name)), DNS1123_SUBDOMAIN_MSG, 253
    out = [] if ok else [invalid("metadata.name", name, msg)]
    if len(name) > most:
        out.append(invalid("metadata.name", name, f"must be no more than {most} characters"))
    return out


def _label_causes(labels: Any, path: str = "metadata.labels") -> list[Cause]:
    if labels is None:
        return []
    if not isinstance(labels, dict):
        return [invalid(path, labels, "must be a map of strings")]
    out: list[Cause] = []
    for key, value in labels.items():
        name = str(key).rsplit("/", 1)[-1]
        if not _QUALIFIED_NAME.match(name) or len(name) > 63:
            out.append(invalid(path, key, "name part must consist of alphanumeric "
                               "characters, '-', '_' or '.', and must start and end with an "
                               "alphanumeric character"))
        if not isinstance(value, str) or len(value) > 63 or not _LABEL_VALUE.match(value):
            out.append(invalid(path, value, "a valid label must be an empty "
                               "string or consist of alphanumeric characters, '-', '_' or "
                               "'.', and must start and end with an alphanumeric character"))
    return out


def validate(rt: ResourceType, obj: dict[str, Any]) -> list[Cause]:
    meta = obj.get("metadata") or {}
    causes = _name_causes(rt, meta.get("name")) + _label_causes(meta.get("labels"))
    if rt is SERVICES:
        causes += _service(obj.get("spec") or {})
    elif is_endpoint_slice(rt):
        causes += _endpoint_slice(obj)
    elif rt is ENDPOINTS:
        causes += _endpoints(obj)
    return causes


def _ip(value: Any) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(value) if isinstance(value, str) else None
    except ValueError:
        return None


def _service(spec: dict[str, Any]) -> list[Cause]:
    out: list[Cause] = []
    svc_type = spec.get("type", "ClusterIP")
    if svc_type not in ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName"):
        out.append(not_supported("spec.type", svc_type,
                                 ("ClusterIP", "ExternalName", "LoadBalancer", "NodePort")))
    cluster_ip = spec.get("clusterIP", "")
    headless = cluster_ip == "None"
    ips = spec.get("clusterIPs") or ([cluster_ip] if cluster_ip else [])
    if cluster_ip and ips and ips[0] != cluster_ip:
        out.append(invalid("spec.clusterIPs", ips,
                           "first value must match `clusterIP`"))
    for i, ip in enumerate(ips):
        if ip == "None" and i == 0:
            continue
        if _ip(ip) is None:
            out.append(invalid(f"spec.clusterIPs[{i}]", ip, "must be a valid IP address, "
                               "(e.g. 10.9.8.7 or 2001:db8::ffff)"))
    if svc_type == "ExternalName":
        ext = spec.get("externalName")
        if not ext:
            out.append(required("spec.externalName"))
        elif not isinstance(ext, str) or not _DNS1123_SUBDOMAIN.match(ext.rstrip(".")):
            out.append(invalid("spec.externalName", ext, DNS1123_SUBDOMAIN_MSG))
    ports = spec.get("ports") or []
    if not isinstance(ports, list):
        return [*out, invalid("spec.ports", ports, "must be a list")]
    if not ports and not headless and svc_type != "ExternalName":
        out.append(required("spec.ports"))
    names: set[str] = set()
    seen: set[tuple[Any, Any]] = set()
    for path, port in _objects(out, ports, "spec.ports"):
        name = port.get("name", "")
        if len(ports) > 1 and not name:
            out.append(required(f"{path}.name"))
        elif name:
            if not isinstance(name, str) or not _DNS1123_LABEL.match(name):
                out.append(invalid(f"{path}.name", name, DNS1123_LABEL_MSG))
            elif name in names:
                out.append(duplicate(f"{path}.name", name))
            names.add(str(name))
        out += _port_range(f"{path}.port", port.get("port"))
        proto = port.get("protocol", "TCP")
        if proto not in PROTOCOLS:
            out.append(not_supported(f"{path}.protocol", proto, PROTOCOLS))
        if (port.get("port"), proto) in seen:
            out.append(duplicate(path, f"{port.get('port')}/{proto}"))
        seen.add((port.get("port"), proto))
        target = port.get("targetPort")
        if isinstance(target, int) and not isinstance(target, bool):
            out += _port_range(f"{path}.targetPort", target)
        elif target is not None and (not isinstance(target, str) or not re.fullmatch(
                r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", target) or len(target) > 15):
            out.append(invalid(f"{path}.targetPort", target, "must contain only alpha-numeric "
                               "characters (a-z, 0-9), and hyphens (-)"))
        if "nodePort" in port and port["nodePort"] not in (None, 0):
            if svc_type not in ("NodePort", "LoadBalancer"):
                out.append(forbidden(f"{path}.nodePort",
                                     f"may not be used when `type` is '{svc_type}'"))
            else:
                out += _port_range(f"{path}.nodePort", port["nodePort"])
    for key, allowed in (("sessionAffinity", ("ClientIP", "None")),
                         ("externalTrafficPolicy", ("Cluster", "Local")),
                         ("internalTrafficPolicy", ("Cluster", "Local")),
                         ("ipFamilyPolicy", ("PreferDualStack", "RequireDualStack",
                                             "SingleStack"))):
        if key in spec and spec[key] is not None and spec[key] not in allowed:
            out.append(not_supported(f"spec.{key}", spec[key], allowed))
    for i, fam in enumerate(spec.get("ipFamilies") or []):
        if fam not in ("IPv4", "IPv6"):
            out.append(not_supported(f"spec.ipFamilies[{i}]", fam, ("IPv4", "IPv6")))
    for i, ip in enumerate(spec.get("externalIPs") or []):
        if _ip(ip) is None:
            out.append(invalid(f"spec.externalIPs[{i}]", ip, "must be a valid IP address, "
                               "(e.g. 10.9.8.7 or 2001:db8::ffff)"))
    return out


def _endpoint_slice(obj: dict[str, Any]) -> list[Cause]:
    out: list[Cause] = []
    addr_type = obj.get("addressType")
    if not addr_type:
        out.append(required("addressType"))
    elif addr_type not in ("IPv4", "IPv6", "FQDN"):
        out.append(not_supported("addressType", addr_type, ("FQDN", "IPv4", "IPv6")))
    endpoints = obj.get("endpoints") or []
    if not isinstance(endpoints, list):
        return [*out, invalid("endpoints", endpoints, "must be a list")]
    if len(endpoints) > 1000:
        out.append(too_many("endpoints", len(endpoints), 1000))
    for path, ep in _objects(out, endpoints, "endpoints"):
        addrs = ep.get("addresses") or []
        if not addrs:
            out.append(required(f"{path}.addresses", "must contain at least 1 address"))
        elif len(addrs) > 100:
            out.append(too_many(f"{path}.addresses", len(addrs), 100))
        for j, addr in enumerate(addrs if isinstance(addrs, list) else []):
            apath = f"{path}.addresses[{j}]"
            ip = _ip(addr)
            if addr_type == "IPv4" and (ip is None or ip.version != 4):
                out.append(invalid(apath, addr, "must be a valid IPv4 address"))
            elif addr_type == "IPv6" and (ip is None or ip.version != 6):
                out.append(invalid(apath, addr, "must be a valid IPv6 address"))
            elif addr_type == "FQDN" and (
                    not isinstance(addr, str) or not _DNS1123_SUBDOMAIN.match(addr)):
                out.append(invalid(apath, addr, DNS1123_SUBDOMAIN_MSG))
        conditions = ep.get("conditions") or {}
        for cond in ("ready", "serving", "terminating"):
            value = conditions.get(cond) if isinstance(conditions, dict) else None
            if value is not None and not isinstance(value, bool):
                out.append(invalid(f"{path}.conditions.{cond}", value, "must be a boolean"))
        # v1beta1 (1.20): where an endpoint runs is a label-like map, validated as labels.
        out += _label_causes(ep.get("topology"), f"{path}.topology")
        node = ep.get("nodeName")
        if node is not None and (not isinstance(node, str) or not _DNS1123_SUBDOMAIN.match(node)):
            out.append(invalid(f"{path}.nodeName", node, DNS1123_SUBDOMAIN_MSG))
    ports = obj.get("ports") or []
    if not isinstance(ports, list):
        return [*out, invalid("ports", ports, "must be a list")]
    if len(ports) > 20000:
        out.append(too_many("ports", len(ports), 20000))
    names: set[str] = set()
    for path, port in _objects(out, ports, "ports"):
        name = port.get("name") or ""
        if name and (not isinstance(name, str) or not _DNS1123_LABEL.match(name)):
            out.append(invalid(f"{path}.name", name, DNS1123_LABEL_MSG))
        if name in names:
            out.append(duplicate(f"{path}.name", name))
        names.add(str(name))
        proto = port.get("protocol")
        if proto is not None and proto not in PROTOCOLS:
            out.append(not_supported(f"{path}.protocol", proto, PROTOCOLS))
        if port.get("port") is not None:
            out += _port_range(f"{path}.port", port["port"], lowest=0)
    return out


def _endpoints(obj: dict[str, Any]) -> list[Cause]:
    out: list[Cause] = []
    subsets = obj.get("subsets") or []
    if not isinstance(subsets, list):
        return [invalid("subsets", subsets, "must be a list")]
    for path, subset in _objects(out, subsets, "subsets"):
        addresses = subset.get("addresses") or []
        not_ready = subset.get("notReadyAddresses") or []
        if not addresses and not not_ready:
            out.append(required(path, "must specify `addresses` or `notReadyAddresses`"))
        for field_name, items in (("addresses", addresses), ("notReadyAddresses", not_ready)):
            for j, addr in enumerate(items if isinstance(items, list) else []):
                ipath = f"{path}.{field_name}[{j}].ip"
                value = addr.get("ip") if isinstance(addr, dict) else addr
                ip = _ip(value)
                if ip is None:
                    out.append(invalid(ipath, value, "must be a valid IP address, "
                                       "(e.g. 10.9.8.7 or 2001:db8::ffff)"))
                elif ip.is_unspecified:
                    out.append(invalid(ipath, value, f"may not be unspecified ({value})"))
                elif ip.is_loopback:
                    out.append(invalid(ipath, value, "may not be in the loopback range "
                                       "(127.0.0.0/8, ::1/128)"))
                elif ip.is_link_local:
                    out.append(invalid(ipath, value, "may not be in the link-local range "
                                       "(169.254.0.0/16, fe80::/10)"))
        ports = subset.get("ports") or []
        for ppath, port in _objects(out, ports if isinstance(ports, list) else [],
                                    f"{path}.ports"):
            if len(ports) > 1 and not port.get("name"):
                out.append(required(f"{ppath}.name"))
            out += _port_range(f"{ppath}.port", port.get("port"))
            proto = port.get("protocol", "TCP")
            if proto not in PROTOCOLS:
                out.append(not_supported(f"{ppath}.protocol", proto, PROTOCOLS))
    return out
