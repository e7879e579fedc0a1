"""Fixtures for kernel tests: a fresh kernel per call, results in tmp_path; and the tier's
summary line (which kernel booted, how, how often, for how long)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from labs.kernel.harness import BOOTS, DEFAULT_TIMEOUT, KernelResult, run_in_kernel
from tests.kernel.scenario_host import SCENARIO_SECONDS


@pytest.fixture(scope="session", autouse=True)
def _as_root() -> None:
    # QEMU itself runs unprivileged, but the suite's contract is that kernel tests, like
    # the e2e tests, run as root (CI does: the kernel cache and the guest's namespaces
    # and rules need it) and are skipped, loudly, otherwise. Session scope: checked
    # before any module's boot.
    if os.geteuid() != 0:
        pytest.skip("kernel tests boot a kernel and need root; run as root (CI does)")


class KernelRunner:
    """``kernel(script, args, timeout=...)``: run_in_kernel with a fresh folder per call."""

    def __init__(self, base: Path) -> None:
        self._base = base
        self._count = itertools.count()

    def __call__(
        self,
        script: Path | str,
        args: Iterable[str] = (),
        *,
        timeout: float = DEFAULT_TIMEOUT,
        **kwargs: Any,
    ) -> KernelResult:
        workdir = self._base / f"k{next(self._count)}"
        workdir.mkdir()
        return run_in_kernel(script, args, workdir=workdir, timeout=timeout, **kwargs)


@pytest.fixture
def kernel(tmp_path: Path) -> KernelRunner:
    return KernelRunner(tmp_path)


def pytest_sessionfinish() -> None:
    BOOTS.stop()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if BOOTS.count:
        for described in sorted(BOOTS.described):
            terminalreporter.write_line(f"kernel lab: {described}")
        terminalreporter.write_line(
            f"kernel lab: {BOOTS.count} boots, {BOOTS.seconds:.0f} s of kernel wall time")
    if SCENARIO_SECONDS:  # where a shared boot's time went (pytest shows it as one setup)
        modules: dict[str, float] = {}
        for case, seconds in SCENARIO_SECONDS.items():
            module = case.split("::", 1)[0]
            modules[module] = modules.get(module, 0.0) + seconds
        terminalreporter.write_line("kernel lab, scenario seconds inside the kernel: " + ", ".join(
            f"{m} {s:.0f}" for m, s in sorted(modules.items(), key=lambda kv: -kv[1])))
        slowest = sorted(SCENARIO_SECONDS.items(), key=lambda kv: -kv[1])[:8]
        terminalreporter.write_line("kernel lab, slowest scenarios: " + ", ".join(
            f"{case.split('::', 1)[1]} {s:.0f}" for case, s in slowest))
