"""bench.memory INSIDE the kernel lab's guest (started by `python -m bench.memory` for
the IPVS mode; never run it on the host: it mounts a cgroup hierarchy and makes
namespaces). The same measurement as on the host, with the guest's own v1 memory
cgroup, the work on the guest's tmpfs; the result goes back through write_result.

    python bench/memory/guest.py --services N --modes ipvs [the options of bench.memory]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

from bench.memory.__main__ import MODES
from bench.memory.cgroup import mount_in_guest
from bench.memory.measure import SITUATIONS, Settings, run
from labs.kernel.guest import write_result


def main() -> int:
    import argparse

    ap = argparse.ArgumentParser()
    ap.add_argument("--services", type=int, required=True)
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--modes", choices=MODES, required=True)
    ap.add_argument("--situations", nargs="+", choices=SITUATIONS, default=list(SITUATIONS))
    ap.add_argument("--burst-new", type=int, default=1000)
    ap.add_argument("--replace-share", type=float, default=0.1)
    ap.add_argument("--sync-period", type=float)
    ap.add_argument("--settle", type=float, default=5.0)
    ap.add_argument("--simulator-shape", action="store_true")
    ap.add_argument("--limit", type=int)
    ap.add_argument("--iptables-backend", choices=("auto", "nft", "legacy"), default="auto")
    ap.add_argument("--timeout", type=float, default=1200.0)
    args = ap.parse_args()
    scratch = Path(os.environ["KERNEL_SCRATCH"])
    os.environ["TMPDIR"] = str(scratch)  # the root file system is read-only here
    tempfile.tempdir = str(scratch)
    mount_in_guest()
    s = Settings(services=args.services, endpoints=args.endpoints, mode=args.modes,
                 situations=tuple(args.situations), burst_new=args.burst_new,
                 replace_share=args.replace_share, sync_period=args.sync_period,
                 settle=args.settle, real_shaped=not args.simulator_shape,
                 iptables_backend=args.iptables_backend, limit_mib=args.limit, timeout=args.timeout)
    work = scratch / "memory"
    work.mkdir()

    def progress(text: str) -> None:
        print(f"[{time.monotonic():9.2f}] {text}", file=sys.stderr, flush=True)

    result = run(s, work, progress)
    result["guest_memory_mb"] = _total_mb()
    write_result(result)
    return 0


def _total_mb() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) // 1024
    return 0


if __name__ == "__main__":
    sys.exit(main())
