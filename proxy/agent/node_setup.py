"""kube-proxy's node settings, kept: `python -m proxy --init-only` writes them and exits
(the DaemonSets' privileged init container); the agent at start only reads them and
warns once if they differ, so an operator who skipped the init step sees it.

The values come from the same configuration the agent reads (its flags and ConfigMap,
or kube-proxy's own file with kube-proxy's defaults): dataplane/common/node_settings.py
says which and why, dataplane/common/node_files.py reads and writes them.

What the node held before each change is recorded on the node (node_originals.py), so
that `python -m proxy --restore-node-settings`, the uninstall's last step on a node,
gives it back (docs/uninstall.md).
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
from proxy.dataplane.common.node_originals import Action, Record, noted, restoration
from proxy.dataplane.common.node_settings import (
    NodeSettingsOptions,
    Setting,
    shown_name,
    wanted,
)

log = logging.getLogger("proxy.agent.node_setup")

EXIT_OK, EXIT_FAILED = 0, 1


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


def _recorded(files: NodeFiles) -> Record:
    try:
        return files.read_record()
    except (OSError, ValueError) as exc:
        log.warning("the record of the node's original settings is unreadable: starting "
                    "a new one", extra={"record": str(files.record_path), "error": str(exc)})
        return {}


def _save(files: NodeFiles, record: Record) -> bool:
    try:
        if record:
            files.write_record(record)
        else:
            files.remove_record()
        return True
    except OSError as exc:
        log.warning("the node's original settings are not recorded: an uninstall cannot "
                    "give them back", extra={"record": str(files.record_path),
                                             "error": str(exc),
                                             "fix": "mount the node's /run/sliceproxy there, "
                                                    "writable (the manifests' host path)"})
        return False


def set_node_settings(config: Config, files: NodeFiles,
                      load: Callable[[str], None] | None = request_module) -> list[Result]:
    """Write what differs, recording first what the node held (node_originals.py); log
    each change (old -> new), each refusal and each absent file with what kube-proxy
    would set, and a summary."""
    settings = node_settings(config, files.root)
    old = _recorded(files)
    # The originals are on the node before any is overwritten, then what was written.
    intent = noted(old, [(r.setting.path, r.before, r.setting.value)
                         for r in check(files, settings)
                         if r.outcome is Outcome.DIFFERS and r.before is not None])
    saved = intent == old or _save(files, intent)
    results = apply(files, settings, load)
    done = noted(old, [(r.setting.path, r.before, r.after) for r in results
                       if r.outcome is Outcome.CHANGED and r.before is not None
                       and r.after is not None])
    if saved and done != intent:
        _save(files, done)
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


def restore_only(config: Config) -> int:
    """`--restore-node-settings`: exit 1 if a recorded setting could not be written back
    (its record is kept for another try)."""
    logs.setup(config.verbosity, fmt=config.logging_format)
    return restore_node_settings(NodeFiles())


def restore_node_settings(files: NodeFiles) -> int:
    """Give the node back each setting `--init-only` changed, where it still holds what
    was written then; remove the record."""
    try:
        record = files.read_record()
    except (OSError, ValueError) as exc:
        log.error("cannot read the record of the node's original settings", extra={
            "record": str(files.record_path), "error": str(exc)})
        return EXIT_FAILED
    current: dict[str, int | None] = {}
    for path in record:
        try:
            current[path] = files.read_path(path)
        except (OSError, ValueError):
            current[path] = None
    failed: Record = {}
    n: Counter[Action] = Counter()
    for step in restoration(record, current):
        name, was = shown_name(step.path), step.noted
        n[step.action] += 1
        if step.action is Action.CHANGED_SINCE:
            log.warning("node setting left as it is: changed since sliceproxy set it",
                        extra={"setting": name, "current": step.current,
                               "sliceproxy_set": was.ours, "original": was.original})
        elif step.action is Action.RESTORE:
            try:
                files.write_path(step.path, was.original)
            except OSError as exc:
                log.error("node setting not given back: the kernel refused the write",
                          extra={"setting": name, "current": step.current,
                                 "original": was.original, "error": str(exc)})
                failed[step.path] = was
                continue
            log.info("node setting given back", extra={
                "setting": name, "old": step.current, "new": was.original})
        else:
            log.log(logs.V(2), "node setting: nothing to give back", extra={
                "setting": name, "current": step.current, "why": step.action.value})
    try:
        if failed:
            files.write_record(failed)
        else:
            files.remove_record()
    except OSError as exc:
        log.error("cannot update the record", extra={
            "record": str(files.record_path), "error": str(exc)})
        return EXIT_FAILED
    log.info("node settings given back", extra={
        "restored": n[Action.RESTORE] - len(failed), "changed_since": n[Action.CHANGED_SINCE],
        "failed": len(failed), "recorded": len(record)})
    return EXIT_FAILED if failed else EXIT_OK
