"""Connections kept while real servers are moved in the kernel's list (order.py).

Moving a real server is deleting it and adding it back: it returns from IPVS's trash with
its connections. Between the two requests (tens of microseconds, one batched exchange) it
is unavailable, and with net.ipv4.vs.expire_nodest_conn=1 (kube-proxy's setting, and
ours: common/node_settings.py) a packet of one of its connections arriving then expires
that connection: its client gets a reset. With 0 the packet is dropped instead and
retransmitted, by which time the real server is back. So the sysctl is 0 for exactly
the exchange that moves, and put back at once; should the agent die in between, the next
start's node-settings step writes 1 again, and the agent warns of any other value.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from proxy.dataplane.common.node_settings import EXPIRE_NODEST_CONN as SYSCTL
from proxy.dataplane.common.node_settings import PROC_SYS

log = logging.getLogger(__name__)

# Per network namespace: the calling thread's (the data plane's).
EXPIRE_NODEST_CONN = Path("/", PROC_SYS, SYSCTL)


@contextmanager
def connections_kept(moves: int, path: Path = EXPIRE_NODEST_CONN) -> Iterator[None]:
    """Around an exchange that moves `moves` real servers: expire_nodest_conn is 0
    within (module docstring); nothing happens when nothing moves."""
    before = _read(path) if moves else None
    lowered = before not in (None, "0") and _write(path, "0")
    try:
        yield
    finally:
        if lowered and before is not None and not _write(path, before):
            log.warning("could not put back expire_nodest_conn after moving real servers",
                        extra={"path": str(path), "value": before})


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _write(path: Path, value: str) -> bool:
    try:
        path.write_text(value)
    except OSError:
        return False
    return True
