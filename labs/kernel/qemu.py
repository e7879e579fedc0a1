"""The kernel lab's machine: Debian's own amd64 kernel under QEMU.

Boots on every x86 machine (Debian's user-mode Linux, the lab's first kernel, does not on
CPUs with a large XSAVE area: see docs/kernel-tests.md). The guest has no network device
(``-nodefaults``); it sees the host's root file system read-only through 9p (virtio), and
the run's result folder read-write through a second 9p share. Debian's kernel has virtio
and 9p as modules, so a tiny initramfs (a static busybox and those modules, written here
as a newc archive) loads them, mounts the host's root and hands over to the run's init.sh
with ``switch_root``.

Accelerator: KVM where a short probe boot shows it works, else TCG (software
emulation, with every CPU feature it can emulate: `-cpu max` booted 8% faster than the
default model). ``/dev/kvm`` may exist where a KVM guest hangs in early boot (nested
virtualisation), so its presence proves nothing. ``SLICEPROXY_QEMU_ACCEL=tcg|kvm``
skips the probe.
"""

from __future__ import annotations

import functools
import lzma
import os
import re
import shutil
import signal
import struct
import subprocess
import tempfile
import time
from pathlib import Path

from labs.kernel.debian_kernel import DebianKernel, KernelError, ensure
from proxy.netns_lab.poll import TimedOut, wait

QEMU = "qemu-system-x86_64"
BUSYBOX = Path("/bin/busybox")
CPUS = 2  # one emulated CPU made the agent's first sync twice as slow (14-16 s against
# 31-35 s, measured for issue 12)
ACCELS = ("auto", "tcg", "kvm")
PROBE_TIMEOUT = 8.0  # a working KVM reaches the initramfs in about a second
PROBE_MARK = "sliceproxy-initramfs: up"
# What the initramfs loads to reach the host's files; their dependencies come first.
INITRAMFS_MODULES = ("virtio_pci", "9pnet_virtio", "9p")
# 9p: the protocol version with Linux semantics, large messages; the read-only root
# cached loosely (its files do not change during a run; importing the agent took 5.5-6.5 s
# against 11-12 s, measured for issue 12), the result folder not at all (the host reads
# it after the guest is gone).
NINEP = "trans=virtio,version=9p2000.L,msize=512000"

INIT = f"""#!/bin/busybox sh
# PID 1 of the kernel lab's initramfs (labs/kernel/qemu.py).
bb=/bin/busybox
fail() {{ echo "sliceproxy-initramfs: $*"; $bb reboot -f; }}
$bb mount -t proc proc /proc
for ko in $($bb cat /modules/order); do
    $bb insmod /modules/$ko || fail "insmod $ko failed"
done
[ -n "$sliceproxy_probe" ] && {{ echo "{PROBE_MARK}"; $bb reboot -f; }}
$bb mount -t 9p -o {NINEP},ro,cache=loose hostroot /mnt || fail "cannot mount the host's root"
[ -x "/mnt$sliceproxy_init" ] || fail "no init at $sliceproxy_init"
$bb umount /proc
exec $bb switch_root /mnt "$sliceproxy_init"
"""


# Paths go into QEMU's comma-separated options and the kernel's blank-separated command
# line: refuse paths that would be mangled rather than debug a silent mis-mount.
_SAFE_PATH = re.compile(r"^/[A-Za-z0-9._+/@-]*$")


def check_path(path: Path, what: str) -> str:
    text = str(path)
    if not _SAFE_PATH.match(text):
        raise ValueError(f"{what} {text!r} must be absolute and free of blanks and commas")
    return text


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


def kill_group(pgid: int, grace: float = 10.0) -> None:
    """SIGKILL the process group the kernel ran in and wait until it is gone."""
    def gone() -> bool:
        if not _group_members(pgid):
            return True
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            return True
        return False

    try:
        wait(gone, grace, f"process group {pgid} to go", interval=0.02)
    except TimedOut:
        raise KernelError(f"kernel processes {_group_members(pgid)} survived SIGKILL") from None


