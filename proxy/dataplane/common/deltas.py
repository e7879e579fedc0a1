"""What every mode checks before rendering a port from its endpoint delta alone.

`ResolvedServicePort.endpoint_delta` promises that nothing but the endpoints changed;
a mode that trusted a wrong promise would leave wrong rules in the kernel until the
next full sync, so the promise is checked here, in O(1) of the endpoints."""

from __future__ import annotations

from proxy.model.snapshot import ResolvedServicePort


def only_endpoints_changed(old: ResolvedServicePort, new: ResolvedServicePort) -> bool:
    return (old.key == new.key and old.service == new.service and old.port == new.port
            and old.cluster_ips == new.cluster_ips and old.uses_cluster == new.uses_cluster
            and old.uses_local == new.uses_local)
