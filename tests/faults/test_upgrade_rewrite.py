"""An upgrade to a build that renders every nftables port otherwise (restart.rewrite_of),
with real traffic through the real agent (`python -m proxy`) in a lab node: the successor
rewrites every table, a transaction each (its bases are the old build's), while clients
open new connections to every kind of service and eight long-lived UDP flows keep one
socket each. No connection fails, no flow moves to another endpoint, no datagram goes
unanswered.

"Another build" is the same code with a start-up hook (`ANOTHER_BUILD`, Python's
`sitecustomize`) that makes each port's fingerprint and the code's digest otherwise (the
rules are the same) and lowers the rewrite's thresholds from 1,000 ports to this node's
few dozen. Both agents put 8 ports in a shard table (`SMALL_SHARDS`), not 1,000, so
that the few dozen make several tables, each rewritten in its own transaction."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.netns_lab import Lab
from tests.e2e.agent_support import ROOT
from tests.faults.conftest import FaultNode, bulk_services, make_node
from tests.faults.test_restart_flows import (
    AFTER,
    FLOWS_IP,
    INTERVAL,
    PER_BACKEND,
    TIMEOUT,
    WEB,
    record,
    udp_service,
)
from tests.faults.traffic import UdpFlows, pinned_flows

pytestmark = [pytest.mark.root, pytest.mark.slow]

BULK = 30  # more services: more ports for the rewrite to write
SMALL_SHARDS = '''
import proxy.dataplane.nftables.render as render

render.SHARD_PORTS = 8
'''
ANOTHER_BUILD = SMALL_SHARDS + '''
import proxy.dataplane.nftables.marks as marks
import proxy.dataplane.nftables.render as render
import proxy.dataplane.nftables.restart as restart

fingerprint = render.fingerprint


def salted(family, owner, *rest, **named):
    other = (*owner, "another build") if len(owner) > 1 else owner  # a port's, not a base's
    return fingerprint(family, other, *rest, **named)


render.fingerprint = salted
marks.source_digest = lambda: b"another build"
restart.REWRITE_MIN_PORTS = restart.REWRITE_SAMPLE = 8
'''


def hook(tmp_path: Path, name: str, code: str) -> dict[str, str]:
    """The environment of an agent that runs `code` at its start (`sitecustomize`)."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(code)
    return {"PYTHONPATH": f"{folder}:{ROOT}"}


@pytest.fixture
def rewrite_node(fault_lab: Lab, tmp_path: Path) -> Iterator[FaultNode]:
    with make_node(fault_lab, tmp_path, "nftables", bulk_services(fault_lab, BULK)) as node:
        node.start_agent(env=hook(tmp_path, "small-shards", SMALL_SHARDS)).wait_ready(90.0)
        yield node


def test_an_upgrade_that_rewrites_every_table_drops_no_connection(
        rewrite_node: FaultNode, tmp_path: Path) -> None:
    node, lab = rewrite_node, rewrite_node.lab
    udp_service(node, "flows", FLOWS_IP, WEB)
    lab.wait_for(lab.client_ns, FLOWS_IP, 53, set(WEB), proto="udp")
    flows = pinned_flows(lab.client_ns, FLOWS_IP, 53, dict.fromkeys(WEB, PER_BACKEND),
                         TIMEOUT)
    successor = hook(tmp_path, "another-build", ANOTHER_BUILD)
    with node.traffic() as traffic, UdpFlows(flows, interval=INTERVAL) as busy:
        busy.more(5)
        began = time.monotonic()
        node.agent.stop(signal.SIGTERM)
        node.start_agent(env=successor).wait_ready(60.0)
        took = time.monotonic() - began
        busy.more(AFTER)
        logs = busy.logs()
    report = traffic.report(since=began)
    log = node.agent.log_path.read_text()
    rewrites = [line for line in log.splitlines() if "rewriting every table" in line]
    record(node, f"upgrade rewriting every table, {len(logs)} UDP flows", logs, took,
           f"{report.failed} of {report.attempts} new connections failed; converge: "
           "signal -> successor ready", rewrite=rewrites)
    assert len(rewrites) == 1 and 'how="a table a transaction"' in rewrites[0], rewrites
    assert "tables=9 " in rewrites[0], rewrites  # 8 shards (35 ports, 8 a shard) and the main
    assert report.failed == 0, report.failures()
    moved = [str(g) for g in logs if g.moved]
    assert not moved, f"{len(moved)} of {len(logs)} flows moved: {moved}"
    silent = {g.name: g.unanswered for g in logs if g.unanswered}
    assert not silent, f"datagrams unanswered within {TIMEOUT:g} s: {silent}"
    assert node.agent.alive() and node.restarts() == 0
