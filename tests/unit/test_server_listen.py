"""Where the agent's HTTP servers listen, as kube-proxy's Go listener does: 0.0.0.0 or ::
is every address of both families (one dual-stack socket), or IPv4 alone where there is
no IPv6 (said in the log); a specific address is that address only. Under asyncio and
uvloop, on the host's own loopback addresses (nothing is added anywhere)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
import uvloop
from aiohttp import web

from proxy.server import http
from proxy.server.http import Listening, serve

pytestmark = pytest.mark.skipif(http.ipv6_missing() is not None,
                                reason="the host has no IPv6 loopback to connect to")

LOOPS: dict[str, Callable[[Coroutine[Any, Any, Any]], Any]] = {
    "asyncio": asyncio.run, "uvloop": uvloop.run}


def hello_app() -> web.Application:
    async def hello(_: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    return app


def answers(host: str, port: int) -> bool:
    """Whether an HTTP server answers at host:port (a blocking client, off the loop)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.settimeout(2.0)
            sock.connect((host, port))
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return b"hello" in sock.recv(4096)
    except OSError:
        return False


def served(host: str, loop: str) -> tuple[Listening, dict[str, bool]]:
    """(what `serve` says it listens on; which loopback addresses answered). After the
    clean-up the port is bound again: the server let it go."""

    async def go() -> tuple[Listening, dict[str, bool]]:
        runner, listening = await serve(hello_app(), host, 0)
        try:
            reached = {}
            for client in ("127.0.0.1", "::1"):
                reached[client] = await asyncio.to_thread(answers, client, listening.port)
        finally:
            await runner.cleanup()
        sock, _ = http.listen_socket(host, listening.port)  # raises if still in use
        sock.close()
        return listening, reached

    result: tuple[Listening, dict[str, bool]] = LOOPS[loop](go())
    return result


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize(("host", "shown", "families", "reached"), [
    ("0.0.0.0", "[::]", "IPv4 and IPv6", {"127.0.0.1": True, "::1": True}),
    ("::", "[::]", "IPv4 and IPv6", {"127.0.0.1": True, "::1": True}),
    ("127.0.0.1", "127.0.0.1", "IPv4", {"127.0.0.1": True, "::1": False}),
    ("::1", "[::1]", "IPv6", {"127.0.0.1": False, "::1": True}),
])
def test_an_unspecified_address_is_both_families_a_specific_one_itself(
        loop: str, host: str, shown: str, families: str, reached: dict[str, bool]) -> None:
    listening, got = served(host, loop)
    assert listening.address == f"{shown}:{listening.port}"
    assert listening.families == families and listening.ipv6_missing is None
    assert got == reached


@pytest.mark.parametrize("loop", sorted(LOOPS))
@pytest.mark.parametrize("host", ["0.0.0.0", "::"])
def test_without_ipv6_an_unspecified_address_is_ipv4_alone(
        monkeypatch: pytest.MonkeyPatch, loop: str, host: str) -> None:
    """As where the kernel has no IPv6 or the namespace disables it (the real case:
    tests/e2e/test_agent_listen.py)."""
    monkeypatch.setattr(http, "ipv6_missing", lambda: "Address family not supported")
    listening, got = served(host, loop)
    assert listening == Listening(f"0.0.0.0:{listening.port}", "IPv4",
                                  "Address family not supported")
    assert got == {"127.0.0.1": True, "::1": False}


def test_a_port_in_use_is_an_error_and_leaves_nothing_open() -> None:
    async def go() -> None:
        runner, listening = await serve(hello_app(), "127.0.0.1", 0)
        try:
            with pytest.raises(OSError):
                await serve(hello_app(), "0.0.0.0", listening.port)
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_the_agent_logs_what_it_really_listens_on(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from proxy.agent.app import Agent
    from proxy.config.options import parse_args

    def free_port() -> int:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::", 0))
            port: int = s.getsockname()[1]
            return port

    async def start(*flags: str) -> list[logging.LogRecord]:
        caplog.clear()
        agent = Agent(parse_args(["--hostname-override", "node-a", *flags]))
        try:
            with caplog.at_level(logging.INFO, logger="proxy.agent.app"):
                await agent._start_http()
        finally:
            await agent.shutdown()
        return [r for r in caplog.records if "serving" in r.getMessage()
                or "IPv6" in r.getMessage()]

    healthz, metrics = free_port(), free_port()
    flags = ("--healthz-bind-address", f"0.0.0.0:{healthz}",
             "--metrics-bind-address", f"127.0.0.1:{metrics}")
    first, second = asyncio.run(start(*flags))
    assert (first.getMessage(), first.__dict__["address"], first.__dict__["families"]) == (
        "serving healthz", f"[::]:{healthz}", "IPv4 and IPv6")
    assert (second.getMessage(), second.__dict__["address"], second.__dict__["families"],
            second.__dict__["debug_dump"]) == (
        "serving metrics", f"127.0.0.1:{metrics}", "IPv4", "local")
    monkeypatch.setattr(http, "ipv6_missing", lambda: "Cannot assign requested address")
    why, first, _ = asyncio.run(start(*flags))
    assert why.getMessage() == "IPv6 is not available here: serving healthz on IPv4 only"
    assert why.__dict__["reason"] == "Cannot assign requested address"
    assert (first.__dict__["address"], first.__dict__["families"]) == (
        f"0.0.0.0:{healthz}", "IPv4")