def ordered_modules(modules_dep: str, targets: tuple[str, ...]) -> list[str]:
    """Paths (as in modules.dep) of `targets` and their dependencies, in load order."""
    deps: dict[str, list[str]] = {}
    by_name: dict[str, str] = {}
    for line in modules_dep.splitlines():
        if ":" in line:
            path, rest = line.split(":", 1)
            deps[path] = rest.split()
            by_name[path.rsplit("/", 1)[-1].split(".ko", 1)[0].replace("-", "_")] = path
    order: list[str] = []
    for target in targets:
        if target not in by_name:
            raise KernelError(f"the lab's kernel has no module {target} (needed to boot)")
        # modules.dep lists a module's dependencies so that the last loads first.
        for path in [*reversed(deps[by_name[target]]), by_name[target]]:
            if path not in order:
                order.append(path)
    return order


def newc_archive(entries: list[tuple[str, int, bytes, tuple[int, int]]]) -> bytes:
    """A newc ("070701") archive, the initramfs format, of (name, mode, data, device)."""
    out = []
    for ino, (name, mode, data, rdev) in enumerate([*entries, ("TRAILER!!!", 0, b"", (0, 0))]):
        fields = (ino + 1, mode, 0, 0, 1, 0, len(data), 0, 0, *rdev, len(name) + 1, 0)
        head = b"070701" + b"".join(b"%08X" % f for f in fields) + name.encode() + b"\0"
        out += [head, b"\0" * (-len(head) % 4), data, b"\0" * (-len(data) % 4)]
    return b"".join(out)


def _is_static(path: Path) -> bool:
    """An ELF executable with no PT_INTERP program header (no dynamic loader needed)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:  # 64-bit only
        return False
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    return all(struct.unpack_from("<I", data, phoff + i * phentsize)[0] != 3
               for i in range(phnum))


def _module_bytes(path: Path) -> bytes:
    if path.suffix == ".xz":
        return lzma.decompress(path.read_bytes())
    if path.suffix != ".ko":
        raise KernelError(f"{path}: cannot unpack this module format for busybox insmod")
    return path.read_bytes()


def initramfs(kernel: DebianKernel) -> bytes:
    """An uncompressed newc archive: /init, a static busybox, the 9p stack's modules."""
    if not BUSYBOX.is_file() or not _is_static(BUSYBOX):
        raise KernelError(f"{BUSYBOX} is missing or not statically linked: install the "
                          "Debian package busybox-static (./run setup does)")
    paths = ordered_modules((kernel.modules / "modules.dep").read_text(), INITRAMFS_MODULES)
    names = [p.rsplit("/", 1)[-1].split(".ko", 1)[0] + ".ko" for p in paths]
    none = (0, 0)
    return newc_archive([
        *((d, 0o40755, b"", none) for d in ("bin", "dev", "proc", "mnt", "modules")),
        ("dev/console", 0o20600, b"", (5, 1)),
        ("init", 0o100755, INIT.encode(), none),
        ("bin/busybox", 0o100755, BUSYBOX.read_bytes(), none),
        ("modules/order", 0o100644, "\n".join(names).encode() + b"\n", none),
        *((f"modules/{name}", 0o100644, _module_bytes(kernel.modules / path), none)
          for name, path in zip(names, paths, strict=True)),
    ])


def _accel_from_env() -> str:
    accel = os.environ.get("SLICEPROXY_QEMU_ACCEL", "auto")
    if accel not in ACCELS:
        raise KernelError(f"SLICEPROXY_QEMU_ACCEL={accel!r}: use one of {', '.join(ACCELS)}")
    return accel


