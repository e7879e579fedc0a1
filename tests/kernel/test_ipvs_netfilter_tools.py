"""The IPVS plane's ipsets and fixed iptables rules against the host's real binaries and
kernel (no IPVS needed), in a network namespace of the test's own, on both iptables
back ends: the kernel accepts the text, jumps are added once however often a full sync
runs, and clean-up leaves nothing of ours (and everything of others')."""

from __future__ import annotations

import secrets
import subprocess
from collections.abc import Iterator
from ipaddress import ip_network

import pytest

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.ipvs.kernel import Ipsets
from proxy.dataplane.ipvs.netfilter import JUMPS, cleanup_text, ipset_replace, restore_text
from proxy.dataplane.ipvs.render import SET_PREFIX, SetEntry, SetRole
from proxy.dataplane.xtables.restore_runner import Backend, IptablesRunner
from proxy.dataplane.xtables.saved import parse_save
from proxy.model.types import Family
from proxy.netns_lab.netns import entered

pytestmark = pytest.mark.root

OPTIONS = DataplaneOptions(node_name="n", cluster_cidrs=(ip_network("198.18.1.0/24"),
                                                         ip_network("fd00:18:1::/64")))
ENTRIES = {
    SetEntry(SetRole.SERVICES, Family.V4, "198.18.128.10,tcp:80"),
    SetEntry(SetRole.FIREWALL_ALLOW, Family.V4, "198.18.2.50,tcp:80,198.18.0.0/24"),
    SetEntry(SetRole.FIREWALL_ALLOW, Family.V4, "198.18.2.50,tcp:80,0.0.0.0/1"),
    SetEntry(SetRole.LOOPBACK, Family.V6, "fd00:18:1::10,udp:8081,fd00:18:1::10"),
}


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"spx-ipvsnf-{secrets.token_hex(3)}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False)


@pytest.mark.parametrize("backend", [Backend.LEGACY, Backend.NFT])
def test_rules_and_sets_in_a_real_kernel(netns: str, backend: Backend) -> None:
    with entered(netns):
        ipsets = Ipsets()
        ipsets.restore(ipset_replace([Family.V4, Family.V6], ENTRIES))
        ipsets.restore(ipset_replace([Family.V4, Family.V6], ENTRIES))  # idempotent
        saved_sets = subprocess.run(["ipset", "save"], capture_output=True, text=True,
                                    check=True).stdout
        for family in (Family.V4, Family.V6):
            runner = IptablesRunner(family, backend)
            if not runner.available():
                pytest.skip(f"{runner.restore_cmd} not usable here")
            runner.restore("*nat\n:OTHER - [0:0]\n-A PREROUTING -j OTHER\nCOMMIT\n")
            for _ in range(2):  # a full sync, then another
                runner.restore(restore_text(family, OPTIONS, parse_save(runner.save())))
            text = runner.save()
            for jump in JUMPS:
                assert sum(1 for line in text.splitlines()
                           if line.startswith(f"-A {jump.chain} ")
                           and line.endswith(f"-j {jump.target}")) == 1, (jump, text)
            assert "--match-set SPX-IPVS" in text
            runner.restore(cleanup_text(parse_save(runner.save())))
            after = runner.save()
            assert "SPX-IPVS" not in after, after
            assert "-A PREROUTING -j OTHER" in after
        for name in ipsets.names():
            if name.startswith(SET_PREFIX):
                ipsets.destroy(name)
        assert not [n for n in ipsets.names() if n.startswith(SET_PREFIX)]
    # ipset spelled our entries back as we wrote them (the /1 net included).
    assert "add SPX-IPVS4-FW-ALLOW 198.18.2.50,tcp:80,0.0.0.0/1" in saved_sets
    assert "add SPX-IPVS6-LOOPBACK fd00:18:1::10,udp:8081,fd00:18:1::10" in saved_sets
