"""The data plane's own thread.

Data planes are blocking code, and pyroute2's netlink sockets must stay on the thread
that made them (FINDINGS), so every data-plane call runs here, one at a time, in order.
The thread is a daemon: a sync stuck on the xtables lock must not keep a stopping agent
alive (an `iptables-restore` already started completes or fails atomically on its own).
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class Worker:
    def __init__(self, name: str = "dataplane") -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            job()

    def call(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queue `fn` on the worker thread; await the returned future for its result."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[T] = loop.create_future()

        def job() -> None:
            try:
                result, error = fn(), None
            except BaseException as exc:
                result, error = None, exc
            # The loop may be gone: a job still running when the agent exited.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, result, error)

        self._jobs.put(job)
        return fut

    def run_sync(self, fn: Callable[[], T], timeout: float | None = None) -> T:
        """Run `fn` on the worker thread from plain (non-async) code and wait for it
        (TimeoutError if it has not run within `timeout`)."""
        box: list[tuple[bool, Any]] = []
        done = threading.Event()

        def job() -> None:
            try:
                box.append((True, fn()))
            except BaseException as exc:
                box.append((False, exc))
            finally:
                done.set()

        self._jobs.put(job)
        if not done.wait(timeout):
            raise TimeoutError(f"the worker did not run the job within {timeout}s")
        ok, value = box[0]
        if not ok:
            raise value
        result: T = value
        return result

    def stop(self, timeout: float | None = None) -> bool:
        """Let queued jobs finish, then end the thread; False if it is still busy."""
        self._jobs.put(None)
        self._thread.join(timeout)
        return not self._thread.is_alive()


def _settle(fut: asyncio.Future[Any], value: Any, exc: BaseException | None) -> None:
    if fut.done():  # the awaiting task was cancelled meanwhile
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)
