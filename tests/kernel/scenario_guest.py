"""Helpers for IPVS scenarios that run INSIDE the kernel lab's guest (see
tests/kernel/scenarios/). Importable on the host too, but only useful in the guest.

- `Cluster`: API objects in (the tests/unit/builders.py dicts), `DesiredState` out,
  through the same model the agent uses.
- `NodeThread`: one thread that lives in the lab's node namespace, the way the agent's
  data-plane worker lives in the node's: every data-plane call and every kernel read-back
  runs there.
- `read_kernel`: the IPVS table, dummy addresses and our ipsets as the kernel has them,
  in the renderer's vocabulary, for comparing with what was rendered.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_address
from typing import Any, TypeVar

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs.apply import IpvsDataPlane
from proxy.dataplane.ipvs.kernel import IpvsTable, Links
from proxy.dataplane.ipvs.netfilter import parse_ipset_save
from proxy.dataplane.ipvs.render import (
    DUMMY_INTERFACE,
    IpvsContext,
    SetEntry,
    SetRole,
    VsKey,
    render_all,
    set_name,
    usable_node_address,
)
from proxy.dataplane.xtables.restore_runner import Backend
from proxy.kube.ingest import apply_object, delete_object
from proxy.model.snapshot import DesiredState
from proxy.model.tracker import ClusterModel
from proxy.model.types import Family, IPAddress
from proxy.netns_lab.netns import CLONE_NEWNET
from proxy.netns_lab.netns import path as netns_path
from tests.unit import builders

T = TypeVar("T")
_libc = ctypes.CDLL(None, use_errno=True)
NODE = "node-a"
# How long an established connection's answer may take in the guest: one took over 5 s
# in CI, the guest emulated (TCG) beside the real-node tier on the same two cores, and
# a held flow's 2 s answer timed out once after an agent's SIGTERM. A broken flow never
# answers (or is reset), so 15 s still tells a stall from a flow that broke.
HELD_FLOW_TIMEOUT = 15.0
# How long a `python -m proxy` run may take in the guest, from its start to ready, or a
# `--cleanup` to its end: emulated (TCG) beside the real-node tier, an agent took 61 s
# from its start to its lists once, and a --cleanup outlasted 60 s.
READY_DEADLINE = 120.0
CLUSTER_CIDRS = (IPv4Network("198.18.1.0/24"), IPv6Network("fd00:18:1::/64"))


def options(**overrides: Any) -> DataplaneOptions:
    base: dict[str, Any] = {"node_name": NODE, "cluster_cidrs": CLUSTER_CIDRS}
    base.update(overrides)
    return DataplaneOptions(**base)


class Cluster:
    """A cluster's objects, resolved for node-a by the agent's own model."""

    def __init__(self, node_name: str = NODE) -> None:
        self.model = ClusterModel(node_name)
        apply_object(self.model, builders.node(node_name))

    def apply(self, *objects: dict[str, Any]) -> DesiredState:
        for obj in objects:
            apply_object(self.model, obj)
        # Scenario input must be valid: a skipped object would leave nothing to check.
        # Services sharing an external IP are arbitrated by the model (`conflict`), and
        # the kernel must follow the winner: that one is allowed.
        odd = [s for s in self.model.skipped() if s.reason != "conflict"]
        assert not odd, odd
        return self.model.resolve()

    def delete(self, kind: str, name: str, namespace: str = "ns") -> DesiredState:
        delete_object(self.model, kind, namespace, name)
        return self.model.resolve()

    @property
    def state(self) -> DesiredState:
        return self.model.state


class NodeThread:
    """A single worker thread inside network namespace `ns`, holding the data plane."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="node",
                                        initializer=self._enter)
        self.plane: IpvsDataPlane | None = None

    def _enter(self) -> None:
        # For the thread's whole life: it exists only to work in `ns`. (Not through a
        # context manager left open: its finaliser would setns() back whichever thread
        # happened to run the garbage collector.)
        fd = os.open(netns_path(self.ns), os.O_RDONLY)
        try:
            if _libc.setns(fd, CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                raise OSError(err, f"setns {self.ns}: {os.strerror(err)}")
        finally:
            os.close(fd)

    def run(self, fn: Callable[[], T], timeout: float = 60.0) -> T:
        return self._pool.submit(fn).result(timeout=timeout)

    def start_plane(self, opts: DataplaneOptions | None = None,
                    backend: Backend = Backend.NFT) -> IpvsDataPlane:
        """A fresh IpvsDataPlane (an agent restart: nothing carried over but the kernel),
        its few iptables rules on `backend`: nf_tables unless asked, as on Debian 12."""
        if self.plane is not None:
            self.run(self.plane.close)
        plane = IpvsDataPlane(opts or options(), iptables_backend=backend)
        self.plane = plane
        return plane

    def sync(self, state: DesiredState, full: bool = False) -> Any:
        plane = self.plane
        assert plane is not None
        return self.run(lambda: plane.sync(state, full))

    def housekeeping(self) -> None:
        plane = self.plane
        assert plane is not None
        self.run(plane.housekeeping)

    def exec(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        """A command in the node namespace (children inherit this thread's namespace)."""
        return self.run(lambda: subprocess.run(cmd, capture_output=True, text=True,
                                               timeout=30, check=False))

    def close(self) -> None:
        if self.plane is not None:
            plane, self.plane = self.plane, None
            self.run(plane.close)
        self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class KernelView:
    """What the kernel holds, in comparable form."""

    services: dict[str, dict[str, Any]]  # "TCP ip:port" -> {scheduler, flags, timeout, dests}
    addresses: set[IPAddress]  # on the dummy interface
    entries: set[SetEntry]  # in our ipsets


def read_kernel(thread: NodeThread) -> KernelView:
    def read() -> KernelView:
        table = IpvsTable()
        links = Links(DUMMY_INTERFACE)
        try:
            services = {
                str(k): {"scheduler": s.scheduler, "flags": s.flags, "timeout": s.timeout,
                         "dests": {str(r): d.weight for r, d in s.dests.items()}}
                for k, s in table.services().items()
            }
            index = links.index()
            addresses = ({a for a in links.addresses(index) if usable_node_address(a)}
                         if index is not None else set())
        finally:
            table.close()
            links.close()
        entries: set[SetEntry] = set()
        names = {set_name(role, family): (role, family) for family in Family
                 for role in SetRole}
        saved = subprocess.run(["ipset", "save"], capture_output=True, text=True,
                               check=True, timeout=30).stdout
        for name, listed in parse_ipset_save(saved).items():
            if name in names:
                role, family = names[name]
                entries.update(normalise_entry(SetEntry(role, family, e)) for e in listed)
        return KernelView(services, addresses, entries)

    return thread.run(read)


def rendered_view(state: DesiredState, opts: DataplaneOptions, thread: NodeThread,
                  families: tuple[Family, ...] = (Family.V4, Family.V6)) -> KernelView:
    """What the renderer says the kernel should hold for `state` (node addresses read
    from the node namespace, as the data plane reads them)."""

    def node_addresses() -> set[IPAddress]:
        links = Links(DUMMY_INTERFACE)
        try:
            return links.node_addresses(exclude=links.index())
        finally:
            links.close()

    ctx = IpvsContext.build(opts, thread.run(node_addresses))
    from proxy.dataplane.ipvs.index import RenderIndex

    index = RenderIndex(render_all(state, ctx, families))
    services = {
        str(k): {"scheduler": vs.scheduler, "flags": vs.flags, "timeout": vs.timeout,
                 "dests": {str(r): 1 for r in vs.real_servers}}
        for k, (_owner, vs) in index.virtual_servers().items()
    }
    return KernelView(services, index.addresses(),
                      {normalise_entry(e) for e in index.entries()})


def normalise_entry(e: SetEntry) -> SetEntry:
    """ipset prints entries its own way (IPv6 compressed, /32 nets bare): compare parsed."""
    parts = e.entry.split(",")
    out = []
    for part in parts:
        proto, sep, port = part.partition(":")
        if sep and proto in ("tcp", "udp", "sctp") and port.isdigit():
            out.append(part)
            continue
        addr, slash, bits = part.partition("/")
        try:
            parsed = ip_address(addr)
        except ValueError:
            out.append(part)
            continue
        full = parsed.max_prefixlen
        if slash and int(bits) != full:
            out.append(f"{parsed}/{bits}")
        else:
            out.append(str(parsed))
    return SetEntry(e.role, e.family, ",".join(out))


__all__ = ["Cluster", "KernelView", "NodeThread", "VsKey", "normalise_entry", "options",
           "read_kernel", "rendered_view"]


def ipvsadm_view(thread: NodeThread) -> dict[str, dict[str, Any]]:
    """The IPVS table as `ipvsadm -Sn` prints it: a reader independent of ours.

    Lines look like `-A -t 198.18.128.10:80 -s rr -p 60` and
    `-a -t 198.18.128.10:80 -r 198.18.1.10:8080 -m -w 1`; -m is masquerading."""
    out = thread.exec("ipvsadm", "-Sn")
    assert out.returncode == 0, out.stderr
    protocols = {"-t": "TCP", "-u": "UDP", "--sctp-service": "SCTP"}
    table: dict[str, dict[str, Any]] = {}
    for line in out.stdout.splitlines():
        words = line.split()
        if len(words) < 3 or words[1] not in protocols:
            continue
        key = f"{protocols[words[1]]} {words[2]}"
        opts = dict(zip(words[3::2], words[4::2], strict=False))
        if words[0] == "-A":
            table[key] = {"scheduler": opts.get("-s"),
                          "persistent": int(opts["-p"]) if "-p" in opts else None,
                          "dests": {}}
        elif words[0] == "-a":
            rest = words[3:]
            real = rest[rest.index("-r") + 1]
            weight = int(rest[rest.index("-w") + 1])
            masq = "-m" in rest
            table[key]["dests"][real] = weight if masq else f"not masquerading: {line}"
    return table


def as_ipvsadm(view: KernelView) -> dict[str, dict[str, Any]]:
    """A rendered view in `ipvsadm_view`'s terms."""
    return {k: {"scheduler": v["scheduler"],
                "persistent": v["timeout"] if v["flags"] & 1 else None,
                "dests": v["dests"]} for k, v in view.services.items()}
