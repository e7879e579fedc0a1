"""Per-type create/update rules (upstream's registry "strategies"): defaults, fields the
server owns (status, generation, allocated IPs and ports), and what an update may change.

Each function edits the new object in place and returns field errors (422 causes).
"""

from __future__ import annotations

import ipaddress
from typing import Any

from proxy.sim import v1beta1
from proxy.sim.allocators import Allocators
from proxy.sim.errors import Cause
from proxy.sim.resources import (
    ENDPOINT_SLICES_V1BETA1,
    NAMESPACES,
    NODES,
    SERVICES,
    ResourceType,
    is_endpoint_slice,
)
from proxy.sim.validation import invalid

# Namespaces upstream refuses to delete.
IMMORTAL_NAMESPACES = ("default", "kube-system", "kube-public")


def prepare_create(rt: ResourceType, obj: dict[str, Any]) -> None:
    meta = obj["metadata"]
    meta.pop("generation", None)
    meta.pop("deletionTimestamp", None)
    if rt is SERVICES:
        obj["status"] = {"loadBalancer": {}}
        _service_defaults(obj)
    elif is_endpoint_slice(rt):
        meta["generation"] = 1
        if rt is ENDPOINT_SLICES_V1BETA1:
            v1beta1.prepare(obj)
        _slice_defaults(obj)
    elif rt is NAMESPACES:
        obj["spec"] = {"finalizers": ["kubernetes"]}
        obj["status"] = {"phase": "Active"}
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]


def prepare_update(rt: ResourceType, new: dict[str, Any], old: dict[str, Any]) -> None:
    """Carry server-owned fields over from the stored object."""
    meta, old_meta = new["metadata"], old["metadata"]
    for key in ("uid", "creationTimestamp", "deletionTimestamp", "generation"):
        if key in old_meta:
            meta[key] = old_meta[key]
        else:
            meta.pop(key, None)
    if rt in (SERVICES, NODES, NAMESPACES):  # status only changes through /status
        if "status" in old:
            new["status"] = old["status"]
        else:
            new.pop("status", None)
    if rt is SERVICES:
        _keep_allocations(new, old)
        _service_defaults(new)
    elif rt is NAMESPACES:
        new["spec"] = old.get("spec", {})
        meta.setdefault("labels", {})["kubernetes.io/metadata.name"] = meta["name"]
    elif is_endpoint_slice(rt):
        if rt is ENDPOINT_SLICES_V1BETA1:
            v1beta1.prepare(new)
        _slice_defaults(new)
        strip = ("metadata",)
        changed = {k: v for k, v in new.items() if k not in strip} != {
            k: v for k, v in old.items() if k not in strip}
        if changed or meta.get("labels") != old_meta.get("labels"):
            meta["generation"] = int(old_meta.get("generation") or 0) + 1


def prepare_status_update(new: dict[str, Any], old: dict[str, Any]) -> dict[str, Any]:
    """A write to /status: everything but .status comes from the stored object."""
    out = {k: v for k, v in old.items() if k != "status"}
    out["metadata"] = dict(old["metadata"])
    rv = (new.get("metadata") or {}).get("resourceVersion")
    if rv:
        out["metadata"]["resourceVersion"] = rv
    else:
        out["metadata"].pop("resourceVersion", None)
    if "status" in new:
        out["status"] = new["status"]
    return out


def _service_defaults(obj: dict[str, Any]) -> None:
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        return
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    for port in spec.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("protocol", "TCP")
            if "targetPort" not in port and "port" in port:
                port["targetPort"] = port["port"]
    if spec["type"] == "ExternalName":
        return
    spec.setdefault("internalTrafficPolicy", "Cluster")
    if spec["type"] in ("NodePort", "LoadBalancer"):
        spec.setdefault("externalTrafficPolicy", "Cluster")
    if spec["type"] == "LoadBalancer":
        spec.setdefault("allocateLoadBalancerNodePorts", True)


def _slice_defaults(obj: dict[str, Any]) -> None:
    """Upstream's SetDefaults_EndpointPort (v1 and v1beta1): a port without a name is
    named "", without a protocol is TCP."""
    for port in obj.get("ports") or []:
        if isinstance(port, dict):
            port.setdefault("name", "")
            port.setdefault("protocol", "TCP")


