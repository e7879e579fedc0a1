"""Server-side printing: the `meta.k8s.io` Tables kube-apiserver answers when a client
(kubectl get) asks for `application/json;as=Table;v=v1;g=meta.k8s.io`.

Holds the Accept negotiation (which answer a request gets, or 406), the `includeObject`
option, one printer per kind the simulator serves (columns and cells as upstream's
`pkg/printers/internalversion/printers.go`), apimachinery's `duration.HumanDuration` for
AGE, and the table built from a list, an object or a watch event. Pure functions of their
inputs (and of the clock, for AGE). Checked against kube-apiserver v1.20.2 and kubectl.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import orjson

from proxy.sim.errors import ApiError

Obj = dict[str, Any]
Cells = list[Any]
GROUP = "meta.k8s.io"
VERSIONS = ("v1", "v1beta1")
INCLUDE = ("None", "Metadata", "Object")
# What the server serialises for built-in resources, in its order of preference.
SERIALIZERS = ("application/json", "application/yaml", "application/vnd.kubernetes.protobuf")
MORE = 3  # list cells show this many entries, then "+ N more..."

# ---- Accept negotiation --------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Clause:
    type: str
    subtype: str
    q: float
    params: dict[str, str]


def parse_accept(header: str) -> list[Clause]:
    """goautoneg.ParseAccept: clauses by quality, wildcards after concrete types."""
    out: list[Clause] = []
    for part in header.split(","):
        media, *raw_params = part.strip(" ").split(";")
        pieces = media.split("/")
        kind = pieces[0].strip(" ")
        if len(pieces) == 1 and kind == "*":
            sub = "*"
        elif len(pieces) == 2:
            sub = pieces[1].strip(" ")
        else:
            continue
        q, params = 1.0, {}
        for raw in raw_params:
            key, eq, value = raw.partition("=")
            if not eq:
                continue
            if key.strip(" ") == "q":
                try:
                    q = float(value)
                except ValueError:
                    q = 0.0  # Go's ParseFloat error leaves 0
            else:
                params[key.strip(" ")] = value.strip(" ")
        out.append(Clause(kind, sub, q, params))
    out.sort(key=lambda c: (-c.q, c.type == "*", c.subtype == "*"))
    return out


def _route_accepts(header: str) -> bool:
    """go-restful's check before any handler runs: one plain media type the route produces."""
    for part in header.split(","):
        mime = part.split(";", 1)[0].strip(" ")
        if mime == "*/*" or mime in SERIALIZERS:
            return True
    return False


def _target(params: Mapping[str, str], serializer: str) -> tuple[bool, str | None]:
    """apiserver's acceptMediaTypeOptions + AllowsMediaTypeTransform for one clause:
    (acceptable, Table version or None for the plain object)."""
    stream = params.get("stream")
    if stream and (stream != "watch" or serializer == "application/yaml"):
        return False, None  # YAML has no stream serializer
    if not ({"as", "g", "v"} & params.keys()):
        return True, None
    kind, group, version = params.get("as", ""), params.get("g", ""), params.get("v", "")
    if group != GROUP or version not in VERSIONS:
        return False, None
    if kind == "Table":
        return serializer in ("application/json", "application/yaml"), version
    # Metadata-only answers are served as the full object here (not implemented).
    return kind in ("PartialObjectMetadata", "PartialObjectMetadataList"), None


def negotiate(accept: str | None) -> str | None:
    """The Table version ("v1", "v1beta1") a GET is answered with, or None for the object
    itself; 406 when nothing acceptable is offered. The simulator writes JSON where the
    real server would write YAML or protobuf."""
    if not accept:
        return None
    if not _route_accepts(accept):
        raise ApiError(406, "NotAcceptable", "406: Not Acceptable", {})
    for clause in parse_accept(accept):
        for serializer in SERIALIZERS:
            kind, sub = serializer.split("/")
            if (clause.type, clause.subtype) in ((kind, sub), (kind, "*"), ("*", "*")):
                ok, version = _target(clause.params, serializer)
                if ok:
                    return version
    raise ApiError(406, "NotAcceptable", "only the following media types are accepted: "
                   + ", ".join(SERIALIZERS))


