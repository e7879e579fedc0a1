"""Real IPVS traffic in the kernel lab (see scripts/ipvs_smoke.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.kernel.conftest import KernelRunner

SCRIPTS = Path(__file__).parent / "scripts"
BACKENDS = {"backend-a", "backend-b"}

pytestmark = pytest.mark.kernel


def test_ipvs_round_robin_and_real_server_removal(kernel: KernelRunner) -> None:
    run = kernel(SCRIPTS / "ipvs_smoke.py").check()
    result = run.result
    print(
        f"boot {run.boot_seconds:.2f} s (kernel start to script start), "
        f"startup {run.startup_seconds:.2f} s (host), script {run.script_seconds:.2f} s, "
        f"wall {run.wall_seconds:.2f} s; missing modules: {list(run.modules_missing)}"
    )
    print(result)
    both = result["both"]["answers"]
    assert set(both) == BACKENDS, f"expected only both backends to answer, got {both}"
    # rr over two real servers and fresh connections: an even split.
    assert both == {"backend-a": 10, "backend-b": 10}, both
    after = result["after_delete"]["answers"]
    assert after == {"backend-b": 20}, f"after deleting backend-a: {after}"
    assert [d["addr"] for d in result["after_delete"]["dests"]] == ["198.18.3.2"]
    assert all(d["fwd_method"] == 0 for d in result["both"]["dests"])
