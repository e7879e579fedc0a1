"""A digest of this agent's own code: what a rendered rule may depend on besides its
input.

A restart keeps a port's rules unrendered only when they were rendered from the same
input by the same code (nftables/restart.py). Which modules a renderer depends on is
not written anywhere a program can check, so every Python source of the `proxy`
package counts: any other build renders (and compares) every port again, and keeps
those whose rules come out the same.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from pathlib import Path

import proxy


@functools.cache
def source_digest() -> bytes:
    """16 bytes over the interpreter's version and every .py file of the package, by
    path and content. Random (never equal to another process's) if a source cannot be
    read or none is there: a package without its sources is not known to be the same
    code."""
    root = Path(proxy.__file__).parent
    h = hashlib.blake2b(sys.version.encode(), digest_size=16)
    sources = sorted(root.rglob("*.py"))
    try:
        for path in sources:
            h.update(str(path.relative_to(root)).encode() + b"\0")
            h.update(path.read_bytes())
    except OSError:
        return os.urandom(16)
    return h.digest() if sources else os.urandom(16)