def include_object(value: str | None) -> str:
    """The `includeObject` query option (default Metadata), or 400 as upstream."""
    if value in (None, ""):
        return "Metadata"
    if value not in INCLUDE:
        raise ApiError(400, "BadRequest", "Unable to convert to Table as requested: "
                       f"includeObject: Invalid value: {json.dumps(value)}: must be "
                       "'Metadata', 'Object', 'None', or empty")
    return value


# ---- formatting helpers --------------------------------------------------------------


# apimachinery's HumanDuration, step by step: (unit, its seconds, the next smaller unit
# and its seconds, below how many units the smaller one is shown too ("2m5s"), below how
# many the unit alone is shown).
_DURATION_STEPS = (
    ("m", 60, "s", 1, 10, 3 * 60),
    ("h", 3600, "m", 60, 8, 48),
    ("d", 86400, "h", 3600, 8, 365 * 2),
    ("y", 86400 * 365, "d", 86400, 8, None),
)


def human_duration(seconds: float) -> str:
    """apimachinery's duration.HumanDuration: ~2-3 significant figures."""
    whole = int(seconds)  # Go truncates toward zero
    if whole < -1:
        return "<invalid>"
    if whole < 0:
        return "0s"
    if whole < 120:
        return f"{whole}s"
    for unit, size, smaller, smaller_size, with_smaller, alone in _DURATION_STEPS:
        count = whole // size
        if count < with_smaller:
            rest = whole // smaller_size % (size // smaller_size)
            return f"{count}{unit}" if rest == 0 else f"{count}{unit}{rest}{smaller}"
        if alone is None or count < alone:
            return f"{count}{unit}"
    raise AssertionError("unreachable: the last step has no bound")


def age(obj: Mapping[str, Any], now: datetime) -> str:
    stamp = _dict(obj.get("metadata")).get("creationTimestamp")
    if not isinstance(stamp, str) or not stamp:
        return "<unknown>"
    try:
        created = datetime.fromisoformat(stamp)
    except ValueError:
        return "<unknown>"
    if created.tzinfo is None:
        created = created.replace(tzinfo=UTC)
    return human_duration((now - created).total_seconds())


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else []


def _str(value: Any) -> str:
    return value if isinstance(value, str) else ""


def _int(value: Any) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


def _name(obj: Mapping[str, Any]) -> str:
    return _str(_dict(obj.get("metadata")).get("name"))


def format_labels(labels: Any) -> str:
    """labels.FormatLabels: sorted k=v pairs, or <none>."""
    pairs = [f"{k}={v}" for k, v in sorted(_dict(labels).items())]
    return ",".join(pairs) or "<none>"


def _with_more(items: list[str], count: int) -> str:
    """upstream's listWithMoreString: the first MORE items, then how many were left out."""
    text = ",".join(items[:MORE])
    if count > MORE:
        return f"{text} + {count - MORE} more..."
    return text or "<unset>"


def _host_port(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"  # net.JoinHostPort


# ---- printers: one per kind, columns then cells ------------------------------------


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    description: str
    priority: int = 0
    format: str = ""
    type: str = "string"

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "type": self.type, "format": self.format,
                "description": self.description, "priority": self.priority}


