"""Running the iptables binaries: back-end detection, restore and save.

The only place that executes `iptables*` programs. It always runs them in the calling
thread's network namespace (a child inherits the namespace of the thread that forks
it), which is how the tests point it at a namespace of their own.

Back ends. iptables 1.8 comes in two flavours that program different kernel
subsystems: "legacy" (x_tables) and "nft" (nf_tables). Rules written with one are
invisible to the other, and ordering relative to the host's other rules only holds
within one, so we must use the back end the host already uses. `detect_backend`
follows upstream (kubernetes-sigs/iptables-wrappers, which kube-proxy's image uses):

1. kubelet (1.17+) leaves a `KUBE-IPTABLES-HINT` or `KUBE-KUBELET-CANARY` chain in the
   mangle table of the back end it uses: nft is checked first, then legacy;
2. otherwise (our addition, the wrapper's older rule), the back end holding more rules
   (`-A` lines over iptables and ip6tables) wins, when one holds more;
3. otherwise the flavour of the plain `iptables` binary (`iptables -V` prints
   "(nf_tables)" or "(legacy)"); nft when even that cannot be told, as upstream.

Whatever picked nft, it must be able to do NAT: a kernel may have nf_tables without its
nat chain type (Debian's user-mode Linux does), where the nat table still lists but every
restore that creates a nat chain fails. A probe that changes nothing
(proxy/dataplane/common/nfnetlink.py) asks the kernel; if nf_tables cannot do NAT, legacy
is used and the log says why.
"""

from __future__ import annotations

import enum
import itertools
import logging
import re
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterable, Iterator
from typing import Protocol

from proxy.dataplane.common.nfnetlink import nat_unsupported
from proxy.dataplane.common.processes import RUN_TIMEOUT, run_recorded
from proxy.model.types import Family

log = logging.getLogger(__name__)

_KUBELET_CHAINS = re.compile(r"^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY) ", re.MULTILINE)
# "iptables-restore: line 4 failed" (either back end) or, for errors found while
# parsing a rule, "Error occurred at line: 3".
_FAILED_LINE = re.compile(r"line:? (\d+)(?: failed)?")


class Backend(enum.Enum):
    LEGACY = "legacy"
    NFT = "nft"


class RunnerError(Exception):
    """An iptables binary could not be run or failed (other than a refused restore)."""


class RestoreError(RunnerError):
    """iptables-restore refused the input; the kernel's rules are unchanged.

    `line` is the 1-based line of the input it named, and `offending` that line's text.
    """

    def __init__(self, message: str, line: int | None = None,
                 offending: str | None = None) -> None:
        super().__init__(message)
        self.line = line
        self.offending = offending


def _base(family: Family) -> str:
    return "iptables" if family is Family.V4 else "ip6tables"


def binary(family: Family, backend: Backend, tool: str = "") -> str:
    """`iptables-legacy-restore`, `ip6tables-nft-save`, `iptables-nft`, ..."""
    name = f"{_base(family)}-{backend.value}"
    return f"{name}-{tool}" if tool else name


def _output(cmd: list[str], timeout: float = 30.0) -> str:
    """stdout of `cmd`, or "" when it cannot run: detection is best effort."""
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return result.stdout


def _rule_count(backend: Backend) -> int:
    total = 0
    for family in (Family.V4, Family.V6):
        text = _output([binary(family, backend, "save")])
        total += sum(1 for line in text.splitlines() if line.startswith("-A "))
    return total


def detect_backend() -> Backend:
    """The back end this network namespace uses (rule in the module docstring)."""
    backend, why = _preferred_backend()
    if backend is Backend.NFT and (missing := nat_unsupported(Family.V4)) is not None:
        log.warning("iptables back end: legacy, as nf_tables cannot do NAT in this kernel",
                    extra={"backend": "legacy", "preferred": "nft", "preferred_because": why,
                           "probe": missing})
        return Backend.LEGACY
    return _detected(backend, why)


def _preferred_backend() -> tuple[Backend, str]:
    for family in (Family.V4, Family.V6):
        if _KUBELET_CHAINS.search(_output([binary(family, Backend.NFT, "save"), "-t", "mangle"])):
            return Backend.NFT, "kubelet hint chain in nf_tables"
    # Without "-t mangle": asking legacy for a table creates it (upstream avoids that too).
    for family in (Family.V4, Family.V6):
        if _KUBELET_CHAINS.search(_output([binary(family, Backend.LEGACY, "save")])):
            return Backend.LEGACY, "kubelet hint chain in legacy tables"
    legacy, nft = _rule_count(Backend.LEGACY), _rule_count(Backend.NFT)
    if legacy != nft:
        return (Backend.LEGACY if legacy > nft else Backend.NFT,
                f"rules: legacy {legacy}, nft {nft}")
    version = _output(["iptables", "-V"])
    if "(legacy)" in version:
        return Backend.LEGACY, f"iptables -V: {version.strip()}"
    return Backend.NFT, f"iptables -V: {version.strip() or 'unknown'}"


def _detected(backend: Backend, why: str) -> Backend:
    log.info("iptables back end detected", extra={"backend": backend.value, "reason": why})
    return backend


class Script(Protocol):
    """iptables-restore input made line by line as it is written (ruleset.RestoreText):
    a full sync at 10,000 services is 46 MB of text, never held whole."""

    def lines(self) -> Iterable[str]: ...

    def render(self) -> str: ...


RestoreInput = str | Script


