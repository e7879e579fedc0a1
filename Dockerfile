# sliceproxy's node agent image.
#
#   docker build -t sliceproxy:0.1.0 .
#   docker run --rm sliceproxy:0.1.0 --help
#
# Stage 1 builds wheels (python-iptables compiles a small C extension, so gcc lives
# only here); stage 2 is a slim runtime with the kernel tools the data planes call.

FROM python:3.11-slim-bookworm AS build
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
COPY proxy ./proxy
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM python:3.11-slim-bookworm
# iptables (legacy and nft back ends), ipset, conntrack and ipvsadm for the data planes
# and operators; nftables (nft and libnftables1) for --proxy-mode nftables; iproute2 for addresses (`ip`). No kmod: the container cannot load
# modules (no SYS_MODULE, no /lib/modules), the node must have them (docs/security.md).
RUN apt-get update \
 && apt-get install -y --no-install-recommends \
      iptables ipset conntrack ipvsadm nftables iproute2 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir --no-index --find-links=/wheels sliceproxy \
 && rm -rf /wheels
# Unprivileged by default (`explain` and `--help` need nothing more). The agent itself
# needs uid 0 with NET_ADMIN and NET_RAW: deploy/daemonset.yaml asks for exactly that.
RUN useradd --system --uid 65532 --no-create-home --shell /usr/sbin/nologin sliceproxy
USER 65532
ENV PYTHONUNBUFFERED=1
EXPOSE 10256
ENTRYPOINT ["python", "-m", "proxy"]