# Column descriptions are the types' swagger docs, as the v1.32 API server sends them;
# LEGACY_DOCS has the v1.20 wording where it differs (measured against v1.20.2).
DOCS = {
    "name": "Name must be unique within a namespace. Is required when creating resources, "
            "although some resources may allow a client to request the generation of an "
            "appropriate name automatically. Name is primarily intended for creation "
            "idempotence and configuration definition. Cannot be updated. More info: "
            "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names",
    "age": "CreationTimestamp is a timestamp representing the server time when this object "
           "was created. It is not guaranteed to be set in happens-before order across "
           "separate operations. Clients may not set this value. It is represented in "
           "RFC3339 form and is in UTC.\n\nPopulated by the system. Read-only. Null for "
           "lists. More info: https://git.k8s.io/community/contributors/devel/"
           "sig-architecture/api-conventions.md#metadata",
    "svc.type": "type determines how the Service is exposed. Defaults to ClusterIP. Valid "
                "options are ExternalName, ClusterIP, NodePort, and LoadBalancer. "
                "\"ClusterIP\" allocates a cluster-internal IP address for load-balancing "
                "to endpoints. Endpoints are determined by the selector or if that is not "
                "specified, by manual construction of an Endpoints object or EndpointSlice "
                "objects. If clusterIP is \"None\", no virtual IP is allocated and the "
                "endpoints are published as a set of endpoints rather than a virtual IP. "
                "\"NodePort\" builds on ClusterIP and allocates a port on every node which "
                "routes to the same endpoints as the clusterIP. \"LoadBalancer\" builds on "
                "NodePort and creates an external load-balancer (if supported in the "
                "current cloud) which routes to the same endpoints as the clusterIP. "
                "\"ExternalName\" aliases this service to the specified externalName. "
                "Several other fields do not apply to ExternalName services. More info: "
                "https://kubernetes.io/docs/concepts/services-networking/service/"
                "#publishing-services-service-types",
    "svc.clusterIP": "clusterIP is the IP address of the service and is usually assigned "
                     "randomly. If an address is specified manually, is in-range (as per "
                     "system configuration), and is not in use, it will be allocated to "
                     "the service; otherwise creation of the service will fail. This field "
                     "may not be changed through updates unless the type field is also "
                     "being changed to ExternalName (which requires this field to be "
                     "blank) or the type field is being changed from ExternalName (in "
                     "which case this field may optionally be specified, as describe "
                     "above).  Valid values are \"None\", empty string (\"\"), or a valid "
                     "IP address. Setting this to \"None\" makes a \"headless service\" (no "
                     "virtual IP), which is useful when direct endpoint connections are "
                     "preferred and proxying is not required.  Only applies to types "
                     "ClusterIP, NodePort, and LoadBalancer. If this field is specified "
                     "when creating a Service of type ExternalName, creation will fail. "
                     "This field will be wiped when updating a Service to type "
                     "ExternalName. More info: https://kubernetes.io/docs/concepts/"
                     "services-networking/service/#virtual-ips-and-service-proxies",
    "svc.externalIPs": "externalIPs is a list of IP addresses for which nodes in the "
                       "cluster will also accept traffic for this service.  These IPs are "
                       "not managed by Kubernetes.  The user is responsible for ensuring "
                       "that traffic arrives at a node with this IP.  A common example is "
                       "external load-balancers that are not part of the Kubernetes "
                       "system.",
    "svc.ports": "The list of ports that are exposed by this service. More info: "
                 "https://kubernetes.io/docs/concepts/services-networking/service/"
                 "#virtual-ips-and-service-proxies",
    "svc.selector": "Route service traffic to pods with label keys and values matching "
                    "this selector. If empty or not present, the service is assumed to "
                    "have an external process managing its endpoints, which Kubernetes "
                    "will not modify. Only applies to types ClusterIP, NodePort, and "
                    "LoadBalancer. Ignored if type is ExternalName. More info: "
                    "https://kubernetes.io/docs/concepts/services-networking/service/",
    "ep.subsets": "The set of all endpoints is the union of all subsets. Addresses are "
                  "placed into subsets according to the IPs they share. A single address "
                  "with multiple ports, some of which are ready and some of which are not "
                  "(because they come from different containers) will result in the "
                  "address being displayed in different subsets for the different ports. "
                  "No address will appear in both Addresses and NotReadyAddresses in the "
                  "same subset. Sets of addresses and ports that comprise a service.",
    "eps.addressType": "addressType specifies the type of address carried by this "
                       "EndpointSlice. All addresses in this slice must be the same type. "
                       "This field is immutable after creation. The following address "
                       "types are currently supported: * IPv4: Represents an IPv4 Address. "
                       "* IPv6: Represents an IPv6 Address. * FQDN: Represents a Fully "
                       "Qualified Domain Name.",
    "eps.ports": "ports specifies the list of network ports exposed by each endpoint in "
                 "this slice. Each port must have a unique name. When ports is empty, it "
                 "indicates that there are no defined ports. When a port is defined with a "
                 "nil port value, it indicates \"all ports\". Each slice may include a "
                 "maximum of 100 ports.",
    "eps.endpoints": "endpoints is a list of unique endpoints in this slice. Each slice may "
                     "include a maximum of 1000 endpoints.",
    "node.kubeletVersion": "Kubelet Version reported by the node.",
    "node.addresses": "List of addresses reachable to the node. Queried from cloud "
                      "provider, if available. More info: https://kubernetes.io/docs/"
                      "reference/node/node-status/#addresses Note: This field is declared "
                      "as mergeable, but the merge key is not sufficiently unique, which "
                      "can cause data corruption when it is merged. Callers should instead "
                      "use a full-replacement patch. See https://pr.k8s.io/79391 for an "
                      "example. Consumers should assume that addresses can change during "
                      "the lifetime of a Node. However, there are some exceptions where "
                      "this may not be possible, such as Pods that inherit a Node's "
                      "address in its own status or consumers of the downward API "
                      "(status.hostIP).",
    "node.osImage": "OS Image reported by the node from /etc/os-release (e.g. Debian "
                    "GNU/Linux 7 (wheezy)).",
    "node.kernelVersion": "Kernel Version reported by the node from 'uname -r' (e.g. "
                          "3.16.0-0.bpo.4-amd64).",
    "node.containerRuntimeVersion": "ContainerRuntime Version reported by the node through "
                                    "runtime remote API (e.g. containerd://1.4.2).",
}
LEGACY_DOCS = {
    "name": DOCS["name"].replace(
        "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names",
        "http://kubernetes.io/docs/user-guide/identifiers#names"),
    "node.addresses": "List of addresses reachable to the node. Queried from cloud "
                      "provider, if available. More info: https://kubernetes.io/docs/"
                      "concepts/nodes/node/#addresses Note: This field is declared as "
                      "mergeable, but the merge key is not sufficiently unique, which can "
                      "cause data corruption when it is merged. Callers should instead use "
                      "a full-replacement patch. See http://pr.k8s.io/79391 for an "
                      "example.",
    "node.containerRuntimeVersion": "ContainerRuntime Version reported by the node through "
                                    "runtime remote API (e.g. docker://1.5.0).",
}
LEGACY_LEVELS = ("1.20",)

