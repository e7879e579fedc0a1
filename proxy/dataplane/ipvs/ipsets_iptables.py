"""The ipset and iptables side of the IPVS plane: our ipsets (restored in one `ipset
restore`), our few fixed iptables rules per family (netfilter.py renders both), reading
them back for drift checks, and removing them at clean-up.

`writing` is held while we write iptables rules, so the legacy canary (common/
drift_watch.py) never reports our own writes as someone else's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from proxy.dataplane.base import DataplaneOptions
from proxy.dataplane.common.drift_watch import LegacyCanary, NftablesListener, watch_xtables
from proxy.dataplane.ipvs.kernel import IpsetError, Ipsets
from proxy.dataplane.ipvs.netfilter import cleanup_text, differences, restore_text
from proxy.dataplane.ipvs.ownership import read_set_keys
from proxy.dataplane.ipvs.render import SET_PREFIX, SetRole, VsKey, set_name
from proxy.dataplane.ipvs.run_record import RunRecord
from proxy.dataplane.xtables.restore_runner import IptablesRunner, RunnerError
from proxy.dataplane.xtables.saved import parse_save
from proxy.model.types import Family

Runners = dict[Family, IptablesRunner]


class IpsetsAndIptables:
    def __init__(self, options: DataplaneOptions) -> None:
        self.options = options
        self.writing = threading.Lock()
        self._canary: LegacyCanary | None = None

    def watch(self, runners: Runners, nft: bool, notify: Callable[[str], None]
              ) -> NftablesListener | LegacyCanary:
        """Start watching our iptables rules for other writers (`nft`: on the nf_tables
        back end)."""
        watch = watch_xtables(runners, nft, notify, self.writing)
        if isinstance(watch, LegacyCanary):
            self._canary = watch
        return watch

    def unwatch(self) -> None:
        self._canary = None

    def restore_sets(self, ipsets: Ipsets, text: str, run: RunRecord) -> bool:
        """One `ipset restore` of `text`; whether it worked."""
        if not text:
            return True
        try:
            ipsets.restore(text)
        except IpsetError as exc:
            run.fail(exc.offending or "ipset restore", exc)
            return False
        run.ipset_lines += text.count("\n")
        return True

    def write_rules(self, runners: Runners, run: RunRecord) -> None:
        for family, runner in runners.items():
            try:
                with self.writing:
                    text = restore_text(family, self.options, parse_save(runner.save()))
                    try:
                        runner.restore(text, noflush=True)
                    finally:
                        self._rebaseline()
                run.iptables_lines += text.count("\n")
            except RunnerError as exc:
                run.fail(getattr(exc, "offending", None) or f"iptables-restore ({family.label})",
                         exc, family=family.label)

    @staticmethod
    def owned_by_sets(ipsets: Ipsets) -> set[VsKey]:
        """Virtual servers our SERVICES sets list (what an earlier run programmed)."""
        return read_set_keys(ipsets, (set_name(SetRole.SERVICES, f) for f in Family))

    def rule_differences(self, runners: Runners) -> list[str]:
        """How our iptables chains and jumps (rule counts) differ from ours, per family."""
        found: list[str] = []
        for family, runner in runners.items():
            with self.writing:
                try:
                    saved = parse_save(runner.save())
                except RunnerError as exc:
                    found.append(f"{family.label}: our iptables rules could not be read: {exc}")
                    continue
                finally:
                    self._rebaseline()
            found += [f"{family.label}: {d}" for d in differences(family, self.options, saved)]
        return found

    @staticmethod
    def set_differences(ipsets: Ipsets, families: Iterable[Family]) -> list[str]:
        """Which of our ipsets are missing."""
        try:
            sets = set(ipsets.names())
        except IpsetError as exc:
            return [f"our ipsets could not be listed: {exc}"]
        return [f"ipset {n} is missing" for n in (
            set_name(role, family) for family in families for role in SetRole)
            if n not in sets]

    def remove_rules(self, runners: Runners, run: RunRecord) -> None:
        for family, runner in runners.items():
            try:
                with self.writing:
                    text = cleanup_text(parse_save(runner.save()))
                    if text:
                        runner.restore(text, noflush=True)
                        run.iptables_lines += text.count("\n")
                    self._rebaseline()
            except RunnerError as exc:
                run.fail(f"remove iptables chains ({family.label})", exc)

    @staticmethod
    def destroy_sets(ipsets: Ipsets, run: RunRecord) -> int:
        """Destroy our ipsets (after our iptables rules: a set in use cannot be
        destroyed); how many."""
        try:
            ours = [n for n in ipsets.names() if n.startswith(SET_PREFIX)]
            if ours:
                ipsets.restore("".join(f"destroy {n}\n" for n in ours))
            return len(ours)
        except IpsetError as exc:
            run.fail("destroy ipsets", exc)
            return 0

    def _rebaseline(self) -> None:
        """Our iptables write is done (caller holds `writing`): the legacy canary's
        summaries of now are ours."""
        if self._canary is not None:
            self._canary.rebaseline()
