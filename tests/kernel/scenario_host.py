"""Host side of the scenario runs: boot one kernel for every selected scenario module
that needs the same kernel, run their scenarios with pytest inside (scenarios/run.py),
then report each one as a host test of its own (so a failure names the scenario and
shows the guest's traceback).

Modules share a boot because a boot costs more than the kernel's own start: pytest and
the project's imports take tens of seconds in an emulated guest. They are shared out
between LANES kernels that run at once, by what each module's scenarios cost: an
emulated guest keeps about one of the machine's cores busy (its work is mostly one
process at a time), so one kernel alone left the other core idle for most of the tier.
A module whose kernel differs (`deny_modules`) boots on its own; `-k` or a single file
boots only what is selected. A module's `env` is read in its lane's own thread: one that
waits (scenario_mode_switch.py's kube-proxy, built by the real-control-plane tier beside
this one on a fresh machine) holds back its lane only."""

from __future__ import annotations

import ast
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from labs.kernel.debian_kernel import KernelError
from labs.kernel.harness import DEFAULT_MODULES, KernelResult, run_in_kernel
from labs.kernel.qemu import lab_guest

SCENARIOS = Path(__file__).parent / "scenarios"
RUNNER = SCENARIOS / "run.py"
DEFAULT_TIMEOUT = 420.0
LANES = 2  # kernels at once: one per core of the 2-core machines the suite runs on
DEFAULT_COST = 60.0


