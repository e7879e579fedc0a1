"""Who commits our netfilter transactions: the child programs we run, and our own threads.

The nf_tables drift listeners (proxy/dataplane/common/drift_watch.py and the IPVS
data plane's) tell our own commits from anyone else's by the committer the kernel names
in each transaction's NEWGEN announcement. That is:
- for a child (iptables-restore, `nft -f -`): its process id, so each child's pid is
  noted here before it can commit (`run_recorded`);
- for libnftables in-process: the id of the *thread* that made the call (the kernel
  reports task_pid_nr(current), measured: a worker thread's native id, not getpid()),
  and a port id unrelated to our pid once the process has another netlink socket. So
  a thread that commits in-process is noted too (`note_thread`).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import threading
from collections import Counter, deque
from collections.abc import Iterable

# Restores at 10,000 services take seconds (minutes for a full iptables-nft restore,
# see FINDINGS); a hung binary must still not hang the agent forever.
RUN_TIMEOUT = 900.0

_children: deque[int] = deque(maxlen=256)
# Counted: two runners may share a thread, and only the last to go forgets it.
_threads: Counter[int] = Counter()
_lock = threading.Lock()


def started_here(pid: int) -> bool:
    """`pid` is this process, one of its committing threads or a recent child we ran."""
    if pid == os.getpid():
        return True
    with _lock:
        return pid in _children or pid in _threads


def note_thread(tid: int) -> None:
    """Thread `tid` (threading.get_native_id()) commits in-process from now on."""
    with _lock:
        _threads[tid] += 1


def forget_thread(tid: int) -> None:
    """Undo one note_thread(tid): a finished thread's id may go to another process."""
    with _lock:
        _threads[tid] -= 1
        if _threads[tid] <= 0:
            del _threads[tid]


def run_recorded(cmd: list[str], text: str | Iterable[bytes],
                 timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """Run `cmd` with `text` on its stdin, noting the child's pid before it can commit.

    `text` may come in pieces made as they are written (a full iptables sync at 10,000
    services is 46 MB of input, which then never exists whole, nor twice as str and
    bytes). Output goes to unnamed files, not pipes: nothing has to read it while we
    write. A child that stops reading (it refused a line and exited) ends the writing;
    its exit status says why.

    Raises OSError when `cmd` cannot start and subprocess.TimeoutExpired (the child
    killed) after `timeout` seconds.
    """
    pieces = [text.encode()] if isinstance(text, str) else text
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, stderr=err) as proc:
            with _lock:
                _children.append(proc.pid)
            expired = threading.Event()

            def expire() -> None:
                expired.set()
                proc.kill()

            killer = threading.Timer(timeout, expire)
            killer.start()
            try:
                _feed(proc, pieces)
                proc.wait()
            finally:
                killer.cancel()
            if expired.is_set() and proc.returncode == -signal.SIGKILL:
                raise subprocess.TimeoutExpired(cmd, timeout)
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(cmd, proc.returncode,
                                           out.read().decode(errors="replace"),
                                           err.read().decode(errors="replace"))


def _feed(proc: subprocess.Popen[bytes], pieces: Iterable[bytes]) -> None:
    assert proc.stdin is not None
    try:
        for piece in pieces:
            proc.stdin.write(piece)
        proc.stdin.close()
    except BrokenPipeError:
        # It stopped reading: its exit status and stderr say why. Closing again drops
        # what is still buffered (Popen's exit would raise on flushing it).
        with contextlib.suppress(BrokenPipeError):
            proc.stdin.close()
