"""The kernel's IPVS table, addresses and ipsets after applies, in the kernel lab: one
boot runs every scenario of scenarios/scenario_table.py (the read-back property, drift
repair, clean-up, schedulers); each scenario is reported here on its own."""

from __future__ import annotations

from tests.kernel.scenario_host import scenario_module

run, test_scenario = scenario_module("scenario_table.py")
