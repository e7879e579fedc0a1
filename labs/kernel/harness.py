"""Run a Python script inside a freshly booted Linux kernel that has IPVS.

The host kernel has no IPVS, so kernel tests boot one: Debian 12's own amd64 kernel under
QEMU (labs/kernel/qemu.py), which boots on every x86 machine. The guest sees the host's
root file system read-only, so the host's Python, the project's virtual environment and
its code run inside unchanged. A generated ``init.sh`` (handed over to by the initramfs)
mounts the basics, loads modules, runs one command with stdin from /dev/null and
stdout/stderr/exit code going to a per-run host folder mounted read-write, then powers
the kernel off. The guest has no network device, so nothing touches the host's network
namespace. See docs/kernel-tests.md.

Inside the guest the script finds:
- ``KERNEL_RESULT``: a path; JSON written there comes back as ``KernelResult.result``
  (``labs.kernel.guest.write_result`` does this);
- ``KERNEL_SCRATCH``: a writable tmpfs folder (the root file system is read-only).
"""

from __future__ import annotations

import compileall
import functools
import json
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from labs.kernel.debian_kernel import KernelError
from labs.kernel.qemu import NINEP, QemuGuest, kill_group, lab_guest

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT = 180.0
DEFAULT_MEMORY_MB = 1024
# The guest gets its own, shorter deadline so that a hanging script is killed inside and
# its stdout/stderr still come back; the host timeout is the hard stop.
GUEST_MARGIN = 15.0

# Everything the data planes and their tests may touch, loaded by one `modprobe -a` at
# boot (one call each costs seconds under emulation). Modules the kernel asks for on
# demand (an iptables match, an IPVS scheduler) load through the modprobe wrapper too.
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
    "bridge",  # proxy/netns_lab's pod bridge
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
    # iptables' nf_tables back end (Debian 12's default `iptables`).
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
)

class _Boots:
    """What this process booted: for the tier's summary line; and the process groups of
    the kernels running now (several threads may boot at once)."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.described: set[str] = set()
        self.running: set[int] = set()

    def stop(self) -> None:
        """Kill every kernel still running: a session that ends early (an interrupt,
        -x) must not wait, at exit, for kernels booted by threads."""
        for pgid in list(self.running):
            kill_group(pgid)


BOOTS = _Boots()


@dataclass(frozen=True)
class KernelResult:
    exit_code: int
    stdout: str
    stderr: str
    result: Any  # the JSON the script wrote to $KERNEL_RESULT, or None
    console: str  # the kernel's console (boot messages, init.sh's own output)
    boot_seconds: float  # guest uptime when the command started: kernel start to script start
    startup_seconds: float  # host wall clock from spawning the kernel to script start
    script_seconds: float  # the command's own run time (guest clock)
    wall_seconds: float  # the whole run as the host saw it
    backend: str = ""  # QemuGuest.describe() of what booted
    modules_loaded: tuple[str, ...] = ()
    modules_missing: tuple[str, ...] = ()  # not shipped with this kernel
    modules_failed: tuple[str, ...] = ()  # shipped, but modprobe did not load them
    modprobe_errors: str = ""

    def console_tail(self, lines: int = 40) -> str:
        return tail(self.console, lines)

    def describe(self) -> str:
        return (
            f"exit code {self.exit_code} ({self.backend})\n--- stderr (tail) ---\n"
            f"{tail(self.stderr, 40)}\n--- stdout (tail) ---\n{tail(self.stdout, 20)}\n"
            f"--- console (tail) ---\n{self.console_tail(20)}"
        )

    def timings(self) -> str:
        return (f"boot {self.boot_seconds:.2f} s (kernel start to script start), "
                f"startup {self.startup_seconds:.2f} s (host), script "
                f"{self.script_seconds:.2f} s, wall {self.wall_seconds:.2f} s; {self.backend}")

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


def module_names(version_dir: Path) -> tuple[set[str], set[str]]:
    """(loadable, built-in) module names, with '-' normalised to '_' as modprobe does."""

    def name(line: str) -> str:
        base = line.split(":", 1)[0].strip().rsplit("/", 1)[-1]
        return base.split(".ko", 1)[0].replace("-", "_")

    dep = (version_dir / "modules.dep").read_text().splitlines()
    builtin_file = version_dir / "modules.builtin"
    builtin = builtin_file.read_text().splitlines() if builtin_file.is_file() else []
    return {name(x) for x in dep if x.strip()}, {name(x) for x in builtin if x.strip()}


def init_script(
    *,
    guest: QemuGuest,
    modules: Sequence[str],
    deny: Sequence[str],
    command: Sequence[str],
    guest_timeout: float,
    env: dict[str, str],
) -> str:
    """The guest's init (after the initramfs has mounted the host's root)."""
    q = shlex.quote
    exports = "\n".join(f"export {k}={q(v)}" for k, v in sorted(env.items()))
    # No dummy0 when dummy loads (Debian's own default, which -C leaves out): the guest has
    # no network device but lo. A denied module gets an "install" command that fails, for
    # explicit loads and the kernel's own requests by alias alike.
    config = "options dummy numdummies=0\n" + "".join(f"install {m} /bin/false\n"
                                                       for m in deny)
    return f"""#!/bin/sh
