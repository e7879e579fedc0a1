"""The kernel lab itself: which kernel boots and how (QEMU, Debian's kernel, the
accelerator), results, failures that name their cause, timeouts, concurrency, clean-up."""

from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from labs.kernel.debian_kernel import DebianKernel, KernelError
from labs.kernel.harness import DEFAULT_MODULES, KernelResult, run_in_kernel
from labs.kernel.qemu import QemuGuest, lab_guest
from tests.kernel.conftest import KernelRunner

PROBE = Path(__file__).parent / "scripts" / "probe.py"

pytestmark = pytest.mark.kernel


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (our kernel's files)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue  # exited while we looked
    return found


def unbootable(tmp_path: Path) -> DebianKernel:
    """The lab's kernel with its image replaced by bytes QEMU cannot boot."""
    real = lab_guest().kernel
    root = tmp_path / "broken-kernel"
    (root / "boot").mkdir(parents=True)
    (root / "lib" / "modules").mkdir(parents=True)
    (root / "lib" / "modules" / real.release).symlink_to(real.modules)
    broken = DebianKernel(root, real.package, real.version, real.release)
    broken.vmlinuz.write_bytes(b"not a kernel" * 1000)
    return broken


def test_two_kernels_at_once_one_ok_one_failing(kernel: KernelRunner, tmp_path: Path) -> None:
    # Two kernels side by side must not clash (result folders, shares, consoles).
    with ThreadPoolExecutor(max_workers=2) as pool:
        ok_future = pool.submit(kernel, PROBE, ["hello", "two words"])
        bad_future = pool.submit(kernel, PROBE, ["fail"])
        ok: KernelResult = ok_future.result()
        bad: KernelResult = bad_future.result()

    ok.check()
    print(ok.timings())
    assert ok.result["argv"] == ["hello", "two words"]
    # Debian's own kernel under QEMU, whatever this machine's CPU: never user-mode Linux.
    guest = lab_guest()
    assert ok.result["kernel"] == guest.kernel.release, ok.result
    assert ok.backend == guest.describe() and ok.backend.startswith("qemu (")
    # No network device: nothing in the guest can reach the host's network.
    assert ok.result["links"] == ["lo"]
    assert ok.result["lo_up"] is True
    assert ok.result["ipvs_services"] == 0
    assert (ok.result["ip_forward"], ok.result["vs_conntrack"]) == ("1", "1")
    assert ok.result["scratch_ok"] is True
    assert "probe done" in ok.stdout
    assert 0 < ok.boot_seconds < ok.wall_seconds
    # Every module the data planes use is in this kernel and loaded.
    assert not ok.modules_failed, ok.modprobe_errors
    assert not ok.modules_missing
    assert set(ok.modules_loaded) == set(DEFAULT_MODULES)

    assert bad.exit_code == 3
    assert "failing on purpose" in bad.stderr
    assert bad.result is None
    with pytest.raises(KernelError, match="failing on purpose"):
        bad.check()
    assert not processes_mentioning(str(tmp_path))


def test_script_timeout_inside_the_kernel(kernel: KernelRunner) -> None:
    # Long enough for Python to start and print in an emulated guest on a busy host (2 s
    # was not, once, with the rest of the suite beside it); the hang itself is endless.
    run = kernel(PROBE, ["hang"], timeout=90, script_timeout=8)
    assert run.exit_code == 124
    assert "hanging on purpose" in run.stdout
    with pytest.raises(KernelError, match="timed out inside the kernel"):
        run.check()


def test_host_timeout_kills_the_kernel(kernel: KernelRunner, tmp_path: Path) -> None:
    # Far too short to boot: the host must kill QEMU and say so, with the console's tail.
    with pytest.raises(KernelError, match=r"the kernel did not boot within 1 s"):
        kernel(PROBE, timeout=1)
    assert not processes_mentioning(str(tmp_path))


def test_a_kernel_that_cannot_boot_fails_naming_the_cause(tmp_path: Path) -> None:
    guest = QemuGuest(unbootable(tmp_path), accel="tcg")
    with pytest.raises(KernelError) as failed:
        run_in_kernel(PROBE, workdir=tmp_path / "run", guest=guest, timeout=60)
    message = str(failed.value)
    # Said at once, not after the timeout, and in QEMU's own words.
    assert "the kernel did not boot after" in message and "within" not in message, message
    assert "QEMU exit 1: qemu: " in message and "kernel" in message.split("QEMU exit")[1], \
        message
    assert not processes_mentioning(str(tmp_path))


def test_accelerator_choice(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    kernel = lab_guest().kernel
    # No KVM device: emulation, and why.
    guest = QemuGuest(kernel, accel="auto", kvm_device=tmp_path / "no-kvm")
    assert (guest.accel, guest.accel_reason) == ("tcg", f"no usable {tmp_path / 'no-kvm'}")
    assert guest.describe().startswith(f"qemu (tcg, no usable {tmp_path / 'no-kvm'}) with Debian")
    # A KVM guest that cannot boot (here: a broken image) is not used: the probe falls
    # back to emulation, on machines with a working /dev/kvm and without one alike.
    broken = QemuGuest(unbootable(tmp_path), accel="auto")
    assert broken.accel == "tcg"
    assert broken.accel_reason.startswith(("a KVM guest failed", "no usable /dev/kvm")), \
        broken.accel_reason
    # Asked for by name: no probe.
    monkeypatch.setenv("SLICEPROXY_QEMU_ACCEL", "tcg")
    assert QemuGuest(kernel).describe() == f"qemu (tcg) with {kernel.describe()}"
    monkeypatch.setenv("SLICEPROXY_QEMU_ACCEL", "hvf")
    with pytest.raises(KernelError, match="SLICEPROXY_QEMU_ACCEL='hvf': use one of auto, "):
        QemuGuest(kernel)


def test_missing_qemu_is_an_error_naming_the_package(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    assert shutil.which("qemu-system-x86_64")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(KernelError, match="install the Debian package qemu-system-x86"):
        QemuGuest(lab_guest().kernel, accel="tcg")
