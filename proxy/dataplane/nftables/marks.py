"""The elements of @fingerprints a port has beside its rules (pure): 128-bit digests,
spelled as the set's key (four IPv4 addresses, or one IPv6 address).

- its fingerprint (render.fingerprint): of what it writes, its output, written with
  it. A restart that renders the port compares it: any version whose rules for it come
  out the same keeps them.
- its input mark (`InputMarks`): of what it was rendered from, by which code (the
  resolved port, the render context, the shard count, source_digest). A restart by the
  same build over an unchanged port finds its mark without rendering the port at all
  (restart.kept_by_marks). Only for a port whose rules are what that input alone
  renders (`PortObjects.from_input`: not after an endpoint delta, nor a render that kept
  earlier slots), and added after the sync that wrote the port, when the agent is idle
  (mark_steps.py's `_write_marks`, from the data plane's housekeeping): ~28 us a
  port, which neither a start nor a change waits for.
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import socket

from proxy.dataplane.common.context import RenderContext
from proxy.dataplane.common.naming import packed_v6_text
from proxy.dataplane.common.source_digest import source_digest
from proxy.dataplane.nftables.objects import Key
from proxy.model.digest import ResolutionDigests, flat
from proxy.model.snapshot import ResolvedServicePort
from proxy.model.types import Family


def spelled(family: Family, digest: bytes) -> Key:
    """16 bytes as an element of @fingerprints in `family`'s table."""
    if family is Family.V4:
        return tuple(socket.inet_ntoa(digest[i:i + 4]) for i in range(0, 16, 4))
    return (packed_v6_text(digest),)


class InputMarks:
    """Input marks in one context: `of(rsp)`. The context's part (code, context, shard
    count) is hashed once; the resolution's by model/digest.py (~28 us a port of 10
    endpoints, a third of rendering it)."""

    __slots__ = ("_digests", "_prefix", "family")

    def __init__(self, ctx: RenderContext, shards: int) -> None:
        self.family = ctx.family
        self._prefix = hashlib.blake2b(
            source_digest() + marshal.dumps((flat(ctx), shards)), digest_size=16).digest()
        self._digests = ResolutionDigests()

    def of(self, rsp: ResolvedServicePort) -> Key:
        return spelled(self.family, self._digests.of(rsp, self._prefix))


@functools.lru_cache(maxsize=8)
def marks_for(ctx: RenderContext, shards: int) -> InputMarks:
    """The InputMarks of a context: a sync renders its ports in one or two."""
    return InputMarks(ctx, shards)
