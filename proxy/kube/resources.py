"""The API resources sliceproxy watches, and where they live."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Resource:
    kind: str
    group_version: str  # "v1" for the core group, else "group/version"
    plural: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return self.group_version

    @property
    def path(self) -> str:
        """The cluster-wide collection path (lists across all namespaces)."""
        prefix = "/api" if self.group_version == "v1" else "/apis"
        return f"{prefix}/{self.group_version}/{self.plural}"

    def __str__(self) -> str:
        return f"{self.plural}.{self.group_version}"


SERVICES = Resource("Service", "v1", "services", namespaced=True)
ENDPOINTS = Resource("Endpoints", "v1", "endpoints", namespaced=True)
NODES = Resource("Node", "v1", "nodes", namespaced=False)
ENDPOINT_SLICES_V1 = Resource("EndpointSlice", "discovery.k8s.io/v1", "endpointslices", True)
# Clusters 1.17-1.20 serve EndpointSlices only as v1beta1 (topology map, no hints).
ENDPOINT_SLICES_V1BETA1 = Resource(
    "EndpointSlice", "discovery.k8s.io/v1beta1", "endpointslices", True)
