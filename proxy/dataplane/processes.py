"""Who commits our netfilter transactions: the child programs we run, and our own threads.

The nf_tables drift listeners (proxy/dataplane/iptables/drift_watch.py and the IPVS
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

import os
import subprocess
import threading
from collections import Counter, deque

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


def run_recorded(cmd: list[str], text: str,
                 timeout: float = RUN_TIMEOUT) -> subprocess.CompletedProcess[str]:
    """subprocess.run(cmd, input=text), noting the child's pid before it can commit.

    Raises OSError when `cmd` cannot start and subprocess.TimeoutExpired (the child
    killed) after `timeout` seconds.
    """
    with subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True) as proc:
        with _lock:
            _children.append(proc.pid)
        try:
            out, err = proc.communicate(text, timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)
