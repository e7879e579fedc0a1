"""What the agent says about where NodePorts listen (`--nodeport-addresses`).

- At start, in the modes whose default is every local address (iptables, IPVS), with no
  `--nodeport-addresses`: upstream's hint to use `primary` (its checkBadConfig).
- When `primary` cannot restrict a family because the Node object shows no address of
  it: that family's NodePorts accept connections on every local address (as upstream;
  model/nodeport_addresses.py). Said once per family, and only once a NodePort of the
  family exists (a single-stack cluster has no IPv6 NodePort to worry about); said again
  only after the Node has had an address of the family in between.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from proxy.config.options import Config
from proxy.model.nodeport_addresses import unrestricted_by_primary
from proxy.model.snapshot import DesiredState
from proxy.model.types import Family, IPAddress, ServicePortKey

log = logging.getLogger("proxy.agent")


def warn_unset(config: Config) -> None:
    """Upstream's start-up hint, in the modes where unset means every address."""
    if not (config.nodeport_addresses or config.nodeport_primary):
        log.warning("nodePortAddresses is unset: NodePorts accept connections on every "
                    "local address; consider --nodeport-addresses primary",
                    extra={"mode": config.proxy_mode})


class PrimaryAddressWarnings:
    """Checks each synced snapshot (`check`) for a family `primary` leaves open."""

    def __init__(self, config: Config) -> None:
        self._node = config.node_name
        self._cidrs = config.nodeport_addresses
        self._primary = config.nodeport_primary
        self._warned: set[Family] = set()
        self._checked: tuple[IPAddress, ...] | None = None  # primary IPs last looked at

    def check(self, state: DesiredState, keys: Iterable[ServicePortKey]) -> None:
        """After a sync of `state`, whose `keys` changed: O(changes), or O(ports) when
        the node's primary addresses changed since the last check."""
        if not self._primary:
            return
        open_families = set(unrestricted_by_primary(self._cidrs, True, state.primary_ips))
        for family in sorted(self._warned - open_families):
            log.info("the Node now has an address of this family: its NodePorts accept "
                     "connections on that address only",
                     extra={"node": self._node, "family": family.label,
                            "primary_ips": [str(ip) for ip in state.primary_ips]})
        self._warned &= open_families
        pending = open_families - self._warned
        whole = state.primary_ips != self._checked
        self._checked = state.primary_ips
        if not pending:
            return
        candidates = state.ports.keys() if whole else keys
        for key in candidates:
            rsp = state.ports.get(key)
            if key.family in pending and rsp is not None and rsp.port.node_port:
                log.warning("nodePortAddresses primary: the Node has no address of this "
                            "family, so its NodePorts accept connections on every local "
                            "address", extra={"node": self._node, "family": key.family.label,
                                              "service_port": str(key)})
                self._warned.add(key.family)
                pending.discard(key.family)
                if not pending:
                    return
