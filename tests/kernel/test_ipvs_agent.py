"""The real agent process (`python -m proxy --proxy-mode ipvs`) in user-mode Linux,
against the cluster simulator, judged by real traffic: one boot runs every scenario of
scenarios/scenario_agent.py; each scenario is reported here on its own."""

from __future__ import annotations

import pytest

from tests.kernel.ipvs_host import boot, outcome, scenario_names
from tests.kernel.uml import KernelResult

MODULE = "scenario_agent.py"

pytestmark = [pytest.mark.kernel, pytest.mark.slow]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> KernelResult:
    return boot(MODULE, tmp_path_factory)


@pytest.mark.parametrize("name", scenario_names(MODULE))
def test_scenario(run: KernelResult, name: str) -> None:
    outcome(run, name)
