"""The native nftables data plane (`--proxy-mode nftables`): our own `ip sliceproxy` and
`ip6 sliceproxy` tables, verdict-map dispatch, one chain per service port.

`NftablesDataPlane` is imported lazily so that the pure modules (render, transaction)
load without libnftables.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from proxy.dataplane.nftables.apply import NftablesDataPlane

__all__ = ["NftablesDataPlane"]


def __getattr__(name: str) -> Any:
    if name == "NftablesDataPlane":
        from proxy.dataplane.nftables.apply import NftablesDataPlane

        return NftablesDataPlane
    raise AttributeError(name)
