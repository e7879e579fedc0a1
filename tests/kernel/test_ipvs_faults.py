"""The fault suite in IPVS mode: the real agent in the kernel lab while the API server,
the cluster and other processes misbehave (scenarios/scenario_faults.py, one boot); each
fault is reported here on its own, then the figures table, as tests/faults prints it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from labs.kernel.harness import KernelResult
from tests.faults.conftest import FaultRecord
from tests.kernel.scenario_host import scenario_module

# Two agent restarts under UDP flows (issue 28) take about 2.5 min of the guest alone.
run, test_scenario = scenario_module("scenario_faults.py", timeout=720.0, cost=370.0)


@pytest.mark.kernel
@pytest.mark.slow
def test_figures(run: KernelResult, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Print the table the guest wrote (and copy it to $SLICEPROXY_FAULT_REPORT)."""
    found = sorted(tmp_path_factory.getbasetemp().glob("scenarios*/out/faults.json"))
    assert found, "the scenarios wrote no figures"
    rows = [FaultRecord(**r) for r in json.loads(found[-1].read_text())]
    print("\nfault suite, IPVS mode in the kernel lab (emulated; behaviour, not timing):")
    print(f"  {'fault':<44} {'mode':<14} {'tried':>6} {'failed':>6} "
          f"{'window':>8} {'converge':>8} {'rst':>3}")
    for row in rows:
        print(row.row())
    out = os.environ.get("SLICEPROXY_FAULT_REPORT")
    if out:
        Path(out).write_text(json.dumps([vars(r) for r in rows], indent=2) + "\n")
