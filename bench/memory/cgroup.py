"""A memory cgroup for the agent and every process it starts, as a container has.

A container's memory limit is a memory cgroup's: the kernel charges the group for the
anonymous memory of every process in it (the agent and its iptables-restore, ipset...),
the page cache they read or write, and kernel memory allocated on their behalf. That
last part matters here: nf_tables objects (tables, chains, rules, set elements),
x_tables blobs and IPVS services are allocated with `GFP_KERNEL_ACCOUNT`, so the rules a
proxy programs are charged to its container and stay charged after the process that
made them exits (to the pod's cgroup, once a restarted container's own is removed).
When a charge would pass the limit the kernel first reclaims page cache; only when
what is left (anon + kernel memory) cannot fit does the cgroup's OOM killer end a
process. So the figure to hold under a limit is the group's, not one process's RSS.

cgroup v1's memory controller (this machine's kind mounts it at /sys/fs/cgroup/memory;
the kernel lab's guest mounts one the same way): the peaks (`max_usage_in_bytes`,
`kmem.max_usage_in_bytes`) can be reset between situations, which v2's `memory.peak`
can only be on kernels from 6.12.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from proxy.netns_lab.poll import TimedOut, wait

V1 = Path("/sys/fs/cgroup/memory")
MIB = 1024 * 1024


@dataclass(frozen=True)
class Charged:
    """What the group is charged now, in MiB."""

    usage: float  # everything: anon + page cache + kernel
    anon: float  # the processes' anonymous memory (v1 `rss`)
    cache: float  # page cache: reclaimed before any OOM kill
    kernel: float  # kernel memory: slabs, page tables, the rules' objects

    @property
    def unreclaimable(self) -> float:
        """What a limit must hold: anon + kernel memory (no swap on a node)."""
        return self.anon + self.kernel


def available(root: Path = V1) -> bool:
    return (root / "memory.kmem.max_usage_in_bytes").exists()


def mount_in_guest(root: Path = V1) -> None:
    """Inside the kernel lab's guest (never on the host): a v1 memory hierarchy."""
    if available(root):
        return
    parent = root.parent
    if not os.path.ismount(parent):
        subprocess.run(["mount", "-t", "tmpfs", "cgroup", str(parent)], check=True)
    root.mkdir(exist_ok=True)
    subprocess.run(["mount", "-t", "cgroup", "-o", "memory", "memory", str(root)], check=True)


class MemoryCgroup:
    def __init__(self, path: Path) -> None:
        self.path = path

    @classmethod
    @contextmanager
    def made(cls, label: str, limit_mib: int | None = None,
             root: Path = V1) -> Iterator[MemoryCgroup | None]:
        """A group of our own (None where there is no v1 memory controller), removed on
        the way out with any process of ours still in it."""
        if not available(root):
            yield None
            return
        group = cls(root / f"spx-{os.getpid()}-{uuid.uuid4().hex[:6]}-{label}")
        group.path.mkdir()
        try:
            if limit_mib is not None:
                group._write("memory.limit_in_bytes", str(limit_mib * MIB))
            yield group
        finally:
            group.remove()

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` started inside the group (its children are born there too)."""
        return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', str(self.path),
                *argv]

    def _read(self, name: str) -> int:
        return int((self.path / name).read_text().split()[0])

    def _write(self, name: str, value: str) -> None:
        (self.path / name).write_text(value)

    def reset_peaks(self) -> None:
        self._write("memory.max_usage_in_bytes", "0")
        self._write("memory.kmem.max_usage_in_bytes", "0")

    def peaks(self) -> tuple[float, float]:
        """Since the last reset: the group's peak charge and its kernel memory's, MiB."""
        return (self._read("memory.max_usage_in_bytes") / MIB,
                self._read("memory.kmem.max_usage_in_bytes") / MIB)

    def charged(self) -> Charged:
        stat = dict(line.split() for line in (self.path / "memory.stat").read_text()
                    .splitlines())
        return Charged(usage=self._read("memory.usage_in_bytes") / MIB,
                       anon=int(stat["rss"]) / MIB, cache=int(stat["cache"]) / MIB,
                       kernel=self._read("memory.kmem.usage_in_bytes") / MIB)

    def oom_kills(self) -> int:
        for line in (self.path / "memory.oom_control").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return 0

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in (self.path / "cgroup.procs").read_text().split()]
        except OSError:
            return []

    def remove(self) -> None:
        def emptied() -> bool:
            pids = self.pids()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            return not pids

        with contextlib.suppress(TimedOut):
            wait(emptied, 30.0, f"{self.path} to empty", interval=0.05)
        # Charges still held (the rules' kernel memory) move to the parent; the group
        # itself can go.
        with contextlib.suppress(OSError):
            self.path.rmdir()
