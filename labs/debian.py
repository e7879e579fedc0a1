"""What the tiers that fetch Debian packages share: the cache outside the clone (CI uses a
fresh clone on the same machine, so anything slow to get is kept here), a lock that
serialises two runs filling it, and asking dpkg what is installed."""

from __future__ import annotations

import fcntl
import logging
import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger("labs.debian")

CACHE_ROOT = Path(os.environ.get("SLICEPROXY_CACHE", "/var/cache/sliceproxy"))


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (created if missing) for the block."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        log.info("waiting for lock", extra={"lock": str(path)})
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def dpkg_installed(package: str) -> bool:
    proc = subprocess.run(["dpkg-query", "-W", "-f=${Status}", package], capture_output=True,
                          text=True, check=False)
    return "install ok installed" in proc.stdout
