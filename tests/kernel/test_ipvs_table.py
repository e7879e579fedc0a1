"""The kernel's IPVS table, addresses and ipsets after applies, in the kernel lab: one
boot runs every scenario of scenarios/scenario_table.py (the read-back property, drift
repair, clean-up, both proxies' claims, the table sampler, schedulers); each scenario is
reported here on its own. SLICEPROXY_SAMPLER_TABLE=10000 measures the sampler's cost at
10,000 virtual servers (docs/reliability.md#ipvs-mode), and reading traffic counts there
(docs/dataplanes.md)."""

from __future__ import annotations

import os

from tests.kernel.scenario_host import scenario_module

SIZE = "SLICEPROXY_SAMPLER_TABLE"

run, test_scenario = scenario_module(
    "scenario_table.py", env=lambda: {SIZE: os.environ[SIZE]} if SIZE in os.environ else {},
    cost=90.0)
