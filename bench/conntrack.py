"""Conntrack at scale: our ctnetlink client (proxy/dataplane/common/ctnetlink.py) against
pyroute2 as common/conntrack.py used it, in a network namespace of its own.

    sudo .venv/bin/python -m bench.conntrack --entries 100000
    sudo .venv/bin/python -m bench.conntrack --entries 10000 --tcp 100000

The namespace is filled with `--entries` UDP entries DNATed to endpoints (and `--tcp`
TCP ones beside them), made through ctnetlink. Then, each `--runs` times, timed alone:
one dump of the family's UDP entries by ours with the kernel's protocol filter, by ours
unfiltered (the protocol checked here), by pyroute2 as `clear` did (a filtered dump, each
message's tuples read); and deleting `--delete` entries by ours (tuple and id, batched)
and by pyroute2 (`entry("del")` each), the deleted entries made again, untimed, between
runs. Medians and extremes in milliseconds. The namespace is deleted on the way out.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import socket
import statistics
import sys
import time
from collections.abc import Callable
from ipaddress import IPv4Address
from typing import Any

from proxy.dataplane.common.ctnetlink import (
    IPPROTO_TCP,
    IPPROTO_UDP,
    IPS_ASSURED,
    IPS_DST_NAT,
    IPS_SEEN_REPLY,
    ConntrackSocket,
    CtEntry,
)
from proxy.model.types import Family
from proxy.netns_lab import netns
from proxy.netns_lab.netns import entered

CLIENTS = IPv4Address("198.18.0.0")  # 198.18.0.0/16: clients
SERVICES = IPv4Address("198.19.0.0")  # 198.19.0.0/17: service addresses
ENDPOINTS = IPv4Address("198.19.128.0")  # 198.19.128.0/17: endpoints


def entries(count: int, protocol: int = IPPROTO_UDP, services: int = 10_000) -> list[CtEntry]:
    """`count` distinct flows of `protocol` from many clients to `services` service ports,
    each DNATed to one of its service's three endpoints."""
    out = []
    for n in range(count):
        service = n % services
        out.append(CtEntry(
            Family.V4, protocol, CLIENTS + n % 250 + 1,
            10_000 + n // 250 % 50_000, SERVICES + service, 53,
            ENDPOINTS + service * 3 % 32_000 + n % 3, 5353,
            IPS_DST_NAT | IPS_SEEN_REPLY | IPS_ASSURED))
    return out


def scratch_namespace(prefix: str = "sp-ctbench") -> contextlib.AbstractContextManager[str]:
    """A network namespace of our own, deleted on the way out (its conntrack table with it)."""
    return netns.scratch(prefix)


def create(sock: ConntrackSocket, made: list[CtEntry]) -> None:
    codes = sock.create(made)
    refused = [c for c in codes if c]
    if refused:
        raise RuntimeError(f"{len(refused)} of {len(made)} creates refused: "
                           f"{os.strerror(refused[0])}")


def timed(fn: Callable[..., Any], *args: Any) -> tuple[float, Any]:
    gc.collect()  # a collection owed by the previous step is not this step's cost
    start = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - start, out


def pyroute2_dump(family: int, protocol: int) -> int:
    """A dump as common/conntrack.py's `clear` read it: filtered by the kernel, every
    message's two tuples read through pyroute2's attribute objects."""
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    def read(nla: Any) -> tuple[Any, ...]:  # as `clear` read a tuple (SCTP's ports too)
        ip, proto = nla.get_attr("CTA_TUPLE_IP"), nla.get_attr("CTA_TUPLE_PROTO")
        return (ip.get_attr("CTA_IP_V4_SRC") or ip.get_attr("CTA_IP_V6_SRC"),
                proto.get_attr("CTA_PROTO_SRC_PORT"),
                ip.get_attr("CTA_IP_V4_DST") or ip.get_attr("CTA_IP_V6_DST"),
                proto.get_attr("CTA_PROTO_DST_PORT"), proto.get_attr("CTA_PROTO_NUM"))

    seen = 0
    with Conntrack(nfgen_family=family) as ct:
        for msg in list(ct.dump(tuple_orig=NFCTAttrTuple(family=family, proto=protocol))):
            read(msg.get_attr("CTA_TUPLE_ORIG"))
            read(msg.get_attr("CTA_TUPLE_REPLY"))
            seen += 1
    return seen


