"""Structured logs: one `key=value` line per record (logfmt), or one JSON object per line
with `--logging-format json` (upstream's flag), with kube-proxy's -v levels.

Code logs with the standard `logging` calls and puts the facts in `extra={...}`; both
formatters print every extra field beside the message, so an operator can grep
`service=demo/web` or feed the lines to a log pipeline without a custom parser. The
JSON lines use the keys of Kubernetes' own JSON format (`ts`: seconds since the epoch,
`msg`, `v`: the verbosity of an info line, `err`: an exception's text) plus `level`
and `logger`, as the text lines have them. The messages and keys an operator may alert
on are listed in docs/logging.md.

Verbosity follows klog: `-v 0` shows INFO and above; a message logged at `V(n)` (the
level INFO - n, e.g. `log.log(V(2), ...)`) shows from `-v n` up. At `-v 9` everything,
DEBUG included, is shown; the libraries we use (aiohttp, kubernetes) stay at WARNING
below `-v 6` because their INFO lines are noise for an operator.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, TextIO

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message", "asctime", "taskName"}

LIBRARIES = ("aiohttp", "kubernetes", "asyncio", "urllib3")


def V(level: int) -> int:
    """The logging level of a klog-style `V(level)` message."""
    return logging.INFO - level


def _quote(value: Any) -> str:
    text = str(value)
    if text and not any(c in text for c in ' "=\n\t'):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _level_name(levelno: int) -> str:
    if logging.INFO > levelno > logging.DEBUG:
        return f"v{logging.INFO - levelno}"
    return logging.getLevelName(levelno).lower()


def log_stamp(epoch: float) -> str:
    """`epoch` (seconds) as a line's time= (UTC, in milliseconds): also how a test finds
    its own moments in an agent's log."""
    return (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(epoch))
            + f".{int(epoch % 1 * 1000):03d}Z")


class LogfmtFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        parts = [
            f"time={log_stamp(record.created)}",
            f"level={_level_name(record.levelno)}",
            f"logger={record.name}",
            f"msg={_quote(record.getMessage())}",
        ]
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                parts.append(f"{key}={_quote(value)}")
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line; values JSON cannot hold are written as text."""

    _OWN = ("ts", "level", "logger", "msg", "v", "err", "stacktrace")

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {"ts": round(record.created, 6),
                               "level": _level_name(record.levelno),
                               "logger": record.name, "msg": record.getMessage()}
        if record.levelno <= logging.INFO:
            out["v"] = min(logging.INFO - record.levelno, 9)
        for key, value in record.__dict__.items():
            if key not in _STANDARD and not key.startswith("_"):
                out[key if key not in self._OWN else f"{key}_"] = value
        if record.exc_info and record.exc_info[1] is not None:
            out["err"] = f"{type(record.exc_info[1]).__name__}: {record.exc_info[1]}"
            out["stacktrace"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, ensure_ascii=False)


FORMATS = {"text": LogfmtFormatter, "json": JsonFormatter}


def setup(verbosity: int, stream: TextIO | None = None, fmt: str = "text") -> None:
    """Configure the root logger for the agent (called once, at start)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(FORMATS[fmt]())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.DEBUG if verbosity >= 9 else V(verbosity))
    lib_level = logging.DEBUG if verbosity >= 9 else (
        logging.INFO if verbosity >= 6 else logging.WARNING)
    for name in LIBRARIES:
        logging.getLogger(name).setLevel(lib_level)
