"""The images the real nodes run, built here with buildah: nothing can be pulled.

* `debian:bookworm-slim` (the Dockerfile's base) stands in for the registry's image: a
  minbase root file system made by mmdebstrap from Debian's own packages, with the same
  path excludes the official slim image uses (docs, man pages, locales), imported under
  the name the Dockerfile asks for. `--pull-never` then builds from it.
* sliceproxy's image: `buildah bud` of the repo's own `Dockerfile` and build context, as
  an operator builds it. The build's RUN steps reach Debian's mirror and PyPI through the
  host's network; the host's CA bundle and a pip.conf naming it are mounted into those
  steps only, for machines whose HTTPS goes through an intercepting proxy (these do).
* another version of sliceproxy's image, to upgrade to and roll back from: some of its
  modules replaced, one layer on top of the image (`layered`).
* the pod sandbox (`pause`): the static binary built from the Kubernetes tree
  (labs/realcp/build.py), alone in an image.
* kube-proxy v1.20.2 as kubeadm runs it (`<repository>/kube-proxy:v1.20.2`): upstream's
  image is Debian with iptables, conntrack and ipset beside the binary; this one is the
  same on `debian:bookworm-slim`, with the binary from the same source build.

Everything lives in buildah's own storage under the cache (outside the clone), so layers
are reused between runs; an image is exported once per content digest as a
docker-archive that `ctr images import` reads.

    python -m tests.nodes.images      # build (or reuse) every image; print sizes and times
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from labs.debian import CACHE_ROOT, locked

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
CACHE = CACHE_ROOT / "images"
STORAGE = ("--root", str(CACHE / "storage"), "--runroot", str(CACHE / "run"),
           "--storage-driver", "overlay")
BASE_REF = "docker.io/library/debian:bookworm-slim"
SLICEPROXY_REPO = "localhost/sliceproxy"
PAUSE_REF = "localhost/pause:3.4.1"
# kubeadm names it <imageRepository>/kube-proxy:<version>; the lab's repository is this.
IMAGE_REPOSITORY = "localhost"
KUBE_PROXY_REF = f"{IMAGE_REPOSITORY}/kube-proxy:v1.20.2"
# The image builders, the nodes' runtime, and dnsmasq for the lab's DNS (tests/nodes/dns.py).
APT_PACKAGES = ("buildah", "mmdebstrap", "containerd", "runc", "containernetworking-plugins",
                "dnsmasq-base")
# What the official slim images leave out (debuerreotype's --slim list).
SLIM_EXCLUDES = ("/usr/share/doc/*", "/usr/share/man/*", "/usr/share/info/*",
                 "/usr/share/locale/*", "/usr/share/lintian/*", "/usr/share/linda/*",
                 "/usr/share/groff/*")
SLIM_INCLUDES = ("/usr/share/doc/*/copyright", "/usr/share/locale/locale.alias")
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")
# Where the build steps see it: not under /etc/ssl, which packages installed there own.
BUILD_CA = "/spx-lab/ca.crt"


class ImageError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Image:
    ref: str  # e.g. localhost/sliceproxy:3f2a...
    archive: Path  # docker-archive for `ctr images import`
    size: str  # uncompressed, as buildah reports it
    build_seconds: float  # this call's build (0 when the export was cached)
    built_now: bool


def _run(cmd: Sequence[str], *, timeout: float = 1800,
         env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False,
                          timeout=timeout, env=env)
    if proc.returncode != 0:
        raise ImageError(f"{' '.join(cmd)} exited {proc.returncode}:\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    return proc.stdout


def buildah(*args: str, timeout: float = 1800) -> str:
    return _run(["buildah", *STORAGE, *args], timeout=timeout)


def ensure_tools() -> None:
    """Install the builder and node packages (Debian's) if missing."""
    from labs.debian import dpkg_installed

    missing = [p for p in APT_PACKAGES if not dpkg_installed(p)]
    if not missing:
        return
    with locked(CACHE_ROOT / "apt.lock"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        _run(["apt-get", "update", "-qq"], env=env)
        _run(["apt-get", "install", "-y", "-qq", "--no-install-recommends", *missing], env=env)


def _exists(ref: str) -> bool:
    proc = subprocess.run(["buildah", *STORAGE, "inspect", "--type", "image", ref],
                          capture_output=True, check=False)
    return proc.returncode == 0


def size_of(ref: str) -> str:
    """The image's size as buildah reports it (uncompressed, e.g. "409 MB")."""
    out = json.loads(buildah("images", "--json", ref))
    return str(out[0]["size"])


def base_image() -> float:
    """Make `debian:bookworm-slim` from Debian's packages unless it is there; seconds spent."""
    if _exists(BASE_REF):
        return 0.0
    started = time.monotonic()
    tar = CACHE / "bookworm-slim.tar"
    opts = [f"--dpkgopt=path-exclude={p}" for p in SLIM_EXCLUDES]
    opts += [f"--dpkgopt=path-include={p}" for p in SLIM_INCLUDES]
    _run(["mmdebstrap", "--variant=minbase", "--format=tar", "--quiet",
          "--hook-dir=/usr/share/mmdebstrap/hooks/merged-usr", *opts, "bookworm", str(tar)])
    ctr = buildah("from", "scratch").strip()
    try:
        buildah("add", ctr, str(tar), "/")
        buildah("config", "--cmd", "bash", "--env",
                "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", ctr)
        buildah("commit", "--quiet", ctr, BASE_REF)
    finally:
        buildah("rm", ctr)
        tar.unlink(missing_ok=True)
    return time.monotonic() - started


def context_digest(root: Path = ROOT) -> str:
    """A digest of what `buildah bud` sends: the Dockerfile and its build context."""
    h = hashlib.sha256()
    files = [root / "Dockerfile", root / ".dockerignore", root / "pyproject.toml",
             root / "README.md", root / "LICENSE", *sorted((root / "proxy").rglob("*"))]
    for f in files:
        if f.is_file() and "__pycache__" not in f.parts and f.suffix != ".pyc":
            h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def _export(ref: str, name: str) -> Path:
    archive = CACHE / "archives" / f"{name}.tar"
    if not archive.exists():
        archive.parent.mkdir(parents=True, exist_ok=True)
        tmp = archive.with_suffix(".tmp")
        tmp.unlink(missing_ok=True)
        buildah("push", "--quiet", ref, f"docker-archive:{tmp}:{ref}")
        tmp.replace(archive)
    return archive


def build_sliceproxy(root: Path = ROOT, tag: str | None = None, *,
                     layers: bool = True) -> Image:
    """The image of the repo's Dockerfile, tagged with its context digest by default."""
    tag = tag or context_digest(root)
    ref = f"{SLICEPROXY_REPO}:{tag}"
    with locked(CACHE / "build.lock"):
        base_image()
        built, seconds = False, 0.0
        if not _exists(ref):
            pipconf = CACHE / "pip.conf"
            pipconf.write_text(f"[global]\ncert = {BUILD_CA}\n")
            started = time.monotonic()
            buildah("bud", "--quiet", "--pull-never", "--network", "host",
                    f"--cni-config-dir={CACHE / 'cni'}",
                    f"--layers={'true' if layers else 'false'}",
                    "-v", f"{HOST_CA}:{BUILD_CA}:ro", "-v", f"{pipconf}:/etc/pip.conf:ro",
                    "-t", ref, "-f", str(root / "Dockerfile"), str(root))
            seconds, built = time.monotonic() - started, True
        archive = _export(ref, f"sliceproxy-{tag}")
        return Image(ref, archive, size_of(ref), seconds, built)


# Where the image's virtual environment holds the package (the Dockerfile's venv,
# Debian 12's Python).
SITE_PACKAGES = "/opt/sliceproxy/lib/python3.11/site-packages"


def layered(image: Image, suffix: str, sources: Mapping[str, str]) -> Image:
    """`image` with some of its package's modules replaced, as one layer on top, tagged
    `<tag>-<suffix>`: another version of the agent to roll to, made in seconds rather
    than by a build. `sources`: path in the repo ("proxy/...py") -> the module's new
    text. Only the source is replaced: its new size no longer matches the compiled
    file's record, so Python compiles it at start (in memory: the root is read-only)."""
    ref = f"{image.ref}-{suffix}"
    digest = hashlib.sha256(repr(sorted(sources.items())).encode()).hexdigest()[:12]
    key = f"{ref.rsplit('/', 1)[-1].replace(':', '-')}-{digest}"

    def steps(ctr: str) -> None:
        staging = CACHE / "layered" / key
        for path, text in sources.items():
            file = staging / path
            file.parent.mkdir(parents=True, exist_ok=True)
            file.write_text(text)
            buildah("copy", "--chmod", "0644", ctr, str(file), f"{SITE_PACKAGES}/{path}")
        shutil.rmtree(staging, ignore_errors=True)

    return _built_from(image.ref, ref, key, steps)


def _built_from(base: str, ref: str, key: str, steps: Callable[[str], None]) -> Image:
    """Image `ref` made from `base` by `steps` (buildah calls on a working container),
    unless it was already made for this `key` (e.g. a binary's digest)."""
    with locked(CACHE / "build.lock"):
        if base == BASE_REF:
            base_image()
        built, seconds = False, 0.0
        stamp = CACHE / f"{key}.built"
        if not (_exists(ref) and stamp.exists()):
            started = time.monotonic()
            ctr = buildah("from", "--pull-never", base).strip()
            try:
                steps(ctr)
                buildah("commit", "--quiet", "--rm", ctr, ref)
            except ImageError:
                subprocess.run(["buildah", *STORAGE, "rm", ctr], capture_output=True,
                               check=False)
                raise
            (CACHE / "archives" / f"{key}.tar").unlink(missing_ok=True)
            stamp.write_text("")
            seconds, built = time.monotonic() - started, True
        return Image(ref, _export(ref, key), size_of(ref), seconds, built)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16]


def build_pause(pause_binary: Path) -> Image:
    """The pod sandbox image: the static pause binary, alone."""
    def steps(ctr: str) -> None:
        buildah("copy", "--chmod", "0755", ctr, str(pause_binary), "/pause")
        buildah("config", "--entrypoint", '["/pause"]', "--user", "65535:65535", ctr)

    return _built_from("scratch", PAUSE_REF, f"pause-{_digest(pause_binary)}", steps)


def build_kube_proxy(binary: Path) -> Image:
    """kube-proxy's image: the binary on debian:bookworm-slim with the tools it calls."""
    def steps(ctr: str) -> None:
        buildah("run", "--network", "host", ctr, "--", "sh", "-c",
                "apt-get update -qq && apt-get install -y -qq --no-install-recommends "
                "iptables conntrack ipset kmod >/dev/null && rm -rf /var/lib/apt/lists/*")
        buildah("copy", "--chmod", "0755", ctr, str(binary), "/usr/local/bin/kube-proxy")
        buildah("config", "--entrypoint", '["/usr/local/bin/kube-proxy"]', ctr)

    return _built_from(BASE_REF, KUBE_PROXY_REF, f"kube-proxy-{_digest(binary)}", steps)


def forget(ref: str) -> None:
    """Remove an image and its exported archive (a cold-build measurement)."""
    subprocess.run(["buildah", *STORAGE, "rmi", "-f", ref], capture_output=True, check=False)
    for archive in (CACHE / "archives").glob("*.tar"):
        if ref.rsplit(":", 1)[-1] in archive.name:
            archive.unlink()


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    from labs.realcp.build import PAUSE, build

    parser = argparse.ArgumentParser(prog="python -m tests.nodes.images")
    parser.add_argument("--cold", action="store_true",
                        help="drop every image and layer first, the base too (a cold build)")
    parser.add_argument("--rebuild", action="store_true",
                        help="drop sliceproxy's image but keep the layers (a cached build)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    ensure_tools()
    if args.cold:
        shutil.rmtree(CACHE / "archives", ignore_errors=True)
        subprocess.run(["buildah", *STORAGE, "rmi", "-a", "-f"], capture_output=True,
                       check=False)
    if args.rebuild:
        forget(f"{SLICEPROXY_REPO}:{context_digest()}")
    started = time.monotonic()
    base = base_image()
    image = build_sliceproxy()
    pause = build_pause(build().path(PAUSE))
    kube_proxy = build_kube_proxy(build().path("kube-proxy"))
    for img in (image, pause, kube_proxy):
        print(f"{img.ref}: {img.size} ({img.archive.stat().st_size / 2**20:.0f} MiB archive), "
              f"built in {img.build_seconds:.1f}s"
              f"{'' if img.built_now else ' (cached)'}; {img.archive}")
    print(f"base {BASE_REF}: {size_of(BASE_REF)}, made in {base:.1f}s; "
          f"total {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
