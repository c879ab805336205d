"""The prefill plan: which worker brings which window to the frozen depth, and which rows travel
between caches (``skiptrain.elastic.prefill.plan_prefill``), checked against what the plan must
leave behind: every cache holding every window it needs, at the least work."""

from __future__ import annotations

from hypothesis import given, settings, strategies as st

from skiptrain.elastic.prefill import plan_prefill


def _apply(plan, needs, depth, workers, frozen):
    """Each cache's windows at ``frozen`` after the plan (the rows held, the work of its
    workers, the rows its workers receive; a sender must hold the row it sends)."""
    cache_of = {r: k for k, rs in workers.items() for r in rs}
    held = {k: {w for w, d in depth.get(k, {}).items() if d == frozen} for k in needs}
    for r, ws in plan.work.items():
        held[cache_of[r]].update(ws)
    for (s, r), ws in plan.sends.items():
        assert set(ws) <= held[cache_of[s]], "a row sent before its sender holds it"
        held[cache_of[r]].update(ws)
    return held


def test_a_location_that_starts_originating_receives_rows_the_other_only_extends():
    """The bench's 2 x 8 -> 1 x 16 freeze: location A holds every window at depth 5, location B
    none; at depth 6 A extends each window by one layer (128 per worker) and B receives them all,
    instead of running 6 layers per window itself."""
    wins = list(range(1024))
    needs = {"A": wins, "B": wins}
    workers = {"A": list(range(8)), "B": list(range(8, 16))}
    plan = plan_prefill(needs, {"A": dict.fromkeys(wins, 5)}, workers, 6, lambda a, b: 0.01)
    assert [plan.layers[r] for r in workers["A"]] == [128] * 8
    assert all(plan.layers[r] == 0 and not plan.work[r] for r in workers["B"])
    assert sorted(w for (s, r), ws in plan.sends.items() for w in ws) == wins
    assert all(s in workers["A"] and r in workers["B"] for s, r in plan.sends)
    assert [sum(map(len, plan.received(r).values())) for r in workers["B"]] == [128] * 8
    held = _apply(plan, needs, {"A": dict.fromkeys(wins, 5)}, workers, 6)
    assert held == {"A": set(wins), "B": set(wins)}
    # a wire slower than the missing layers: B runs them itself, nothing travels
    slow = plan_prefill(needs, {"A": dict.fromkeys(wins, 5)}, workers, 6, lambda a, b: 7.0)
    assert not slow.sends and [slow.layers[r] for r in workers["B"]] == [6 * 128] * 8


def test_one_shared_cache_computes_each_window_once_balanced_over_its_workers():
    wins = list(range(30))
    depth = {"L": {w: 1 for w in range(10)}}           # 10 rows at depth 1, 20 missing
    plan = plan_prefill({"L": wins}, depth, {"L": [4, 5, 6]}, 2, lambda a, b: 0.0)
    assert not plan.sends
    assert sorted(w for ws in plan.work.values() for w in ws) == wins
    assert sum(plan.layers.values()) == 10 * 1 + 20 * 2
    assert max(plan.layers.values()) - min(plan.layers.values()) <= 2


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(1, 5), st.data())
def test_every_cache_ends_holding_what_it_needs_each_window_run_once(n_caches, n_workers, frozen, data):
    keys = [f"c{i}" for i in range(n_caches)]
    workers = {k: list(range(i * n_workers, (i + 1) * n_workers)) for i, k in enumerate(keys)}
    wins = st.lists(st.integers(0, 40), max_size=25)
    needs = {k: data.draw(wins) for k in keys}
    depth = {k: data.draw(st.dictionaries(st.integers(0, 40), st.integers(0, frozen), max_size=20)) for k in keys}
    cost = data.draw(st.floats(0.0, 2.0 * frozen))
    plan = plan_prefill(needs, depth, workers, frozen, lambda a, b: cost)
    held = _apply(plan, needs, depth, workers, frozen)
    for k in keys:
        assert set(needs[k]) <= held[k]
    lacking = {w for k in keys for w in needs[k] if depth[k].get(w, 0) < frozen}
    cache_of = {r: k for k, rs in workers.items() for r in rs}
    runs: dict[tuple, int] = {}
    for r, ws in plan.work.items():
        assert plan.layers[r] == sum(frozen - depth[cache_of[r]].get(w, 0) for w in ws)
        for w in ws:
            runs[(cache_of[r], w)] = runs.get((cache_of[r], w), 0) + 1
    assert all(n == 1 for n in runs.values())          # no cache brings a window up twice
    assert {w for _, w in runs} <= lacking
    if cost < 1.0:
        # every wire is cheaper than a layer: each lacking window runs once in the whole swarm,
        # on a cache holding it deepest
        assert len(runs) == len({w for _, w in runs}) == len([w for w in lacking
                                                                if max(depth[k].get(w, 0) for k in keys) < frozen])


def test_a_cache_computes_the_windows_only_it_needs_itself():
    """No row travels just to balance caches: a window only one cache needs is computed there,
    even when another cache has less work; one that several need is computed once, by the
    least-loaded of them, and sent to the others."""
    needs = {"X": list(range(0, 96)), "Y": list(range(96, 120)), "Z": [5, 100]}
    plan = plan_prefill(needs, {}, {"X": [0], "Y": [1], "Z": [2]}, 1, lambda a, b: 0.0)
    assert plan.work[0] == [w for w in range(96) if w != 5] and plan.work[1] == [w for w in range(96, 120) if w != 100]
    assert plan.work[2] == [5, 100] and plan.sends == {(2, 0): [5], (2, 1): [100]}
