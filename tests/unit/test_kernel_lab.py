"""The kernel lab's pure parts: which kernel package apt names, which modules are kept and
in which order the initramfs loads them, and the initramfs archive itself (read back by
busybox's own cpio, the tool that runs in the guest); how the kernel tier shares its
scenario modules out between the kernels it boots at once."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from labs.kernel.debian_kernel import depends_on, entry_name, keep_set
from labs.kernel.qemu import _is_static, newc_archive, ordered_modules
from tests.kernel.scenario_host import LANES, REGISTERED, Needs, lanes

SHOW = """Package: linux-image-amd64
Source: linux-signed-amd64 (6.1.192+2)
Version: 6.1.192-2
Architecture: amd64
Depends: linux-image-6.1.0-56-amd64 (= 6.1.192-2)
Description: Linux for 64-bit PCs (meta-package)
"""

DEP = """kernel/drivers/virtio/virtio_pci.ko: kernel/drivers/virtio/virtio_pci_legacy_dev.ko \
kernel/drivers/virtio/virtio_pci_modern_dev.ko kernel/drivers/virtio/virtio.ko \
kernel/drivers/virtio/virtio_ring.ko
kernel/drivers/virtio/virtio_pci_legacy_dev.ko:
kernel/drivers/virtio/virtio_pci_modern_dev.ko:
kernel/drivers/virtio/virtio.ko:
kernel/drivers/virtio/virtio_ring.ko:
kernel/net/9p/9pnet_virtio.ko: kernel/net/9p/9pnet.ko kernel/drivers/virtio/virtio.ko \
kernel/drivers/virtio/virtio_ring.ko
kernel/net/9p/9pnet.ko:
kernel/fs/9p/9p.ko: kernel/net/9p/9pnet.ko kernel/fs/fscache/fscache.ko kernel/fs/netfs/netfs.ko
kernel/fs/fscache/fscache.ko: kernel/fs/netfs/netfs.ko
kernel/fs/netfs/netfs.ko:
kernel/sound/core/snd.ko: kernel/drivers/base/soundcore.ko
kernel/drivers/base/soundcore.ko:
kernel/net/netfilter/nf_conntrack.ko: kernel/lib/libcrc32c.ko
kernel/lib/libcrc32c.ko:
kernel/drivers/net/dummy.ko:
kernel/drivers/net/ethernet/intel/e1000/e1000.ko:
"""


def deps() -> dict[str, list[str]]:
    return {line.split(":")[0]: line.split(":")[1].split() for line in DEP.splitlines()}


def test_the_kernel_package_is_what_the_meta_package_depends_on() -> None:
    assert depends_on(SHOW) == ("linux-image-6.1.0-56-amd64", "6.1.192-2")
    assert depends_on(SHOW.replace("Depends:", "Recommends:")) is None
    # A cache entry's name says package, version and recipe, and nothing unsafe.
    assert entry_name("linux-image-6.1.0-56-amd64", "6.1.192-2").startswith(
        "linux-image-6.1.0-56-amd64_6.1.192-2-r")
    assert "/" not in entry_name("linux-image-x-amd64", "1:2/3")


def test_kept_modules_are_networking_boot_and_what_they_need() -> None:
    kept = keep_set(deps())
    assert "kernel/net/netfilter/nf_conntrack.ko" in kept
    assert "kernel/lib/libcrc32c.ko" in kept  # a dependency, and a library
    assert "kernel/drivers/net/dummy.ko" in kept  # named: the IPVS plane's interface
    assert "kernel/fs/9p/9p.ko" in kept and "kernel/fs/netfs/netfs.ko" in kept
    assert "kernel/sound/core/snd.ko" not in kept
    assert "kernel/drivers/base/soundcore.ko" not in kept
    assert "kernel/drivers/net/ethernet/intel/e1000/e1000.ko" not in kept


def test_initramfs_modules_load_after_what_they_need() -> None:
    order = ordered_modules(DEP, ("virtio_pci", "9pnet_virtio", "9p"))
    assert sorted(p.rsplit("/", 1)[1] for p in order) == sorted([
        "virtio_pci.ko", "virtio_pci_legacy_dev.ko", "virtio_pci_modern_dev.ko", "virtio.ko",
        "virtio_ring.ko", "9pnet_virtio.ko", "9pnet.ko", "9p.ko", "fscache.ko", "netfs.ko"])
    needs = deps()
    for i, path in enumerate(order):
        assert set(needs[path]) <= set(order[:i]), path
    with pytest.raises(AssertionError, match="no module nope"):
        ordered_modules(DEP, ("nope",))


@pytest.mark.skipif(shutil.which("busybox") is None, reason="busybox-static not installed "
                    "(./run setup installs it)")
def test_initramfs_archive_reads_back_with_busybox(tmp_path: Path) -> None:
    archive = newc_archive([
        ("bin", 0o40755, b"", (0, 0)),
        ("dev/console", 0o20600, b"", (5, 1)),
        ("init", 0o100755, b"#!/bin/sh\necho hi\n", (0, 0)),
        ("odd", 0o100644, b"x" * 5, (0, 0)),  # a size that needs padding
    ])
    listed = subprocess.run(["busybox", "cpio", "-tv"], input=archive, capture_output=True,
                            check=True).stdout.decode()
    lines = [line.split() for line in listed.splitlines()]
    assert [(cols[0], cols[-1]) for cols in lines] == [
        ("drwxr-xr-x", "bin"), ("crw-------", "dev/console"),
        ("-rwxr-xr-x", "init"), ("-rw-r--r--", "odd")]
    out = tmp_path / "x"
    out.mkdir()
    subprocess.run(["busybox", "cpio", "-i", "-d", "init", "odd"], input=archive, cwd=out,
                   capture_output=True, check=True)
    assert (out / "init").read_bytes() == b"#!/bin/sh\necho hi\n"
    assert (out / "odd").read_bytes() == b"xxxxx"


@pytest.mark.parametrize("binary", ["/bin/ls", "/bin/busybox"])
def test_static_binaries_are_told_apart(binary: str) -> None:
    if not Path(binary).exists():
        pytest.skip(f"{binary} not installed")
    # ldd, the dynamic loader's own answer, is the judge.
    ldd = subprocess.run(["ldd", binary], capture_output=True, text=True, check=False)
    static = "not a dynamic executable" in ldd.stdout + ldd.stderr
    assert _is_static(Path(binary)) is static
    if binary == "/bin/ls":
        assert not static


def test_a_failed_scenario_shows_the_agent_lines_since_it_began(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """scenarios/run.py: the lines stamped since the scenario began (a traceback after
    one included), from every agent log that has any; an agent silent since, left out."""
    from proxy.agent.logs import log_stamp
    from tests.kernel.scenarios.run import agent_logs

    began = 1_800_000_000.25
    logs = tmp_path / "agents" / "faults"
    logs.mkdir(parents=True)
    (logs / "agent-1.log").write_text(
        f"time={log_stamp(began - 5)} msg=before\ntime={log_stamp(began)} msg=during\n"
        "Traceback (most recent call last):\n")
    (logs / "agent-2.log").write_text(f"time={log_stamp(began - 1)} msg=stopped\n")
    monkeypatch.setenv("KERNEL_RESULT", str(tmp_path / "result.json"))
    shown = agent_logs(began)
    assert log_stamp(began) == "2027-01-15T08:00:00.250Z"
    assert "msg=during\nTraceback" in shown and "msg=before" not in shown
    assert "agents/faults/agent-1.log" in shown and "agent-2.log" not in shown
    assert agent_logs(began + 60) == "(no agent logged anything since)"


def _registered(monkeypatch: pytest.MonkeyPatch, **costs: float) -> None:
    for name, cost in costs.items():
        deny = ("nft_chain_nat",) if name.startswith("bare") else ()
        monkeypatch.setitem(REGISTERED, name, Needs(cost=cost, deny_modules=deny))


def test_scenario_modules_are_shared_out_between_lanes_of_about_equal_cost(
        monkeypatch: pytest.MonkeyPatch) -> None:
    _registered(monkeypatch, faults=370, agent=260, switch=240, fail=120, traffic=90,
                table=90, sctp=40, maglev=35, bare=45)
    groups = lanes(["maglev", "bare", "agent", "faults", "switch", "fail", "traffic",
                    "table", "sctp"])
    alike, other = groups[:-1], groups[-1]
    assert other == ["bare"]  # a kernel of its own kind never shares a boot
    assert len(alike) == LANES
    assert sorted(m for g in alike for m in g) == sorted(
        ["agent", "faults", "switch", "fail", "traffic", "table", "sctp", "maglev"])
    totals = [sum(REGISTERED[m].cost for m in g) for g in alike]
    assert max(totals) - min(totals) <= 35  # no lane waits long on the other


def test_one_selected_module_boots_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    _registered(monkeypatch, agent=260, maglev=35)
    assert lanes(["maglev"]) == [["maglev"]]
    assert lanes([]) == []
