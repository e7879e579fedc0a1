"""The user-mode Linux harness itself: results, failures, timeouts, concurrency, cleanup."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.kernel.conftest import KernelRunner
from tests.kernel.uml import DEFAULT_MODULES, KernelError, KernelResult

PROBE = Path(__file__).parent / "scripts" / "probe.py"

pytestmark = pytest.mark.kernel


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line contains `text` (our UML's init path)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if text.encode() in cmdline.read_bytes():
                found.append(int(cmdline.parent.name))
        except OSError:
            continue  # exited while we looked
    return found


def test_two_kernels_at_once_one_ok_one_failing(kernel: KernelRunner, tmp_path: Path) -> None:
    # Two kernels side by side must not clash (umid, uml_dir, result folders).
    with ThreadPoolExecutor(max_workers=2) as pool:
        ok_future = pool.submit(kernel, PROBE, ["hello", "two words"])
        bad_future = pool.submit(kernel, PROBE, ["fail"])
        ok: KernelResult = ok_future.result()
        bad: KernelResult = bad_future.result()

    ok.check()
    print(
        f"boot {ok.boot_seconds:.2f} s (kernel start to script start), "
        f"startup {ok.startup_seconds:.2f} s (host), wall {ok.wall_seconds:.2f} s"
    )
    assert ok.result["argv"] == ["hello", "two words"]
    assert ok.result["kernel"].startswith("6.")
    assert ok.result["lo_up"] is True
    assert ok.result["ipvs_services"] == 0
    assert (ok.result["ip_forward"], ok.result["vs_conntrack"]) == ("1", "1")
    assert ok.result["scratch_ok"] is True
    assert "probe done" in ok.stdout
    assert 0 < ok.boot_seconds < ok.wall_seconds
    assert not ok.modules_failed, ok.modprobe_errors
    assert set(ok.modules_loaded) | set(ok.modules_missing) == set(DEFAULT_MODULES)
    assert "ip_vs" in ok.modules_loaded

    assert bad.exit_code == 3
    assert "failing on purpose" in bad.stderr
    assert bad.result is None
    with pytest.raises(KernelError, match="failing on purpose"):
        bad.check()
    assert not processes_mentioning(str(tmp_path))


def test_script_timeout_inside_the_kernel(kernel: KernelRunner) -> None:
    run = kernel(PROBE, ["hang"], timeout=60, script_timeout=2)
    assert run.exit_code == 124
    assert "hanging on purpose" in run.stdout
    with pytest.raises(KernelError, match="timed out inside the kernel"):
        run.check()


def test_host_timeout_kills_the_kernel(kernel: KernelRunner, tmp_path: Path) -> None:
    # Far too short to boot: the host must kill UML and say so, with the console's tail.
    with pytest.raises(KernelError, match=r"did not (boot|start the script) within 1 s"):
        kernel(PROBE, timeout=1)
    assert not processes_mentioning(str(tmp_path))
