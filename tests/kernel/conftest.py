"""Fixtures for kernel tests: boot user-mode Linux per call, results in tmp_path."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest

from tests.kernel.uml import DEFAULT_TIMEOUT, KernelResult, run_in_kernel


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
    # UML itself runs unprivileged, but the suite's contract is that kernel tests, like
    # the e2e tests, run as root (CI does) and are skipped, loudly, otherwise.
    if os.geteuid() != 0:
        pytest.skip("kernel tests boot user-mode Linux and need root; run as root (CI does)")
    return KernelRunner(tmp_path)
