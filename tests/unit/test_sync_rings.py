"""The chains of a sync ring (skiptrain/schedule/sync_rings.py), run step by step on numpy
vectors the way the runtime's transport runs them, against the plain sum: a reduce-scatter
leaves every owner its piece of the total, the gather gives every member all of it, and a sum
ring is the two; per step a member sends at most one piece and receives at most one."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skiptrain.schedule.sync_rings import SyncRing, chain_starts, moves_at, scatter_pays


def _run(xs, op, owner_pos):
    """Every member's pieces after one pass (``xs[p]`` member ``p``'s vector, in ring order)."""
    m = len(xs)
    parts = [np.array_split(x.copy(), len(owner_pos)) for x in xs]
    starts = chain_starts(m, op, owner_pos)
    plans = [moves_at(m, starts, m - 1, p) for p in range(m)]
    for step in range(m - 1):
        sent = {}
        for p in range(m):
            out, _ = plans[p][step]
            if out is not None:
                sent[(p + 1) % m] = (out, parts[p][out].copy())
        for p in range(m):
            _, into = plans[p][step]
            assert (into is None) == (p not in sent)
            if into is None:
                continue
            piece, buf = sent[p]
            assert piece == into
            parts[p][into] = parts[p][into] + buf if op == "scatter" else buf
    return parts


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 9).flatmap(lambda m: st.tuples(
    st.just(m), st.lists(st.integers(0, m - 1), min_size=1, max_size=m, unique=True), st.integers(0, 2**31))))
def test_scatter_then_gather_equals_the_plain_sum(case):
    m, owner_pos, seed = case
    rng = np.random.default_rng(seed)
    xs = [rng.integers(-50, 50, size=23).astype(np.float64) for _ in range(m)]
    total = np.array_split(np.sum(xs, axis=0), len(owner_pos))
    after = _run(xs, "scatter", owner_pos)
    for j, p in enumerate(owner_pos):
        assert np.array_equal(after[p][j], total[j])
    gathered = _run([np.concatenate(a) for a in after], "gather", owner_pos)
    for p in range(m):
        assert np.array_equal(np.concatenate(gathered[p]), np.concatenate(total))


def test_a_sum_ring_is_every_member_owning_one_piece():
    ring = SyncRing((7, 3, 5))
    assert ring.chains((4, 1 / 3)) == ([0, 1, 2], 4, 1 / 3)
    scatter = SyncRing((7, 3, 5), "scatter", (3, 7))
    assert scatter.chains((4, 1 / 3)) == ([2, 1], 2, 0.5)       # after 3 (position 1), after 7
    assert SyncRing((7, 3, 5), "gather", (3, 7)).chains((4, 1 / 3)) == ([1, 0], 2, 0.5)
    assert SyncRing((4,)).chains((0, 0.0)) == ([], 0, 0.0)


def test_scatter_pays_up_to_twice_the_owners():
    # per link, scatter: (m-1)/k of the bytes in m-1 steps; all-reduce: 2 (m-1)/m in 2 (m-1)
    for m in range(1, 12):
        for k in range(1, m + 1):
            fewer_bytes = (m - 1) / k < 2 * (m - 1) / m
            same_bytes = (m - 1) / k == 2 * (m - 1) / m
            assert scatter_pays(m, k) == (m > 1 and (fewer_bytes or same_bytes))


def test_bad_rings_are_refused():
    with pytest.raises(ValueError):
        SyncRing((0, 1), "scatter")                  # no owners
    with pytest.raises(ValueError):
        SyncRing((0, 1), "gather", (2,))             # an owner outside the ring
    with pytest.raises(ValueError):
        SyncRing((0, 1), "sum", (0,))
    with pytest.raises(ValueError):
        SyncRing((0, 1), "tree")
    with pytest.raises(ValueError):
        SyncRing((0, 1, 2), "scatter", (1, 1))       # an owner twice: a piece would never be sent
    with pytest.raises(ValueError):
        SyncRing((0, 0, 1))
