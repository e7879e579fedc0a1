# sliceproxy's node agent image.
#
#   docker build -t sliceproxy:0.1.0 .        (or: buildah bud -t sliceproxy:0.1.0 .)
#   docker run --rm sliceproxy:0.1.0 --help
#
# Debian 12 and Debian's own Python 3.11 and kernel tools, the distribution the project is
# tested on (docs/image.md says why this base and not python:3.11-slim, with sizes and
# build times). Stage 1 builds a virtual environment (python-iptables compiles a small C
# extension, so gcc lives only there); stage 2 copies it beside the tools the data planes
# call. Dependencies are installed before the package's own code, so a code change
# rebuilds only the last layers.

FROM debian:bookworm-slim AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/sliceproxy
WORKDIR /src
COPY pyproject.toml README.md ./
# The dependencies alone first (from pyproject.toml's list), as their own layer.
RUN /opt/sliceproxy/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/requirements.txt \
 && /opt/sliceproxy/bin/pip install --no-cache-dir -r /tmp/requirements.txt
COPY proxy ./proxy
# pip compiles every module to bytecode as it installs (the root file system is read-only
# at run time); pip and setuptools themselves are not needed there. Size (docs/image.md):
# the extension modules lose their debug symbols, and the `kubernetes` package its
# bytecode (52 MB): it is imported only for kubeconfigs with exec or auth-provider
# plugins, never in the DaemonSet, which reads its service account directly.
RUN /opt/sliceproxy/bin/pip install --no-cache-dir --no-deps . \
 && /opt/sliceproxy/bin/python -m pip uninstall -q -y pip setuptools \
 && find /opt/sliceproxy -name '*.so' -exec strip --strip-unneeded {} + \
 && find /opt/sliceproxy/lib/python3*/site-packages/kubernetes -name __pycache__ -prune \
      -exec rm -rf {} +

FROM debian:bookworm-slim
# python3 runs the virtual environment built above (same Debian Python, same path).
# iptables (legacy and nft back ends), ipset, conntrack and ipvsadm for the data planes
# and operators; nftables (nft and libnftables1) for --proxy-mode nftables; iproute2 for
# addresses (`ip`). No kmod: the container cannot load modules (no SYS_MODULE, no
# /lib/modules), the node must have them (docs/security.md).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      python3 iptables ipset conntrack ipvsadm nftables iproute2 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /opt/sliceproxy /opt/sliceproxy
COPY LICENSE /usr/share/doc/sliceproxy/LICENSE
# Unprivileged by default (`explain` and `--help` need nothing more). The agent itself
# needs uid 0 with NET_ADMIN and NET_RAW: deploy/daemonset.yaml asks for exactly that.
RUN useradd --system --uid 65532 --no-create-home --shell /usr/sbin/nologin sliceproxy
USER 65532
ENV PATH=/opt/sliceproxy/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
EXPOSE 10256
ENTRYPOINT ["python", "-m", "proxy"]
