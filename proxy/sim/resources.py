"""The resource types the simulator serves, with the facts discovery and storage need."""

from __future__ import annotations

from dataclasses import dataclass

FULL_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
NO_COLLECTION_DELETE = ("create", "delete", "get", "list", "patch", "update", "watch")


@dataclass(frozen=True, slots=True)
class ResourceType:
    plural: str
    singular: str
    kind: str
    group: str  # "" for the core group
    version: str
    namespaced: bool
    verbs: tuple[str, ...]
    short_names: tuple[str, ...] = ()
    # PUT to a missing name creates it (upstream AllowCreateOnUpdate).
    create_on_update: bool = False
    # Has a /status subresource whose writes only change .status.
    status_subresource: bool = False
    # DELETE answers with the deleted object rather than a Success Status.
    returns_deleted_object: bool = False

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def qualified(self) -> str:
        """`services` or `endpointslices.discovery.k8s.io`, as used in error messages."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    @property
    def group_kind(self) -> str:
        return f"{self.kind}.{self.group}" if self.group else self.kind

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"


SERVICES = ResourceType(
    "services", "service", "Service", "", "v1", True, NO_COLLECTION_DELETE, ("svc",),
    status_subresource=True, returns_deleted_object=True,
)
ENDPOINTS = ResourceType(
    "endpoints", "endpoints", "Endpoints", "", "v1", True, FULL_VERBS, ("ep",),
    create_on_update=True,
)
NODES = ResourceType(
    "nodes", "node", "Node", "", "v1", False, FULL_VERBS, ("no",), status_subresource=True
)
NAMESPACES = ResourceType(
    "namespaces", "namespace", "Namespace", "", "v1", False, NO_COLLECTION_DELETE, ("ns",),
    status_subresource=True,
)
ENDPOINT_SLICES = ResourceType(
    "endpointslices", "endpointslice", "EndpointSlice", "discovery.k8s.io", "v1", True,
    FULL_VERBS, create_on_update=True,
)

ALL: tuple[ResourceType, ...] = (NAMESPACES, NODES, SERVICES, ENDPOINTS, ENDPOINT_SLICES)

# (group, plural) -> type: how URLs are routed.
BY_PATH: dict[tuple[str, str], ResourceType] = {(r.group, r.plural): r for r in ALL}
# (apiVersion, kind) -> type: how manifests and the Python API find an object's type.
BY_KIND: dict[tuple[str, str], ResourceType] = {(r.api_version, r.kind): r for r in ALL}
