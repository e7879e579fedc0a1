"""A TCP forwarder from the host's loopback into a network namespace.

The control plane lives in a namespace of its own; the test process lives in the host's.
Rather than giving the host an address or route (never allowed), this listens on an
ephemeral port of the host's 127.0.0.1 and connects each accepted client to a target
inside the namespace. The trick: the event loop thread enters the namespace (setns moves
one thread), so every outgoing socket it creates is born there, while the listening
socket, created before, stays in the host's namespace.

It also gives the tests a way to cut every stream at once, abruptly, from the client's
side of the wire (the real API server has no "cut watches" button).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading

from proxy.netns_lab.netns import entered

log = logging.getLogger(__name__)


class NetnsForwarder:
    def __init__(self, namespace: str, target_host: str, target_port: int) -> None:
        self.namespace = namespace
        self.target = (target_host, target_port)
        self.port = 0
        self._listener: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stopping = asyncio.Event()  # bound to the loop on first use (3.10+)

    def start(self) -> int:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen(128)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self._thread = threading.Thread(target=self._run, name=f"fwd-{self.namespace}",
                                        daemon=True)
        self._thread.start()
        if not self._ready.wait(10) or self._error is not None:
            raise RuntimeError(f"forwarder into {self.namespace} did not start: {self._error}")
        return self.port

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            with entered(self.namespace):
                loop.run_until_complete(self._serve())
        except BaseException as exc:  # reported to start(); the thread just ends
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        assert self._listener is not None
        server = await asyncio.start_server(self._handle, sock=self._listener)
        self._ready.set()
        async with server:
            await self._stopping.wait()
        for w in list(self._conns):
            w.transport.abort()

    async def _handle(self, client_r: asyncio.StreamReader,
                      client_w: asyncio.StreamWriter) -> None:
        try:
            up_r, up_w = await asyncio.open_connection(*self.target)
        except OSError as exc:
            log.debug("forward connect failed", extra={"target": self.target, "err": str(exc)})
            client_w.transport.abort()
            return
        pair = {client_w, up_w}
        self._conns |= pair
        try:
            await asyncio.gather(self._pump(client_r, up_w), self._pump(up_r, client_w))
        finally:
            self._conns -= pair
            for w in pair:
                w.transport.abort()

    @staticmethod
    async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            while data := await reader.read(65536):
                writer.write(data)
                await writer.drain()
        # Half-close so that the other side sees the end of this direction.
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()

    def cut(self) -> int:
        """Abort every forwarded connection (both ends see a reset); returns how many."""
        loop = self._loop
        if loop is None:
            return 0

        def abort() -> int:
            conns = list(self._conns)
            for w in conns:
                w.transport.abort()
            return len(conns) // 2

        fut = asyncio.run_coroutine_threadsafe(_call(abort), loop)
        return fut.result(timeout=10)

    def stop(self) -> None:
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            loop.call_soon_threadsafe(self._stopping.set)
            thread.join(timeout=10)
        self._loop = self._thread = None
        if self._listener is not None:
            self._listener.close()
            self._listener = None


async def _call(fn: object) -> int:
    assert callable(fn)
    result: int = fn()
    return result
