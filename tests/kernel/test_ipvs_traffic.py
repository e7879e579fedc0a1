"""Real traffic through the IPVS data plane in the kernel lab: one boot runs every
scenario of scenarios/scenario_traffic.py; each scenario is reported here on its own."""

from __future__ import annotations

from tests.kernel.scenario_host import scenario_module

run, test_scenario = scenario_module("scenario_traffic.py", cost=90.0)
