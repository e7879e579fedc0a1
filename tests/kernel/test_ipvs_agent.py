"""The real agent process (`python -m proxy --proxy-mode ipvs`) in the kernel lab,
against the cluster simulator, judged by real traffic: one boot runs every scenario of
scenarios/scenario_agent.py; each scenario is reported here on its own."""

from __future__ import annotations

from tests.kernel.scenario_host import scenario_module

run, test_scenario = scenario_module("scenario_agent.py", cost=260.0)
