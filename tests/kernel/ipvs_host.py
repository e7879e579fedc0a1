"""Host side of the scenario runs: boot one kernel per scenario module, run every
scenario of it with pytest inside (scenarios/run.py), then report each one as a host
test of its own (so a failure names the scenario and shows the guest's traceback)."""

from __future__ import annotations

import ast
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.uml import KernelResult, run_in_kernel

SCENARIOS = Path(__file__).parent / "scenarios"
RUNNER = SCENARIOS / "run.py"


def scenario_names(module: str) -> list[str]:
    """The test functions of a scenario module, read without importing it."""
    tree = ast.parse((SCENARIOS / module).read_text())
    return [n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def boot(module: str, tmp_path_factory: pytest.TempPathFactory,
         timeout: float = 420.0) -> KernelResult:
    if os.geteuid() != 0:
        pytest.skip("kernel tests boot user-mode Linux and need root; run as root (CI does)")
    workdir = tmp_path_factory.mktemp(module.removesuffix(".py"))
    run = run_in_kernel(RUNNER, [module], workdir=workdir, timeout=timeout)
    print(f"{module}: boot {run.boot_seconds:.2f} s (kernel start to script start), "
          f"startup {run.startup_seconds:.2f} s (host), script {run.script_seconds:.2f} s, "
          f"wall {run.wall_seconds:.2f} s")
    return run.check()


def outcome(run: KernelResult, name: str) -> None:
    """Fail (or skip) the host test as the scenario `name` did inside the kernel."""
    tests: dict[str, Any] = run.result["tests"]
    if name not in tests:
        pytest.fail(f"scenario {name} did not run in the kernel (collection error?)\n"
                    f"{run.describe()}")
    entry = tests[name]
    print(f"{name}: {entry['outcome']} in {entry['seconds']:.2f} s (inside the kernel)")
    if entry["outcome"] == "skipped":
        pytest.skip(entry["longrepr"])
    if entry["outcome"] != "passed":
        pytest.fail(f"{name} {entry['outcome']} inside the kernel:\n{entry['longrepr']}",
                    pytrace=False)


def scenario_module(module: str) -> tuple[Callable[..., KernelResult], Callable[..., None]]:
    """The `run` fixture (one boot for the module) and the parametrized `test_scenario`
    of a host test file: `run, test_scenario = scenario_module("scenario_x.py")`."""

    @pytest.fixture(scope="module")
    def run(tmp_path_factory: pytest.TempPathFactory) -> KernelResult:
        return boot(module, tmp_path_factory)

    @pytest.mark.kernel
    @pytest.mark.slow
    @pytest.mark.parametrize("name", scenario_names(module))
    def test_scenario(run: KernelResult, name: str) -> None:
        outcome(run, name)

    return run, test_scenario
