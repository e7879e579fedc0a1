"""IPVS benchmark: pyroute2 against our own netlink client, and what a data-plane sync
costs, in a real Linux kernel (the kernel lab's: QEMU with Debian's kernel by default).

    sudo .venv/bin/python -m bench.ipvs --services 100 1000 --endpoints 3 --repeat 3 \\
        --json ipvs-bench.json

The host kernel has no IPVS, so each size boots a kernel through the kernel tests'
harness (labs/kernel/harness.py) and runs bench/ipvs/guest.py inside, which says what is
measured: for N TCP virtual servers with M masqueraded real servers each, programming
them all, dumping the whole table, swapping one service's real server, and putting N
addresses on a dummy interface and dumping them, with pyroute2 (one call per object, as
FINDINGS describes its API) and with ours (proxy/dataplane/ipvs/kernel.py, batched);
then the whole IpvsDataPlane's full, repeated full and one-endpoint partial syncs.

Both clients must have built, and both must read back, the same table (and the data
plane the same again): the guest checks that, and this refuses to report timings of
different work. Timings are medians (with min and max) inside the lab's machine (QEMU, with
TCG's emulation where KVM does not work), far slower than a real one: compare the ratios,
not the seconds. --pin runs the kernel on one host CPU (it made the user-mode Linux the
lab used before far steadier). Nothing is asserted on time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.ipvs.workload import Workload
from labs.kernel.harness import DEFAULT_MEMORY_MB, run_in_kernel

GUEST = Path(__file__).resolve().parent / "guest.py"
DEFAULT_TIMEOUT = 600.0  # per boot; the guest's own deadline is a little shorter

# (operation, label); {n} is the number of services, {objects} virtual + real servers.
ROWS = (
    ("program", "program {objects:,} objects (one request each)"),
    ("encode", "the same requests built + encoded in Python only, no kernel"),
    ("dump", "dump the table ({n:,} services + their real servers)"),
    ("swap", "one service: add a real server, delete one"),
    ("addresses_add", "add {n:,} /32 addresses to a dummy interface"),
    ("addresses_dump", "dump every address"),
    ("sync_full", "IpvsDataPlane: first full sync"),
    ("sync_resync", "IpvsDataPlane: full resync, nothing to change"),
    ("sync_partial", "IpvsDataPlane: one-endpoint partial sync (netlink only)"),
    ("sync_partial_ipset", "IpvsDataPlane: the same, endpoint on this node (+ 2 ipset restores)"),
)


class BenchError(RuntimeError):
    """The two clients did not build or read the same table: no timings reported."""


def run(services: int, endpoints: int, repeat: int, *, swaps: int = 20, partials: int = 10,
        dataplane: bool = True, fresh_allocator: bool = False,
        timeout: float = DEFAULT_TIMEOUT, memory_mb: int = DEFAULT_MEMORY_MB,
        cpu: int | None = None, pin: bool = False, workdir: Path | None = None
        ) -> dict[str, Any]:
    """Boot the lab's kernel once and measure one size; the guest's JSON result, plus the
    boot's own timings under "kernel". Raises KernelError if the kernel or the guest failed
    (with the guest's stderr); checks are reported in the result, not raised.

    `pin`: run the kernel on one host CPU, `cpu` (default: the first this process may
    use). In the user-mode Linux the lab used before, whose system calls were ptrace
    hand-offs between host processes, the same 4,000 requests took 1.1 s or 3.4 s left to
    roam, pinned 1.0-1.1 s."""
    Workload(services, endpoints)  # refuse an impossible size before booting
    args = ["--services", str(services), "--endpoints", str(endpoints), "--repeat", str(repeat),
            "--swaps", str(swaps), "--partials", str(partials)]
    if not dataplane:
        args.append("--no-dataplane")
    if fresh_allocator:
        args.append("--fresh-allocator")
    load_before = os.getloadavg()[0]
    # This thread's affinity is inherited by the kernel's processes; restored afterwards.
    affinity = os.sched_getaffinity(0)
    cpu = (min(affinity) if cpu is None else cpu) if pin else None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        with tempfile.TemporaryDirectory(prefix="ipvs-bench-") as tmp:
            kernel = run_in_kernel(GUEST, args, workdir=workdir or Path(tmp), timeout=timeout,
                                   memory_mb=memory_mb).check()
    finally:
        os.sched_setaffinity(0, affinity)
    result: dict[str, Any] = kernel.result
    result["kernel"] = {"boot_s": round(kernel.boot_seconds, 2),
                        "wall_s": round(kernel.wall_seconds, 1), "memory_mb": memory_mb,
                        "cpu": cpu, "backend": kernel.backend}
    # Emulated timings move with the host's load: keep the load next to them.
    result["host_load_1min"] = [load_before, os.getloadavg()[0]]
    return result


def failed_checks(result: dict[str, Any]) -> list[str]:
    return [f"{c['what']}: {c['detail']}" for c in result["checks"] if not c["ok"]]


def markdown(results: list[dict[str, Any]]) -> str:
    rows = ["| size | operation | pyroute2 | ours | pyroute2 / ours: medians (mins) |",
            "|---|---|---|---|---|"]
    for r in results:
        size = f"{r['services']:,} x {r['endpoints_per_service']}"
        for op, label in ROWS:
            by = r["operations"].get(op)
            if not by:
                continue
            theirs, ours = by.get("pyroute2"), by.get("ours")
            ratio = (f"{_ratio(theirs['median_s'] / ours['median_s'])} "
                     f"({_ratio(theirs['min_s'] / ours['min_s'])})" if theirs and ours else "n/a")
            rows.append(f"| {size} | {label.format(n=r['services'], objects=r['objects'])} "
                        f"| {_cell(theirs)} | {_cell(ours)} | {ratio} |")
    return "\n".join(rows)


def _cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "n/a"
    return f"{_time(s['median_s'])} ({_time(s['min_s'])} - {_time(s['max_s'])})"


def _time(seconds: float) -> str:
    if seconds < 0.01:
        return f"{seconds * 1000:.2f} ms"
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    return f"{seconds:.2f} s"


def _ratio(x: float) -> str:
    return f"{x:,.0f}x" if x >= 10 else f"{x:.1f}x"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ipvs",
                                description=__doc__.splitlines()[0])
    p.add_argument("--services", type=int, nargs="+", default=[100, 1000],
                   help="sizes to measure, one kernel boot each")
    p.add_argument("--endpoints", type=int, default=3, help="real servers per service")
    p.add_argument("--repeat", type=int, default=3, help="rounds per size")
    p.add_argument("--swaps", type=int, default=20, help="real-server swaps per round")
    p.add_argument("--partials", type=int, default=10, help="partial syncs per round")
    p.add_argument("--no-dataplane", action="store_true", help="skip the IpvsDataPlane syncs")
    p.add_argument("--fresh-allocator", action="store_true",
                   help="measure in a fresh process's allocator state (see guest.py)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                   help="seconds per kernel boot, all rounds included")
    p.add_argument("--memory-mb", type=int, default=DEFAULT_MEMORY_MB,
                   help="the kernel's memory")
    p.add_argument("--cpu", type=int, help="host CPU to pin the kernel to, for steadier "
                   "timings (default: the first this process may use)")
    p.add_argument("--pin", action="store_true", help="run the kernel on one host CPU")
    p.add_argument("--json", type=Path, metavar="FILE", help="also write the results here")
    args = p.parse_args(argv)
    results = []
    for size in args.services:
        result = run(size, args.endpoints, args.repeat, swaps=args.swaps,
                     partials=args.partials, dataplane=not args.no_dataplane,
                     fresh_allocator=args.fresh_allocator,
                     timeout=args.timeout, memory_mb=args.memory_mb,
                     cpu=args.cpu, pin=args.pin)
        results.append(result)
        print(f"{size} services: {result['seconds']} s in the kernel, "
              f"{result['kernel']['wall_s']} s in all", file=sys.stderr, flush=True)
        failed = failed_checks(result)
        if failed:
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
            raise BenchError("the clients did not build or read the same table, so their "
                             "timings compare different work:\n" + "\n".join(failed))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    print(markdown(results))
    return 0

