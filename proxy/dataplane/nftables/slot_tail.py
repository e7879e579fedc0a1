"""How a very large slot-mapped path splits its slots between two maps (pure), so that a
change of its endpoint count rebinds a map of hundreds of elements, not of the whole
service.

The kernel checks every element of a map when a rule naming it is added
(`nf_tables_bind_set` walks the map: about 65 ns an element). A slot map's one rule
holds n (`numgen random mod n`), so with one map every endpoint added or gone in a
path of 50,000 would rewrite that rule and walk 50,000 elements: most of a change's
kernel time. From SPLIT_MIN endpoints on, a path's slots 0..n-1 are split at `main`:

    svc-<h>          ...; jump tail-svc-<h>;
                     dnat to numgen random mod <main> map @slots-svc-<h>
    tail-svc-<h>     numgen random mod <n> < <n - main>
                         dnat to numgen random mod <n - main> map @tail-svc-<h>

@slots-svc-<h> holds slots 0..main-1, @tail-svc-<h> the others (slot main + i at
key i). The tail rule takes a connection with probability (n - main) / n and picks
uniformly among the tail's endpoints; the others go to the main map, uniformly: every
endpoint gets 1/n, as with one map. A change of n rewrites the tail chain's one rule
(a walk of at most TAIL_MAX elements), not the main rule, while the tail keeps between
1 and TAIL_MAX endpoints; past that, `main` moves so that the tail holds TAIL again:
one walk of the main map every TAIL changes in one direction, at the most.

Where `main` is depends on where it was (`main_size`), so a port rendered whole is
given the slots the kernel holds (render.render_port's `slots`), as for the slots
themselves.
"""

from __future__ import annotations

SPLIT_MIN = 1024  # endpoints in a path from which its slots are split
TAIL = 256  # the tail's size after the split moves
TAIL_MAX = 2 * TAIL  # the most a tail holds before the split moves
TAIL_PREFIX = "tail-"  # the tail chain's and map's prefix: tail-<policy chain>


def main_size(n: int, before: int | None) -> int:
    """How many of a path's `n` slots the main map holds, given how many it held
    (`before`; None: nothing kept). n itself below SPLIT_MIN (no tail)."""
    if n < SPLIT_MIN:
        return n
    if before is not None and before < n <= before + TAIL_MAX:
        return before
    return n - TAIL


def tail_rule(ip: str, proto: str, n: int, main: int, tail_map: str, label: str) -> str:
    """The tail chain's one rule: the tail's share of the `n` slots, uniformly."""
    t = n - main
    return (f"meta l4proto {proto} numgen random mod {n} < {t} "
            f"dnat {ip} to numgen random mod {t} map @{tail_map} {label}")
