"""The IPVS benchmark's measurements, INSIDE the kernel lab's guest: started by bench/ipvs/run.py
through labs/kernel/harness.py. Never run it on the host: it makes and deletes network
namespaces and needs IPVS.

    python bench/ipvs/guest.py --services N --endpoints M --repeat R [--swaps S] [--partials P]

Each round, for each client (pyroute2 and ours; the order alternates between rounds so
that drift in the machine's load falls on both), in a fresh network namespace:
  program    every virtual and real server into the empty table, with that client (and,
             for ours, the same requests built and encoded without sending them: how
             much of its time is Python's);
  dump       the whole table, with each client's reader: both must read the expected table;
  swap       one service's real servers, one added and one deleted, S times (an even number:
             the table ends as it started, which is checked);
  addresses  N /32 addresses onto a dummy interface, then every address dumped by each
             reader: both must read the same, and the dummy's must be the N.
Then, in another fresh namespace, the whole IpvsDataPlane fed the same services through
the model: a full sync into the empty kernel (its table must be the expected one), a
full resync with nothing to change, and P one-endpoint partial syncs (reported apart when
the endpoint is on this node, which also changes ipset entries).

Writes the samples' medians and every check's outcome with labs.kernel.guest.write_result.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import platform
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from bench.common import NODE, change_one, cluster_model, timed
from bench.ipvs.clients import Client, Ours, Pyroute2, encode_program
from bench.ipvs.workload import SPARE, Table, Workload, differences, digest, summary
from labs.kernel.guest import write_result
from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs.apply import IpvsDataPlane
from proxy.dataplane.ipvs.render import DUMMY_INTERFACE
from proxy.dataplane.xtables.restore_runner import Backend
from proxy.model.types import Family
from proxy.netns_lab.netns import entered

CLIENTS = ("pyroute2", "ours")
DUMMY = "spx-bench0"  # the dummy interface the raw clients put addresses on
COMMAND_TIMEOUT = 120.0


@dataclass
class Recorder:
    samples: dict[str, dict[str, list[float]]] = field(default_factory=dict)
    checks: list[dict[str, Any]] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def add(self, operation: str, client: str, seconds: float) -> None:
        self.samples.setdefault(operation, {}).setdefault(client, []).append(seconds)

    def check(self, what: str, ok: bool, detail: str = "") -> None:
        self.checks.append({"what": what, "ok": ok, "detail": detail})
        if not ok:
            log(f"CHECK FAILED: {what}: {detail}")

    def compare(self, what: str, got: Table, want: Table) -> None:
        self.check(what, got == want, "; ".join(differences(got, want)) or digest(got))


def log(text: str) -> None:
    print(f"[{time.monotonic():9.2f}] {text}", file=sys.stderr, flush=True)


def sh(*cmd: str, check: bool = True) -> None:
    """A command in this thread's network namespace (a child inherits the thread's)."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=COMMAND_TIMEOUT,
                          check=False)
    if check and done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")


@contextmanager
def namespace(name: str) -> Iterator[None]:
    """This thread in a fresh network namespace. Afterwards the IPVS table is flushed and
    the links deleted before the namespace goes, so that the kernel's clean-up of one
    round's thousands of objects does not run in the background of the next."""
    sh("ip", "netns", "add", name)
    try:
        # IPVS refuses real servers (EINVAL) in a namespace without any routing table;
        # bringing lo up creates the local one.
        sh("ip", "-n", name, "link", "set", "lo", "up")
        with entered(name):
            yield
    finally:
        sh("ip", "netns", "exec", name, "ipvsadm", "-C", check=False)
        for link in (DUMMY, DUMMY_INTERFACE):
            sh("ip", "-n", name, "link", "del", link, check=False)
        sh("ip", "netns", "del", name, check=False)


def settle_allocator() -> None:
    """Start from a long-running process's allocator state. Until a process frees one large
    block, glibc maps each allocation over 128 KiB afresh and unmaps it when freed; our
    client's receive buffer is 1 MiB per datagram, one datagram per acknowledgement, so
    each request then costs a map, an unmap and page faults, which in user-mode Linux
    made it about 4.5 times dearer. An agent that has run a while has freed large
    blocks (API responses), after which glibc serves such buffers from its heap: free one
    here, once, for both clients (--fresh-allocator skips this, to see the other case)."""
    block = bytearray(8 << 20)
    del block


def open_client(name: str) -> Client:
    return Pyroute2() if name == "pyroute2" else Ours(DUMMY)


