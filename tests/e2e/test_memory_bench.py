"""The memory benchmark (bench/memory/) on a single-stack IPv6 cluster: a tiny run asserts
what the IPv4 one in test_bench_main.py does (every situation's figures, the rules'
kernel memory charged to the cgroup, one periodic full resync); the bursts' objects and
the refusals are checked without a run. Figures are reported, never asserted."""

from __future__ import annotations

import json
import os
import subprocess
from ipaddress import ip_address, ip_network
from pathlib import Path
from typing import Any

import pytest

from bench.memory import __main__ as memory_main
from bench.memory.cgroup import V1
from bench.memory.measure import V4_SERVICES, endpoint_slice, service

ULA = ip_network("fd00::/8")


def _ours() -> set[str]:
    """The network namespaces and memory cgroups a run of this process would leave."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                           check=True).stdout.split()
    groups = [p.name for p in V1.glob(f"spx-{os.getpid()}-*")] if V1.exists() else []
    return {n for n in names if n.startswith("spx-cold-")} | set(groups)


@pytest.mark.root
@pytest.mark.slow
def check_cold_start_and_resync(memory: dict[str, Any]) -> None:
    """One memory run's cold start and periodic resync, as they must read: no error,
    a peak at least the steady anonymous memory, nothing OOM-killed, the rules charged
    to the cgroup, and exactly one periodic resync: a partial sync, then every table a
    part (nftables/resync_steps.py)."""
    assert "error" not in memory
    cold = memory["situations"]["cold_start"]
    assert cold["agent_peak_mib"] >= cold["steady_agent_anon_mib"] > 0
    if memory["cgroup"] is not None:  # a v1 memory controller, as this machine's kind has
        assert memory["oom_kills"] == 0
        assert cold["cgroup_kernel_peak_mib"] > 0  # the rules' objects are charged to it
    resync = memory["situations"]["resync"]
    assert resync["syncs"]["by_trigger"] == {"periodic/partial": 1}
    parts = resync["in_parts"]
    settings = memory["settings"]  # every service's port, the burst's new ones too
    new = settings["burst_new"] if "burst_new" in settings["situations"] else 0
    assert parts["ports"] == memory["services"] + new
    assert 0 < parts["longest_part"] <= parts["work_seconds"] <= parts["seconds"]


def test_a_tiny_ipv6_run_measures_cold_start_and_the_periodic_resync(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = _ours()
    out = tmp_path / "memory.json"
    status = memory_main.main(["--ipv6", "--services", "20", "--endpoints", "3",
                               "--modes", "nftables", "--situations", "cold_start",
                               "resync", "--sync-period", "4", "--settle", "1",
                               "--json", str(out)])
    assert status == 0
    text = capsys.readouterr().out
    for situation in ("cold_start", "resync"):
        assert f"| 20 x 3 IPv6 | nftables | {situation} | **" in text
    assert "Family: IPv6, single stack" in text
    [memory] = json.loads(out.read_text())
    assert memory["family"] == "IPv6" and memory["settings"]["ipv6"] is True
    check_cold_start_and_resync(memory)
    assert _ours() == before  # its namespace and cgroup are gone


def test_the_bursts_write_ipv6_objects_past_the_cluster_s_own_addresses() -> None:
    past = 20 * 3  # bench/agent_start.py's cluster of 20 x 3 took fd00:19::1 to ::3c
    sl = endpoint_slice("burst-0", 3, 0, v6_past=past)
    addresses = [ip_address(a) for e in sl["endpoints"] for a in e["addresses"]]
    assert sl["addressType"] == "IPv6" and all(a in ULA for a in addresses)
    assert min(addresses) == ip_address("fd00:19::1") + past
    svc = service("burst-0", ipv6=True)
    assert svc["spec"]["ipFamilies"] == ["IPv6"]
    assert svc["spec"]["ipFamilyPolicy"] == "SingleStack"
    # Without the flag, the objects are IPv4 as before.
    assert endpoint_slice("burst-0", 3, 0)["addressType"] == "IPv4"
    assert "ipFamilies" not in service("burst-0")["spec"]


@pytest.mark.parametrize(("argv", "said"), [
    (["--services", str(V4_SERVICES), "--modes", "nftables"], "use --ipv6"),
    (["--services", str(V4_SERVICES + 1), "--situations", "cold_start"], "use --ipv6"),
    (["--ipv6", "--services", "10", "--modes", "ipvs"], "host's modes only"),
])
def test_what_cannot_run_is_refused_before_anything_starts(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        memory_main.main(argv)
    assert exit_.value.code == 2 and said in capsys.readouterr().err
