"""The agent's memory by mode, size and situation: cold start, bursts, the periodic full
resync, a restart over its own rules (bench/memory/measure.py says what each is).

    sudo .venv/bin/python -m bench.memory --services 10000 30000 50000 \\
        --modes iptables nftables ipvs --runs 1 --json memory.json
    sudo .venv/bin/python -m bench.memory --ipv6 --services 100000 \\
        --modes nftables --situations cold_start resync

iptables and nftables run on this host, each (mode, size, run) with a simulator and a
network namespace of its own; IPVS in the kernel lab's guest (the host kernel has no
IPVS: Debian's kernel under QEMU, `--guest-memory-mb` for the simulator, the agent and
the cluster's manifest on its tmpfs), one boot per (size, run). The cluster is IPv4,
whose service range holds 65,533 ClusterIPs (the services and burst_new's together);
`--ipv6` makes it single-stack IPv6 instead, as bench/agent_start.py's (host modes only:
the guest's is IPv4). Figures in MiB:

- agent peak: the agent process's VmHWM, reset at each situation's start (exact);
- + children: the agent's RSS plus its children's (iptables-restore, ipset), sampled;
- cgroup peak: what the memory cgroup the agent and its children run in was charged at
  most (exact; page cache included), and of it, kernel memory (the rules' objects);
- cgroup anon + kernel: the part no reclaim can free, sampled: what a container's limit
  must hold (bench/memory/cgroup.py);
- steady: the agent's RSS and the cgroup's anon + kernel `--settle` seconds after.

`--limit MIB` sets the cgroup's limit, as a container's: a run whose agent the kernel
OOM-kills reports it. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import exit_on_sigterm
from bench.memory.measure import SITUATIONS, V4_SERVICES, Settings, run
from bench.memory.report import markdown

GUEST = Path(__file__).resolve().parent / "guest.py"
HOST_MODES = ("iptables", "nftables")
MODES = (*HOST_MODES, "ipvs")
Obj = dict[str, Any]


def settings_args(s: Settings) -> list[str]:
    """The guest's command line for the same settings."""
    args = ["--services", str(s.services), "--endpoints", str(s.endpoints), "--modes", s.mode,
            "--burst-new", str(s.burst_new), "--replace-share", str(s.replace_share),
            "--sync-period", str(s.period()), "--settle", str(s.settle),
            "--timeout", str(s.timeout), "--situations", *s.situations]
    if not s.real_shaped:
        args.append("--simulator-shape")
    if s.limit_mib is not None:
        args += ["--limit", str(s.limit_mib)]
    if s.iptables_backend != "auto":
        args += ["--iptables-backend", s.iptables_backend]
    return args


def in_kernel_lab(s: Settings, memory_mb: int, work: Path) -> Obj:
    from labs.kernel.harness import run_in_kernel

    timeout = s.timeout * (len(s.situations) + 1) + s.period() + 300
    began = time.monotonic()
    kernel = run_in_kernel(GUEST, settings_args(s), workdir=work, timeout=timeout,
                           memory_mb=memory_mb).check()
    result: Obj = kernel.result
    result["kernel"] = {"boot_s": round(kernel.boot_seconds, 2),
                        "wall_s": round(time.monotonic() - began, 1),
                        "memory_mb": memory_mb, "backend": kernel.backend}
    return result


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.memory", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, nargs="+", default=[1000])
    ap.add_argument("--endpoints", type=int, default=10)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(HOST_MODES))
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--situations", nargs="+", choices=SITUATIONS, default=list(SITUATIONS))
    ap.add_argument("--burst-new", type=int, default=1000,
                    help="services created at once in burst_new")
    ap.add_argument("--replace-share", type=float, default=0.1,
                    help="share of the services whose every endpoint burst_replace replaces")
    ap.add_argument("--sync-period", type=float, metavar="SECONDS",
                    help="the agent's --sync-period: the resync comes this long after the "
                    "last sync; the bursts' syncs are partial while they start within it "
                    "of the first sync's start (each sync's kind is reported; default: "
                    "60 s, or 1 s per 250 services past 15,000)")
    ap.add_argument("--settle", type=float, default=5.0, metavar="SECONDS")
    ap.add_argument("--simulator-shape", action="store_true",
                    help="the simulator's lean objects, not kube-apiserver's real-shaped ones")
    ap.add_argument("--iptables-backend", choices=("auto", "nft", "legacy"), default="auto",
                    help="the back end the node's kubelet hint names (iptables and IPVS "
                    "modes; auto: none planted, the agent's own detection: nf_tables here)")
    ap.add_argument("--ipv6", action="store_true",
                    help="a single-stack IPv6 cluster (host modes): room for more than "
                    f"{V4_SERVICES:,} services")
    ap.add_argument("--limit", type=int, metavar="MIB",
                    help="the agent's cgroup limit, as a container's")
    ap.add_argument("--timeout", type=float, default=1200.0, help="seconds per situation")
    ap.add_argument("--guest-memory-mb", type=int, default=8192,
                    help="the kernel lab guest's memory (IPVS)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep-logs", type=Path, metavar="DIR")
    return ap


def plan(args: argparse.Namespace) -> list[Settings]:
    """Every (size, mode)'s settings, checked before the first run starts: a size or a
    combination that cannot run fails at once, not after hours of the others."""
    if args.runs < 1:
        raise ValueError("--runs must be positive")
    out = [Settings(services=services, endpoints=args.endpoints, mode=mode,
                    situations=tuple(args.situations), burst_new=args.burst_new,
                    replace_share=args.replace_share, sync_period=args.sync_period,
                    settle=args.settle, real_shaped=not args.simulator_shape,
                    iptables_backend=args.iptables_backend, limit_mib=args.limit,
                    timeout=args.timeout, ipv6=args.ipv6)
           for services in args.services for mode in args.modes]
    for s in out:
        s.check()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    ap = parser()
    args = ap.parse_args(argv)
    results: list[Obj] = []

    def progress(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    try:
        for s in plan(args):
            for i in range(args.runs):
                with tempfile.TemporaryDirectory(prefix="spx-memory-") as tmp:
                    work = (args.keep_logs / f"{s.mode}-{s.services}-{i}"
                            if args.keep_logs else Path(tmp))
                    work.mkdir(parents=True, exist_ok=True)
                    if s.mode in HOST_MODES:
                        result = run(s, work, progress)
                    else:
                        progress(f"{s.mode}-{s.services}: in the kernel lab")
                        result = in_kernel_lab(s, args.guest_memory_mb, work / "kernel")
                result["run"] = i + 1
                results.append(result)
                if args.json:  # kept as it grows: a long run stopped keeps what it had
                    args.json.write_text(json.dumps(results, indent=2))
    except ValueError as exc:
        ap.error(str(exc))
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
