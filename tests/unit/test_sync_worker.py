"""The data plane's worker thread: one thread, in order, errors delivered to the caller,
and no noise when a job outlives the event loop that queued it."""

from __future__ import annotations

import asyncio
import threading

import pytest

from proxy.agent.worker import Worker


def test_jobs_run_in_order_on_one_other_thread() -> None:
    worker = Worker()
    seen: list[tuple[int, int]] = []

    async def go() -> list[int]:
        futs = [worker.call(lambda i=i: seen.append((i, threading.get_ident())) or i)
                for i in range(5)]
        return list(await asyncio.gather(*futs))

    assert asyncio.run(go()) == [0, 1, 2, 3, 4]
    assert [i for i, _ in seen] == [0, 1, 2, 3, 4]
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()
    assert worker.run_sync(threading.get_ident) == seen[0][1]
    assert worker.stop(5)


def test_errors_reach_the_awaiting_caller() -> None:
    worker = Worker()

    def boom() -> None:
        raise ValueError("refused")

    async def go() -> None:
        with pytest.raises(ValueError, match="refused"):
            await worker.call(boom)

    asyncio.run(go())
    with pytest.raises(ValueError, match="refused"):
        worker.run_sync(boom)
    assert worker.stop(5)


def test_a_job_finishing_after_its_loop_closed_is_harmless() -> None:
    worker = Worker()
    gate, done = threading.Event(), threading.Event()
    errors: list[BaseException] = []
    old_hook = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # type: ignore[assignment]
    try:
        async def go() -> None:
            worker.call(gate.wait)  # never awaited: the "agent" exits meanwhile

        asyncio.run(go())
        gate.set()
        worker.run_sync(done.set, timeout=10)  # the stuck job finished; the thread lives on
        assert done.is_set() and errors == []
    finally:
        threading.excepthook = old_hook
        assert worker.stop(5)
