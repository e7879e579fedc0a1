"""A kernel whose nf_tables has no nat chain type (booted without nft_chain_nat, as
Debian's user-mode Linux is built), on a node whose plain `iptables` is the nf_tables
back end: listing the nat table works there, yet every restore that makes a nat chain
fails. The agent must notice, use legacy iptables instead and say why (run by
tests/kernel/test_nft_without_nat.py through scenarios/run.py; never on the host).
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

import pytest

from proxy.dataplane.common.nfnetlink import nat_unsupported
from proxy.dataplane.xtables.restore_runner import (
    Backend,
    IptablesRunner,
    RestoreError,
    detect_backend,
)
from proxy.model.types import Family
from proxy.netns_lab import Lab
from proxy.netns_lab.netns import entered
from proxy.sim import SimServer
from tests.e2e.agent_support import (
    AgentProcess,
    endpoint,
    endpoint_slice,
    our_rules,
    run_cli,
    service,
)
from tests.kernel.scenario_guest import READY_DEADLINE

VIP = "198.18.128.50"


def test_the_probe_sees_what_the_restore_would_hit(lab: Lab,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="proxy.dataplane.xtables.restore_runner")
    with entered(lab.node_ns):
        flavour = subprocess.run(["iptables", "-V"], capture_output=True, text=True,
                                 check=True).stdout
        assert "(nf_tables)" in flavour  # so nft is what the node would otherwise get
        nft = IptablesRunner(Family.V4, Backend.NFT)
        # What every sync would meet: the kernel refuses to make a nat chain...
        with pytest.raises(RestoreError):
            nft.restore("*nat\n:SPX-PROBE - [0:0]\n-A POSTROUTING -j SPX-PROBE\nCOMMIT\n")
        # ...which the probe finds out without writing anything.
        for family in (Family.V4, Family.V6):
            reason = nat_unsupported(family)
            assert reason is not None and f"nat chain for {family.label}" in reason, reason
        assert not nft.available()
        assert IptablesRunner(Family.V4, Backend.LEGACY).available()
        caplog.clear()
        assert detect_backend() is Backend.LEGACY
    # Legacy because of the probe, not because anything else pointed there.
    (record,) = caplog.records
    assert record.getMessage() == ("iptables back end: legacy, as nf_tables cannot do NAT "
                                   "in this kernel")
    assert vars(record)["preferred"] == "nft", vars(record)


def test_the_agent_uses_legacy_says_why_and_serves(lab: Lab, sim: SimServer,
                                                   workdir: Path) -> None:
    b = lab.backends
    sim.apply(service("web", [VIP]))
    sim.apply(endpoint_slice("web-1", "web", [endpoint(b[n].ipv4) for n in ("web-1", "web-2")]))
    agent = AgentProcess(lab, sim, workdir, "--proxy-mode", "iptables").start()
    try:
        agent.wait_ready(READY_DEADLINE)
        lab.wait_for(lab.client_ns, VIP, 80, {"web-1", "web-2"}, deadline=30.0)
        syncs = agent.dump()["syncs"]
        assert syncs and not [s for s in syncs if s["error"]], syncs
        log = agent.log_text()
        assert 'msg="iptables back end: legacy, as nf_tables cannot do NAT in this kernel"' \
            in log, agent.log_tail()
        assert "nat chain for IPv4" in log
        assert our_rules(lab, ["legacy"]) and not our_rules(lab, ["nft"])
    finally:
        agent.stop()
        done = run_cli(lab, ["--cleanup", "--hostname-override", lab.node_name],
                       timeout=READY_DEADLINE)
        assert done.returncode == 0, done.stderr
    assert our_rules(lab) == []
