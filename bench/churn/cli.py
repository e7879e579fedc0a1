"""`python -m bench.churn`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import churn as package  # its docstring is the command's help
from bench.churn.measure import run
from bench.churn.report import markdown
from bench.churn.workload import PHASES, Settings
from bench.common import PACINGS, POD_CIDR_V6


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds the with-blocks: everything is cleaned up


def main(argv: Sequence[str] | None = None) -> int:
    d = Settings()
    ap = argparse.ArgumentParser(prog="python -m bench.churn", description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--services", type=int, default=d.services)
    ap.add_argument("--endpoints", type=int, default=d.endpoints, help="per service")
    ap.add_argument("--pacing", nargs="+", choices=sorted(PACINGS), default=list(d.pacing),
                    help="one agent each, one after the other: old = --min-sync-period "
                    "1s, budget off; new = no pacing flag")
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=list(d.phases))
    ap.add_argument("--isolated", type=int, default=d.isolated,
                    help="isolated changes, one at a time")
    ap.add_argument("--spacing", type=float, default=d.spacing,
                    help="seconds between one isolated change seen and the next")
    ap.add_argument("--rates", type=float, nargs="+", default=list(d.rates),
                    help="random churn: writes a second, one phase each")
    ap.add_argument("--duration", type=float, default=d.duration,
                    help="seconds of random churn at each rate")
    ap.add_argument("--burst", type=int, default=d.burst, help="services created at once")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--ipv6", action="store_true",
                    help=f"a single-stack IPv6 cluster (pods in {POD_CIDR_V6}): room for "
                    "more than 48,000 endpoints")
    ap.add_argument("--restart", action="store_true",
                    help="restart the agent over its tables after its first sync; the "
                    "phases start at the new one's first sync (changes while a restart "
                    "completes)")
    ap.add_argument("--resync", type=float, metavar="SECONDS",
                    help="the agent's --sync-period: its periodic resync begins this long "
                    "after its first sync began, the changes meanwhile measured as any")
    ap.add_argument("--out", "--json", dest="out", type=Path, help="write the JSON here")
    ap.add_argument("--keep-logs", type=Path, metavar="DIR")
    args = ap.parse_args(argv)
    settings = Settings(services=args.services, endpoints=args.endpoints,
                        pacing=tuple(args.pacing), phases=tuple(args.phases),
                        isolated=args.isolated, spacing=args.spacing,
                        rates=tuple(args.rates), duration=args.duration, burst=args.burst,
                        seed=args.seed, ipv6=args.ipv6, restart=args.restart,
                        resync=args.resync)
    try:
        settings.check()
    except ValueError as exc:
        ap.error(str(exc))
    signal.signal(signal.SIGTERM, _terminated)
    with tempfile.TemporaryDirectory(prefix="spx-churn-") as tmp:
        work = args.keep_logs or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        result = run(settings, work, lambda t: print(t, file=sys.stderr, flush=True))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))
    print(markdown(result))
    return 0
