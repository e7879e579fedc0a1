"""Debian's own amd64 kernel for the kernel lab: downloaded, never installed, and cached.

    python -m labs.kernel.debian_kernel      # fetch (or reuse) it and say where it is

The host's kernel has no IPVS, so the lab boots Debian 12's generic amd64 kernel under
QEMU (the ``cloud`` flavour has no 9p, which the guest needs to see the host's files).
The package ``linux-image-amd64`` depends on is fetched with ``apt-get download`` and
unpacked with ``dpkg-deb -x`` into ``/var/cache/sliceproxy/kernel/<package>_<version>/``,
outside the clone, so a fresh clone on the same machine reuses it. Only the modules the
lab can use are kept (networking, virtio, 9p and what they depend on: ~40 MB of the
package's 400), then ``depmod`` indexes them. A manifest written last marks an entry
complete; entries of other versions are removed once a newer one is ready. When the
package index cannot be read or the download fails, the newest complete entry is used,
with a warning; with none, KernelError says what to run.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from labs.debian import CACHE_ROOT, locked

log = logging.getLogger("labs.kernel.debian_kernel")

META_PACKAGE = "linux-image-amd64"
KERNEL_CACHE = CACHE_ROOT / "kernel"
MANIFEST = "manifest.json"
# Bumped whenever what an entry holds changes (pruning, layout), so an old one is refetched.
RECIPE = 2
# Module folders the lab may load from (the agent's netfilter, IPVS, ipset, namespaces,
# veth and dummy links, bridges), the ones the initramfs needs to reach the host's files,
# and the crypto and library modules that others ask for by name at run time (libcrc32c
# loads "crypto-crc32c": not a dependency modules.dep lists); everything these depend on
# is kept too.
KEEP_PREFIXES = ("kernel/net/", "kernel/drivers/virtio/", "kernel/fs/9p/", "kernel/fs/netfs/",
                 "kernel/fs/fscache/", "kernel/crypto/", "kernel/arch/x86/crypto/",
                 "kernel/lib/")
KEEP_MODULES = ("veth", "dummy")


class KernelError(AssertionError):
    """The kernel lab cannot run: the message says why and what to do."""


@dataclass(frozen=True, slots=True)
class DebianKernel:
    """One complete cache entry."""

    root: Path  # holds boot/ and lib/modules/<release>/, as the package laid them out
    package: str  # linux-image-6.1.0-56-amd64
    version: str  # 6.1.192-2
    release: str  # 6.1.0-56-amd64: `uname -r` in the guest

    @property
    def vmlinuz(self) -> Path:
        return self.root / "boot" / f"vmlinuz-{self.release}"

    @property
    def modules(self) -> Path:
        return self.root / "lib" / "modules" / self.release

    def describe(self) -> str:
        return f"Debian {self.package} {self.version}"


def _run(cmd: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise KernelError(f"{' '.join(cmd)} exited {proc.returncode}: "
                          f"{(proc.stdout + proc.stderr).strip()[-2000:]}")
    return proc.stdout


def depends_on(show_output: str) -> tuple[str, str] | None:
    """(package, version) of the kernel image in `apt-cache show linux-image-amd64`."""
    match = re.search(r"^Depends:.*?\b(linux-image-[0-9][^\s,(]*-amd64)\s*\(=\s*([^)\s]+)\)",
                      show_output, re.MULTILINE)
    return (match.group(1), match.group(2)) if match else None


def candidate() -> tuple[str, str]:
    """The kernel package and version apt would install now (reading the package index,
    refreshed once if it does not know the meta package)."""
    for attempt in range(2):
        proc = subprocess.run(["apt-cache", "show", "--no-all-versions", META_PACKAGE],
                              capture_output=True, text=True, check=False)
        found = depends_on(proc.stdout) if proc.returncode == 0 else None
        if found:
            return found
        if attempt == 0:
            _run(["apt-get", "update", "-qq"])
    raise KernelError(f"apt-cache show {META_PACKAGE} names no kernel package")


def entry_name(package: str, version: str) -> str:
    return re.sub(r"[^A-Za-z0-9.+-]", "_", f"{package}_{version}") + f"-r{RECIPE}"


def load(root: Path) -> DebianKernel | None:
    """The entry at `root` if its manifest is there and its kernel image too."""
    try:
        manifest = json.loads((root / MANIFEST).read_text())
        kernel = DebianKernel(root, manifest["package"], manifest["version"],
                              manifest["release"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not kernel.vmlinuz.is_file() or not (kernel.modules / "modules.dep").is_file():
        return None
    return kernel


def complete_entries() -> list[DebianKernel]:
    """Every complete entry, newest first (by manifest time)."""
    found = [k for p in KERNEL_CACHE.glob("*") if p.is_dir() and (k := load(p)) is not None]
    return sorted(found, key=lambda k: (k.root / MANIFEST).stat().st_mtime, reverse=True)


def _module_deps(modules: Path) -> dict[str, list[str]]:
    """modules.dep as {module path: [dependency paths]}, paths relative to `modules`."""
    deps: dict[str, list[str]] = {}
    for line in (modules / "modules.dep").read_text().splitlines():
        if ":" in line:
            name, rest = line.split(":", 1)
            deps[name.strip()] = rest.split()
    return deps


def _module_name(path: str) -> str:
    return path.rsplit("/", 1)[-1].split(".ko", 1)[0].replace("-", "_")


def keep_set(deps: dict[str, list[str]]) -> set[str]:
    """The module paths the lab keeps: KEEP_PREFIXES, KEEP_MODULES, and all they need."""
    wanted = {p for p in deps if p.startswith(KEEP_PREFIXES) or _module_name(p) in KEEP_MODULES}
    return wanted | {d for p in wanted for d in deps.get(p, ())}


def _prune(root: Path, release: str) -> int:
    """Delete what the lab cannot use; return how many modules are kept."""
    modules = root / "lib" / "modules" / release
    _run(["depmod", "-b", str(root), release])
    keep = keep_set(_module_deps(modules))
    for ko in modules.joinpath("kernel").rglob("*.ko*"):
        if str(ko.relative_to(modules)) not in keep:
            ko.unlink()
    shutil.rmtree(root / "usr", ignore_errors=True)  # documentation, bug scripts
    _run(["depmod", "-b", str(root), release])  # index what is left
    return len(keep)


def fetch(package: str, version: str) -> DebianKernel:
    """Download, unpack, prune and index `package` at `version` into its cache entry."""
    final = KERNEL_CACHE / entry_name(package, version)
    work = KERNEL_CACHE / f".work-{final.name}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    started = time.monotonic()
    try:
        _run(["apt-get", "download", f"{package}={version}"], cwd=work)
        (deb,) = work.glob("*.deb")
        root = work / "root"
        _run(["dpkg-deb", "-x", str(deb), str(root)])
        deb.unlink()
        releases = [p.name for p in (root / "lib" / "modules").iterdir() if p.is_dir()]
        if len(releases) != 1:
            raise KernelError(f"{package} holds modules for {releases}, expected one release")
        release = releases[0]
        kept = _prune(root, release)
        kernel = DebianKernel(root, package, version, release)
        if not kernel.vmlinuz.is_file():
            raise KernelError(f"{package} has no {kernel.vmlinuz.relative_to(root)}")
        (root / MANIFEST).write_text(json.dumps({
            "package": package, "version": version, "release": release,
            "modules_kept": kept, "fetched_seconds": round(time.monotonic() - started, 1),
            "fetched_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        root.rename(final)  # complete, manifest included, or not there at all
    finally:
        shutil.rmtree(work, ignore_errors=True)
    loaded = load(final)
    assert loaded is not None, final
    return loaded


def ensure() -> DebianKernel:
    """The kernel to boot: apt's current candidate, fetched if not cached yet; the newest
    cached one when the candidate cannot be known or fetched."""
    with locked(CACHE_ROOT / "kernel.lock"):
        try:
            package, version = candidate()
            kernel = load(KERNEL_CACHE / entry_name(package, version))
            if kernel is None:
                log.info("fetching the lab's kernel", extra={"package": package,
                                                             "version": version})
                kernel = fetch(package, version)
        except (KernelError, OSError) as exc:
            cached = complete_entries()
            if not cached:
                raise KernelError(
                    f"no Debian kernel for the kernel lab in {KERNEL_CACHE} and none could be "
                    f"fetched ({exc}); `sudo ./run setup` fetches it (needs Debian's package "
                    "registry)") from exc
            log.warning("using the newest cached kernel: %s", exc)
            return cached[0]
        for other in KERNEL_CACHE.glob("*"):
            if other.is_dir() and other != kernel.root and not other.name.startswith("."):
                shutil.rmtree(other, ignore_errors=True)  # an older version's entry
        return kernel


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        kernel = ensure()
    except KernelError as exc:
        print(f"kernel lab: {exc}", file=sys.stderr)
        return 1
    print(f"kernel lab: {kernel.describe()} (release {kernel.release}) in {kernel.root}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
