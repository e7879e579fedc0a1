"""The node settings of node_settings.py read from, and written to, /proc/sys and /sys.

`apply` (the `--init-only` step) writes only what differs and reports every setting's
outcome; `check` (the agent at start) only reads. A refused write is an outcome, never an
exception: a container without the privilege, or a node that is itself a network
namespace, must still start its proxy. The kernel refuses the global settings
(`nf_conntrack_max`, `hashsize`) to every network namespace but the initial one, and a
container runtime mounts /proc/sys and /sys read-only in an unprivileged container.

A file that does not exist belongs to a module that is not loaded. nf_conntrack is then
asked for as the agent itself would load it, by a ctnetlink request (the kernel loads
nf_conntrack_netlink, and nf_conntrack with it); ip_vs is the node's to load.

The record of what the node held before (node_originals.py) is a file in the node's
/run, kept by `NodeFiles` too.

`root` is where the node's /proc, /sys and /run are: `/`, or a folder in the tests.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from proxy.dataplane.common.ctnetlink import IPPROTO_SCTP, ConntrackSocket
from proxy.dataplane.common.node_originals import Record, dumps, loads
from proxy.dataplane.common.node_settings import CONNTRACK_MODULE, Setting
from proxy.model.types import Family

log = logging.getLogger(__name__)

ONLINE_CPUS = "sys/devices/system/cpu/online"
# What `--init-only` changed, for `--restore-node-settings` (node_originals.py). The
# manifests mount the node's /run/sliceproxy there.
RECORD = "run/sliceproxy/node-settings.json"


class Outcome(enum.Enum):
    CHANGED = "changed"
    KEPT = "kept"  # already what was asked
    DIFFERS = "differs"  # read only (check): not what was asked
    REFUSED = "refused"  # the write failed
    ABSENT = "absent"  # no such file: its module is not loaded


@dataclass(frozen=True, slots=True)
class Result:
    setting: Setting
    outcome: Outcome
    before: int | None  # None: absent or unreadable
    after: int | None = None  # what the kernel holds after a write
    error: str = ""


class NodeFiles:
    """The settings' files under `root`."""

    def __init__(self, root: Path = Path("/")) -> None:
        self.root = root

    def read(self, setting: Setting) -> int | None:
        """The file's value; None when it does not exist. ValueError: not a number."""
        return self.read_path(setting.path)

    def write(self, setting: Setting, value: int) -> None:
        self.write_path(setting.path, value)

    def read_path(self, path: str) -> int | None:
        try:
            text = (self.root / path).read_text()
        except FileNotFoundError:
            return None
        return int(text.split()[0])

    def write_path(self, path: str, value: int) -> None:
        # No O_CREAT: a file that is not there is not ours to make (and a fake root
        # behaves as /proc/sys does).
        fd = os.open(self.root / path, os.O_WRONLY | os.O_TRUNC)
        try:
            os.write(fd, str(value).encode())
        finally:
            os.close(fd)

    # --- the originals record (node_originals.py) -----------------------------------

    @property
    def record_path(self) -> Path:
        return self.root / RECORD

    def read_record(self) -> Record:
        """{} when there is none. ValueError: unreadable."""
        try:
            return loads(self.record_path.read_text())
        except FileNotFoundError:
            return {}

    def write_record(self, record: Record) -> None:
        """Whole or not at all (a rename), in the node's /run: it lasts until the next
        boot, as the values it is about do."""
        path = self.record_path
        path.parent.mkdir(parents=True, exist_ok=True)
        part = path.with_name(path.name + ".part")
        part.write_text(dumps(record))
        os.replace(part, path)

    def remove_record(self) -> None:
        """The record, then its folder if nothing else is in it (on a node, the manifest's
        host path makes the folder; a folder mounted from elsewhere stays)."""
        self.record_path.unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            self.record_path.parent.rmdir()


def parse_cpu_list(text: str) -> int:
    """How many CPUs a kernel CPU list names: `0-3,8-11` -> 8."""
    count = 0
    for part in text.strip().split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    if count < 1:
        raise ValueError(f"no CPUs in {text!r}")
    return count


def node_cpus(root: Path = Path("/")) -> int:
    """The node's online CPUs, as kube-proxy counts them since the fix of kubernetes issue
    99225 (`nf_conntrack_max` is for the whole node, whatever this process's cpuset);
    this process's CPU affinity, as Go's runtime.NumCPU, where sysfs cannot tell."""
    try:
        return parse_cpu_list((root / ONLINE_CPUS).read_text())
    except (OSError, ValueError):
        return len(os.sched_getaffinity(0))


def request_module(module: str) -> None:
    """Ask the kernel for `module` the way the agent's own requests would load it; only
    nf_conntrack can be asked for so. Best effort: the caller reads the files again."""
    if module != CONNTRACK_MODULE:
        return
    try:
        with contextlib.closing(ConntrackSocket()) as sock:
            # One rare protocol's entries: the request is what loads the module.
            sock.dump(Family.V4, (IPPROTO_SCTP,))
    except OSError as exc:
        log.debug("conntrack request failed", extra={"error": str(exc)})


def _read(files: NodeFiles, setting: Setting) -> tuple[int | None, str]:
    try:
        return files.read(setting), ""
    except (OSError, ValueError) as exc:
        return None, f"unreadable: {exc}"


def _loaded(files: NodeFiles, settings: Sequence[Setting],
            load: Callable[[str], None] | None) -> None:
    """Load the modules of the settings whose files are absent (once each)."""
    if load is None:
        return
    for module in sorted({s.module for s in settings if s.module}):
        first = next(s for s in settings if s.module == module)
        if _read(files, first) == (None, ""):
            load(module)


def check(files: NodeFiles, settings: Sequence[Setting]) -> list[Result]:
    """Each setting as the node holds it, nothing written."""
    out = []
    for s in settings:
        before, error = _read(files, s)
        if before is None:
            out.append(Result(s, Outcome.REFUSED if error else Outcome.ABSENT, None,
                              error=error))
        else:
            out.append(Result(s, Outcome.KEPT if s.kept_by(before) else Outcome.DIFFERS,
                              before))
    return out


def apply(files: NodeFiles, settings: Sequence[Setting],
          load: Callable[[str], None] | None = request_module) -> list[Result]:
    """Write each setting the node does not hold yet; never raises for a setting."""
    _loaded(files, settings, load)
    out = []
    for r in check(files, settings):
        s = r.setting
        if r.outcome is not Outcome.DIFFERS:
            out.append(r)
            continue
        try:
            files.write(s, s.value)
        except OSError as exc:
            out.append(Result(s, Outcome.REFUSED, r.before, error=_refusal(s, exc)))
            continue
        after, error = _read(files, s)
        if after is not None and s.kept_by(after):
            out.append(Result(s, Outcome.CHANGED, r.before, after))
        else:  # accepted, but not kept: say what the kernel holds
            out.append(Result(s, Outcome.REFUSED, r.before, after,
                              error or f"written, but the kernel holds {after}"))
    return out


def _refusal(setting: Setting, exc: OSError) -> str:
    """The error, with what it means for this setting."""
    text = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno == errno.EROFS:
        return f"{text}: the container's /proc/sys and /sys are read-only (run it privileged)"
    if setting.node_wide and exc.errno in (errno.EACCES, errno.EPERM, errno.EOPNOTSUPP):
        return (f"{text}: a global setting, writable only from the node's initial network "
                "namespace")
    return text
