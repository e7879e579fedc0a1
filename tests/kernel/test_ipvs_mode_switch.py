"""Switching between the IPVS and iptables modes without `--cleanup` (the real agent,
in the kernel lab), and from kube-proxy v1.20.2 (its node settings, beside `--init-only`'s):
one boot runs every scenario of scenarios/scenario_mode_switch.py; each scenario is
reported here on its own."""

from __future__ import annotations

import pytest

from labs.realcp.build import BuildError, build
from tests.kernel.scenario_host import scenario_module


def kube_proxy() -> dict[str, str]:
    """The guest sees the host's root read-only: the binary the real-control-plane tier
    builds (cached) is there for it to run."""
    try:
        return {"KUBE_PROXY": str(build().path("kube-proxy"))}
    except BuildError as exc:
        pytest.fail(f"building Kubernetes v1.20.2 from Debian's source failed: {exc}",
                    pytrace=False)


run, test_scenario = scenario_module("scenario_mode_switch.py", env=kube_proxy,
                                     cost=240.0)
