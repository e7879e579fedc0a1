"""Host side of the scenario runs: boot one kernel per scenario module, run every
scenario of it with pytest inside (scenarios/run.py), then report each one as a host
test of its own (so a failure names the scenario and shows the guest's traceback)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from labs.kernel.harness import KernelResult, run_in_kernel

SCENARIOS = Path(__file__).parent / "scenarios"
RUNNER = SCENARIOS / "run.py"


def scenario_names(module: str) -> list[str]:
    """The test functions of a scenario module, read without importing it."""
    tree = ast.parse((SCENARIOS / module).read_text())
    return [n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


def boot(module: str, tmp_path_factory: pytest.TempPathFactory,
         timeout: float = 420.0, **kwargs: Any) -> KernelResult:
    """Run every scenario of `module` in one fresh kernel (run_in_kernel's `kwargs`)."""
    workdir = tmp_path_factory.mktemp(module.removesuffix(".py"))
    run = run_in_kernel(RUNNER, [module], workdir=workdir, timeout=timeout, **kwargs)
    print(f"{module}: {run.timings()}")
    return run.check()


def outcome(run: KernelResult, name: str) -> None:
    """Fail (or skip) the host test as the scenario `name` did inside the kernel: all of
    its parametrized cases (`name[id]`), if it has any."""
    tests: dict[str, Any] = run.result["tests"]
    cases = {k: v for k, v in tests.items() if k == name or k.startswith(name + "[")}
    if not cases:
        pytest.fail(f"scenario {name} did not run in the kernel (collection error?)\n"
                    f"{run.describe()}")
    for case, entry in cases.items():
        print(f"{case}: {entry['outcome']} in {entry['seconds']:.2f} s (inside the kernel)")
    failed = {k: v for k, v in cases.items() if v["outcome"] not in ("passed", "skipped")}
    if failed:
        pytest.fail("\n".join(f"{k} {v['outcome']} inside the kernel:\n{v['longrepr']}"
                              for k, v in failed.items()), pytrace=False)
    if all(v["outcome"] == "skipped" for v in cases.values()):
        pytest.skip("; ".join(v["longrepr"] for v in cases.values()))


def scenario_module(module: str, env: Callable[[], dict[str, str]] | None = None,
                    **kwargs: Any
                    ) -> tuple[Callable[..., KernelResult], Callable[..., None]]:
    """The `run` fixture (one boot for the module, run_in_kernel's `kwargs`; `env`, when
    given, is called then for the guest's environment) and the parametrized
    `test_scenario` of a host test file:
    `run, test_scenario = scenario_module("scenario_x.py")`."""

    @pytest.fixture(scope="module")
    def run(tmp_path_factory: pytest.TempPathFactory) -> KernelResult:
        extra = {"env": env()} if env is not None else {}
        return boot(module, tmp_path_factory, **kwargs, **extra)

    @pytest.mark.kernel
    @pytest.mark.slow
    @pytest.mark.parametrize("name", scenario_names(module))
    def test_scenario(run: KernelResult, name: str) -> None:
        outcome(run, name)

    return run, test_scenario
