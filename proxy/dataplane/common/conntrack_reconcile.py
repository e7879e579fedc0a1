"""Conntrack reconciled against the rules just applied: which UDP and SCTP entries are
stale, decided from the kernel's own table, never from what the agent knew before it
started (pure; `reconcile` at the end does the kernel part).

A UDP "flow" is a conntrack entry, refreshed by every datagram: the endpoint its first
datagram was DNATed to answers all the others. So an entry is only stale when it can no
longer be right:

- **stale DNAT**: addressed to a service port (a cluster, external or load-balancer
  address, or its NodePort on one of this node's addresses) and DNATed to an endpoint
  that no longer receives that port's traffic (an endpoint removed while no agent ran,
  or a delete event missed);
- **missing DNAT**: addressed to a service port that has endpoints, but not DNATed at
  all: sent while the port had none (routed elsewhere), it would otherwise keep the new
  endpoints out of reach for as long as the client keeps sending (kubernetes #48370).

Every entry DNATed to a live endpoint stays, so a restart or an upgrade of the agent
moves no flow (upstream clears them at start: kubernetes #122740). TCP is never touched:
a connection to a gone endpoint fails and the client reconnects.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from proxy.dataplane.common.conntrack import IPPROTO, used_endpoints
from proxy.dataplane.common.ctnetlink import ConntrackSocket, CtEntry
from proxy.dataplane.common.naming import port_name
from proxy.dataplane.common.netlink_constants import IPS_DST_NAT
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family, IPAddress, ServicePortKey

log = logging.getLogger(__name__)

STALE_DNAT = "stale-dnat"
MISSING_DNAT = "missing-dnat"
REASONS = (STALE_DNAT, MISSING_DNAT)
PROTOCOLS = frozenset(IPPROTO.values())  # UDP and SCTP


@dataclass(frozen=True, slots=True)
class Served:
    """A service port as the kernel's rules serve it: the endpoints its traffic goes to."""

    keys: tuple[ServicePortKey, ...]  # one, unless two ports claim one address (logs)
    live: frozenset[tuple[IPAddress, int]]

    def joined(self, other: Served) -> Served:
        # Never delete what either claimant would serve.
        return Served(self.keys + other.keys, self.live | other.live)


class Frontends:
    """Every address:port of the UDP and SCTP service ports in `ports`, and their NodePorts
    on `node_ips`, by (IP protocol, address, port)."""

    def __init__(self, ports: Iterable[ResolvedServicePort],
                 node_ips: Iterable[IPAddress]) -> None:
        self.by_address: dict[tuple[int, IPAddress, int], Served] = {}
        self.by_node_port: dict[tuple[Family, int, int], Served] = {}
        self.node_ips = frozenset(node_ips)
        for rsp in ports:
            number = IPPROTO.get(rsp.port.protocol)
            if number is None:
                continue  # TCP
            served = Served((rsp.key,), frozenset(used_endpoints(rsp)))
            family, svc, port = rsp.key.family, rsp.service, rsp.port.port
            addresses = (*rsp.cluster_ips, *(a for a in (*svc.external_ips,
                                                         *svc.load_balancer_ips)
                                              if Family.of(a) is family))
            for address in addresses:
                self._add(self.by_address, (number, address, port), served)
            if rsp.port.node_port:
                self._add(self.by_node_port, (family, number, rsp.port.node_port), served)

    @staticmethod
    def _add(index: dict[Any, Served], key: Any, served: Served) -> None:
        there = index.get(key)
        index[key] = served if there is None else there.joined(served)

    def __len__(self) -> int:
        return len(self.by_address) + len(self.by_node_port)

    def lookup(self, protocol: int, dst: IPAddress, dport: int) -> Served | None:
        """The service port an entry's original destination belongs to, if any."""
        found = self.by_address.get((protocol, dst, dport))
        if found is None and dst in self.node_ips:
            found = self.by_node_port.get((Family.of(dst), protocol, dport))
        return found


def verdict(entry: CtEntry, frontends: Frontends) -> tuple[str, Served] | None:
    """Why `entry` is stale, and the port it was addressed to; None if it stays."""
    served = frontends.lookup(entry.protocol, entry.dst, entry.dport)
    if served is None:
        return None  # not addressed to a service port of ours
    answerer = (entry.reply_src, entry.reply_sport)
    if answerer in served.live:
        return None  # going to a live endpoint (host-network ones included)
    if entry.status & IPS_DST_NAT or answerer != (entry.dst, entry.dport):
        return STALE_DNAT, served
    return (MISSING_DNAT, served) if served.live else None


def stale(entries: Iterable[CtEntry], frontends: Frontends
          ) -> list[tuple[CtEntry, str, Served]]:
    """The entries to delete, each with its reason and service port."""
    out = []
    for entry in entries:
        found = verdict(entry, frontends)
        if found is not None:
            out.append((entry, *found))
    return out


def counted(found: Sequence[tuple[CtEntry, str, Served]],
            errors: Sequence[int]) -> dict[str, int]:
    """Entries deleted, by reason (an entry already gone by itself is not counted)."""
    out = dict.fromkeys(REASONS, 0)
    for (_entry, reason, _served), error in zip(found, errors, strict=True):
        if error == 0:
            out[reason] += 1
    return out


def describe(entry: CtEntry, reason: str, served: Served) -> dict[str, object]:
    """The debug log's fields for one deleted entry."""
    return {"service": ", ".join(port_name(k) for k in served.keys), "reason": reason,
            "destination": f"{entry.dst}:{entry.dport}",
            "answered_by": f"{entry.reply_src}:{entry.reply_sport}"}


# --- kernel -----------------------------------------------------------------------------------


def reconcile(applied: Mapping[Family, Iterable[ResolvedServicePort]],
              node_ips: Iterable[IPAddress]) -> dict[str, int]:
    """Dump each family's UDP and SCTP entries once, delete the stale ones; deleted, by
    reason. A failure is logged, never raised: the rules are in place, and the next
    reconcile tries again."""
    deleted = dict.fromkeys(REASONS, 0)
    node_ips = tuple(node_ips)
    started = time.perf_counter()
    examined = 0
    try:
        with contextlib.closing(ConntrackSocket()) as sock:
            for family, ports in applied.items():
                frontends = Frontends(ports, node_ips)
                if not len(frontends):
                    continue  # no UDP or SCTP service port: nothing can be stale
                entries = sock.dump(family, PROTOCOLS)
                examined += len(entries)
                found = stale(entries, frontends)
                if not found:
                    continue
                errors = sock.delete([entry for entry, _, _ in found])
                for reason, count in counted(found, errors).items():
                    deleted[reason] += count
                for (entry, reason, served), error in zip(found, errors, strict=True):
                    if error == 0:
                        log.debug("deleted stale conntrack entry",
                                  extra=describe(entry, reason, served))
    except Exception as exc:  # the rules are in: never fail the sync that called this
        log.warning("conntrack reconcile failed", extra={"error": str(exc)})
    log.debug("conntrack reconciled", extra={
        "entries": examined, **{r.replace("-", "_"): n for r, n in deleted.items()},
        "seconds": round(time.perf_counter() - started, 4)})
    return {reason: count for reason, count in deleted.items() if count}
