"""Traffic through the service while it rolls."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from bench.huge_service import (
    SERVICE_IP,
)
from bench.rolling_update.workload import SERVICE_PORT
from proxy.netns_lab.probe import ask_once

# --- traffic -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    due: float
    started: float
    ended: float
    answer: str  # the pod's address, or a failure kind of proxy.netns_lab.probe


class Traffic:
    """Fresh TCP connections to the ClusterIP from the client namespace at `rate` a
    second, at most `count` of them and until `stop()`."""

    WORKERS = 64

    def __init__(self, ns: str, rate: float, timeout: float, count: int) -> None:
        self.ns, self.rate, self.timeout, self.count = ns, rate, timeout, count
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(self.WORKERS, thread_name_prefix="traffic")
        self._thread = threading.Thread(target=self._run, name="traffic", daemon=True)

    def _one(self, due: float) -> None:
        started = time.monotonic()
        answer = ask_once(self.ns, SERVICE_IP, SERVICE_PORT, "tcp", self.timeout)
        with self._lock:
            self.outcomes.append(Outcome(due, started, time.monotonic(), answer))

    def _run(self) -> None:
        t0 = time.monotonic()
        for k in range(self.count):
            due = t0 + k / self.rate
            # Pacing the connections (the rate), not synchronisation.
            if self._stop.wait(max(0.0, due - time.monotonic())):
                return
            self._pool.submit(self._one, due)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._pool.shutdown(wait=True)
