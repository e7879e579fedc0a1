"""Switching between the IPVS and iptables modes without `--cleanup` (the real agent,
in the kernel lab): one boot runs every scenario of scenarios/scenario_mode_switch.py;
each scenario is reported here on its own."""

from __future__ import annotations

from tests.kernel.scenario_host import scenario_module

run, test_scenario = scenario_module("scenario_mode_switch.py")
