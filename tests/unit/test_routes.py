import random

import pytest
from hypothesis import given, settings, strategies as st

from skiptrain.schedule.routes import (RouteError, balanced_routes, check_route, check_routes, count_swaps,
                                       drop_route, random_route, skip_count, stage_visit_counts)


def test_skip_count_reference_case():
    assert skip_count(0.33, 6) == 2  # SkipPipe: stage 0 + 3 of 5 body stages
    assert skip_count(0.0, 6) == 0
    with pytest.raises(RouteError, match="use a skip ratio below"):
        skip_count(1.0, 6)


@settings(max_examples=100, deadline=None)
@given(S=st.integers(1, 16), k=st.floats(0, 1))
def test_skip_count_always_leaves_a_body_stage_and_its_bound_is_exact(S, k):
    bound = (S - 1.5) / S
    try:
        n = skip_count(k, S)
    except RouteError as e:
        assert n_refused_is_consistent(k, S)
        if S > 1:
            assert f"below {bound:.4g}" in str(e)
        return
    assert n == 0 or n < S - 1
    assert n == 0 or k < bound


def n_refused_is_consistent(k, S):
    n = int(k * S + 0.5)
    return n > 0 and n >= S - 1


def test_swaps():
    assert count_swaps([1, 2, 3]) == 0
    assert count_swaps([2, 1, 4, 3]) == 2
    assert count_swaps([1, 4, 3]) == 1
    with pytest.raises(RouteError):
        count_swaps([3, 1, 2])  # 3 moved two places
    with pytest.raises(RouteError, match="3 swaps"):
        check_route([2, 1, 4, 3, 6, 5], 7, max_swaps=2)


def test_check_route_errors():
    with pytest.raises(RouteError, match="more than once"):
        check_route([1, 1], 4)
    with pytest.raises(RouteError, match="not a body stage"):
        check_route([0, 1], 4)
    with pytest.raises(RouteError, match="expected 2"):
        check_route([1, 2, 3], 4, n_visits=2)


@settings(max_examples=200, deadline=None)
@given(S=st.integers(2, 12), k=st.floats(0, 0.9), M=st.integers(1, 40), swaps=st.integers(0, 2),
       seed=st.integers(0, 10**6))
def test_balanced_routes_satisfy_all_constraints(S, k, M, swaps, seed):
    try:
        skip_count(k, S)
    except RouteError:
        return
    routes = balanced_routes(S, k, M, random.Random(seed), swaps)
    assert len(routes) == M
    check_routes(routes, S, k, max_swaps=swaps, balanced=True)


def test_random_route_and_counts():
    rng = random.Random(1)
    r = random_route(6, 0.33, rng, max_swaps=2)
    check_route(r, 6, n_visits=3, max_swaps=2)
    assert stage_visit_counts([[1, 2], [2, 3]], 4) == [2, 1, 2, 1]


def test_drop_route():
    assert drop_route(6, drop=[2, 4]) == [1, 3, 5]
    r = drop_route(9, drop_fraction=0.5, seed=3)
    assert len(r) == 4 and r == sorted(r)
    assert drop_route(9, drop_fraction=0.5, seed=3) == r
    with pytest.raises(RouteError, match="stage 0 can never be dropped"):
        drop_route(6, drop=[0])
