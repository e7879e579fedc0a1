"""What the node held before sliceproxy, given back on uninstall: the `--init-only` step
records each setting's original the first time it changes it, and
`--restore-node-settings` writes it back only where the node still holds sliceproxy's
value. On a fake node (tests/unit/test_node_settings.py's); the real kernel in a network
namespace: tests/e2e/test_node_settings_kernel.py."""

from __future__ import annotations

import errno
import json
import logging
from pathlib import Path

import pytest

from proxy.agent.node_setup import restore_node_settings, set_node_settings
from proxy.cmd.cli import main
from proxy.config.options import parse_args
from proxy.dataplane.common.node_originals import (
    Action,
    Noted,
    dumps,
    loads,
    noted,
    restoration,
)
from tests.unit.test_node_settings import (
    CLOSE_WAIT,
    ESTABLISHED,
    HASHSIZE,
    KERNEL,
    MAX,
    FakeNode,
    conntrack_files,
)

# --- the record (pure) --------------------------------------------------------------------


def test_the_first_original_is_kept_and_ours_follows_the_last_write() -> None:
    first = noted({}, [(ESTABLISHED, 7200, 86400)])
    again = noted(first, [(ESTABLISHED, 86400, 3600), (CLOSE_WAIT, 60, 3600)])
    assert again == {ESTABLISHED: Noted(7200, 3600), CLOSE_WAIT: Noted(60, 3600)}
    assert first == {ESTABLISHED: Noted(7200, 86400)}  # not changed in place
    assert noted(first, []) == first


@pytest.mark.parametrize(("current", "action"), [
    (86400, Action.RESTORE),  # still ours
    (1234, Action.CHANGED_SINCE),  # someone else's now
    (7200, Action.CHANGED_SINCE),  # already back, by someone else
    (None, Action.GONE),  # its module unloaded since
], ids=["ours", "another value", "the original again", "no file"])
def test_only_a_value_still_ours_is_given_back(current: int | None, action: Action) -> None:
    record = {ESTABLISHED: Noted(7200, 86400)}
    (step,) = restoration(record, {ESTABLISHED: current})
    assert (step.path, step.current, step.action) == (ESTABLISHED, current, action)


def test_given_back_in_the_reverse_order_of_the_changes() -> None:
    record = noted({}, [(MAX, 65536, 131072), (HASHSIZE, 16384, 32768)])
    steps = restoration(record, {MAX: 131072, HASHSIZE: 32768})
    assert [(s.path, s.noted.original) for s in steps] == [(HASHSIZE, 16384), (MAX, 65536)]
    assert restoration(noted({}, [(MAX, 1, 1)]), {MAX: 1})[0].action is Action.UNCHANGED


def test_the_record_reads_back_and_refuses_what_it_did_not_write() -> None:
    record = {MAX: Noted(65536, 131072), ESTABLISHED: Noted(432000, 86400)}
    assert loads(dumps(record)) == record
    assert list(loads(dumps(record))) == [MAX, ESTABLISHED]  # the order of the changes
    for text in ("", "[]", '{"version": 2, "settings": {}}', '{"version": 1}',
                 '{"version": 1, "settings": {"x": {"original": "a", "ours": 1}}}'):
        with pytest.raises(ValueError):
            loads(text)


# --- the init step records, the restore gives back (fake node) ----------------------------


def recorded(node: FakeNode) -> dict[str, tuple[int, int]]:
    doc = json.loads(node.record_path.read_text())
    return {p: (v["original"], v["ours"]) for p, v in doc["settings"].items()}


def test_a_new_node_gets_its_own_values_back_and_the_record_goes(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, conntrack_files(established=7200))
    set_node_settings(parse_args([]), node, load=None)
    assert node.record_path == tmp_path / "run/sliceproxy/node-settings.json"
    assert recorded(node) == {MAX: (65536, 131072), HASHSIZE: (16384, 32768),
                              ESTABLISHED: (7200, 86400), CLOSE_WAIT: (60, 3600)}
    # The agent restarts, the step runs again: nothing changes, the originals stay.
    set_node_settings(parse_args([]), node, load=None)
    assert recorded(node)[ESTABLISHED] == (7200, 86400)
    assert restore_node_settings(node) == 0
    assert {p: node.value(p) for p in (MAX, HASHSIZE, ESTABLISHED, CLOSE_WAIT)} == {
        MAX: 65536, HASHSIZE: 16384, ESTABLISHED: 7200, CLOSE_WAIT: 60}
    assert not node.record_path.exists() and not node.record_path.parent.exists()


