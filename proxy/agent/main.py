"""Running the agent as a process: event loop choice, signals, exit codes, --cleanup."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Callable
from typing import Any

from proxy.agent import logs
from proxy.agent.app import Agent, StartupError, dataplane_options
from proxy.agent.node_setup import warn_unkept
from proxy.agent.nodeport_warnings import warn_unset
from proxy.agent.startup_gc import PAUSE_LIMIT, StartupPause
from proxy.config.options import Config
from proxy.dataplane import modes
from proxy.dataplane.common.fail_fast import remove_table as remove_fail_fast_table
from proxy.dataplane.factory import DataplaneUnavailable, make_dataplane

log = logging.getLogger("proxy.agent")
_GC = StartupPause()  # the process's collector: off until the first sync (startup_gc.py)
# How long a thread that wants the interpreter's lock waits for the one holding it to
# give it up (Python's default: 5 ms). A change is synced on the data plane's thread
# beside the event loop's and, during a traffic reading, the reader's: each time it
# comes back from the kernel it may wait that long. At 100,000 services, changes beside
# a reading: p99 7-12 ms at 5 ms, 5-6 ms at 1 ms (bench/RESULTS.md).
SWITCH_INTERVAL = 0.001

EXIT_OK, EXIT_FAILED = 0, 1


def _loop_factory(use_uvloop: bool) -> Callable[[], asyncio.AbstractEventLoop] | None:
    if not use_uvloop:
        return None
    try:
        import uvloop
    except ImportError:
        log.warning("uvloop is not installed; using the standard asyncio loop")
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def _serve(config: Config, agent_kwargs: dict[str, Any]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = {"count": 0}

    def on_signal(sig: signal.Signals) -> None:
        signals["count"] += 1
        if signals["count"] > 1:
            # A second signal: the operator wants out now (rules still stay in place).
            log.warning("second %s: exiting immediately", sig.name)
            os._exit(EXIT_FAILED)
        log.info("received %s", sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    agent = Agent(config, **agent_kwargs)
    settle = asyncio.ensure_future(_collect_after_first_sync(agent))
    try:
        await agent.run(stop)
    except StartupError as exc:
        log.error("cannot start", extra={"error": str(exc)})
        return EXIT_FAILED
    except Exception:
        log.exception("the agent failed")
        return EXIT_FAILED
    finally:
        settle.cancel()
    log.info("stopped")
    return EXIT_OK


async def _collect_after_first_sync(agent: Agent) -> None:
    try:
        async with asyncio.timeout(PAUSE_LIMIT):
            await agent.settled.wait()
        _GC.end("first sync and its housekeeping done")
    except TimeoutError:
        _GC.end(f"no first sync and housekeeping within {PAUSE_LIMIT:g}s", loaded=False)


def warn_ignored_settings(config: Config) -> None:
    """One warning naming what a KubeProxyConfiguration asked that sliceproxy does not do
    (`fields`), and the fields kube-proxy does not have either (`unknown`: skipped)."""
    if config.ignored_settings or config.unknown_settings:
        log.warning("kube-proxy configuration fields that sliceproxy does not implement "
                    "are ignored", extra={"fields": list(config.ignored_settings),
                                          "unknown": list(config.unknown_settings)})


def run(config: Config, **agent_kwargs: Any) -> int:
    """`python -m proxy [flags]`: run until SIGTERM/SIGINT."""
    _GC.begin()
    sys.setswitchinterval(SWITCH_INTERVAL)
    logs.setup(config.verbosity, fmt=config.logging_format)
    factory = _loop_factory(config.uvloop)
    log.info("sliceproxy starting", extra={
        "node": config.node_name, "mode": config.proxy_mode,
        "event_loop": "uvloop" if factory is not None else "asyncio", "pid": os.getpid()})
    warn_ignored_settings(config)
    warn_unkept(config)
    warn_unset(config)
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(_serve(config, agent_kwargs))


def cleanup(config: Config) -> int:
    """`--cleanup`: remove every rule sliceproxy owns in this network namespace, for the
    chosen mode and (best effort) the other one, and exit. Needs no API server."""
    logs.setup(config.verbosity, fmt=config.logging_format)
    options = dataplane_options(config)
    status = EXIT_OK
    for mode in [config.proxy_mode, *(m for m in modes.names() if m != config.proxy_mode)]:
        chosen = mode == config.proxy_mode
        try:
            dp = make_dataplane(mode, options)
            try:
                dp.cleanup()
            finally:
                dp.close()
        except (DataplaneUnavailable, Exception) as exc:
            if chosen:
                log.error("cleanup failed: %s", exc, extra={"mode": mode})
                status = EXIT_FAILED
            else:
                log.log(logs.V(2), "no cleanup for the other mode: %s", exc,
                        extra={"mode": mode})
            continue
        log.info("removed sliceproxy's rules", extra={"mode": mode})
    if remove_fail_fast_table():  # every mode's: common/fail_fast.py
        log.info("removed sliceproxy's fail-fast table")
    return status