# (column name, description key or literal text, priority); Name is always first.
_COLUMNS: dict[str, list[tuple[str, str, int]]] = {
    "Service": [("Type", "svc.type", 0), ("Cluster-IP", "svc.clusterIP", 0),
                ("External-IP", "svc.externalIPs", 0), ("Port(s)", "svc.ports", 0),
                ("Age", "age", 0), ("Selector", "svc.selector", 1)],
    "Endpoints": [("Endpoints", "ep.subsets", 0), ("Age", "age", 0)],
    "EndpointSlice": [("AddressType", "eps.addressType", 0), ("Ports", "eps.ports", 0),
                      ("Endpoints", "eps.endpoints", 0), ("Age", "age", 0)],
    "Node": [("Status", "The status of the node", 0), ("Roles", "The roles of the node", 0),
             ("Age", "age", 0), ("Version", "node.kubeletVersion", 0),
             ("Internal-IP", "node.addresses", 1), ("External-IP", "node.addresses", 1),
             ("OS-Image", "node.osImage", 1), ("Kernel-Version", "node.kernelVersion", 1),
             ("Container-Runtime", "node.containerRuntimeVersion", 1)],
    "Namespace": [("Status", "The status of the namespace", 0), ("Age", "age", 0)],
}


def columns(kind: str, level: str = "1.32") -> list[Column]:
    docs = {**DOCS, **LEGACY_DOCS} if level in LEGACY_LEVELS else DOCS
    if kind not in _COLUMNS:  # upstream's default convertor, for kinds without a printer
        return [Column("Name", docs["name"], format="name"),
                Column("Created At", docs["age"], type="date")]
    return [Column("Name", docs["name"], format="name")] + [
        Column(name, docs.get(doc, doc), priority) for name, doc, priority in _COLUMNS[kind]]


