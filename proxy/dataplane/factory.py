"""Pick the data plane for `--proxy-mode`, importing only that one: the IPVS plane pulls
in pyroute2's netlink stack, which an iptables-mode agent has no use for."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import cast

from proxy.dataplane.base import DataPlane, DataplaneOptions

# mode -> (module, class); each class takes DataplaneOptions.
PLANES = {
    "iptables": ("proxy.dataplane.iptables.apply", "IptablesDataPlane"),
    "ipvs": ("proxy.dataplane.ipvs.apply", "IpvsDataPlane"),
    "nftables": ("proxy.dataplane.nftables.apply", "NftablesDataPlane"),
}


class DataplaneUnavailable(Exception):
    """The requested data plane cannot be built here (missing module, tool or kernel)."""


def dataplane_class(mode: str) -> Callable[[DataplaneOptions], DataPlane]:
    if mode not in PLANES:
        raise DataplaneUnavailable(f"unknown proxy mode {mode!r} (one of {', '.join(PLANES)})")
    module_name, class_name = PLANES[mode]
    try:
        module = importlib.import_module(module_name)
        return cast(Callable[[DataplaneOptions], DataPlane], getattr(module, class_name))
    except (ImportError, AttributeError) as exc:
        raise DataplaneUnavailable(f"proxy mode {mode} is not available: {exc}") from exc


def make_dataplane(mode: str, options: DataplaneOptions) -> DataPlane:
    return dataplane_class(mode)(options)
