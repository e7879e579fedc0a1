"""Discovery documents (`/version`, `/api`, `/apis`, resource lists) in the classic,
unaggregated form. Newer clients ask for aggregated discovery first and fall back to
these when the answer's Content-Type is plain `application/json`.
"""

from __future__ import annotations

from typing import Any

from proxy.sim.resources import LATEST, ApiSurface, ResourceType


def git_version(surface: ApiSurface = LATEST) -> str:
    return f"v{surface.level}.0-sliceproxy-sim"


def version(surface: ApiSurface = LATEST) -> dict[str, str]:
    return {
        "major": "1",
        "minor": surface.minor,
        "gitVersion": git_version(surface),
        "gitCommit": "0000000000000000000000000000000000000000",
        "gitTreeState": "clean",
        "buildDate": "2026-01-01T00:00:00Z",
        "goVersion": "go1.23.0",
        "compiler": "gc",
        "platform": "linux/amd64",
    }


def core_versions(server_address: str) -> dict[str, Any]:
    return {
        "kind": "APIVersions",
        "versions": ["v1"],
        "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": server_address}
        ],
    }


def _group(surface: ApiSurface, name: str) -> dict[str, Any]:
    versions = sorted({rt.version for rt in surface.types if rt.group == name})
    entries = [{"groupVersion": f"{name}/{v}", "version": v} for v in versions]
    return {"name": name, "versions": entries, "preferredVersion": entries[0]}


def group_list(surface: ApiSurface = LATEST) -> dict[str, Any]:
    return {"kind": "APIGroupList", "apiVersion": "v1",
            "groups": [_group(surface, g) for g in surface.groups]}


def group(name: str, surface: ApiSurface = LATEST) -> dict[str, Any] | None:
    if name not in surface.groups:
        return None
    return {"kind": "APIGroup", "apiVersion": "v1", **_group(surface, name)}


def _entry(rt: ResourceType) -> dict[str, Any]:
    out: dict[str, Any] = {
        "name": rt.plural,
        "singularName": rt.singular,
        "namespaced": rt.namespaced,
        "kind": rt.kind,
        "verbs": list(rt.verbs),
    }
    if rt.short_names:
        out["shortNames"] = list(rt.short_names)
    return out


def resource_list(group_name: str, version_name: str,
                  surface: ApiSurface = LATEST) -> dict[str, Any] | None:
    types = [rt for rt in surface.types
             if rt.group == group_name and rt.version == version_name]
    if not types:
        return None
    resources: list[dict[str, Any]] = []
    for rt in sorted(types, key=lambda r: r.plural):
        resources.append(_entry(rt))
        if rt.status_subresource:
            resources.append({"name": f"{rt.plural}/status", "singularName": "",
                              "namespaced": rt.namespaced, "kind": rt.kind,
                              "verbs": ["get", "patch", "update"]})
    gv = f"{group_name}/{version_name}" if group_name else version_name
    return {"kind": "APIResourceList", "apiVersion": "v1", "groupVersion": gv,
            "resources": resources}