def lines_of(text: RestoreInput) -> Iterable[str]:
    return text.splitlines() if isinstance(text, str) else text.lines()


def whole(text: RestoreInput) -> str:
    """The input as one text, for the runners that need it so (simulated, iptc)."""
    return text if isinstance(text, str) else text.render()


def encoded(text: RestoreInput, size: int = 1 << 20) -> Iterator[bytes]:
    """`text` as UTF-8 in pieces of about `size` bytes, each made when it is written."""
    if isinstance(text, str):
        yield text.encode()
        return
    piece: list[str] = []
    length = 0
    for line in text.lines():
        piece.append(line)
        length += len(line) + 1
        if length >= size:
            piece.append("")
            yield "\n".join(piece).encode()
            piece, length = [], 0
    if piece:
        piece.append("")
        yield "\n".join(piece).encode()


def parse_restore_error(stderr: str, text: RestoreInput) -> tuple[int | None, str | None]:
    """The input line iptables-restore blamed (1-based) and its text, if it said."""
    match = _FAILED_LINE.search(stderr)
    if match is None:
        return None, None
    number = int(match.group(1))
    if number < 1:
        return number, None
    return number, next(itertools.islice(lines_of(text), number - 1, None), None)


class Runner(Protocol):
    """What the data plane needs of `IptablesRunner` (a simulated one fits too)."""

    family: Family
    backend: Backend
    restore_cmd: str
    save_cmd: str

    def restore(self, text: RestoreInput, *, noflush: bool = True,
                counters: bool = False) -> None: ...

    def save(self, table: str | None = None) -> str: ...

    def save_lines(self) -> Iterable[str]: ...

    def available(self) -> bool: ...


class IptablesRunner:
    """iptables-restore / iptables-save for one family and back end."""

    def __init__(self, family: Family, backend: Backend | None = None,
                 lock_wait: float = 5.0) -> None:
        self.family = family
        self.backend = backend if backend is not None else detect_backend()
        self.lock_wait = lock_wait
        self.restore_cmd = binary(family, self.backend, "restore")
        self.save_cmd = binary(family, self.backend, "save")

    def __repr__(self) -> str:
        return f"IptablesRunner({self.family.label}, {self.backend.value})"

    def restore(self, text: RestoreInput, *, noflush: bool = True,
                counters: bool = False) -> None:
        """Apply `text` atomically (one commit per table); raises RestoreError."""
        # The xtables lock (/run/xtables.lock) serialises us with other writers;
        # -w waits for it instead of failing at once. Whole seconds only.
        cmd = [self.restore_cmd, "-w", str(max(1, round(self.lock_wait)))]
        if noflush:
            cmd.append("--noflush")
        if counters:
            cmd.append("--counters")
        try:
            result = run_recorded(cmd, encoded(text))
        except (OSError, subprocess.SubprocessError) as exc:
            raise RestoreError(f"{self.restore_cmd}: {exc}") from exc
        if result.returncode != 0:
            stderr = result.stderr.strip()
            line, offending = parse_restore_error(stderr, text)
            raise RestoreError(f"{self.restore_cmd} exited {result.returncode}: {stderr}",
                               line, offending)

    def save(self, table: str | None = None) -> str:
        cmd = [self.save_cmd] + (["-t", table] if table else [])
        try:
            result = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT,
                                    check=False)
        except (OSError, subprocess.SubprocessError) as exc:
            raise RunnerError(f"{self.save_cmd}: {exc}") from exc
        if result.returncode != 0:
            raise RunnerError(f"{self.save_cmd} exited {result.returncode}: "
                              f"{result.stderr.strip()}")
        return result.stdout

    def save_lines(self) -> Iterator[str]:
        """iptables-save's lines (all tables) as they come, never the whole text: at
        10,000 services x 10 endpoints our rules are 320,000 lines (46 MB), which a full
        sync reads only to skip. Raises RunnerError (from the iteration) on failure."""
        with tempfile.TemporaryFile() as err:
            try:
                proc = subprocess.Popen([self.save_cmd], stdout=subprocess.PIPE, stderr=err,
                                        text=True)
            except OSError as exc:
                raise RunnerError(f"{self.save_cmd}: {exc}") from exc
            killer = threading.Timer(RUN_TIMEOUT, proc.kill)
            killer.start()
            try:
                with proc:
                    assert proc.stdout is not None
                    for line in proc.stdout:
                        yield line.rstrip("\n")
            finally:
                killer.cancel()
            if proc.returncode != 0:
                err.seek(0)
                raise RunnerError(f"{self.save_cmd} exited {proc.returncode}: "
                                  f"{err.read().decode(errors='replace').strip()}")

    def available(self) -> bool:
        """The binaries exist, the kernel's nat table can be listed and, on nf_tables,
        the kernel can make nat chains (see the module docstring)."""
        if not (shutil.which(self.restore_cmd) and shutil.which(self.save_cmd)):
            return False
        if self.backend is Backend.NFT:
            missing = nat_unsupported(self.family)
            if missing is not None:
                log.warning("nf_tables cannot do NAT in this kernel", extra={
                    "family": self.family.label, "probe": missing})
                return False
        lister = binary(self.family, self.backend)
        try:
            result = subprocess.run(
                [lister, "-w", str(max(1, round(self.lock_wait))), "-t", "nat", "-S",
                 "POSTROUTING"],
                capture_output=True, text=True, timeout=30, check=False)
        except (OSError, subprocess.SubprocessError):
            return False
        return result.returncode == 0
