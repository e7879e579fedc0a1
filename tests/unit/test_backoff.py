"""The reflector's backoff (proxy/kube/backoff.py): every delay within its
bounds, whatever the parameters, the number of failures in a row and Retry-After; and
the numbers docs/watch.md gives for the defaults (recovery after an outage, request rate
from 5,000 nodes), computed from the code so that they cannot drift apart."""

from __future__ import annotations

import random

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from proxy.kube.backoff import Backoff
from proxy.kube.reflector import ReflectorOptions

initials = st.floats(min_value=1e-3, max_value=10.0)
factors = st.floats(min_value=1.0, max_value=1000.0)  # maximum = initial * factor
seeds = st.integers(min_value=0, max_value=2**32 - 1)


@given(initials, factors, st.integers(min_value=1, max_value=3000), seeds)
@example(0.5, 16.0, 1100, 0)  # the defaults, past 1,024 failures (it overflowed there)
def test_every_delay_is_within_half_its_ceiling_and_the_cap(
        initial: float, factor: float, failures: int, seed: int) -> None:
    maximum = initial * factor
    b = Backoff(initial, maximum, random.Random(seed))
    ceiling = initial
    for _ in range(failures):
        assert b.ceiling == ceiling
        delay = b.next()
        assert ceiling / 2 <= delay <= ceiling <= maximum
        ceiling = min(maximum, ceiling * 2)  # doubling a float is exact
    # Thousands of failures in a row (hours of outage) stay at the cap, no overflow.
    assert b.ceiling == ceiling


@given(initials, factors, st.integers(min_value=0, max_value=50),
       st.floats(min_value=0.0, max_value=1e4), seeds)
def test_retry_after_is_a_floor_and_adds_nothing_else(
        initial: float, factor: float, failures: int, at_least: float, seed: int) -> None:
    maximum = initial * factor
    b = Backoff(initial, maximum, random.Random(seed))
    for _ in range(failures):
        b.next()
    ceiling = b.ceiling
    delay = b.next(at_least)
    assert delay >= at_least
    assert delay <= max(at_least, ceiling)


@given(initials, factors, st.integers(min_value=1, max_value=200), seeds)
def test_reset_starts_again_from_the_initial_delay(
        initial: float, factor: float, failures: int, seed: int) -> None:
    b = Backoff(initial, initial * factor, random.Random(seed))
    for _ in range(failures):
        b.next()
    b.reset()
    assert initial / 2 <= b.next() <= initial


@pytest.mark.parametrize(("initial", "maximum"), [(0.0, 1.0), (-1.0, 1.0), (2.0, 1.0)])
def test_nonsense_parameters_are_refused(initial: float, maximum: float) -> None:
    with pytest.raises(ValueError, match="backoff needs"):
        Backoff(initial, maximum)


# ---- the defaults' numbers, as docs/watch.md states them -------------------------------

NODES = 5_000
REFLECTORS_PER_NODE = 3  # Services, EndpointSlices (or Endpoints), the node's own Node


def test_the_default_cap_bounds_recovery_after_a_20s_outage() -> None:
    """Worst case from the server's return to the next attempt: one full delay at the
    cap, drawn right after a failure. A 20 s outage reaches the cap (the ceilings before
    it add up to at most 0.5+1+2+4 = 7.5 s) for every draw of the jitter."""
    o = ReflectorOptions()
    assert (o.backoff_initial, o.backoff_max) == (0.5, 8.0)
    b = Backoff(o.backoff_initial, o.backoff_max)
    longest_before_cap = 0.0
    while b.ceiling < o.backoff_max:
        longest_before_cap += b.ceiling
        b.next()
    assert longest_before_cap == 7.5  # < 20 s
    worst_wait_after_return = b.ceiling
    assert worst_wait_after_return == 8.0  # + one round trip: within the 10 s goal


def test_request_rate_from_5000_nodes_while_the_server_is_away() -> None:
    """At the cap every reflector retries once per uniform [4, 8] s."""
    cap = ReflectorOptions().backoff_max
    reflectors = NODES * REFLECTORS_PER_NODE
    mean_delay = (cap / 2 + cap) / 2
    assert reflectors / mean_delay == 2_500.0  # requests/s on average
    assert reflectors / (cap / 2) == 3_750.0  # at most: every delay at its floor
    # client-go's reflector for comparison: 30 s cap, jitter 1.0, delays in [30, 60) s.
    assert round(reflectors / 45.0) == 333
    # The old 30 s cap of this reflector: delays in [15, 30] s.
    assert round(reflectors / 22.5) == 667
    # Any policy that brings every reflector back within 10 s of the return must make
    # each ask at least once in those 10 s.
    assert reflectors / 10.0 == 1_500.0
