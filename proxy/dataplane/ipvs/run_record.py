"""The book-keeping of one IPVS sync (or clean-up): the operations that failed, and the
ipset and iptables lines written. A failure is logged where it happens and the sync
goes on; the plane raises one ApplyError at the end (apply.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger(__name__)


@dataclass(slots=True)
class RunRecord:
    failures: list[tuple[str, str]] = field(default_factory=list)  # (operation, error)
    ipset_lines: int = 0
    iptables_lines: int = 0

    def fail(self, what: str, exc: BaseException, **extra: Any) -> None:
        self.failures.append((what, str(exc)))
        log.error("IPVS data plane operation failed",
                  extra={"operation": what, "error": str(exc), **extra})
