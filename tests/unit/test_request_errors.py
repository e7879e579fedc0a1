"""The time limit every list and watch request runs under (proxy/kube/request_errors.py
`time_limit`): its expiry says what was late, in the words the reflector logs, and a
TimeoutError of the client's own passes as it was raised."""

from __future__ import annotations

import asyncio

import pytest

from proxy.kube.request_errors import _Stalled, time_limit

SOON = 0.01


async def never() -> None:
    await asyncio.Event().wait()


def test_an_expired_limit_says_what_was_late() -> None:
    async def main() -> None:
        async with time_limit(asyncio.timeout(SOON), "no whole answer within 0.01s"):
            await never()

    with pytest.raises(TimeoutError, match=r"^no whole answer within 0\.01s$"):
        asyncio.run(main())


def test_an_expired_limit_raises_the_error_chosen_when_it_fires() -> None:
    chosen: list[Exception] = []

    def late() -> Exception:
        chosen.append(_Stalled())
        return chosen[-1]

    async def main() -> None:
        async with time_limit(asyncio.timeout(SOON), late):
            await never()

    with pytest.raises(_Stalled) as raised:
        asyncio.run(main())
    assert chosen == [raised.value]


def test_the_clients_own_timeout_passes_unchanged() -> None:
    own = TimeoutError("the client's own limit")

    async def main() -> None:
        async with time_limit(asyncio.timeout(60), "never said"):
            raise own

    with pytest.raises(TimeoutError) as raised:
        asyncio.run(main())
    assert raised.value is own

