"""Pick the data plane for `--proxy-mode`, importing only that one: the IPVS plane pulls
in pyroute2's netlink stack, which an iptables-mode agent has no use for. Which class a
mode uses is in modes.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

from proxy.dataplane import modes
from proxy.dataplane.base import DataPlane, DataplaneOptions


class DataplaneUnavailable(Exception):
    """The requested data plane cannot be built here (missing module, tool or kernel)."""


def dataplane_class(mode: str) -> Callable[[DataplaneOptions], DataPlane]:
    try:
        path = modes.get(mode).plane
    except KeyError:
        raise DataplaneUnavailable(
            f"unknown proxy mode {mode!r} (one of {', '.join(sorted(modes.names()))})") from None
    try:
        return cast(Callable[[DataplaneOptions], DataPlane], modes.load(path))
    except (ImportError, AttributeError) as exc:
        raise DataplaneUnavailable(f"proxy mode {mode} is not available: {exc}") from exc


def make_dataplane(mode: str, options: DataplaneOptions) -> DataPlane:
    return dataplane_class(mode)(options)
