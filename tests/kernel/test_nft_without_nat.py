"""A kernel without nf_tables' nat chain type (nft_chain_nat cannot load in it): the
agent notices and uses legacy iptables, saying why. One boot runs every scenario of
scenarios/scenario_nft_without_nat.py; each scenario is reported here on its own."""

from __future__ import annotations

from tests.kernel.scenario_host import scenario_module

run, test_scenario = scenario_module("scenario_nft_without_nat.py",
                                     deny_modules=("nft_chain_nat",))
