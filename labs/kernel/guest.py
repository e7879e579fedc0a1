"""Helpers for scripts that run inside the kernel lab's guest (see harness.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def write_result(result: Any) -> None:
    """Hand ``result`` (JSON-serialisable) back to the host as ``KernelResult.result``."""
    path = Path(os.environ["KERNEL_RESULT"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=2, sort_keys=True))
    tmp.replace(path)  # the host never sees a half-written file
