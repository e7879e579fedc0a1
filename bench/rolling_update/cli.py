"""`python -m bench.rolling_update`."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from bench import rolling_update as package  # its docstring is the command's help
from bench.common import PACINGS
from bench.rolling_update.measure import run
from bench.rolling_update.report import markdown
from bench.rolling_update.workload import MODES, Settings


def _terminated(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rolling_update",
                                 description=package.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=1000)
    ap.add_argument("--rate", type=float, nargs="+", default=[100.0],
                    help="endpoints replaced a second (one roll per rate)")
    ap.add_argument("--mode", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--traffic-rate", type=float, default=200.0,
                    help="new connections a second")
    ap.add_argument("--ready-delay", type=float, default=0.5)
    ap.add_argument("--grace", type=float, default=2.0,
                    help="seconds from terminating to deleted")
    ap.add_argument("--teardown", type=float, default=1.0,
                    help="seconds from deleted to the address removed")
    ap.add_argument("--pacing", nargs="+", choices=sorted(PACINGS), default=["old", "new"],
                    help="the agent's sync pacing, one roll each, side by side: old = "
                    "--min-sync-period 1s, budget off; new = no pacing flag")
    ap.add_argument("--min-sync-period", default="",
                    help="an explicit --min-sync-period for the agent instead (one roll)")
    ap.add_argument("--out", "--json", dest="out", type=Path, help="write the JSON here")
    ap.add_argument("--keep-logs", type=Path, metavar="DIR")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, _terminated)
    results = []
    pacings = ["custom"] if args.min_sync_period else args.pacing
    # Old and new pacing one right after the other at each rate and mode: the machine's
    # other load changes less between them than across the whole run.
    for rate, mode, pacing in ((r, m, p) for r in args.rate for m in args.mode
                               for p in pacings):
        settings = Settings(endpoints=args.endpoints, rate=rate, mode=mode,
                            ready_delay=args.ready_delay, grace=args.grace,
                            teardown=args.teardown, traffic_rate=args.traffic_rate,
                            pacing="new" if pacing == "custom" else pacing,
                            min_sync_period=args.min_sync_period)
        with tempfile.TemporaryDirectory(prefix="spx-roll-") as tmp:
            work = args.keep_logs or Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            result = run(settings, work, lambda t: print(t, file=sys.stderr, flush=True))
        results.append(result)
        brief = {k: v for k, v in result.items() if k not in ("lag", "traffic")}
        print(json.dumps(brief), file=sys.stderr, flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    print(markdown(results))
    return 0