# Generated by labs/kernel/harness.py: the init of a throw-away kernel.
export PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin
export HOME=/run/scratch KERNEL_SCRATCH=/run/scratch KERNEL_RESULT=/run/out/result.json
export TMPDIR=/run/scratch/tmp
export PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PYTHONPATH={q(str(REPO_ROOT))}
{exports}
say() {{ echo "kernel-harness: $*"; }}
halt() {{
    sync
    # busybox's poweroff -f is a direct reboot(2), synchronous; the sysrq fallback is
    # asynchronous, so init must stay alive until the kernel stops (the host timeout
    # bounds this). QEMU exits when the guest powers off.
    /bin/busybox poweroff -f >/dev/null 2>&1
    echo o > /proc/sysrq-trigger
    exec sleep 60
}}
mount -t proc proc /proc
mount -t sysfs sysfs /sys
# The guest's own device nodes, shared memory and ptys (the host's /dev is read-only).
if mount -t devtmpfs devtmpfs /dev 2>/dev/null; then
    mkdir -p /dev/shm /dev/pts
    mount -t tmpfs tmpfs /dev/shm
    mount -t devpts devpts /dev/pts
fi
# /run, not /tmp: a tmpfs on /tmp would hide the host's /tmp (pytest's tmp_path, a venv).
mount -t tmpfs -o mode=0755 tmpfs /run
mkdir -p /run/out /run/netns /run/scratch/tmp /run/scratch/mp.d
mount -t 9p -o {NINEP} out /run/out || {{ say "cannot mount /run/out"; halt; }}
read -r up _ < /proc/uptime; echo "$up" > /run/out/t_init
# The kernel's modules are in its cache entry (lib/modules/<release>, seen through the host's
# root); modprobe's configuration is ours alone (-C), not the host's /etc/modprobe.d.
printf %s {q(config)} > /run/scratch/mp.d/lab.conf
printf '#!/bin/sh\\nexec /sbin/modprobe -C /run/scratch/mp.d -d %s "$@"\\n' \
    {q(str(guest.kernel.root))} > /run/scratch/modprobe
chmod 755 /run/scratch/modprobe
echo /run/scratch/modprobe > /proc/sys/kernel/modprobe
# One modprobe for all (fast); it stops at the first failure, so then go one by one.
mods={q(" ".join(modules))}
/run/scratch/modprobe -a $mods 2> /run/out/modprobe.err || for m in $mods; do
    grep -q "^$m " /proc/modules || /run/scratch/modprobe "$m" 2>> /run/out/modprobe.err
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


@functools.cache
def _precompile() -> None:
    """Byte-compile the project once per process: the guest's root is read-only, so
    whatever is not compiled on the host is compiled again, in memory, at every boot."""
    for folder in ("proxy", "labs", "tests", "bench"):
        compileall.compile_dir(REPO_ROOT / folder, quiet=1, workers=1)