class QemuGuest:
    """Boots the lab's kernel: what `labs.kernel.harness.run_in_kernel` runs."""

    def __init__(self, kernel: DebianKernel, accel: str | None = None,
                 kvm_device: Path = Path("/dev/kvm")) -> None:
        binary = shutil.which(QEMU)
        if binary is None:
            raise KernelError(f"{QEMU} not found: install the Debian package "
                              "qemu-system-x86 (./run setup does)")
        self.binary = binary
        self.kernel = kernel
        self._initramfs = initramfs(kernel)
        self.accel_reason = ""
        wanted = accel or _accel_from_env()
        self.accel = self._probe_accel(kvm_device) if wanted == "auto" else wanted

    def describe(self) -> str:
        why = f", {self.accel_reason}" if self.accel_reason else ""
        return f"qemu ({self.accel}{why}) with {self.kernel.describe()}"

    def _base_argv(self, initrd: Path, console: Path, accel: str, memory_mb: int,
                   append: str) -> list[str]:
        return [
            self.binary, "-nodefaults", "-no-user-config", "-display", "none", "-no-reboot",
            "-accel", accel, *(["-cpu", "max"] if accel == "tcg" else []),
            "-m", str(memory_mb), "-smp", str(CPUS),
            "-kernel", check_path(self.kernel.vmlinuz, "kernel image"),
            "-initrd", check_path(initrd, "initramfs"),
            "-serial", f"file:{check_path(console, 'console log')}",
            "-append", f"console=ttyS0 panic=-1 quiet {append}",
        ]

    def argv(self, *, workdir: Path, init: Path, out_dir: Path, memory_mb: int) -> list[str]:
        """Boot with `init` handed over to, its console in workdir/console.log."""
        initrd = workdir / "initramfs.cpio"
        initrd.write_bytes(self._initramfs)
        return [
            *self._base_argv(initrd, workdir / "console.log", self.accel, memory_mb,
                             f"sliceproxy_init={check_path(init, 'init script')}"),
            # The host's root spans several file systems (/proc, /sys, /tmp...) whose inode
            # numbers collide: without remapping, the guest took /sys for /proc.
            "-virtfs", "local,path=/,mount_tag=hostroot,security_model=none,readonly=on,"
            "multidevs=remap",
            "-virtfs",
            f"local,path={check_path(out_dir, 'result folder')},mount_tag=out,"
            "security_model=none",
        ]

    def close(self, workdir: Path) -> None:
        (workdir / "initramfs.cpio").unlink(missing_ok=True)

    def _probe_accel(self, kvm_device: Path) -> str:
        """kvm if a KVM guest reaches the initramfs within PROBE_TIMEOUT, else tcg."""
        if not os.access(kvm_device, os.R_OK | os.W_OK):
            self.accel_reason = f"no usable {kvm_device}"
            return "tcg"
        with tempfile.TemporaryDirectory(prefix="kvm-probe-") as tmp:
            work = Path(tmp)
            (work / "initramfs.cpio").write_bytes(self._initramfs)
            console, errors = work / "console.log", work / "qemu.log"
            argv = self._base_argv(work / "initramfs.cpio", console, "kvm", 256,
                                   "sliceproxy_probe=1")
            started = time.monotonic()
            exited = True
            with errors.open("wb") as err:
                proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=err,
                                        stderr=subprocess.STDOUT, start_new_session=True)
                try:
                    proc.wait(timeout=PROBE_TIMEOUT)
                except subprocess.TimeoutExpired:
                    exited = False
                finally:
                    kill_group(proc.pid)
                    proc.wait()
            took = time.monotonic() - started
            if PROBE_MARK in console.read_text(errors="replace"):
                self.accel_reason = f"KVM probe booted in {took:.1f} s"
                return "kvm"
            said = errors.read_text(errors="replace").strip().splitlines()
        self.accel_reason = (f"a KVM guest failed: {said[-1] if said else 'no reason given'}"
                             if exited else
                             f"a KVM guest did not boot within {PROBE_TIMEOUT:.0f} s")
        return "tcg"


@functools.cache
def lab_guest() -> QemuGuest:
    """The guest every kernel test and benchmark boots: built once per process (the
    accelerator probe boots a kernel)."""
    return QemuGuest(ensure())
