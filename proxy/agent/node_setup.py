"""kube-proxy's node settings, kept: `python -m proxy --init-only` writes them and exits
(the DaemonSets' privileged init container); the agent at start only reads them and
warns once if they differ, so an operator who skipped the init step sees it.

The values come from the same configuration the agent reads (its flags and ConfigMap,
or kube-proxy's own file with kube-proxy's defaults): dataplane/common/node_settings.py
says which and why, dataplane/common/node_files.py reads and writes them.
"""

from __future__ import annotations

import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from proxy.agent import logs
from proxy.config.options import Config
from proxy.dataplane.common.node_files import (
    NodeFiles,
    Outcome,
    Result,
    apply,
    check,
    node_cpus,
    request_module,
)
from proxy.dataplane.common.node_settings import NodeSettingsOptions, Setting, wanted

log = logging.getLogger("proxy.agent.node_setup")

EXIT_OK = 0


def node_settings_options(config: Config) -> NodeSettingsOptions:
    return NodeSettingsOptions(
        max_per_core=config.conntrack_max_per_core,
        minimum=config.conntrack_min,
        tcp_established=config.conntrack_tcp_timeout_established,
        tcp_close_wait=config.conntrack_tcp_timeout_close_wait,
        tcp_be_liberal=config.conntrack_tcp_be_liberal,
        udp_timeout=config.conntrack_udp_timeout,
        udp_stream_timeout=config.conntrack_udp_timeout_stream,
        ipvs=config.proxy_mode == "ipvs",
        strict_arp=config.ipvs_strict_arp,
    )


def node_settings(config: Config, root: Path = Path("/")) -> tuple[Setting, ...]:
    """What kube-proxy would set on this node with this configuration."""
    return wanted(node_settings_options(config), node_cpus(root), os.uname().release)


def _shown(r: Result) -> str:
    now = "absent" if r.before is None else str(r.before)
    return f"{r.setting.name}={now} (kube-proxy sets {r.setting.wanted})"


def init_only(config: Config) -> int:
    """`--init-only`: exit 0 whatever the kernel refused (a refusal must not keep the
    node's proxy from starting; it is logged)."""
    logs.setup(config.verbosity, fmt=config.logging_format)
    set_node_settings(config, NodeFiles())
    return EXIT_OK


def set_node_settings(config: Config, files: NodeFiles,
                      load: Callable[[str], None] | None = request_module) -> list[Result]:
    """Write what differs; log each change (old -> new), each refusal and each absent
    file with what kube-proxy would set, and a summary."""
    results = apply(files, node_settings(config, files.root), load)
    for r in results:
        s = r.setting
        if r.outcome is Outcome.CHANGED:
            log.info("node setting changed", extra={
                "setting": s.name, "old": r.before, "new": r.after, "why": s.why})
        elif r.outcome is Outcome.KEPT:
            log.log(logs.V(2), "node setting kept", extra={
                "setting": s.name, "current": r.before, "wanted": s.wanted})
        elif r.outcome is Outcome.ABSENT:
            log.warning("node setting not changed: its file does not exist", extra={
                "setting": s.name, "wanted": s.wanted, "why": s.why,
                "module": s.module or "none"})
        else:
            log.warning("node setting not changed: the kernel refused the write", extra={
                "setting": s.name, "current": r.before, "wanted": s.wanted, "why": s.why,
                "error": r.error})
    n = Counter(r.outcome for r in results)
    log.info("node settings done", extra={
        "mode": config.proxy_mode, "changed": n[Outcome.CHANGED], "kept": n[Outcome.KEPT],
        "refused": n[Outcome.REFUSED], "absent": n[Outcome.ABSENT]})
    return results


def warn_unkept(config: Config, root: Path = Path("/")) -> list[Result]:
    """At the agent's start: one warning naming every setting the node does not hold as
    kube-proxy would have set it (read only). Returns what it found."""
    results = check(NodeFiles(root), node_settings(config, root))
    differ = [r for r in results if r.outcome is not Outcome.KEPT]
    if differ:
        log.warning("node settings differ from what kube-proxy would set", extra={
            "settings": [_shown(r) for r in differ],
            "fix": "run `python -m proxy --init-only` with the agent's configuration, "
                   "privileged (the DaemonSets' init container)"})
    return results
