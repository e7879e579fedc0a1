"""Shortcuts the renderers take for service ports with many endpoints write exactly
what the general code writes."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.dataplane.iptables.render import COMMENT_MAX, _arrow_comment, comment

ENDPOINT_TEXTS = st.sampled_from(["198.18.0.1:80", "[fd00::1]:8080", "198.19.255.254:65535",
                                  "[fd00:1:2:3:4:5:6:7]:1"])


@settings(max_examples=500, deadline=None)
@given(st.text(max_size=COMMENT_MAX + 20), ENDPOINT_TEXTS)
def test_arrow_comment_is_comment_of_the_whole_text(name: str, text: str) -> None:
    assert _arrow_comment(name)(text) == comment(f"{name} -> {text}")


@given(st.sampled_from(['ns/svc:http', 'a"b\\c\'d/e', "x" * (COMMENT_MAX - 10), "ü/ß:ä"]),
       st.text(max_size=30))
def test_arrow_comment_falls_back_for_any_other_text(name: str, text: str) -> None:
    assert _arrow_comment(name)(text) == comment(f"{name} -> {text}")
