"""The agent's side of drift: a data plane's report of someone else's change leads to
one check, and to a full sync only when the check finds our rules changed."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.sim import SimServer
from tests.integration.agent_harness import FakeDataPlane, running_agent, wait_until
from tests.integration.test_agent_watch import metric, namespace, web_slice
from tests.unit.builders import node, service


@pytest.fixture
def sim() -> Iterator[SimServer]:
    with SimServer(objects=[namespace(), node("node-a"),
                            service("web", ips=("198.18.128.10",)),
                            web_slice("198.18.1.10")], bookmark_interval=0.2) as server:
        yield server


def test_a_report_is_checked_and_real_drift_gets_a_full_sync(sim: SimServer,
                                                             tmp_path: Path) -> None:
    fake = FakeDataPlane()
    with running_agent(sim, tmp_path, dataplane=fake) as agent:
        notify = wait_until(lambda: fake.notify, what="the agent to ask for drift reports")
        wait_until(lambda: len(fake.syncs) == 1, what="the first sync")

        # A report, but our rules are intact: one check, no sync.
        notify("nf_tables transaction: somebody changed ip filter")
        wait_until(lambda: fake.drift_checks == 1, what="the check")
        assert len(fake.syncs) == 1

        # Our rules were changed: a full sync follows, counted.
        fake.drift = ["IPv4: nat chain SPX-SERVICES is missing"]
        for i in range(5):  # a burst of reports (a firewall script) is checked once
            notify(f"report {i}")
        wait_until(lambda: len(fake.syncs) == 2, what="the repairing sync")
        assert fake.syncs[1][0] is True  # full
        assert fake.drift_checks == 2
        assert metric(agent, "sliceproxy_rules_drift_repairs_total") == 1
        assert metric(agent, "sliceproxy_rules_drift_checks_total") == 2
        assert agent.dump()["syncs"][0]["trigger"] == "drift"  # newest first
