"""What the benchmarks share: the repository's root, a process's figures from /proc (CPU
seconds, sizes such as RSS, its descendants) and the cluster simulator run in a lab
network namespace."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from proxy.lab.poll import TimedOut, wait

ROOT = Path(__file__).resolve().parents[1]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# --- /proc --------------------------------------------------------------------------------


def cpu_times(pid: int) -> tuple[float, float]:
    """User + system CPU seconds of a process so far, and of the children it has reaped
    (the iptables binaries a proxy ran). OSError when the process is gone."""
    # After the command's closing parenthesis: utime, stime, cutime, cstime are 11..14.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / CLOCK_TICKS, (cutime + cstime) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of the process itself."""
    return cpu_times(pid)[0]


def status_mib(pid: int) -> dict[str, float]:
    """The size fields of /proc/PID/status (VmRSS, VmHWM: peak RSS, ...) in MiB. OSError
    when the process is gone."""
    out: dict[str, float] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) / 1024
    return out


def size_mib(pid: int, field: str) -> float | None:
    """One size field (VmRSS, VmHWM...) in MiB; None when the process or field is gone."""
    try:
        return status_mib(pid).get(field)
    except OSError:
        return None


def descendants(pid: int) -> list[int]:
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids = (task / "children").read_text().split()
        except OSError:
            continue
        for kid in map(int, kids):
            out += [kid, *descendants(kid)]
    return out


def agent_pid(root: int) -> int | None:
    """The python process running `-m proxy` under `ip netns exec` (and py-spy)."""
    for pid in [root, *descendants(root)]:
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"proxy" in cmd and b"-m" in cmd and not cmd[0].endswith(b"py-spy"):
            return pid
    return None


# --- processes in a namespace -------------------------------------------------------------


def in_namespace(ns: str, argv: Sequence[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def stop(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM, then SIGKILL after 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def simulator(ns: str, manifest: Path, work: Path, watch_cache: bool) -> Iterator[Path]:
    """`python -m proxy.sim` serving `manifest` in namespace `ns`: its kubeconfig."""
    kubeconfig = work / "kubeconfig"
    log = (work / "sim.log").open("wb")
    proc = subprocess.Popen(in_namespace(ns, [
        sys.executable, "-m", "proxy.sim", "--listen", "127.0.0.1:0", "--kubeconfig-out",
        str(kubeconfig), "--history", "1000", "-f", str(manifest),
        *(() if watch_cache else ("--no-watch-cache",))]),
        stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        with contextlib.suppress(TimedOut):  # judged below: the file is there or it is not
            wait(lambda: kubeconfig.exists() or proc.poll() is not None, 600,
                 "the simulator's kubeconfig", interval=0.1)
        if not kubeconfig.exists():
            raise RuntimeError(f"the simulator did not start: {work / 'sim.log'}")
        yield kubeconfig
    finally:
        stop(proc)
        log.close()
