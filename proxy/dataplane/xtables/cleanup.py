"""Removing sliceproxy's chains from x_tables, in any back end: `--cleanup`, a mode
switch, and the IPVS mode removing the iptables mode's leftovers.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence

from proxy.dataplane.xtables.restore_runner import (
    Backend,
    IptablesRunner,
    Runner,
    RunnerError,
    binary,
)
from proxy.dataplane.xtables.saved import cleanup_restore, ours, parse_save
from proxy.model.types import Family


def cleanup_runners(families: Sequence[Family]) -> list[Runner]:
    """A runner for each family and back end whose binaries exist (no detection)."""
    return [IptablesRunner(family, backend) for family in families for backend in Backend
            if shutil.which(binary(family, backend, "save"))
            and shutil.which(binary(family, backend, "restore"))]


def remove_chains(runners: Sequence[Runner], owned: Callable[[str], bool] = ours
                  ) -> list[tuple[Runner, int]]:
    """Remove the chains `owned` names (every `SPX-` chain by default), and every rule
    jumping to one, through each runner (ruleset.cleanup_restore); nothing else. The
    runners that removed something, with how many chains. A back end whose save fails
    is skipped (unusable here: nothing of ours in it); a refused restore raises
    RestoreError."""
    done = []
    for runner in runners:
        # Plain save only: asking legacy for a table (as `available` does) would
        # create it, and iptables-save would then differ from before.
        try:
            saved = runner.save()
        except RunnerError:
            continue
        text = cleanup_restore(parse_save(saved), owned)
        rendered = text.render()
        if rendered:
            runner.restore(rendered)
            done.append((runner, sum(len(text.delete[t]) for t in text.delete)))
    return done