def test_a_node_switched_from_kube_proxy_has_nothing_recorded_and_keeps_its_values(
        tmp_path: Path) -> None:
    """kube-proxy set them first: the step changes nothing, so there is nothing of
    sliceproxy's to give back, and they stay as kube-proxy left them."""
    kube_proxys = conntrack_files(max=131072, hashsize=32768, established=86400,
                                  close_wait=3600)
    node = FakeNode(tmp_path, kube_proxys)
    set_node_settings(parse_args([]), node, load=None)
    assert not node.record_path.exists() and node.writes == []
    assert restore_node_settings(node) == 0
    assert {p: node.value(p) for p in kube_proxys} == kube_proxys


def test_a_later_configuration_keeps_the_first_original(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, conntrack_files())
    set_node_settings(parse_args([]), node, load=None)
    set_node_settings(parse_args(["--conntrack-tcp-timeout-established=2h"]), node,
                      load=None)
    assert recorded(node)[ESTABLISHED] == (KERNEL[ESTABLISHED], 7200)
    assert restore_node_settings(node) == 0
    assert node.value(ESTABLISHED) == KERNEL[ESTABLISHED]


def test_a_value_changed_since_is_left_and_logged(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    node = FakeNode(tmp_path, conntrack_files())
    set_node_settings(parse_args([]), node, load=None)
    (tmp_path / CLOSE_WAIT).write_text("120\n")  # an operator's sysctl since
    with caplog.at_level(logging.INFO, logger="proxy"):
        assert restore_node_settings(node) == 0
    assert node.value(CLOSE_WAIT) == 120 and node.value(ESTABLISHED) == KERNEL[ESTABLISHED]
    (left,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert left.getMessage() == "node setting left as it is: changed since sliceproxy set it"
    assert (left.__dict__["setting"], left.__dict__["current"], left.__dict__["original"]) \
        == ("net.netfilter.nf_conntrack_tcp_timeout_close_wait", 120, KERNEL[CLOSE_WAIT])
    assert not node.record_path.exists()


def test_a_refused_write_is_not_recorded(tmp_path: Path) -> None:
    """A node that is a network namespace: the global table size is refused, so only the
    per-namespace timeouts are sliceproxy's to give back."""
    node = FakeNode(tmp_path, conntrack_files(),
                    refuse={MAX: errno.EACCES, HASHSIZE: errno.EACCES})
    set_node_settings(parse_args([]), node, load=None)
    assert recorded(node) == {ESTABLISHED: (KERNEL[ESTABLISHED], 86400),
                              CLOSE_WAIT: (KERNEL[CLOSE_WAIT], 3600)}


class RefusingLater(FakeNode):
    read_only: tuple[str, ...] = ()

    def write_path(self, path: str, value: int) -> None:
        if path in self.read_only:
            raise OSError(errno.EROFS, "Read-only file system")
        super().write_path(path, value)


def test_a_refused_restore_fails_and_keeps_only_what_is_left_to_give_back(
        tmp_path: Path) -> None:
    node = RefusingLater(tmp_path, conntrack_files())
    set_node_settings(parse_args([]), node, load=None)
    node.read_only = (CLOSE_WAIT,)
    assert restore_node_settings(node) == 1
    assert recorded(node) == {CLOSE_WAIT: (KERNEL[CLOSE_WAIT], 3600)}
    assert node.value(ESTABLISHED) == KERNEL[ESTABLISHED]


def test_without_a_writable_record_the_settings_are_still_set(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """An init container without the host path (a manifest from before): the node still
    gets kube-proxy's values; the warning says the uninstall cannot give them back."""
    node = FakeNode(tmp_path, conntrack_files())
    (tmp_path / "run").write_text("not a folder")
    with caplog.at_level(logging.WARNING, logger="proxy"):
        set_node_settings(parse_args([]), node, load=None)
    assert node.value(ESTABLISHED) == 86400
    (warning,) = [r for r in caplog.records
                  if r.getMessage().startswith("the node's original settings are not")]
    assert "/run/sliceproxy" in warning.__dict__["fix"]


def test_no_record_is_nothing_to_do(tmp_path: Path) -> None:
    node = FakeNode(tmp_path, conntrack_files())
    assert restore_node_settings(node) == 0 and node.writes == []
    node.record_path.parent.mkdir(parents=True)
    node.record_path.write_text("garbage")
    assert restore_node_settings(node) == 1 and node.record_path.exists()


def test_restore_is_one_of_the_three_one_shot_commands(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--restore-node-settings", "--init-only"]) == 2
    assert "--init-only and --restore-node-settings: give one" in capsys.readouterr().err
    assert main(["--cleanup", "--restore-node-settings"]) == 2