def scenario_names(module: str) -> list[str]:
    """The test functions of a scenario module, read without importing it."""
    tree = ast.parse((SCENARIOS / module).read_text())
    return [n.name for n in tree.body
            if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")]


@dataclass(frozen=True)
class Needs:
    """What a scenario module needs of its kernel and its run."""

    timeout: float = DEFAULT_TIMEOUT
    modules: tuple[str, ...] = DEFAULT_MODULES
    deny_modules: tuple[str, ...] = ()
    env: Callable[[], dict[str, str]] | None = None
    cost: float = DEFAULT_COST  # seconds inside an emulated kernel, to balance the lanes


REGISTERED: dict[str, Needs] = {}
# Seconds each scenario took inside its kernel, for the tier's summary (conftest.py).
SCENARIO_SECONDS: dict[str, float] = {}
_BOOTED: dict[tuple[str, ...], Future[KernelResult | BaseException]] = {}
# Each module's run folder (console.log, out/: result.json, the agents' whole logs), for
# a failure to name: pytest keeps the last few base temporary folders only.
FOLDERS: dict[str, Path] = {}


def selected(session: pytest.Session) -> list[str]:
    """Scenario modules with at least one host test selected, in collection order."""
    found: list[str] = []
    for item in session.items:
        module = getattr(getattr(item, "function", None), "scenario_module", None)
        if module is not None and module not in found:
            found.append(module)
    return found


def lanes(modules: list[str]) -> list[list[str]]:
    """`modules` shared out for boots that run at once: those whose kernel is the same
    split into at most LANES groups of about equal cost (the costliest first, each to
    the cheapest lane so far), each module whose kernel differs a group of its own
    after them."""
    groups: list[list[str]] = []
    kinds = list(dict.fromkeys(REGISTERED[m].deny_modules for m in modules))
    for deny in kinds:
        alike = sorted((m for m in modules if REGISTERED[m].deny_modules == deny),
                       key=lambda m: -REGISTERED[m].cost)
        shares: list[list[str]] = [[] for _ in range(min(LANES, len(alike)))]
        for module in alike:
            min(shares, key=lambda g: sum(REGISTERED[m].cost for m in g)).append(module)
        groups += sorted(shares, key=lambda g: -sum(REGISTERED[m].cost for m in g))
    return groups


def boot(group: list[str], workdir: Path, beside: int = 1) -> KernelResult:
    """Run every scenario of the modules in `group` in one fresh kernel, `beside` kernels
    running at once: each of them slows the others' scenarios (measured with two, beside
    the real-node tier: up to 2.3 times as long), so each module's timeout counts that
    many times."""
    needs = [REGISTERED[m] for m in group]
    modules = list(DEFAULT_MODULES)
    env: dict[str, str] = {}
    for need in needs:
        modules += [m for m in need.modules if m not in modules]
        env.update(need.env() if need.env is not None else {})
    run = run_in_kernel(RUNNER, group, workdir=workdir,
                        timeout=beside * sum(n.timeout for n in needs), modules=modules,
                        deny_modules=needs[0].deny_modules, env=env)
    return run.check()


def _booted(group: list[str], workdir: Path, beside: int = 1) -> KernelResult | BaseException:
    try:
        return boot(group, workdir, beside)
    except (KernelError, pytest.fail.Exception) as exc:  # every module of it fails
        return exc


def start_boots(session: pytest.Session, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Boot a kernel for every lane of the selected modules, LANES at a time."""
    lab_guest()  # its accelerator probe once, before the threads
    pool = ThreadPoolExecutor(max_workers=LANES, thread_name_prefix="kernel-lane")
    groups = lanes(selected(session))
    for group in groups:
        workdir = tmp_path_factory.mktemp("scenarios")
        FOLDERS.update(dict.fromkeys(group, workdir))
        _BOOTED[tuple(group)] = pool.submit(_booted, group, workdir, min(LANES, len(groups)))
    pool.shutdown(wait=False)


def shared_run(module: str, request: pytest.FixtureRequest,
               tmp_path_factory: pytest.TempPathFactory) -> KernelResult:
    """The boot `module`'s scenarios ran in: every lane's boot is started when the first
    module asks, each module waits for its own."""
    if not _BOOTED:
        start_boots(request.session, tmp_path_factory)
    key = next(k for k in _BOOTED if module in k)  # asked by a selected test: planned
    done = _BOOTED[key].result()
    if isinstance(done, BaseException):
        raise done
    if module == key[0]:
        print(f"{' '.join(key)}: {done.timings()}")
    return done


def outcome(run: KernelResult, module: str, name: str) -> None:
    """Fail (or skip) the host test as the scenario `name` of `module` did inside the
    kernel: all of its parametrized cases (`name[id]`), if it has any."""
    tests: dict[str, Any] = run.result["tests"]
    qualified = f"{module}::{name}"
    cases = {k.split("::", 1)[1]: v for k, v in tests.items()
             if k == qualified or k.startswith(qualified + "[")}
    if not cases:
        pytest.fail(f"scenario {name} did not run in the kernel (collection error?)\n"
                    f"{run.describe()}")
    for case, entry in cases.items():
        SCENARIO_SECONDS[f"{module}::{case}"] = entry["seconds"]
        phases = ", ".join(f"{k} {v:.1f}" for k, v in entry.get("phases", {}).items())
        print(f"{case}: {entry['outcome']} in {entry['seconds']:.2f} s (inside the kernel; "
              f"{phases})")
    failed = {k: v for k, v in cases.items() if v["outcome"] not in ("passed", "skipped")}
    if failed:
        pytest.fail("\n".join(f"{k} {v['outcome']} inside the kernel:\n{v['longrepr']}"
                              for k, v in failed.items())
                    + f"\nthe run's folder (out/agents/: the agents' whole logs): "
                    f"{FOLDERS.get(module)}", pytrace=False)
    if all(v["outcome"] == "skipped" for v in cases.values()):
        pytest.skip("; ".join(v["longrepr"] for v in cases.values()))


def scenario_module(module: str, env: Callable[[], dict[str, str]] | None = None,
                    timeout: float = DEFAULT_TIMEOUT,
                    modules: tuple[str, ...] = DEFAULT_MODULES,
                    deny_modules: tuple[str, ...] = (), cost: float = DEFAULT_COST
                    ) -> tuple[Callable[..., KernelResult], Callable[..., None]]:
    """The `run` fixture (the boot the module's scenarios ran in: `timeout` is this
    module's share; `modules` loaded and `deny_modules` refused at boot; `env`, when
    given, is called then for the guest's environment; `cost`, about what its
    scenarios take in an emulated kernel, shares the modules out between lanes) and the
    parametrized `test_scenario` of a host test file:
    `run, test_scenario = scenario_module("scenario_x.py")`."""
    REGISTERED[module] = Needs(timeout, modules, deny_modules, env, cost)

    @pytest.fixture(scope="module")
    def run(request: pytest.FixtureRequest,
            tmp_path_factory: pytest.TempPathFactory) -> KernelResult:
        return shared_run(module, request, tmp_path_factory)

    @pytest.mark.kernel
    @pytest.mark.slow
    @pytest.mark.parametrize("name", scenario_names(module))
    def test_scenario(run: KernelResult, name: str) -> None:
        outcome(run, module, name)

    setattr(test_scenario, "scenario_module", module)  # noqa: B010 (found by `selected`)
    return run, test_scenario
