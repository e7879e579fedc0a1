"""Clients in real pods, kept busy while the cluster changes under them: on each client
pod, back-to-back fresh TCP connections to a ClusterIP, one long-lived TCP connection and
one UDP flow (one socket, so one source port), each asked once per round. What failed is
recorded with when and where, so a test can say how many and the longest window.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from proxy.netns_lab import probe
from proxy.netns_lab.poll import wait

ROUND_PAUSE = 0.02  # pacing of the load between rounds (not synchronisation)


@dataclass
class Tally:
    attempts: int = 0
    failures: list[tuple[float, str, str]] = field(default_factory=list)  # when, node, what
    broken_long: list[str] = field(default_factory=list)  # long-lived TCP broken
    udp_moved: list[str] = field(default_factory=list)  # a UDP flow answered by another pod
    udp_unanswered: int = 0
    udp_rounds: int = 0

    def longest_failure_window(self) -> float:
        """The longest run of consecutive failed fresh connections, in seconds (per node),
        counted from the first failure to the last of the run."""
        longest = 0.0
        by_node: dict[str, list[float]] = {}
        for when, node, _ in self.failures:
            by_node.setdefault(node, []).append(when)
        for times in by_node.values():
            start = prev = times[0]
            for t in times[1:]:
                if t - prev > 1.0:
                    start = t
                prev = t
                longest = max(longest, prev - start)
        return longest

    def summary(self) -> str:
        return (f"{self.attempts} connections, {len(self.failures)} failed (longest window "
                f"{self.longest_failure_window():.1f}s), {len(self.broken_long)} long-lived "
                f"broken, {len(self.udp_moved)} UDP flows moved, {self.udp_unanswered} of "
                f"{self.udp_rounds} UDP datagrams unanswered")


class Clients:
    """One thread per client pod (node -> netns path), each doing rounds until stopped."""

    def __init__(self, clients: dict[str, str], ip: str, names: set[str],
                 tcp_port: int = 80, udp_port: int = 81) -> None:
        self.clients, self.ip, self.names = clients, ip, names
        self.tcp_port, self.udp_port = tcp_port, udp_port
        self.tally = Tally()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._rounds = dict.fromkeys(clients, 0)  # node -> rounds done
        self._threads = [threading.Thread(target=self._run, args=(n, ns), daemon=True)
                         for n, ns in clients.items()]

    def _run(self, node: str, netns: str) -> None:
        t = self.tally
        flow = probe.Flow(netns, self.ip, self.tcp_port)
        udp = probe.UdpFlow(netns, self.ip, self.udp_port, timeout=2.0)
        long_alive = True
        try:
            udp_pod = udp.ask()
            while not self._stop.is_set():
                answer = probe.ask_once(netns, self.ip, self.tcp_port, timeout=2.0)
                got = udp.ask()
                with self._lock:
                    t.attempts += 1
                    if answer not in self.names:
                        t.failures.append((time.monotonic(), node, answer))
                    t.udp_rounds += 1
                    if got is None:
                        t.udp_unanswered += 1
                    elif udp_pod is None:
                        udp_pod = got
                    elif got != udp_pod:
                        t.udp_moved.append(f"{node}: {udp_pod} -> {got}")
                        udp_pod = got
                if long_alive:
                    try:
                        flow.ask()
                    except OSError as exc:
                        long_alive = False
                        with self._lock:
                            t.broken_long.append(f"{node}: {exc}")
                with self._lock:
                    self._rounds[node] += 1
                time.sleep(ROUND_PAUSE)
        finally:
            flow.close()
            udp.close()

    def more_rounds(self, n: int, timeout: float = 120.0) -> None:
        """Return once every client has done `n` more rounds (traffic after a change,
        so that late failures are counted); fails if a client stopped."""
        with self._lock:
            want = {node: done + n for node, done in self._rounds.items()}

        def done() -> bool:
            dead = [t.name for t in self._threads if not t.is_alive()]
            assert not dead, f"client threads ended early: {dead}"
            with self._lock:
                return all(self._rounds[node] >= count for node, count in want.items())

        wait(done, timeout, f"{n} more rounds from every client", interval=0.05)

    def __enter__(self) -> Clients:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)
