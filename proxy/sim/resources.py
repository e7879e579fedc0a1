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

# discovery.k8s.io/v1beta1 as a v1.20 API server serves it: `topology` map instead of
# nodeName/zone, no hints (the only EndpointSlice version of clusters 1.17-1.20).
ENDPOINT_SLICES_V1BETA1 = ResourceType(
    "endpointslices", "endpointslice", "EndpointSlice", "discovery.k8s.io", "v1beta1", True,
    FULL_VERBS, create_on_update=True,
)

# The other kinds of deploy/daemonset.yaml, so that `kubectl create|apply -f` of it works
# against the simulator (kubectl maps every kind through discovery, even for a client-side
# dry run). Stored and served like any object; nothing interprets them.
CONFIG_MAPS = ResourceType(
    "configmaps", "configmap", "ConfigMap", "", "v1", True, FULL_VERBS, ("cm",))
SERVICE_ACCOUNTS = ResourceType(
    "serviceaccounts", "serviceaccount", "ServiceAccount", "", "v1", True, FULL_VERBS, ("sa",))
DAEMON_SETS = ResourceType(
    "daemonsets", "daemonset", "DaemonSet", "apps", "v1", True, FULL_VERBS, ("ds",),
    status_subresource=True)
CLUSTER_ROLES = ResourceType(
    "clusterroles", "clusterrole", "ClusterRole", "rbac.authorization.k8s.io", "v1", False,
    FULL_VERBS)
CLUSTER_ROLE_BINDINGS = ResourceType(
    "clusterrolebindings", "clusterrolebinding", "ClusterRoleBinding",
    "rbac.authorization.k8s.io", "v1", False, FULL_VERBS)
DEPLOY_KINDS = (CONFIG_MAPS, SERVICE_ACCOUNTS, DAEMON_SETS, CLUSTER_ROLES, CLUSTER_ROLE_BINDINGS)


@dataclass(frozen=True, slots=True)
class ApiSurface:
    """What one Kubernetes release serves of the resources the simulator knows."""

    level: str  # "1.32", "1.20"
    types: tuple[ResourceType, ...]

    @property
    def minor(self) -> str:
        return self.level.split(".")[1]

    @property
    def groups(self) -> list[str]:
        return sorted({rt.group for rt in self.types if rt.group})

    def by_path(self, group: str, plural: str) -> ResourceType | None:
        """(group, plural) -> type: how URLs are routed."""
        return next((rt for rt in self.types if (rt.group, rt.plural) == (group, plural)), None)

    def by_kind(self, api_version: str, kind: str) -> ResourceType | None:
        """(apiVersion, kind) -> type: how manifests and the Python API find a type."""
        return next((rt for rt in self.types
                     if (rt.api_version, rt.kind) == (api_version, kind)), None)


LATEST = ApiSurface("1.32", (NAMESPACES, NODES, SERVICES, ENDPOINTS, ENDPOINT_SLICES,
                             *DEPLOY_KINDS))
V1_20 = ApiSurface("1.20", (NAMESPACES, NODES, SERVICES, ENDPOINTS, ENDPOINT_SLICES_V1BETA1,
                            *DEPLOY_KINDS))
API_LEVELS = {s.level: s for s in (LATEST, V1_20)}


def api_surface(level: str | None) -> ApiSurface:
    if not level:
        return LATEST
    try:
        return API_LEVELS[level]
    except KeyError:
        raise ValueError(f"unsupported API level {level!r}: use one of "
                         f"{', '.join(sorted(API_LEVELS))}") from None


def is_endpoint_slice(rt: ResourceType) -> bool:
    return rt.group == "discovery.k8s.io" and rt.kind == "EndpointSlice"


ALL: tuple[ResourceType, ...] = LATEST.types

# (group, plural) -> type at the latest level.
BY_PATH: dict[tuple[str, str], ResourceType] = {(r.group, r.plural): r for r in ALL}
# (apiVersion, kind) -> type at the latest level.
BY_KIND: dict[tuple[str, str], ResourceType] = {(r.api_version, r.kind): r for r in ALL}
