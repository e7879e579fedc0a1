"""Run a Python script inside a freshly booted user-mode Linux kernel (Linux 6.1 with IPVS).

The host kernel has no IPVS, so kernel tests boot Debian's ``linux.uml`` as an ordinary
process with the host's root file system mounted read-only through hostfs: the host's
Python, the project's virtual environment and its code run inside unchanged. A generated
``init.sh`` (PID 1 in the guest) mounts the basics, loads modules, runs one command with
stdin from /dev/null and stdout/stderr/exit code going to a per-run host folder mounted
read-write through hostfs, then powers the kernel off. The guest has no network device, so
nothing touches the host's network namespace. See docs/kernel-tests.md.

Inside the guest the script finds:
- ``KERNEL_RESULT``: a path; JSON written there comes back as ``KernelResult.result``
  (``tests.kernel.guest.write_result`` does this);
- ``KERNEL_SCRATCH``: a writable tmpfs folder (the root file system is read-only).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

UML_BINARY = "linux.uml"
UML_MODULES_ROOT = Path("/usr/lib/uml/modules")
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT = 120.0
DEFAULT_MEMORY = "768M"
# The guest gets its own, shorter deadline so that a hanging script is killed inside and
# its stdout/stderr still come back; the host timeout is the hard stop.
GUEST_MARGIN = 15.0

# Everything the IPVS data plane and its tests may touch. Modules the kernel also asks for
# on demand (an iptables match, an IPVS scheduler) load through the modprobe wrapper too.
DEFAULT_MODULES: tuple[str, ...] = (
    "ipv6",
    "nfnetlink",
    "nf_conntrack",
    "nf_conntrack_netlink",
    "nf_nat",
    "ip_vs",
    "ip_vs_rr",
    "ip_vs_wrr",
    "ip_vs_lc",
    "ip_vs_wlc",
    "ip_vs_sh",
    "ip_vs_sed",
    "ip_vs_nq",
    "ip_vs_mh",
    "veth",
    "dummy",
    "bridge",  # proxy/lab's pod bridge
    "x_tables",
    "ip_tables",
    "iptable_nat",
    "iptable_filter",
    "iptable_mangle",
    "iptable_raw",
    "ip6_tables",
    "ip6table_nat",
    "ip6table_filter",
    "xt_MASQUERADE",
    "xt_mark",
    "xt_comment",
    "xt_set",
    "xt_addrtype",
    "xt_conntrack",
    "xt_tcpudp",
    "xt_multiport",
    "xt_nat",
    "xt_statistic",
    "xt_recent",
    "xt_ipvs",
    "ip_set",
    "ip_set_hash_ip",
    "ip_set_hash_ipport",
    "ip_set_hash_ipportip",
    "ip_set_hash_ipportnet",
    "ip_set_hash_net",
    "ip_set_bitmap_port",
)

# hostfs takes the host path as raw mount data and the kernel command line splits on
# blanks: refuse paths that would be mangled rather than debug a silent mis-mount.
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._+/@-]*$")
# sun_path is 108 bytes; UML puts its mconsole socket at <uml_dir>/<umid>/mconsole.
_MAX_SOCKET_PATH = 100


class KernelError(AssertionError):
    """The kernel did not boot, or the command did not finish: the message says which."""


@dataclass(frozen=True)
class KernelResult:
    exit_code: int
    stdout: str
    stderr: str
    result: Any  # the JSON the script wrote to $KERNEL_RESULT, or None
    console: str  # the kernel's console (boot messages, init.sh's own output)
    boot_seconds: float  # guest uptime when the command started: kernel start to script start
    startup_seconds: float  # host wall clock from spawning linux.uml to script start
    script_seconds: float  # the command's own run time (guest clock)
    wall_seconds: float  # the whole run as the host saw it
    modules_loaded: tuple[str, ...] = ()
    modules_missing: tuple[str, ...] = ()  # not shipped with this kernel
    modules_failed: tuple[str, ...] = ()  # shipped, but modprobe did not load them
    modprobe_errors: str = ""

    def console_tail(self, lines: int = 40) -> str:
        return tail(self.console, lines)

    def describe(self) -> str:
        return (
            f"exit code {self.exit_code}\n--- stderr (tail) ---\n{tail(self.stderr, 40)}\n"
            f"--- stdout (tail) ---\n{tail(self.stdout, 20)}\n"
            f"--- console (tail) ---\n{self.console_tail(20)}"
        )

    def check(self) -> KernelResult:
        """Raise KernelError unless the command exited 0 and wrote a JSON result."""
        if self.exit_code != 0:
            timed_out = self.exit_code in (124, 137)  # timeout(1): TERM, then KILL
            reason = " (timed out inside the kernel)" if timed_out else ""
            raise KernelError(f"script failed in the kernel{reason}: {self.describe()}")
        if self.result is None:
            raise KernelError(f"script wrote no JSON result: {self.describe()}")
        return self


def tail(text: str, lines: int) -> str:
    return "\n".join(text.splitlines()[-lines:])


def kernel_version_dir(root: Path = UML_MODULES_ROOT) -> Path:
    """The one ``/usr/lib/uml/modules/<version>`` folder (the newest if several)."""
    versions = sorted(
        (p for p in root.iterdir() if (p / "modules.dep").is_file()),
        key=lambda p: [int(x) if x.isdigit() else x for x in re.split(r"[.-]", p.name)],
    ) if root.is_dir() else []
    if not versions:
        raise KernelError(
            f"no user-mode Linux modules under {root}: install the Debian package "
            "user-mode-linux (./run setup does)"
        )
    return versions[-1]


def _module_names(version_dir: Path) -> tuple[set[str], set[str]]:
    """(loadable, built-in) module names, with '-' normalised to '_' as modprobe does."""

    def name(line: str) -> str:
        base = line.split(":", 1)[0].strip().rsplit("/", 1)[-1]
        return base.split(".ko", 1)[0].replace("-", "_")

    dep = (version_dir / "modules.dep").read_text().splitlines()
    builtin_file = version_dir / "modules.builtin"
    builtin = builtin_file.read_text().splitlines() if builtin_file.is_file() else []
    return {name(x) for x in dep if x.strip()}, {name(x) for x in builtin if x.strip()}


def _check_path(path: Path, what: str) -> str:
    text = str(path)
    if not _SAFE_PATH.match(text):
        raise ValueError(f"{what} {text!r} must be absolute and free of blanks and commas")
    return text


def _init_script(
    *,
    version: str,
    out_dir: str,
    modules: Sequence[str],
    command: Sequence[str],
    guest_timeout: float,
    env: dict[str, str],
) -> str:
    q = shlex.quote
    exports = "\n".join(f"export {k}={q(v)}" for k, v in sorted(env.items()))
    return f"""#!/bin/sh
