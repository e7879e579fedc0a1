"""Which way to program nf_tables natively (issue 14): the appliers that exist, by numbers.

    sudo .venv/bin/python -m bench.nftables.appliers --sizes 1000 10000 --changes 20

Appliers:
- `nft -f -`: Debian's `nft`, one subprocess per transaction, the ruleset as text;
- `libnftables`: the same library in-process through ctypes (`libnftables.so.1`,
  Debian's `libnftables1`, which `nftables` depends on), the same text;
- `pyroute2`: pyroute2's nf_tables netlink socket, one batch per transaction. Its rule
  API is a prototype (pyroute2's words) with expression builders for addresses and
  verdicts only (no nat, numgen or maps), so it is measured on what it can express:
  a table and N chains in one batch, against the same thing through the other two.

Workload (layout "B" of the issue's note): a table `ip spxbench`, a verdict map
daddr . l4proto . dport -> goto service chain, one chain per service holding one rule
`dnat ip to numgen random mod 3 map { i : addr . port }`. Measured per applier, size:
- full: everything into an empty table, one transaction;
- change: one service's chain flushed and rewritten (its endpoints replaced), one
  transaction, repeated; median and max;
- chains: N empty chains in one transaction (all three appliers).
Each applier runs in a fresh network namespace of its own (never the host's).
Timings are reported, never asserted.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from bench.common import node_namespace, timed
from proxy.dataplane.common.netlink_constants import NFPROTO_IPV4
from proxy.netns_lab.netns import entered

TABLE = "spxbench"


def full_text(services: int) -> str:
    out = [f"add table ip {TABLE}", f"flush table ip {TABLE}",
           f"add map ip {TABLE} services {{ type ipv4_addr . inet_proto . inet_service : "
           "verdict; }",
           f"add chain ip {TABLE} prerouting {{ type nat hook prerouting priority dstnat; }}",
           f"add rule ip {TABLE} prerouting ip daddr . meta l4proto . th dport "
           "vmap @services"]
    for i in range(services):
        out.append(f"add chain ip {TABLE} svc-{i}")
        out.append(_service_rule(i, 3, 0))
        out.append(f"add element ip {TABLE} services {{ 198.18.{128 + i // 250}."
                   f"{1 + i % 250} . tcp . 80 : goto svc-{i} }}")
    return "\n".join(out) + "\n"


def _service_rule(i: int, n: int, generation: int) -> str:
    eps = ", ".join(f"{j} : 198.19.{(j + generation) % 250}.{1 + i % 250} . 8080"
                    for j in range(n))
    return (f"add rule ip {TABLE} svc-{i} meta l4proto tcp "
            f"dnat ip to numgen random mod {n} map {{ {eps} }}")


def change_text(i: int, generation: int) -> str:
    return f"flush chain ip {TABLE} svc-{i}\n{_service_rule(i, 3, generation)}\n"


def chains_text(services: int) -> str:
    return "\n".join([f"add table ip {TABLE}"] + [f"add chain ip {TABLE} c-{i}"
                                                  for i in range(services)]) + "\n"


class NftCommand:
    name = "nft -f"

    def run(self, text: str) -> None:
        subprocess.run(["nft", "-f", "-"], input=text.encode(), check=True)


class Libnftables:
    """libnftables through ctypes: nft_run_cmd_from_buffer, errors to a buffer."""

    name = "libnftables"

    def __init__(self) -> None:
        lib = ctypes.CDLL("libnftables.so.1")
        lib.nft_ctx_new.restype = ctypes.c_void_p
        lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
        lib.nft_ctx_free.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_get_error_buffer.restype = ctypes.c_char_p
        lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
        self.lib = lib
        self.ctx = lib.nft_ctx_new(0)
        lib.nft_ctx_buffer_error(self.ctx)

    def run(self, text: str) -> None:
        if self.lib.nft_run_cmd_from_buffer(self.ctx, text.encode()) != 0:
            raise RuntimeError(self.lib.nft_ctx_get_error_buffer(self.ctx).decode())

    def close(self) -> None:
        self.lib.nft_ctx_free(self.ctx)


def pyroute2_chains(services: int) -> None:
    """A table and `services` chains in one netlink batch through pyroute2."""
    from pyroute2.nftables.main import NFTables

    nft = NFTables(nfgen_family=NFPROTO_IPV4)
    try:
        nft.begin()
        nft.table("add", name=TABLE)
        for i in range(services):
            nft.chain("add", table=TABLE, name=f"c-{i}")
        nft.commit()
    finally:
        nft.close()


@contextmanager
def applier_in_namespace(applier: str) -> Iterator[NftCommand | Libnftables]:
    """A fresh namespace, entered, and the applier made inside it: libnftables opens its
    netlink socket when its context is made, in the namespace of that moment."""
    with node_namespace() as ns, entered(ns):
        runner = NftCommand() if applier == "nft -f" else Libnftables()
        try:
            yield runner
        finally:
            if isinstance(runner, Libnftables):
                runner.close()


def run_one(applier: str, services: int, changes: int) -> dict[str, Any]:
    out: dict[str, Any] = {"applier": applier, "services": services}
    if applier == "pyroute2":
        with node_namespace() as ns, entered(ns):
            out["chains_s"] = round(timed(lambda: pyroute2_chains(services))[0], 4)
            out["chains_made"] = _chains_here()
        return out
    with applier_in_namespace(applier) as runner:
        out["chains_s"] = round(timed(lambda: runner.run(chains_text(services)))[0], 4)
        out["chains_made"] = _chains_here()
    with applier_in_namespace(applier) as runner:
        text = full_text(services)
        out["full_s"] = round(timed(lambda: runner.run(text))[0], 4)

        def change(k: int) -> None:
            runner.run(change_text(k * 7 % services, k + 1))

        times = [timed(partial(change, k))[0] for k in range(changes)]
        out["change_ms"] = {"median": round(statistics.median(times) * 1000, 2),
                            "max": round(max(times) * 1000, 2), "n": len(times)}
        out["last_change"] = _chain_text(f"svc-{(changes - 1) * 7 % services}")
    return out


def _chains_here() -> int:
    listing = subprocess.run(["nft", "list", "chains", "ip"], capture_output=True,
                             text=True, check=True).stdout
    return listing.count("\tchain ")


def _chain_text(chain: str) -> str:
    return subprocess.run(["nft", "list", "chain", "ip", TABLE, chain], capture_output=True,
                          text=True, check=True).stdout


APPLIERS = ("nft -f", "libnftables", "pyroute2")


def markdown(results: list[dict[str, Any]]) -> str:
    lines = ["| applier | services | full | one change (median / max) | N chains alone |",
             "|---|---|---|---|---|"]
    for r in results:
        full = f"{r['full_s']:.3f} s" if "full_s" in r else "- (cannot express it)"
        change = (f"{r['change_ms']['median']:.1f} / {r['change_ms']['max']:.1f} ms"
                  if "change_ms" in r else "-")
        lines.append(f"| {r['applier']} | {r['services']:,} | {full} | {change} | "
                     f"{r['chains_s']:.3f} s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000])
    parser.add_argument("--changes", type=int, default=20)
    parser.add_argument("--appliers", nargs="+", choices=APPLIERS, default=list(APPLIERS))
    args = parser.parse_args(argv)
    results = []
    for size in args.sizes:
        for applier in args.appliers:
            result = run_one(applier, size, args.changes)
            result.pop("last_change", None)
            results.append(result)
            print(json.dumps(result), file=sys.stderr, flush=True)
    print(markdown(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