def pyroute2_delete(doomed: list[CtEntry]) -> int:
    from pyroute2 import Conntrack
    from pyroute2.netlink.nfnetlink.nfctsocket import NFCTAttrTuple

    done = 0
    with Conntrack(nfgen_family=socket.AF_INET) as ct:
        for e in doomed:
            ct.entry("del", tuple_orig=NFCTAttrTuple(
                family=socket.AF_INET, saddr=str(e.src), daddr=str(e.dst), proto=e.protocol,
                sport=e.sport, dport=e.dport))
            done += 1
    return done


def spread(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000.0 for s in seconds]
    return {"median": round(statistics.median(ms), 1), "min": round(min(ms), 1),
            "max": round(max(ms), 1)}


def measure(udp: int, tcp: int, delete: int, runs: int) -> dict[str, Any]:
    """One namespace filled with `udp` + `tcp` entries; every figure of one size."""
    out: dict[str, Any] = {"udp": udp, "tcp": tcp, "delete": delete, "runs": runs}
    times: dict[str, list[float]] = {k: [] for k in (
        "ours_filtered", "ours_unfiltered", "pyroute2_dump", "ours_delete", "pyroute2_delete")}
    with scratch_namespace() as ns, entered(ns):
        sock = ConntrackSocket()
        try:
            made = entries(udp)
            out["create_s"] = round(timed(create, sock, made)[0], 2)
            if tcp:
                create(sock, entries(tcp, IPPROTO_TCP))
            for _ in range(runs):
                for key, kernel_filter in (("ours_filtered", True), ("ours_unfiltered", False)):
                    sock.kernel_filter = kernel_filter
                    seconds, found = timed(sock.dump, Family.V4, (IPPROTO_UDP,))
                    assert len(found) == udp, (key, len(found))
                    times[key].append(seconds)
                seconds, count = timed(pyroute2_dump, socket.AF_INET, IPPROTO_UDP)
                assert count == udp, count
                times["pyroute2_dump"].append(seconds)
            if delete:
                _deletes(sock, udp, delete, runs, times)
        finally:
            sock.close()
    out.update({k: spread(v) for k, v in times.items() if v})
    return out


def _deletes(sock: ConntrackSocket, udp: int, delete: int, runs: int,
             times: dict[str, list[float]]) -> None:
    """Delete `delete` of the table's entries, then make them again (untimed), each way."""
    sock.kernel_filter = True
    for _ in range(runs):
        doomed = sock.dump(Family.V4, (IPPROTO_UDP,))[:delete]
        seconds, codes = timed(sock.delete, doomed)
        assert not any(codes), codes[:5]
        times["ours_delete"].append(seconds)
        create(sock, doomed)
        doomed = sock.dump(Family.V4, (IPPROTO_UDP,))[:delete]
        seconds, _ = timed(pyroute2_delete, doomed)
        times["pyroute2_delete"].append(seconds)
        assert len(sock.dump(Family.V4, (IPPROTO_UDP,))) == udp - delete
        create(sock, doomed)