def run_in_kernel(
    script: Path | str,
    args: Iterable[str] = (),
    *,
    workdir: Path,
    timeout: float = DEFAULT_TIMEOUT,
    modules: Sequence[str] = DEFAULT_MODULES,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    memory_mb: int = DEFAULT_MEMORY_MB,
    script_timeout: float | None = None,
    deny_modules: Sequence[str] = (),
    guest: QemuGuest | None = None,
) -> KernelResult:
    """Boot a fresh kernel, run ``python script *args`` in it, return what happened.

    ``workdir`` must be an empty-ish private folder (pytest's ``tmp_path``); it receives the
    generated init, the console log and the script's outputs. A script exiting non-zero is
    not an error here (inspect ``exit_code``, or call ``.check()``); a kernel that does not
    boot, or a run that exceeds ``timeout`` seconds, raises KernelError with the tail of the
    console log. Inside, the script itself is stopped after ``script_timeout`` seconds
    (default: ``timeout`` less a margin for booting) and then exits 124. The kernel's
    process group is killed on every exit path. ``deny_modules`` cannot be loaded in the
    guest (a kernel without them). ``guest`` defaults to the lab's (qemu.lab_guest).
    """
    script_path = Path(script).resolve()
    if not script_path.is_file():
        raise FileNotFoundError(script_path)
    if guest is None:
        guest = lab_guest()
    loadable, builtin = module_names(guest.kernel.modules)
    deny = [m.replace("-", "_") for m in deny_modules]
    wanted = [m.replace("-", "_") for m in modules if m.replace("-", "_") not in deny]
    missing = tuple(m for m in wanted if m not in loadable and m not in builtin)
    to_load = [m for m in wanted if m in loadable]
    _precompile()

    workdir = workdir.resolve()
    out_dir = workdir / "out"
    out_dir.mkdir(parents=True, exist_ok=False)
    init = workdir / "init.sh"
    init.write_text(init_script(
        guest=guest,
        modules=to_load,
        deny=deny,
        command=[python, str(script_path), *args],
        guest_timeout=script_timeout or max(5.0, timeout - GUEST_MARGIN),
        env=dict(env or {}),
    ))
    init.chmod(0o755)
    argv = guest.argv(workdir=workdir, init=init, out_dir=out_dir, memory_mb=memory_mb)
    console_path, qemu_log = workdir / "console.log", workdir / "qemu.log"

    started = time.time()
    deadline = time.monotonic() + timeout
    timed_out = False
    with qemu_log.open("wb") as qemu_out:
        # stdin is /dev/null, never the caller's terminal (CI has none). A session of its
        # own lets us kill QEMU and anything it started.
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=qemu_out,
                                stderr=subprocess.STDOUT, start_new_session=True, cwd=workdir)
        BOOTS.running.add(proc.pid)
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            # Kill before reaping: an unreaped leader keeps its pid (our pgid) from reuse.
            try:
                kill_group(proc.pid)
            finally:
                proc.wait()
                BOOTS.running.discard(proc.pid)
                guest.close(workdir)
    wall = time.time() - started
    BOOTS.count += 1
    BOOTS.seconds += wall
    BOOTS.described.add(guest.describe())
    console_text = _read(console_path)

    def fail(reason: str) -> KernelError:
        said = _read(qemu_log).strip()
        return KernelError(
            f"{reason} after {wall:.1f} s ({guest.describe()}; QEMU exit "
            f"{proc.returncode}{': ' + tail(said, 5) if said else ''}); files in "
            f"{workdir}\n--- script stderr (tail) ---\n{tail(_read(out_dir / 'stderr'), 20)}"
            f"\n--- console (tail) ---\n{tail(console_text, 40)}"
        )

    t_start = _float(out_dir / "t_start")
    if t_start is None:
        what = "did not start the script" if _float(out_dir / "t_init") else "did not boot"
        raise fail(f"the kernel {what}" + (f" within {timeout:.0f} s" if timed_out else ""))
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
        backend=guest.describe(),
        modules_loaded=tuple(m for m in wanted if m in loaded_now or m in builtin),
        modules_missing=missing,
        modules_failed=tuple(m for m in to_load if m not in loaded_now),
        modprobe_errors=_read(out_dir / "modprobe.err"),
    )
