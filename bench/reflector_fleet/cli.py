"""`python -m bench.reflector_fleet` (and its `--worker` children)."""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, NoReturn

from bench import reflector_fleet as package  # its docstring is the command's help
from bench.common import quiet
from bench.reflector_fleet.measure import run
from bench.reflector_fleet.report import markdown
from bench.reflector_fleet.servers import encodings, preload, real_target, sim_target
from bench.reflector_fleet.worker import WorkerSpec, worker_main
from bench.reflector_fleet.workload import SIZES, Settings


def _on_sigterm(signum: int, frame: object) -> NoReturn:
    raise SystemExit(128 + signum)  # unwinds the with-blocks: everything is cleaned up


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if args_list[:1] == ["--worker"]:
        return worker_main(WorkerSpec(**json.loads(args_list[1])))
    p = argparse.ArgumentParser(prog="python -m bench.reflector_fleet",
                                description=(package.__doc__ or "").splitlines()[0])
    p.add_argument("--server", choices=("real", "sim"), default="real")
    p.add_argument("--size", choices=sorted(SIZES), default="small",
                   help="defaults for the rest (small: CI-sized; full: the issue's)")
    p.add_argument("--agents", type=int, nargs="+")
    p.add_argument("--first-list", nargs="+", choices=("cache", "consistent"),
                   default=["cache"])
    p.add_argument("--services", type=int)
    p.add_argument("--endpoints", type=int, help="per service")
    p.add_argument("--changes", type=int)
    p.add_argument("--rate", type=float, help="changes per second")
    p.add_argument("--workers", type=int, default=1, help="agent processes")
    p.add_argument("--deadline", type=float, default=600.0, help="per phase, seconds")
    p.add_argument("--json", type=Path, help="write the full results here")
    args = p.parse_args(args_list)
    size = SIZES[args.size]
    settings = Settings(
        server=args.server, agents=tuple(args.agents or size["agents"]),
        first_lists=tuple(args.first_list),
        services=args.services or size["services"],
        endpoints=args.endpoints or size["endpoints"],
        changes=args.changes or size["changes"], rate=args.rate or size["rate"],
        workers=args.workers, deadline=args.deadline)
    settings.check()
    if args.server == "real" and os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, _on_sigterm)
    _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # the API server's sockets

    def progress(text: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)

    result = run_cli(settings, progress)
    result["command"] = "python -m bench.reflector_fleet " + " ".join(args_list)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(markdown(result))
    return 0


def run_cli(settings: Settings, progress: Callable[[str], None] = quiet) -> dict[str, Any]:
    """The whole bench: start the server, preload, run every (mode, N), stop."""
    nodes = max(settings.agents)
    if settings.server == "sim":
        with sim_target(settings, nodes, progress) as target:
            return run(target, settings, progress)
    from labs.realcp.build import build
    from labs.realcp.controlplane import ControlPlane

    with ControlPlane(build()) as cp, real_target(cp) as target:
        progress(f"control plane up in namespace {cp.namespace}")
        seconds = preload(target, settings, nodes, progress)
        result = {**run(target, settings, progress), "preload_s": seconds}
        result["encodings"] = encodings(target, settings)
        progress(f"encodings: {result['encodings']}")
        return result


def settings_for(size: str, **over: Any) -> Settings:
    s = SIZES[size]
    base = Settings(agents=tuple(s["agents"]), services=s["services"],
                    endpoints=s["endpoints"], changes=s["changes"], rate=s["rate"])
    return replace(base, **over)