def _keep_allocations(new: dict[str, Any], old: dict[str, Any]) -> None:
    """An update that omits clusterIP or nodePorts keeps the allocated ones (upstream
    `patchAllocatedValues`), so `kubectl replace` of the original manifest works."""
    spec, old_spec = new.get("spec"), old.get("spec") or {}
    if not isinstance(spec, dict):
        return
    if not spec.get("clusterIP") and not spec.get("clusterIPs"):
        for key in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
            if key in old_spec and key not in spec:
                spec[key] = old_spec[key]
    if spec.get("type") in ("NodePort", "LoadBalancer"):
        old_ports = {(p.get("port"), p.get("protocol", "TCP")): p.get("nodePort")
                     for p in old_spec.get("ports") or [] if isinstance(p, dict)}
        for port in spec.get("ports") or []:
            if isinstance(port, dict) and not port.get("nodePort"):
                prev = old_ports.get((port.get("port"), port.get("protocol", "TCP")))
                if prev:
                    port["nodePort"] = prev


def _family(ip: str) -> str | None:
    try:
        return "IPv4" if ipaddress.ip_address(ip).version == 4 else "IPv6"
    except ValueError:
        return None


def allocate_service(obj: dict[str, Any], old: dict[str, Any] | None,
                     alloc: Allocators) -> list[Cause]:
    """Assign cluster IPs and node ports; check requested ones. Returns 422 causes."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or spec.get("type") == "ExternalName":
        return []
    old_spec = (old or {}).get("spec") or {}
    causes: list[Cause] = []
    old_ips = [ip for ip in old_spec.get("clusterIPs") or [] if ip != "None"]
    ips: list[str] = list(spec.get("clusterIPs") or ([spec["clusterIP"]]
                                                      if spec.get("clusterIP") else []))
    if old_ips and ips[: len(old_ips)] != old_ips:
        shown = ", ".join(f'"{ip}"' for ip in ips)
        return [Cause("FieldValueInvalid",
                      f"Invalid value: []string{{{shown}}}: may not change once set",
                      "spec.clusterIPs[0]")]
    headless = bool(ips) and ips[0] == "None"
    families: list[str] = list(spec.get("ipFamilies") or [])
    if not families:
        families = [f for f in (_family(ip) for ip in ips if ip != "None") if f] or ["IPv4"]
    policy = spec.get("ipFamilyPolicy") or "SingleStack"
    if policy in ("PreferDualStack", "RequireDualStack") and len(families) == 1:
        families.append("IPv6" if families[0] == "IPv4" else "IPv4")
    spec["ipFamilies"], spec["ipFamilyPolicy"] = families, policy
    if headless:
        spec["clusterIP"], spec["clusterIPs"] = "None", ["None"]
    else:
        taken_here: list[str] = []
        for i, fam in enumerate(families):
            version = 4 if fam == "IPv4" else 6
            if i < len(ips):
                if ips[i] not in old_ips:
                    cause = alloc.check_ip(ips[i], f"spec.clusterIPs[{i}]")
                    if cause:
                        causes.append(cause)
                continue
            ip = alloc.allocate_ip(version)
            while ip is not None and ip in taken_here:
                ip = alloc.allocate_ip(version)
            if ip is None:
                causes.append(invalid(f"spec.clusterIPs[{i}]", "", "failed to allocate IP: "
                                      "range is full"))
                continue
            taken_here.append(ip)
            ips.append(ip)
        spec["clusterIPs"] = ips
        spec["clusterIP"] = ips[0] if ips else ""
    if spec.get("type") in ("NodePort", "LoadBalancer") and (
            spec.get("type") == "NodePort" or spec.get("allocateLoadBalancerNodePorts", True)):
        old_node_ports = {p.get("nodePort") for p in old_spec.get("ports") or []
                          if isinstance(p, dict)}
        local: set[int] = set()
        for i, port in enumerate(spec.get("ports") or []):
            if not isinstance(port, dict):
                continue
            want = port.get("nodePort")
            if isinstance(want, int) and want:
                if want not in old_node_ports:
                    cause = alloc.check_node_port(want, f"spec.ports[{i}].nodePort")
                    if cause is None and want in local:
                        cause = invalid(f"spec.ports[{i}].nodePort", want,
                                        "provided port is already allocated")
                    if cause:
                        causes.append(cause)
                local.add(want)
                continue
            got = alloc.allocate_node_port()
            while got is not None and got in local:
                got = alloc.allocate_node_port()
            if got is None:
                causes.append(invalid(f"spec.ports[{i}].nodePort", 0, "failed to allocate "
                                      "port: range is full"))
                continue
            port["nodePort"] = got
            local.add(got)
    return causes
