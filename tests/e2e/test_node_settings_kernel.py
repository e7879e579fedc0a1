"""`python -m proxy --init-only` on the host's kernel, run in a network namespace of the
test's own, as on a node that is itself a network namespace (the real-node lab's): the
per-namespace TCP timeouts are set there, the global table size and hash size are
refused by the kernel and reported with what kube-proxy would set, the command still
exits 0, and nothing changes in the host's own namespace; `--restore-node-settings`
then gives the namespace its own values back. Each command runs with a /run of its own
(the record of originals goes to the test's folder, never the host's /run). The values
and the rules on a
fake node: tests/unit/test_node_settings.py; in a kernel's initial namespace, beside
kube-proxy v1.20.2: tests/kernel/scenarios/scenario_mode_switch.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from proxy.netns_lab import netns

pytestmark = pytest.mark.root

ROOT = Path(__file__).resolve().parents[2]
NF = Path("/proc/sys/net/netfilter")
HASHSIZE = Path("/sys/module/nf_conntrack/parameters/hashsize")
TIMEOUTS = ("nf_conntrack_tcp_timeout_established", "nf_conntrack_tcp_timeout_close_wait")


def host_values() -> dict[str, str]:
    """The host namespace's values of everything the command may touch."""
    paths = [NF / "nf_conntrack_max", HASHSIZE, *(NF / t for t in TIMEOUTS)]
    return {str(p): p.read_text().strip() for p in paths}


@pytest.fixture
def ns() -> Iterator[str]:
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root (CI runs as root)")
    with netns.scratch("sp-nodeset") as name:
        yield name


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """What the commands see as the node's /run/sliceproxy."""
    (tmp_path / "run-sliceproxy").mkdir()
    return tmp_path / "run-sliceproxy"


def in_ns(ns: str, *argv: str, run: Path | None = None) -> subprocess.CompletedProcess[str]:
    """`argv` in the namespace; with `run`, in a mount namespace whose /run is empty but
    for `run` as /run/sliceproxy."""
    if run is not None:
        script = ("mount -t tmpfs sp-run /run && mkdir /run/sliceproxy && "
                  f"mount --bind {run} /run/sliceproxy && exec \"$@\"")
        argv = ("unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                "sh", *argv)
    return subprocess.run(["ip", "netns", "exec", ns, *argv], capture_output=True,
                          text=True, timeout=60, check=False, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def proxy_in_ns(ns: str, run: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return in_ns(ns, sys.executable, "-m", "proxy", "--logging-format=json", *flags,
                 run=run)


def timeouts(ns: str) -> list[int]:
    return [int(in_ns(ns, "cat", str(NF / t)).stdout) for t in TIMEOUTS]


def test_init_only_in_a_namespace_sets_its_timeouts_and_reports_the_refused_table(
        ns: str, run_dir: Path) -> None:
    before = host_values()
    table = int(before[str(NF / "nf_conntrack_max")])
    # A minimum above the host's table, a quarter of it above the host's hash size:
    # kube-proxy would raise both.
    wanted = 8 * max(table, int(before[str(HASHSIZE)]))
    assert in_ns(ns, "cat", str(NF / TIMEOUTS[0])).stdout.strip() != "86400"
    run = proxy_in_ns(ns, run_dir, "--init-only", f"--conntrack-min={wanted}")
    assert run.returncode == 0, run.stderr
    lines = [json.loads(line) for line in run.stderr.splitlines() if line.startswith("{")]
    refused = {line["setting"]: line for line in lines
               if line["msg"] == "node setting not changed: the kernel refused the write"}
    assert set(refused) == {"net.netfilter.nf_conntrack_max", str(HASHSIZE)}
    table_line = refused["net.netfilter.nf_conntrack_max"]
    assert (table_line["current"], table_line["wanted"]) == (table, f">= {wanted}")
    assert "initial network namespace" in table_line["error"]
    changed = {line["setting"]: line["new"] for line in lines
               if line["msg"] == "node setting changed"}
    assert changed == {"net.netfilter.nf_conntrack_tcp_timeout_established": 86400,
                       "net.netfilter.nf_conntrack_tcp_timeout_close_wait": 3600}
    # Read back from the namespace itself, then from the host's: only the former moved.
    assert [in_ns(ns, "cat", str(NF / t)).stdout.strip() for t in TIMEOUTS] == \
        ["86400", "3600"]
    assert host_values() == before
    # Run again: nothing left to write; the refusals are reported again.
    again = proxy_in_ns(ns, run_dir, "--init-only", f"--conntrack-min={wanted}")
    done = [json.loads(line) for line in again.stderr.splitlines()
            if line.startswith("{") and '"node settings done"' in line]
    assert [(d["changed"], d["kept"], d["refused"]) for d in done] == [(0, 2, 2)]
    assert host_values() == before


def test_restore_gives_the_namespace_its_own_timeouts_back(ns: str, run_dir: Path) -> None:
    """A node whose own configuration set the established timeout (7200): the init step
    records it and the kernel's close-wait default, not the table size it was refused;
    a second run keeps those originals; the restore writes them back and removes the
    record."""
    assert in_ns(ns, "sysctl", "-qw", f"net.netfilter.{TIMEOUTS[0]}=7200").returncode == 0
    before = host_values()
    own = timeouts(ns)
    assert own[0] == 7200
    for _ in range(2):
        assert proxy_in_ns(ns, run_dir, "--init-only").returncode == 0
        assert timeouts(ns) == [86400, 3600]
        record = json.loads((run_dir / "node-settings.json").read_text())
        assert {k: (v["original"], v["ours"]) for k, v in record["settings"].items()} == {
            f"proc/sys/net/netfilter/{TIMEOUTS[0]}": (7200, 86400),
            f"proc/sys/net/netfilter/{TIMEOUTS[1]}": (own[1], 3600)}
    back = proxy_in_ns(ns, run_dir, "--restore-node-settings")
    assert back.returncode == 0, back.stderr
    assert timeouts(ns) == own
    assert list(run_dir.iterdir()) == []
    given = [json.loads(line) for line in back.stderr.splitlines()
             if '"node setting given back"' in line]
    assert sorted((g["setting"], g["old"], g["new"]) for g in given) == sorted([
        (f"net.netfilter.{TIMEOUTS[0]}", 86400, 7200),
        (f"net.netfilter.{TIMEOUTS[1]}", 3600, own[1])])
    assert host_values() == before
