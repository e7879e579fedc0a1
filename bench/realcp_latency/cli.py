"""`python -m bench.realcp_latency`: builds (or reuses) the binaries, starts the control
plane and runs."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from bench import realcp_latency as package  # its docstring is the command's help
from bench.common import PACINGS, exit_on_sigterm
from bench.realcp_latency.report import markdown
from bench.realcp_latency.run import run
from bench.realcp_latency.settings import BACKENDS, KCM_FLAGS, PROXIES, Settings
from labs.realcp.build import Binaries, build
from labs.realcp.controlplane import ControlPlane


@contextlib.contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="sliceproxy-latency-") as d:
        yield Path(d)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.realcp_latency",
                                description=(package.__doc__ or "").splitlines()[0])
    d = Settings()
    p.add_argument("--services", type=int, default=d.services)
    p.add_argument("--pods-per-service", type=int, default=d.pods_per_service)
    p.add_argument("--changes", type=int, default=d.changes)
    p.add_argument("--poll-interval", type=float, default=d.poll_interval,
                   help="seconds between polls of each node's nat table")
    p.add_argument("--spacing", type=float, default=d.spacing,
                   help="seconds of quiet between one change being seen and the next")
    p.add_argument("--change-deadline", type=float, default=d.change_deadline)
    p.add_argument("--setup-deadline", type=float, default=d.setup_deadline)
    p.add_argument("--parallel", type=int, default=d.parallel)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--proxies", nargs="+", choices=PROXIES, default=list(d.proxies),
                   help="run only these (default both, side by side)")
    p.add_argument("--iptables-backend", choices=("auto", *BACKENDS), default=d.iptables_backend,
                   help="the iptables back end of every node (default: each proxy's own "
                   "choice)")
    p.add_argument("--pacing", nargs="+", choices=sorted(PACINGS), default=[],
                   help="run each sliceproxy side once per sync pacing: old = "
                   "--min-sync-period 1s, budget off; new = no flag; default: "
                   "once, with the agent's defaults")
    p.add_argument("--json", type=Path, help="write the full results here")
    p.add_argument("--keep-logs", type=Path,
                   help="a directory for the proxies' logs (kept); default: a temporary one")
    args = p.parse_args(argv)
    settings = Settings(
        services=args.services, pods_per_service=args.pods_per_service, changes=args.changes,
        poll_interval=args.poll_interval, spacing=args.spacing,
        change_deadline=args.change_deadline, setup_deadline=args.setup_deadline,
        parallel=args.parallel, seed=args.seed, proxies=tuple(args.proxies),
        iptables_backend=args.iptables_backend, pacing=tuple(args.pacing))
    settings.check()
    return on_control_plane(
        p.prog, argv, lambda cp, bins, workdir, progress: run(cp, bins, settings, workdir,
                                                              progress),
        markdown, args.json, args.keep_logs, controller_manager_flags=KCM_FLAGS)


Measure = Callable[[ControlPlane, Binaries, Path, Callable[[str], None]], dict[str, Any]]


def on_control_plane(prog: str, argv: Sequence[str] | None, measure: Measure,
                     markdown: Callable[[dict[str, Any]], str], json_path: Path | None,
                     keep_logs: Path | None, **control_plane: Any) -> int:
    """A benchmark command's body: builds (or reuses) the binaries, starts the control
    plane (`control_plane`: ControlPlane's options), runs `measure` on it with a work
    directory (`keep_logs`, else a temporary one) and progress on stderr, everything
    removed on the way out, SIGTERM included; then writes the result (with the command)
    to `json_path` and prints its Markdown. Needs root (network namespaces)."""
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    exit_on_sigterm()

    def progress(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    progress("building (or reusing) Kubernetes v1.20.2")
    bins = build()
    with ControlPlane(bins, **control_plane) as cp, _workdir(keep_logs) as workdir:
        progress(f"control plane up in namespace {cp.namespace}")
        result = measure(cp, bins, workdir, progress)
    result["command"] = f"{prog} " + " ".join(sys.argv[1:] if argv is None else argv)
    if json_path:
        json_path.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0