def clients_round(w: Workload, writer_name: str, swaps: int, rec: Recorder) -> None:
    """One client programs and changes the table; both read it, the writer first (the
    writers alternate, so each reader goes first as often as second)."""
    clients: dict[str, Client] = {}
    try:
        for name in sorted(CLIENTS, key=lambda n: n != writer_name):
            clients[name] = open_client(name)
        writer = clients[writer_name]
        servers = w.virtual_servers()
        expected = w.expected()
        seconds, _ = timed(lambda: writer.program(servers))
        rec.add("program", writer_name, seconds)
        log(f"{writer_name}: programmed {w.objects} objects in {seconds:.3f} s")
        if writer_name == "ours":
            rec.add("encode", "ours", timed(partial(encode_program, servers))[0])
        for reader in clients.values():
            seconds, table = timed(reader.dump)
            rec.add("dump", reader.name, seconds)
            rec.compare(f"table programmed by {writer_name}, read by {reader.name}",
                        table, expected)
            log(f"{reader.name}: dumped {len(table)} services in {seconds:.3f} s")

        vs, original = w.update_target()
        for i in range(swaps):
            add, remove = (SPARE, original) if i % 2 == 0 else (original, SPARE)
            seconds, _ = timed(partial(writer.swap, vs, add, remove))
            rec.add("swap", writer_name, seconds)
        rec.compare(f"table after {swaps} swaps by {writer_name}", clients["ours"].dump(),
                    expected)

        sh("ip", "link", "add", DUMMY, "type", "dummy")
        sh("ip", "link", "set", DUMMY, "up")  # as the data plane's: local routes too
        index = socket.if_nametoindex(DUMMY)
        addresses = w.addresses()
        seconds, _ = timed(lambda: writer.add_addresses(index, addresses))
        rec.add("addresses_add", writer_name, seconds)
        log(f"{writer_name}: added {len(addresses)} addresses in {seconds:.3f} s")
        seen = {}
        for reader in clients.values():
            seconds, seen[reader.name] = timed(reader.dump_addresses)
            rec.add("addresses_dump", reader.name, seconds)
        a, b = seen["pyroute2"], seen["ours"]
        rec.check(f"addresses added by {writer_name}: both readers agree", a == b,
                  f"only pyroute2: {sorted(a - b)[:3]}, only ours: {sorted(b - a)[:3]}")
        on_dummy = {addr for i, addr in b if i == index and ":" not in addr}
        want = {str(x) for x in addresses}
        rec.check(f"addresses added by {writer_name}: the dummy holds the {len(want)}",
                  on_dummy == want, f"{len(on_dummy)} there, {len(on_dummy ^ want)} differ")
    finally:
        for client in clients.values():
            client.close()


def dataplane_round(w: Workload, partials: int, rec: Recorder) -> None:
    """The whole IPVS data plane, fed the same services through the model."""
    model, slices = cluster_model(w.services, w.endpoints)
    plane = IpvsDataPlane(DataplaneOptions(NODE, families=(Family.V4,)),
                          iptables_backend=Backend.LEGACY)
    reader = Ours(DUMMY_INTERFACE)
    try:
        seconds, report = timed(lambda: plane.sync(model.state, full=True))
        rec.add("sync_full", "ours", seconds)
        rec.details.setdefault("sync_full", report.details)
        log(f"data plane: full sync in {seconds:.3f} s: {report.details}")
        rec.compare("table of the data plane's full sync", reader.dump(), w.expected())
        index = socket.if_nametoindex(DUMMY_INTERFACE)
        on_dummy = {a for i, a in reader.dump_addresses() if i == index and ":" not in a}
        rec.check("the data plane's dummy holds the service addresses",
                  on_dummy == {str(a) for a in w.addresses()}, f"{len(on_dummy)} there")

        seconds, report = timed(lambda: plane.sync(model.state, full=True))
        rec.add("sync_resync", "ours", seconds)
        rec.check("a resync changes nothing", report.details["ipvs_changes"] == 0,
                  str(report.details))
        for i in range(partials):
            state = change_one(model, slices[(i * 7919) % len(slices)], i)
            seconds, report = timed(partial(plane.sync, state))
            # An endpoint on this node also changes the hairpin (LOOPBACK) ipset entries:
            # two `ipset restore` runs, which cost far more than the netlink requests.
            op = "sync_partial_ipset" if report.details["ipset_lines"] else "sync_partial"
            rec.add(op, "ours", seconds)
            rec.details.setdefault(op, report.details)
            if report.full:
                rec.check("a one-endpoint change syncs partially", False, str(report.details))
    finally:
        plane.close()
        reader.close()


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, required=True)
    p.add_argument("--endpoints", type=int, required=True)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--swaps", type=int, default=20)
    p.add_argument("--partials", type=int, default=10)
    p.add_argument("--no-dataplane", action="store_true")
    p.add_argument("--fresh-allocator", action="store_true")
    args = p.parse_args(argv)
    if not args.fresh_allocator:
        settle_allocator()
    w = Workload(args.services, args.endpoints)
    swaps = args.swaps + args.swaps % 2  # even: the table ends as it started
    rec = Recorder()
    started = time.monotonic()
    for r in range(args.repeat):
        for name in CLIENTS if r % 2 == 0 else CLIENTS[::-1]:
            with namespace(f"bench-{r}-{name}"):
                clients_round(w, name, swaps, rec)
        if not args.no_dataplane:
            with namespace(f"bench-{r}-dataplane"):
                dataplane_round(w, args.partials, rec)
        log(f"round {r + 1} of {args.repeat} done")
    write_result({
        "services": w.services,
        "endpoints_per_service": w.endpoints,
        "objects": w.objects,
        "repeat": args.repeat,
        "swaps_per_round": swaps,
        "partials_per_round": 0 if args.no_dataplane else args.partials,
        "fresh_allocator": args.fresh_allocator,
        "operations": {op: {c: summary(s) for c, s in by.items()}
                       for op, by in rec.samples.items()},
        "checks": rec.checks,
        "tables_match": bool(rec.checks) and all(c["ok"] for c in rec.checks),
        "table_digest": digest(w.expected()),
        "sync_details": rec.details,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "pyroute2": importlib.metadata.version("pyroute2"),
        "cpus": os.cpu_count(),
        "seconds": round(time.monotonic() - started, 1),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
