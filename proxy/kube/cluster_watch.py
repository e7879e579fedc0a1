"""Everything the agent watches: Services, this Node, and EndpointSlices or Endpoints.

One reflector per resource, all feeding one event handler (the agent applies the
events to the model). `wait_synced` tells the agent when every resource has listed, so
its first sync never programs a partial view of the cluster.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import replace

import orjson

from proxy.kube.client import Api, BodyTooLarge, read_body
from proxy.kube.ingest import EndpointsSource
from proxy.kube.reflector import Reflector, ReflectorOptions, WatchEvent
from proxy.kube.resources import (
    ENDPOINT_SLICES_V1,
    ENDPOINT_SLICES_V1BETA1,
    ENDPOINTS,
    NODES,
    SERVICES,
    Resource,
)

log = logging.getLogger(__name__)

# As upstream: slices and Endpoints of headless services are never proxied, so do not
# even receive them.
NOT_HEADLESS = "!service.kubernetes.io/headless"


class DiscoveryError(Exception):
    pass


# A group's discovery document is a few hundred bytes; this only stops a broken server.
DISCOVERY_BODY_BYTES = 1 * 2**20


async def endpoint_slice_resource(api: Api, timeout: float = 30.0) -> Resource:
    """discovery.k8s.io/v1 where served (1.21+), else v1beta1 (1.17-1.20)."""
    try:
        async with asyncio.timeout(timeout):  # body included
            resp = await api.get("/apis/discovery.k8s.io", {}, timeout)
            try:
                data = await read_body(resp, DISCOVERY_BODY_BYTES)
            finally:
                resp.close()
    except BodyTooLarge:
        raise DiscoveryError("discovery of discovery.k8s.io: an answer over "
                             f"{DISCOVERY_BODY_BYTES} bytes") from None
    if resp.status == 404:
        raise DiscoveryError("the API server does not serve discovery.k8s.io "
                             "(EndpointSlices); use --endpoints-source=endpoints")
    if resp.status != 200:
        raise DiscoveryError(f"discovery of discovery.k8s.io failed: HTTP {resp.status}")
    group = orjson.loads(data)
    if not isinstance(group, dict):
        raise DiscoveryError("discovery of discovery.k8s.io: the answer is not an object")
    versions = {v.get("version") for v in group.get("versions") or [] if isinstance(v, dict)}
    if "v1" in versions:
        return ENDPOINT_SLICES_V1
    if "v1beta1" in versions:
        return ENDPOINT_SLICES_V1BETA1
    raise DiscoveryError(f"discovery.k8s.io serves {sorted(map(str, versions))}, "
                         "neither v1 nor v1beta1")


class ClusterWatch:
    def __init__(
        self,
        api: Api,
        node_name: str,
        source: EndpointsSource,
        handler: Callable[[WatchEvent], None],
        options: ReflectorOptions | None = None,
        slice_resource: Resource = ENDPOINT_SLICES_V1,
    ) -> None:
        base = options or ReflectorOptions()
        endpoints = slice_resource if source is EndpointsSource.ENDPOINT_SLICES else ENDPOINTS
        self.reflectors = [
            Reflector(api, SERVICES, handler, base),
            Reflector(api, endpoints, handler, replace(base, label_selector=NOT_HEADLESS)),
            Reflector(api, NODES, handler,
                      replace(base, field_selector=f"metadata.name={node_name}")),
        ]
        self._tasks: list[asyncio.Task[None]] = []
        log.info("watching %s", ", ".join(str(r.resource) for r in self.reflectors),
                 extra={"endpoints_source": source.value})

    def start(self) -> None:
        for r in self.reflectors:
            self._tasks.append(asyncio.create_task(r.run(), name=f"watch {r.resource}"))

    @property
    def synced(self) -> bool:
        return all(r.synced.is_set() for r in self.reflectors)

    async def wait_synced(self) -> None:
        await asyncio.gather(*(r.synced.wait() for r in self.reflectors))

    async def wait_synced_but_endpoints(self) -> None:
        """Until Services and the Node have listed: what decides which service ports
        exist and how endpoints are chosen, so that the endpoints listed from then on
        can be resolved as they arrive."""
        services, _endpoints, nodes = self.reflectors
        await asyncio.gather(services.synced.wait(), nodes.synced.wait())

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
