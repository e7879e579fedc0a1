"""The IPVS data plane (`--proxy-mode ipvs`): virtual servers over netlink, service
addresses on a dummy interface, ipsets and a few fixed iptables rules.

`IpvsDataPlane` is imported lazily so that the pure modules (render, index, diff,
netfilter) load without pyroute2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.dataplane.ipvs.apply import IpvsDataPlane

__all__ = ["IpvsDataPlane"]


def __getattr__(name: str) -> Any:
    if name == "IpvsDataPlane":
        from proxy.dataplane.ipvs.apply import IpvsDataPlane

        return IpvsDataPlane
    raise AttributeError(name)
