"""SCTP services with real packets in the kernel lab (the host's kernel has no SCTP
module): one boot runs every scenario of scenarios/scenario_sctp.py, for the iptables
(both back ends), nftables and IPVS data planes; each scenario is reported here on its
own. The guest loads `sctp` (the backends' and the client's sockets) and `xt_sctp`
(iptables' `-m sctp --dport`) at boot with the rest of the lab's modules."""

from __future__ import annotations

from labs.kernel.harness import DEFAULT_MODULES
from tests.kernel.scenario_host import scenario_module

run, test_scenario = scenario_module("scenario_sctp.py",
                                     modules=(*DEFAULT_MODULES, "sctp", "xt_sctp"), cost=40.0)
