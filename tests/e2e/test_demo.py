"""`./run demo` (the README's first command): the real agent in a lab, real traffic,
a change followed, everything torn down. Runs the demo exactly as a user does."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.root


def test_demo_shows_traffic_following_the_agents_decisions() -> None:
    began = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "proxy.cmd.demo"], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, "NO_COLOR": "1"})
    out, err = proc.communicate(timeout=120)
    took = time.monotonic() - began
    assert proc.returncode == 0, f"{out}\n{err}"
    assert "UNEXPECTED" not in out
    # Who answered, service by service (each line ends in "ok" when it matched the dump).
    assert re.search(r"demo/draining .*draining-1 .*draining-2 .* ok$", out, re.M)
    assert re.search(r"demo/nearby:http .*nearby-1 █+ 20  ok$", out, re.M)
    assert re.search(r"demo/node-local:http .*node-local-1 █+ 20  ok$", out, re.M)
    assert re.search(r"demo/web:dns .*/UDP .*web-1 .*web-2 .* ok$", out, re.M)
    # Why: reasons from /debug/dump, the conflict, the rules.
    assert "used because no endpoint is ready" in out
    assert "is listed by nearby-1, nearby-2 with different ready, serving" in out
    # The change followed, by a partial sync, in traffic.
    assert re.search(r"sync: trigger change, partial, changed demo/web:dns \(IPv4\), "
                     r"demo/web:http \(IPv4\)", out)
    assert re.search(r"demo/web:http .*web-1 █+ \d+  web-3 █+ \d+  ok$", out, re.M)
    # Stop leaves the rules, cleanup removes them, the lab is gone.
    assert re.search(r"agent stopped in [\d.]+s; [1-9]\d* rules still serving", out)
    assert "--cleanup: 0 rules left" in out
    pid_prefix = f"spx-{proc.pid}-"
    assert not [n for n in os.listdir("/run/netns") if n.startswith(pid_prefix)]
    print(f"\ndemo took {took:.1f}s")
