"""Maglev and source hashing in the kernel lab: three nodes (network namespaces) fed the
same endpoints in three histories choose the same endpoint for every 5-tuple, and
removing one endpoint of ten moves few of the others' flows
(scenarios/scenario_maglev.py, one boot). SLICEPROXY_MAGLEV_FLOWS=10000 measures the
goal's 10,000 5-tuples (docs/dataplanes.md#balancing)."""

from __future__ import annotations

import os

from tests.kernel.scenario_host import scenario_module

FLOWS = "SLICEPROXY_MAGLEV_FLOWS"

run, test_scenario = scenario_module(
    "scenario_maglev.py", env=lambda: {FLOWS: os.environ[FLOWS]} if FLOWS in os.environ else {},
    cost=35.0)
