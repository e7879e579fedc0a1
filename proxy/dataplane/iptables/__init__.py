"""The iptables data plane: `render` (pure), `ruleset` (pure restore text), `runner`
(the binaries), `apply` (the DataPlane)."""

from proxy.dataplane.iptables.apply import IptablesDataPlane

__all__ = ["IptablesDataPlane"]