# Generated by tests/kernel/uml.py: PID 1 of a throw-away user-mode Linux kernel.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/run/scratch KERNEL_SCRATCH=/run/scratch KERNEL_RESULT=/run/out/result.json
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH={q(str(REPO_ROOT))}
{exports}
say() {{ echo "kernel-harness: $*"; }}
halt() {{
    sync
    # poweroff -f is a direct reboot(2), synchronous; the sysrq fallback is asynchronous,
    # so PID 1 must stay alive until the kernel stops (the host timeout bounds this).
    poweroff -f >/dev/null 2>&1
    echo o > /proc/sysrq-trigger
    exec sleep 60
}}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
# /run, not /tmp: a tmpfs on /tmp would hide the host's /tmp (pytest's tmp_path, a venv).
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/out /run/netns /run/scratch/mr/lib/modules
mount -t hostfs -o {q(out_dir)} none /run/out || {{ say "cannot mount {out_dir}"; halt; }}
read -r up _ < /proc/uptime; echo "$up" > /run/out/t_init
# modprobe -d wants <dir>/lib/modules/<version>; the modules live elsewhere on the host.
ln -s {q(str(UML_MODULES_ROOT / version))} /run/scratch/mr/lib/modules/{q(version)}
printf '#!/bin/sh\\nexec /sbin/modprobe -d /run/scratch/mr "$@"\\n' > /run/scratch/modprobe
chmod 755 /run/scratch/modprobe
echo /run/scratch/modprobe > /proc/sys/kernel/modprobe
# One modprobe for all (fast); it stops at the first failure, so then go one by one.
mods={q(" ".join(modules))}
modprobe -a -d /run/scratch/mr $mods 2> /run/out/modprobe.err || for m in $mods; do
    grep -q "^$m " /proc/modules || modprobe -d /run/scratch/mr "$m" 2>> /run/out/modprobe.err
