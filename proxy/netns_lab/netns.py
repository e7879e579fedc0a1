"""Entering a named network namespace from Python, one thread at a time.

`setns(2)` moves only the calling thread; a socket keeps the namespace it was created
in, so a socket made inside `entered(name)` can be used from anywhere afterwards.
Python 3.11 has no `os.setns`, hence ctypes.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import subprocess
from collections.abc import Iterator

CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def path(name: str) -> str:
    """A name under /run/netns, or a path as is (a process's /proc/PID/ns/net)."""
    return name if name.startswith("/") else f"{NETNS_DIR}/{name}"


@contextlib.contextmanager
def entered(name: str) -> Iterator[None]:
    """Run the block with this thread in network namespace `name` (see `path`), then
    come back."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(path(name), os.O_RDONLY)
        try:
            _setns(target)
        finally:
            os.close(target)
        try:
            yield
        finally:
            _setns(home)
    finally:
        os.close(home)


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[str]:
    """A network namespace of our own, `<prefix>-<pid>`, deleted on the way out (its
    conntrack table and rules with it), for tests and benchmarks that need only one."""
    name = f"{prefix}-{os.getpid()}"
    subprocess.run(["ip", "netns", "add", name], check=True, timeout=30)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "delete", name], check=False, timeout=30)
