"""The servers' CPU and RSS over a phase, from /proc."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Mapping

from bench.common import cpu_seconds, status_mib
from bench.reflector_fleet.workload import SAMPLE_EVERY

# --- /proc ------------------------------------------------------------------------------


class Sampler:
    """RSS of some processes every SAMPLE_EVERY seconds, in a thread: the peak of each."""

    def __init__(self, pids: Mapping[str, int]) -> None:
        self.pids = dict(pids)
        self.peak = dict.fromkeys(pids, 0.0)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while True:
            for name, pid in self.pids.items():
                with contextlib.suppress(OSError):
                    self.peak[name] = max(self.peak[name], status_mib(pid).get("VmRSS", 0.0))
            if self._stop.wait(SAMPLE_EVERY):
                return

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def snapshot(pids: Mapping[str, int]) -> dict[str, dict[str, float]]:
    out = {}
    for name, pid in pids.items():
        cpu, sizes = cpu_seconds(pid), status_mib(pid)
        out[name] = {"cpu_s": cpu, "rss_mib": sizes.get("VmRSS", 0.0),
                     "hwm_mib": sizes.get("VmHWM", 0.0)}
    return out
