"""Routes: which body stages a micro-batch visits, in which order.

A route is a list of body-stage indices (1..S-1).  Stage 0 is implicit: every micro-batch starts
there (embedding and stage 0's layers) and ends there (final norm, head, loss), so it never
appears in the list.

The SkipPipe route constraints (DESIGN.md section 1):

* every micro-batch skips the same number of body stages, ``skip_count(k, S) = floor(k * S + 0.5)``
  (S counts all stages, stage 0 included: S=6, k=0.33 skips 2 of the 5 body stages), and visits
  at least one: a skip ratio that skips every body stage is refused (k must stay below
  ``(S - 1.5) / S``);
* no stage is visited twice;
* the order is ascending except for swaps of two neighbours in the visit list, at most
  ``max_swaps`` (<= 2) of them, and the swapped pairs do not overlap;
* over one iteration every body stage is visited by the same number of micro-batches (or, when
  that number does not divide evenly, counts differ by at most one).

Per-node constraints (memory credits, collisions) belong to a schedule, not to a route, and are
checked by the scheduler.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Iterable, Sequence

from ..config import ConfigError
from ..config import skip_count as config_skip_count
from ..errors import UserError

Route = list[int]


class RouteError(UserError, ValueError):
    """A route or route request that breaks a constraint; the message says which."""


def skip_count(skip_ratio: float, n_stages: int) -> int:
    """Body stages each micro-batch skips for skip ratio ``k`` and ``n_stages`` stages in total
    (the rule is :func:`skiptrain.config.skip_count`; here a broken one is a RouteError)."""
    try:
        return config_skip_count(skip_ratio, n_stages)
    except ConfigError as e:
        raise RouteError(str(e)) from None


def visits_per_route(skip_ratio: float, n_stages: int) -> int:
    return n_stages - 1 - skip_count(skip_ratio, n_stages)


def full_route(n_stages: int) -> Route:
    return list(range(1, n_stages))


def count_swaps(route: Sequence[int]) -> int:
    """Number of adjacent swaps that turn the sorted visit list into ``route``.

    Raises RouteError when the route is not sorted-with-disjoint-neighbour-swaps.
    """
    order = sorted(route)
    swaps, i = 0, 0
    while i < len(route):
        if route[i] == order[i]:
            i += 1
        elif i + 1 < len(route) and route[i] == order[i + 1] and route[i + 1] == order[i]:
            swaps += 1
            i += 2
        else:
            raise RouteError(
                f"route {list(route)} is not ascending up to swaps of neighbouring stages "
                f"(position {i} holds stage {route[i]}, expected {order[i]} or a swap with {order[i + 1] if i + 1 < len(order) else None})")
    return swaps


def check_route(route: Sequence[int], n_stages: int, n_visits: int | None = None,
                max_swaps: int = 2) -> None:
    """Raise RouteError if ``route`` breaks a per-route constraint."""
    r = list(route)
    for s in r:
        if not isinstance(s, int) or not 1 <= s < n_stages:
            raise RouteError(f"route {r}: stage {s!r} is not a body stage (1..{n_stages - 1}); "
                             "stage 0 is implicit at both ends")
    if len(set(r)) != len(r):
        dup = [s for s, c in Counter(r).items() if c > 1]
        raise RouteError(f"route {r} visits stage(s) {dup} more than once")
    if n_visits is not None and len(r) != n_visits:
        raise RouteError(f"route {r} visits {len(r)} body stages, expected {n_visits}")
    swaps = count_swaps(r)
    if swaps > max_swaps:
        raise RouteError(f"route {r} needs {swaps} swaps, more than the {max_swaps} allowed")


def stage_visit_counts(routes: Iterable[Sequence[int]], n_stages: int) -> list[int]:
    """Visits per stage over ``routes``; index 0 counts every route (stage 0 always runs)."""
    counts = [0] * n_stages
    for r in routes:
        counts[0] += 1
        for s in r:
            counts[s] += 1
    return counts


def check_balanced(routes: Sequence[Sequence[int]], n_stages: int) -> None:
    counts = stage_visit_counts(routes, n_stages)[1:]
    if counts and max(counts) - min(counts) > 1:
        raise RouteError(f"body-stage visit counts {counts} are unbalanced (max - min > 1)")


def check_routes(routes: Sequence[Sequence[int]], n_stages: int, skip_ratio: float,
                 max_swaps: int = 2, balanced: bool = True) -> None:
    """Every per-route constraint for each route, plus balance over the iteration."""
    n_visits = visits_per_route(skip_ratio, n_stages)
    for r in routes:
        check_route(r, n_stages, n_visits, max_swaps)
    if balanced:
        check_balanced(routes, n_stages)


def apply_random_swaps(route: Route, max_swaps: int, rng: random.Random, p: float = 0.5) -> Route:
    """Swap up to ``max_swaps`` disjoint neighbouring pairs, each chosen with probability ``p``."""
    r = list(route)
    if max_swaps <= 0 or len(r) < 2:
        return r
    pairs = list(range(len(r) - 1))
    rng.shuffle(pairs)
    used: set[int] = set()
    swaps = 0
    for i in pairs:
        if swaps >= max_swaps:
            break
        if i in used or i + 1 in used or rng.random() >= p:
            continue
        r[i], r[i + 1] = r[i + 1], r[i]
        used.update((i, i + 1))
        swaps += 1
    return r


def random_route(n_stages: int, skip_ratio: float, rng: random.Random, max_swaps: int = 0) -> Route:
    """One route: a uniformly random subset of body stages, ascending, then optional swaps."""
    visits = visits_per_route(skip_ratio, n_stages)
    chosen = sorted(rng.sample(range(1, n_stages), visits))
    return apply_random_swaps(chosen, max_swaps, rng)


def balanced_routes(n_stages: int, skip_ratio: float, n_routes: int, rng: random.Random,
                    max_swaps: int = 0) -> list[Route]:
    """``n_routes`` random routes whose body-stage visit counts differ by at most one.

    Each route takes the least-visited stages so far, ties broken at random; the result is
    shuffled so that the early routes are not systematically different from the late ones.
    """
    visits = visits_per_route(skip_ratio, n_stages)
    counts = {s: 0 for s in range(1, n_stages)}
    routes: list[Route] = []
    for _ in range(n_routes):
        order = sorted(counts, key=lambda s: (counts[s], rng.random()))
        chosen = sorted(order[:visits])
        for s in chosen:
            counts[s] += 1
        routes.append(apply_random_swaps(chosen, max_swaps, rng))
    rng.shuffle(routes)
    return routes


def drop_route(n_stages: int, drop: Iterable[int] = (), drop_fraction: float = 0.0,
               seed: int = 0) -> Route:
    """The ascending route that omits the given body stages, or a random ``drop_fraction`` of them.

    Used to evaluate a model with stages missing (inference robustness).
    """
    body = list(range(1, n_stages))
    dropped = set(drop)
    for s in dropped:
        if s not in body:
            raise RouteError(f"cannot drop stage {s}: body stages are 1..{n_stages - 1} "
                             "(stage 0 can never be dropped)")
    if drop_fraction:
        if not 0.0 <= drop_fraction <= 1.0:
            raise RouteError(f"drop fraction {drop_fraction} must lie in [0, 1]")
        n = int(drop_fraction * len(body) + 0.5)
        dropped |= set(random.Random(seed).sample(body, n))
    return [s for s in body if s not in dropped]