done
cut -d' ' -f1 /proc/modules > /run/out/modules.loaded
ip link set lo up
echo 1 > /proc/sys/net/ipv4/ip_forward
[ -w /proc/sys/net/ipv4/vs/conntrack ] && echo 1 > /proc/sys/net/ipv4/vs/conntrack
cd /run/scratch
read -r up _ < /proc/uptime; echo "$up" > /run/out/t_start; date +%s.%N > /run/out/wall_start
say "starting the script"
timeout -k 5 {guest_timeout:.1f} {" ".join(q(c) for c in command)} \\
    < /dev/null > /run/out/stdout 2> /run/out/stderr
echo $? > /run/out/exit_code.tmp
read -r up _ < /proc/uptime; echo "$up" > /run/out/t_end
mv /run/out/exit_code.tmp /run/out/exit_code
say "done, exit code $(cat /run/out/exit_code)"
halt
"""


def _group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes in process group `pgid`."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            # The fields after the ")" closing the command name: state ppid pgrp ...
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # exited while we looked
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _kill_group(pgid: int, grace: float = 10.0) -> None:
    """SIGKILL the process group UML ran in (it forks a host process per guest address
    space) and wait until it is gone: SIGKILL to a traced process lands asynchronously."""
    deadline = time.monotonic() + grace
    while _group_members(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return
        if time.monotonic() > deadline:
            raise KernelError(f"user-mode Linux processes {_group_members(pgid)} survived SIGKILL")
        time.sleep(0.02)  # polling interval, bounded by the deadline above


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def _float(path: Path) -> float | None:
    try:
        return float(path.read_text().split()[0])
    except (FileNotFoundError, ValueError, IndexError):
        return None


def run_in_kernel(
    script: Path | str,
    args: Iterable[str] = (),
    *,
    workdir: Path,
    timeout: float = DEFAULT_TIMEOUT,
    modules: Sequence[str] = DEFAULT_MODULES,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    memory: str = DEFAULT_MEMORY,
    script_timeout: float | None = None,
) -> KernelResult:
    """Boot a fresh user-mode Linux, run ``python script *args`` in it, return what happened.

    ``workdir`` must be an empty-ish private folder (pytest's ``tmp_path``); it receives the
    generated init, the console log and the script's outputs. A script exiting non-zero is
    not an error here (inspect ``exit_code``, or call ``.check()``); a kernel that does not
    boot, or a run that exceeds ``timeout`` seconds, raises KernelError with the tail of the
    console log. Inside, the script itself is stopped after ``script_timeout`` seconds
    (default: ``timeout`` less a margin for booting) and then exits 124. The UML process
    group is killed on every exit path.
    """
    script_path = Path(script).resolve()
    if not script_path.is_file():
        raise FileNotFoundError(script_path)
    binary = shutil.which(UML_BINARY)
    if binary is None:
        raise KernelError(
            f"{UML_BINARY} not found: install the Debian package user-mode-linux "
            "(./run setup does)"
        )
    version_dir = kernel_version_dir()
    loadable, builtin = _module_names(version_dir)
    wanted = [m.replace("-", "_") for m in modules]
    missing = tuple(m for m in wanted if m not in loadable and m not in builtin)
    to_load = [m for m in wanted if m in loadable]

    workdir = workdir.resolve()
    out_dir = workdir / "out"
    out_dir.mkdir(parents=True, exist_ok=False)
    init = workdir / "init.sh"
    command = [python, str(script_path), *args]
    init.write_text(
        _init_script(
            version=version_dir.name,
            out_dir=_check_path(out_dir, "result folder"),
            modules=to_load,
            command=command,
            guest_timeout=script_timeout or max(5.0, timeout - GUEST_MARGIN),
            env=dict(env or {}),
        )
    )
    init.chmod(0o755)

    umid = "k" + secrets.token_hex(4)  # unique per run: two kernels may run at once
    uml_dir = workdir / "u"
    own_uml_dir = None
    if len(str(uml_dir / umid / "mconsole")) > _MAX_SOCKET_PATH:
        own_uml_dir = uml_dir = Path(tempfile.mkdtemp(prefix="uml-"))
    uml_dir.mkdir(exist_ok=True)
    console_path = workdir / "console.log"
    argv = [
        binary,
        f"mem={memory}",
        "root=/dev/root",
        "rootfstype=hostfs",
        "rootflags=/",
        "ro",
        f"init={_check_path(init, 'init script')}",
        "con=null",
        "con0=fd:0,fd:1",
        f"uml_dir={_check_path(uml_dir, 'uml_dir')}",
        f"umid={umid}",
    ]

    started = time.time()
    deadline = time.monotonic() + timeout
    timed_out = False
    with console_path.open("wb") as console:
        # stdin is /dev/null, never the caller's terminal (CI has none; UML would read it).
        # A session of its own lets us kill UML and every helper process it forked.
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=console,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=workdir,
        )
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Kill before reaping: an unreaped leader keeps its pid (our pgid) from reuse.
            try:
                _kill_group(proc.pid)
            finally:
                proc.wait()
                if own_uml_dir is not None:
                    shutil.rmtree(own_uml_dir, ignore_errors=True)
    wall = time.time() - started
    console_text = _read(console_path)

    def fail(reason: str) -> KernelError:
        return KernelError(
            f"{reason} after {wall:.1f} s (kernel exit {proc.returncode}); "
            f"files in {workdir}\n--- script stderr (tail) ---\n"
            f"{tail(_read(out_dir / 'stderr'), 20)}\n--- console (tail) ---\n"
            f"{tail(console_text, 40)}"
        )

    t_start = _float(out_dir / "t_start")
    if t_start is None:
        what = "did not start the script" if _float(out_dir / "t_init") else "did not boot"
        raise fail(f"user-mode Linux {what}" + (f" within {timeout:.0f} s" if timed_out else ""))
    exit_text = _read(out_dir / "exit_code").strip()
    if not exit_text:
        raise fail(
            f"script did not finish within {timeout:.0f} s" if timed_out
            else "kernel stopped before the script finished"
        )

    result_text = _read(out_dir / "result.json")
    try:
        result = json.loads(result_text) if result_text.strip() else None
    except json.JSONDecodeError as exc:
        raise fail(f"result.json is not JSON ({exc})") from exc
    loaded_now = set(_read(out_dir / "modules.loaded").split())
    wall_start = _float(out_dir / "wall_start")
    t_end = _float(out_dir / "t_end")
    return KernelResult(
        exit_code=int(exit_text),
        stdout=_read(out_dir / "stdout"),
        stderr=_read(out_dir / "stderr"),
        result=result,
        console=console_text,
        boot_seconds=t_start,
        startup_seconds=(wall_start - started) if wall_start is not None else float("nan"),
        script_seconds=(t_end - t_start) if t_end is not None else float("nan"),
        wall_seconds=wall,
        modules_loaded=tuple(m for m in wanted if m in loaded_now or m in builtin),
        modules_missing=missing,
        modules_failed=tuple(m for m in to_load if m not in loaded_now),
        modprobe_errors=_read(out_dir / "modprobe.err"),
    )