def _service_external_ip(spec: Mapping[str, Any], status: Mapping[str, Any]) -> str:
    """getServiceExternalIP, wide (the server never clips the load-balancer list)."""
    external = [ip for ip in _list(spec.get("externalIPs")) if isinstance(ip, str)]
    kind = spec.get("type")
    if kind in ("ClusterIP", "NodePort"):
        return ",".join(external) or "<none>"
    if kind == "LoadBalancer":
        ingress = _list(_dict(status.get("loadBalancer")).get("ingress"))
        lb = sorted({_str(i.get("ip")) or _str(i.get("hostname"))
                     for i in ingress if isinstance(i, dict)} - {""})
        return ",".join(lb + external) or "<pending>"
    if kind == "ExternalName":
        return _str(spec.get("externalName"))
    return "<unknown>"


def _service_ports(ports: list[Any]) -> str:
    pieces = []
    for p in ports:
        p = _dict(p)
        port, node_port, proto = _int(p.get("port")), _int(p.get("nodePort")), p.get("protocol")
        pieces.append(f"{port}:{node_port}/{_str(proto)}" if node_port > 0
                      else f"{port}/{_str(proto)}")
    return ",".join(pieces) or "<none>"


def service_cells(obj: Obj, now: datetime) -> Cells:
    spec, status = _dict(obj.get("spec")), _dict(obj.get("status"))
    ips = _list(spec.get("clusterIPs"))
    return [_name(obj), _str(spec.get("type")), _str(ips[0]) if ips else "<none>",
            _service_external_ip(spec, status), _service_ports(_list(spec.get("ports"))),
            age(obj, now), format_labels(spec.get("selector"))]


def endpoints_cells(obj: Obj, now: datetime) -> Cells:
    """formatEndpoints: ip:port per (port, address), not-ready addresses left out."""
    subsets = _list(obj.get("subsets"))
    if not subsets:
        return [_name(obj), "<none>", age(obj, now)]
    shown: list[str] = []
    count = 0
    for ss in map(_dict, subsets):
        ips = [_str(_dict(a).get("ip")) for a in _list(ss.get("addresses"))]
        ports = _list(ss.get("ports"))
        if not ports:  # a headless service without ports
            count += len(ips)
            shown += ips[: MORE - len(shown)]
            continue
        for port in ports:
            count += len(ips)
            number = _int(_dict(port).get("port"))
            shown += [_host_port(ip, number) for ip in ips[: MORE - len(shown)]]
    text = ",".join(shown)
    if count > len(shown):
        text = f"{text} + {count - MORE} more..."
    return [_name(obj), text, age(obj, now)]


def endpoint_slice_cells(obj: Obj, now: datetime) -> Cells:
    ports = []
    for p in map(_dict, _list(obj.get("ports"))):
        number, name = p.get("port"), p.get("name")
        # A port without a number is its name ("" when unnamed), "*" if it has neither.
        ports.append(str(number) if isinstance(number, int) else
                     name if isinstance(name, str) else "*")
    addresses = [_str(a) for ep in _list(obj.get("endpoints"))
                 for a in _list(_dict(ep).get("addresses"))]
    return [_name(obj), _str(obj.get("addressType")), _with_more(ports, len(ports)),
            _with_more(addresses, len(addresses)), age(obj, now)]


def node_roles(labels: Mapping[str, Any]) -> list[str]:
    prefix = "node-role.kubernetes.io/"
    roles = {k[len(prefix):] for k in labels if k.startswith(prefix) and len(k) > len(prefix)}
    role = labels.get("kubernetes.io/role")
    if isinstance(role, str) and role:
        roles.add(role)
    return sorted(roles)


