"""Run scenario modules with pytest INSIDE the kernel lab's guest and hand the
outcome of every test back to the host (as $KERNEL_RESULT JSON, via guest.write_result).

    python tests/kernel/scenarios/run.py scenario_traffic.py [more.py ...] [-k EXPR]

Scenario files are named scenario_*.py so the host's pytest never collects them (they
need IPVS); the host side (tests/kernel/scenario_host.py) boots a few kernels at once,
each for some of the selected modules that need the same kernel, and turns each
scenario's outcome into a host test.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from labs.kernel.guest import write_result
from proxy.agent.logs import log_stamp

HERE = Path(__file__).resolve().parent
AGENT_LOG_LINES = 200


def agent_logs(since: float) -> str:
    """What the scenarios' agents logged since `since` (epoch seconds), the last
    AGENT_LOG_LINES lines of each log under the run's agents/ (the `workdir` fixtures';
    AgentProcess writes them). CI keeps a kernel run's text, not its folder: without
    these lines nobody can tell what an agent did when a probe failed. A log is chosen
    by its own time= stamps (the guest's clock, as `since`), not by its file's mtime,
    which the host's clock sets through 9p."""
    result = os.environ.get("KERNEL_RESULT")
    if not result:
        return ""
    out_dir = Path(result).parent
    cutoff = "time=" + log_stamp(since)
    parts = []
    for path in sorted((out_dir / "agents").glob("**/*.log")):
        lines = path.read_text(errors="replace").splitlines()
        first = next((i for i, line in enumerate(lines)
                      if line.startswith("time=") and line[:len(cutoff)] >= cutoff), None)
        if first is None:
            continue  # silent since: an earlier scenario's agent
        shown = lines[first:][-AGENT_LOG_LINES:]
        parts.append(f"--- {path.relative_to(out_dir)} in the run's out/: {len(shown)} "
                     f"lines (those since {log_stamp(since)}, the last "
                     f"{AGENT_LOG_LINES} at most) ---\n" + "\n".join(shown))
    return "\n".join(parts) or "(no agent logged anything since)"


class Collector:
    def __init__(self) -> None:
        self.tests: dict[str, dict[str, Any]] = {}
        # Per scenario: since when its agents' lines are not shown yet (epoch seconds).
        self.unshown: dict[str, float] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # "scenario_x.py::test_y[case]": several modules may run in one boot.
        path, _, test = report.nodeid.partition("::")
        name = f"{Path(path).name}::{test}"
        entry = self.tests.setdefault(name, {"outcome": "passed", "seconds": 0.0,
                                             "phases": {}, "longrepr": ""})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        entry["phases"][report.when] = round(report.duration, 3)  # where the time went
        since = self.unshown.setdefault(name, report.start)  # its setup's start
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else f"error ({report.when})"
            entry["longrepr"] += str(report.longrepr)
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["longrepr"] += str(report.longrepr)
        if report.capstderr and report.failed:
            entry["longrepr"] += "\n--- stderr ---\n" + report.capstderr[-4000:]
        if report.failed:
            entry["longrepr"] += (f"\n--- {report.when} failed at {log_stamp(report.stop)} "
                                  f"(the guest's clock, UTC, as the agents' time=) ---\n"
                                  f"{agent_logs(since)}")
            self.unshown[name] = report.stop


def main(argv: list[str]) -> int:
    files = [str(HERE / a) for a in argv if a.endswith(".py")]
    extra = [a for a in argv if not a.endswith(".py")]
    collector = Collector()
    started = time.monotonic()
    code = pytest.main([
        "-p", "no:cacheprovider",  # the root file system is read-only
        # Its summary hook imports hypothesis whatever ran: seconds in an emulated guest.
        # Scenarios that use @given still run and report without it.
        "-p", "no:hypothesispytest",
        "-o", "python_files=scenario_*.py",
        "-q", "-rA", "--tb=short", *extra, *files,
    ], plugins=[collector])
    write_result({"exit_code": int(code), "tests": collector.tests,
                  "seconds": round(time.monotonic() - started, 3)})
    return 0  # the host judges each scenario from the result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