def udp_cluster(services: int, gone_every: int) -> list[Any]:
    """The resolved UDP service ports `entries` addresses (port 53 -> 5353, three
    endpoints each), every `gone_every`-th service without its first endpoint: the flows
    to it are what a reconcile finds stale."""
    from proxy.kube.decode import decode_endpoint_slice, decode_service
    from proxy.model.tracker import ClusterModel

    model = ClusterModel("node-a")
    for i in range(services):
        svc, _ = decode_service({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": f"u{i}", "namespace": "b", "resourceVersion": "1"},
            "spec": {"clusterIP": str(SERVICES + i),
                     "ports": [{"name": "dns", "port": 53, "protocol": "UDP"}]}})
        first = 1 if gone_every and i % gone_every == 0 else 0
        sl, _ = decode_endpoint_slice({
            "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": f"u{i}", "namespace": "b", "resourceVersion": "1",
                         "labels": {"kubernetes.io/service-name": f"u{i}"}},
            "addressType": "IPv4",
            "ports": [{"name": "dns", "port": 5353, "protocol": "UDP"}],
            "endpoints": [{"addresses": [str(ENDPOINTS + i * 3 % 32_000 + k)],
                           "conditions": {"ready": True}} for k in range(first, 3)]})
        assert svc is not None and sl is not None
        model.apply_service(svc)
        model.apply_slice(sl)
    return list(model.resolve().ports.values())


def _match(listed: list[CtEntry], ports: list[Any]) -> list[Any]:
    from proxy.dataplane.common.conntrack_reconcile import Frontends, stale

    return stale(listed, Frontends(ports, ()))


def reconcile_cost(udp: int, services: int, gone_every: int, runs: int) -> dict[str, Any]:
    """One reconcile (dump, match, delete) at `services` UDP service ports and `udp`
    entries, `runs` times (the deleted entries made again, untimed, between runs)."""
    from proxy.dataplane.common.conntrack_reconcile import reconcile

    ports = udp_cluster(services, gone_every)
    made = entries(udp, services=services)
    out: dict[str, Any] = {"udp": udp, "services": services, "runs": runs}
    totals, matches, deleted = [], [], []
    with scratch_namespace() as ns, entered(ns):
        sock = ConntrackSocket()
        try:
            create(sock, made)
            for _ in range(runs):
                listed = sock.dump(Family.V4, (IPPROTO_UDP,))
                seconds, found = timed(_match, listed, ports)
                matches.append(seconds)
                seconds, counts = timed(reconcile, {Family.V4: ports}, ())
                totals.append(seconds)
                deleted.append(sum(counts.values()))
                create(sock, [e for e, _, _ in found])
        finally:
            sock.close()
    out.update(reconcile=spread(totals), match=spread(matches), deleted=deleted[0])
    return out


def markdown(results: list[dict[str, Any]]) -> str:
    rows = ["| UDP + TCP entries | dump UDP: ours, kernel filter | ours, unfiltered | "
            "pyroute2 | delete N: ours | pyroute2 |", "|---|---|---|---|---|---|"]

    def cell(r: dict[str, Any], key: str) -> str:
        v = r.get(key)
        return f"{v['median']:,} ({v['min']:,}-{v['max']:,})" if v else "-"

    for r in results:
        rows.append(f"| {r['udp']:,} + {r['tcp']:,} | {cell(r, 'ours_filtered')} "
                    f"| {cell(r, 'ours_unfiltered')} | {cell(r, 'pyroute2_dump')} "
                    f"| {cell(r, 'ours_delete')} | {cell(r, 'pyroute2_delete')} |")
    rows += ["", "milliseconds: median (min-max) of the runs; N: the deleted entries"]
    return "\n".join(rows)


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--entries", type=int, default=100_000, help="UDP entries")
    p.add_argument("--tcp", type=int, default=0, help="TCP entries beside them")
    p.add_argument("--delete", type=int, default=10_000)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--reconcile", type=int, metavar="SERVICES", default=0,
                   help="instead: one whole reconcile at SERVICES UDP service ports (every "
                        "tenth without one of its three endpoints) and --entries entries")
    args = p.parse_args(argv)
    # SIGTERM unwinds like an exception, so the namespace is deleted on the way out.
    signal.signal(signal.SIGTERM, _terminated)
    if args.reconcile:
        import json
        print(json.dumps(reconcile_cost(args.entries, args.reconcile, 10, args.runs), indent=2))
        return 0
    result = measure(args.entries, args.tcp, min(args.delete, args.entries), args.runs)
    if args.json:
        import json
        print(json.dumps(result, indent=2))
    else:
        print(markdown([result]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
