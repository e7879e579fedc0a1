"""Run scenario modules with pytest INSIDE the kernel lab's guest and hand the
outcome of every test back to the host (as $KERNEL_RESULT JSON, via guest.write_result).

    python tests/kernel/scenarios/run.py scenario_traffic.py [more.py ...] [-k EXPR]

Scenario files are named scenario_*.py so the host's pytest never collects them (they
need IPVS); the host side (tests/kernel/scenario_host.py) boots one kernel for every
selected module that needs the same kernel and turns each scenario's outcome into a host
test.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from labs.kernel.guest import write_result

HERE = Path(__file__).resolve().parent


class Collector:
    def __init__(self) -> None:
        self.tests: dict[str, dict[str, Any]] = {}

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        # "scenario_x.py::test_y[case]": several modules may run in one boot.
        path, _, test = report.nodeid.partition("::")
        name = f"{Path(path).name}::{test}"
        entry = self.tests.setdefault(name, {"outcome": "passed", "seconds": 0.0,
                                             "phases": {}, "longrepr": ""})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        entry["phases"][report.when] = round(report.duration, 3)  # where the time went
        if report.failed:
            entry["outcome"] = "failed" if report.when == "call" else f"error ({report.when})"
            entry["longrepr"] += str(report.longrepr)
        elif report.skipped and entry["outcome"] == "passed":
            entry["outcome"] = "skipped"
            entry["longrepr"] += str(report.longrepr)
        if report.capstderr and report.failed:
            entry["longrepr"] += "\n--- stderr ---\n" + report.capstderr[-4000:]


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
