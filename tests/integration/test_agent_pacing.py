"""How the running agent paces its syncs, as an operator sees it: the default (by cost,
within --sync-cpu-budget) and kube-proxy's --min-sync-period, in /debug/dump, /metrics
and the start-up log; the agent in-process against the simulator."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from proxy.sim import SimServer
from tests.integration.agent_harness import running_agent, wait_until
from tests.integration.test_agent_watch import endpoints, get, metric, sim, web_slice

__all__ = ["sim"]  # the fixture


def test_default_pacing_is_by_cost_and_shows(sim: SimServer, tmp_path: Path,
                                              caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.agent.app")
    with running_agent(sim, tmp_path) as agent:
        wait_until(lambda: endpoints(agent) == {"198.18.1.10:8080"}, what="first sync")
        for ip in ("198.18.1.11", "198.18.1.12", "198.18.1.13"):  # each applied
            sim.apply(web_slice(ip))
            wait_until(lambda ip=ip: endpoints(agent) == {f"{ip}:8080"}, what=ip)
        pacing = json.loads(get(agent, "/debug/dump")[1])["pacing"]
        assert pacing["mode"] == "cost" and pacing["cpu_budget"] == "20%"
        assert pacing["min_sync_period_seconds"] is None
        assert pacing["syncs_held_back"] == {"cpu-budget": 0, "min-sync-period": 0}
        assert 0 < pacing["credit_cpu_seconds"] <= 0.2
        assert metric(agent, "sliceproxy_sync_cpu_seconds_total") > 0
        assert metric(agent, 'sliceproxy_syncs_held_back_total{reason="cpu-budget"}') == 0
    started = next(r for r in caplog.records if r.getMessage() == "agent started")
    assert (vars(started)["min_sync_period"], vars(started)["sync_cpu_budget"]) == (
        "unset", "20%")


def test_min_sync_period_set_is_kube_proxys_pacing(sim: SimServer, tmp_path: Path) -> None:
    with running_agent(sim, tmp_path, "--min-sync-period", "1s",
                       "--sync-cpu-budget", "off") as agent:
        wait_until(lambda: endpoints(agent) == {"198.18.1.10:8080"}, what="first sync")
        doc = json.loads(get(agent, "/debug/dump")[1])
        assert doc["config"]["min-sync-period"] == "1s"
        assert doc["config"]["sync-cpu-budget"] == "off"
        pacing = doc["pacing"]
        assert (pacing["mode"], pacing["min_sync_period_seconds"], pacing["burst"]) == (
            "min-sync-period", 1.0, 2)
        assert pacing["cpu_budget"] == "off" and pacing["credit_cpu_seconds"] is None
