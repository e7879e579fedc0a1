"""Our dummy interface (kube-proxy's kube-ipvs0) and the service addresses on it: IPVS
only sees packets to local addresses, so every cluster IP, externalIP and load-balancer
IP we serve is added to it. Also where the node's own addresses are read (full syncs).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

from proxy.dataplane.base import ApplyError
from proxy.dataplane.common.kube_proxy_objects import IPVS_INTERFACE as KUBE_IPVS_INTERFACE
from proxy.dataplane.ipvs.kernel import Links
from proxy.dataplane.ipvs.render import address_order, usable_node_address
from proxy.dataplane.ipvs.run_record import RunRecord
from proxy.model.types import IPAddress


class DummyInterface:
    def __init__(self, name: str) -> None:
        self.name = name
        self.index: int | None = None  # as we made or found it at the last full sync

    def set_up(self, links: Links) -> tuple[list[IPAddress], set[IPAddress]]:
        """Make sure the interface is there and up; the node's own addresses and the
        service addresses on it now. Raises ApplyError."""
        try:
            self.index = links.ensure()
            # kube-proxy's dummy interface holds service addresses, not the node's
            # (it is there between the switch from kube-proxy and its clean-up).
            services = {self.index, links.index(KUBE_IPVS_INTERFACE)}
            table = links.address_table()
        except Exception as exc:
            raise ApplyError(f"cannot set up dummy interface {self.name}: {exc}",
                             offending=f"link {self.name}") from exc
        node = [a for i, a in table if i not in services]
        present = {a for i, a in table if i == self.index and usable_node_address(a)}
        return node, present

    def change(self, links: Links, add: Iterable[IPAddress], remove: Iterable[IPAddress],
               run: RunRecord) -> None:
        """Add and remove service addresses (adding one there, removing one gone: done)."""
        index = self.index
        assert index is not None
        adding = sorted(add, key=address_order)
        removing = sorted(remove, key=address_order)
        if not adding and not removing:
            return
        try:
            codes = links.change(index, adding, removing)
        except Exception as exc:
            run.fail(f"change addresses of {self.name}", exc)
            return
        for address, code in zip(adding, codes[:len(adding)], strict=True):
            if code and code != errno.EEXIST:
                run.fail(f"add address {address} to {self.name}",
                         OSError(code, os.strerror(code)))
        for address, code in zip(removing, codes[len(adding):], strict=True):
            if code and code != errno.EADDRNOTAVAIL:
                run.fail(f"delete address {address} from {self.name}",
                         OSError(code, os.strerror(code)))

    def differences(self, links: Links, wanted: set[IPAddress]) -> list[str]:
        """How the interface (there, up, the same one) and its addresses differ from
        what we made: `wanted` are the addresses it should hold."""
        try:
            state = links.state()
        except Exception as exc:
            return [f"dummy interface {self.name} could not be read: {exc}"]
        if state is None:
            return [f"dummy interface {self.name} is missing"]
        index, up = state
        if index != self.index:
            return [f"dummy interface {self.name} was re-created"]
        found = [] if up else [f"dummy interface {self.name} is down"]
        try:
            present = {a for a in links.addresses(index) if usable_node_address(a)}
        except Exception as exc:
            return [*found, f"addresses of {self.name} could not be read: {exc}"]
        missing = sorted(wanted - present, key=address_order)
        extra = sorted(present - wanted, key=address_order)
        if missing:
            found.append(f"{len(missing)} address(es) missing from {self.name}, "
                         f"first {missing[0]}")
        if extra:
            found.append(f"{len(extra)} address(es) on {self.name} that are not "
                         f"ours, first {extra[0]}")
        return found

    def delete(self, links: Links, run: RunRecord) -> bool:
        """Delete the interface, its addresses with it; whether it was there."""
        self.index = None
        try:
            return links.delete()
        except Exception as exc:
            run.fail(f"delete link {self.name}", exc)
            return False