def node_cells(obj: Obj, now: datetime) -> Cells:
    spec, status = _dict(obj.get("spec")), _dict(obj.get("status"))
    conditions = {c.get("type"): c for c in map(_dict, _list(status.get("conditions")))}
    ready = conditions.get("Ready")  # the only condition upstream shows
    states = ["Unknown" if ready is None else
              "Ready" if ready.get("status") == "True" else "NotReady"]
    if spec.get("unschedulable") is True:
        states.append("SchedulingDisabled")
    info = _dict(status.get("nodeInfo"))
    addresses = [_dict(a) for a in _list(status.get("addresses"))]

    def address(kind: str) -> str:
        return next((_str(a.get("address")) for a in addresses if a.get("type") == kind),
                    "<none>")

    return [_name(obj), ",".join(states),
            ",".join(node_roles(_dict(_dict(obj.get("metadata")).get("labels")))) or "<none>",
            age(obj, now), _str(info.get("kubeletVersion")),
            address("InternalIP"), address("ExternalIP"),
            _str(info.get("osImage")) or "<unknown>",
            _str(info.get("kernelVersion")) or "<unknown>",
            _str(info.get("containerRuntimeVersion")) or "<unknown>"]


def namespace_cells(obj: Obj, now: datetime) -> Cells:
    return [_name(obj), _str(_dict(obj.get("status")).get("phase")), age(obj, now)]


def _default_cells(obj: Obj, now: datetime) -> Cells:
    return [_name(obj), _dict(obj.get("metadata")).get("creationTimestamp")]


PRINTERS: dict[str, Callable[[Obj, datetime], Cells]] = {
    "Service": service_cells,
    "Endpoints": endpoints_cells,
    "EndpointSlice": endpoint_slice_cells,  # v1 and v1beta1 print alike
    "Node": node_cells,
    "Namespace": namespace_cells,
}


# ---- tables --------------------------------------------------------------------------


def _row(kind: str, obj: Obj, version: str, include: str, now: datetime) -> dict[str, Any]:
    cells = PRINTERS.get(kind, _default_cells)(obj, now)
    if include == "None":
        row_object: Obj | None = None
    elif include == "Object":
        row_object = obj
    else:  # meta.AsPartialObjectMetadata: the whole ObjectMeta
        row_object = {"kind": "PartialObjectMetadata", "apiVersion": f"{GROUP}/{version}",
                      "metadata": obj.get("metadata") or {}}
    return {"cells": cells, "object": row_object}


def table(kind: str, objects: list[Obj], metadata: Mapping[str, Any], *, version: str,
          include: str, level: str = "1.32", headers: bool = True,
          now: datetime | None = None) -> dict[str, Any]:
    """A Table of `objects` (with their kind and apiVersion), all columns (the server
    prints wide; clients hide priority > 0). `metadata`: the list's resourceVersion,
    continue and remainingItemCount, or the one object's resourceVersion. Without
    headers (watch events after the first) columnDefinitions is null, as upstream."""
    at = now or datetime.now(UTC)
    return {"kind": "Table", "apiVersion": f"{GROUP}/{version}", "metadata": dict(metadata),
            "columnDefinitions": [c.as_dict() for c in columns(kind, level)] if headers
            else None,
            "rows": [_row(kind, o, version, include, at) for o in objects]}


def object_table(kind: str, obj: Obj, *, version: str, include: str, level: str = "1.32",
                 headers: bool = True, now: datetime | None = None) -> dict[str, Any]:
    rv = _dict(obj.get("metadata")).get("resourceVersion")
    return table(kind, [obj], {"resourceVersion": rv} if rv else {}, version=version,
                 include=include, level=level, headers=headers, now=now)


class WatchTables:
    """Turns encoded watch lines into lines whose objects are one-row Tables; headers only
    on the first (as the server's watch encoder); ERROR Status objects pass through."""

    def __init__(self, kind: str, version: str, include: str, level: str = "1.32") -> None:
        self.kind, self.version, self.include, self.level = kind, version, include, level
        self.headers = True

    def line(self, raw: bytes) -> bytes:
        event = orjson.loads(raw)
        obj = event.get("object")
        if event.get("type") == "ERROR" or not isinstance(obj, dict):
            return raw
        event["object"] = object_table(self.kind, obj, version=self.version,
                                       include=self.include, level=self.level,
                                       headers=self.headers)
        self.headers = False
        return orjson.dumps(event) + b"\n"
