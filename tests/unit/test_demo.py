"""`./run demo` (today: the model's decisions for examples/) keeps working."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_demo_prints_the_examples_decisions() -> None:
    proc = subprocess.run([sys.executable, "-m", "proxy.demo"], capture_output=True, text=True,
                          cwd=ROOT, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "cluster set: 198.18.1.21:8080, 198.18.1.22:8080" in proc.stdout  # terminating fallback
    assert "local set:   198.18.1.31:8080" in proc.stdout
    assert "kept the copy from nearby-1" in proc.stdout
