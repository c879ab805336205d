"""Placing a node that joins a running job: which stage it takes (:func:`choose_stage`), the
schedule with it added as a replica of that stage (:func:`add_replica`), and the messages that
give it the stage's state from the live replicas (:func:`join_transfers`).  Deterministic, so
the coordinator's choice can be recomputed from the same inputs."""

from __future__ import annotations

from collections import Counter

from ..schedule.schedule import MicroBatch, Schedule


def add_replica(schedule: Schedule, node: int, stage: int, original: Schedule | None = None) -> Schedule:
    """The schedule with ``node`` added as a replica of body ``stage`` (a node joining the run).

    * ``stage`` has replicas: forward hops of that stage move, last micro-batches first, from the
      most-loaded replica to ``node`` until their counts differ by at most one.
    * ``stage`` has none (it was lost and is skipped by every route): it goes back into every
      route that visited it in ``original`` (the phase's schedule; every route when ``None``),
      at the position that keeps ``original``'s visit order, on ``node``.

    * ``stage`` 0 of a schedule of one stage (plain data parallelism, e.g. after freezing shrank
      the pipeline): micro-batches move, last first, from the originator with the most to
      ``node``, which originates them, until the counts differ by at most one.

    Micro-batch ids never change (same samples), nor do originators of a pipeline.  Every route
    is then kept on its nodes (:meth:`Schedule.keep_on_nodes`): where other nodes serve several
    stages, a hop of ``stage`` whose previous node also serves it stays there, so ``node`` gets
    only the hops that reach ``stage`` from a node that does not serve it.  Deterministic."""
    S = len(schedule.placement)
    if not (1 <= stage < S or (stage == 0 and S == 1)):
        raise ValueError(f"a joining node takes a body stage (1..{S - 1}), or stage 0 of a schedule of one stage; "
                         f"not stage {stage} of {S}")
    if node in schedule.stage_of():
        raise ValueError(f"node {node} is already in the schedule")
    placement = [list(p) for p in schedule.placement]
    mbs = [MicroBatch(m.id, m.originator, list(m.route), m.start_s) for m in schedule.micro_batches]
    if stage == 0:
        _move_originators(mbs, placement[0], node)
    elif placement[stage]:
        _move_stage_hops(mbs, placement[stage], stage, node)
    else:
        _restore_lost_stage(mbs, len(placement), stage, node, original)
    placement[stage].append(node)
    meta = dict(schedule.meta)
    meta["joined"] = {**meta.get("joined", {}), str(node): stage}
    meta["takeover"] = {}
    return Schedule(placement=placement, micro_batches=mbs, memory=schedule.memory,
                    skip_ratio=schedule.skip_ratio, max_swaps=schedule.max_swaps, policy=schedule.policy,
                    method=schedule.method, meta=meta).keep_on_nodes()


def _move_originators(mbs: list[MicroBatch], originators: list[int], node: int) -> None:
    """:func:`add_replica` on stage 0 of a schedule of one stage, in place on ``mbs``: the last
    micro-batches of the originator with the most go to ``node`` until the counts differ by at
    most one (ties: lowest id gives first)."""
    load = Counter({n: 0 for n in originators})
    load.update(m.originator for m in mbs)
    load[node] = 0
    while True:
        top = max(originators, key=lambda x: (load[x], -x))
        if load[top] - load[node] <= 1:
            break
        i = max(i for i, m in enumerate(mbs) if m.originator == top)
        mbs[i] = MicroBatch(mbs[i].id, node, mbs[i].route, mbs[i].start_s)
        load[top] -= 1
        load[node] += 1


def _move_stage_hops(mbs: list[MicroBatch], replicas: list[int], stage: int, node: int) -> None:
    """:func:`add_replica` on a body stage with ``replicas``, in place on the routes of ``mbs``:
    the last hops of ``stage`` on its most-loaded replica go to ``node`` until the counts differ
    by at most one (ties: lowest id gives first)."""
    load = Counter({n: 0 for n in replicas})
    for m in mbs:
        for s, n in m.route:
            if s == stage:
                load[n] += 1
    load[node] = 0
    while True:
        top = max(replicas, key=lambda x: (load[x], -x))
        if load[top] - load[node] <= 1:
            break
        m = next(m for m in reversed(mbs) if (stage, top) in m.route)
        m.route[m.route.index((stage, top))] = (stage, node)
        load[top] -= 1
        load[node] += 1


def _restore_lost_stage(mbs: list[MicroBatch], n_stages: int, stage: int, node: int,
                        original: Schedule | None) -> None:
    """:func:`add_replica` on a body stage with no replica left, in place on the routes of
    ``mbs``: a hop of ``stage`` on ``node`` goes back into every route that visited it in
    ``original`` (every route when ``None``), keeping ``original``'s visit order."""
    orig = {m.id: m.stages for m in original.micro_batches} if original is not None else {}
    for m in mbs:
        order = orig.get(m.id, list(range(1, n_stages))) if original is not None else \
            list(range(1, n_stages))
        if stage not in order or stage in m.stages:
            continue
        before = set(order[:order.index(stage)])
        pos = sum(1 for s in m.stages if s in before)
        m.route.insert(pos, (stage, node))


def choose_stage(schedule: Schedule, node: int, original: Schedule | None = None, topo=None,
                 cost=None) -> tuple[int, dict]:
    """Where a joining ``node`` shortens the iteration most: a body stage with no replica left
    first (the routes skip it today), else (stage 0 when it is the only stage) the body stage
    whose extra replica gives the lowest
    simulated iteration time (:func:`~skiptrain.schedule.simulator.simulate` with the phase's
    topology and cost model, link contention on, no DP sync, like the runtime's planning).
    Without a topology covering ``node`` (or a cost model) the stage with the most forward hops
    per replica is taken.  Returns ``(stage, report)``; the report lists every candidate's score."""
    from ..schedule.simulator import simulate

    S = len(schedule.placement)
    empty = [s for s in range(1, S) if not schedule.placement[s]]
    pool = empty or list(range(1, S)) or [0]     # one stage: one more data-parallel replica
    scores: dict[int, float] = {}
    rule = "empty stage" if empty else "simulated iteration time"
    if topo is not None and cost is not None and node < topo.n:
        for s in pool:
            scores[s] = simulate(add_replica(schedule, node, s, original), topo, cost, contention=True,
                                 dp_sync=False, record=False).iteration_s
        best = min(pool, key=lambda s: (scores[s], s))
        base = simulate(schedule, topo, cost, contention=True, dp_sync=False, record=False).iteration_s
    else:
        hops = Counter(s for m in schedule.micro_batches for s in m.stages)
        per = {s: (hops[s] / len(schedule.placement[s]) if schedule.placement[s] else float("inf")) for s in pool}
        best = max(pool, key=lambda s: (per[s], -s))
        base = None
        if not empty:
            rule = "most forward hops per replica (no topology or cost model covering this node)"
    return best, {"stage": best, "rule": rule, "candidates": pool,
                  "simulated_s": {str(k): round(v, 6) for k, v in scores.items()},
                  "simulated_before_s": None if base is None else round(base, 6)}


def join_transfers(sizes: dict[str, int], partition, placement: list[list[int]], joins: dict[int, int],
                   drift: bool = False) -> list:
    """The messages that give joining nodes (``joins``: node -> stage, already in ``placement``)
    their stage's state, planned by the layout-change core
    (:func:`skiptrain.layout.transfer.transfer_plan`): each tensor from the least-loaded live
    replica, so the sends spread over a stage's replicas.  With ``drift`` (replicas differ
    between syncs: DiLoCo, SparseLoCo) every tensor of a stage comes from its first live replica,
    so a joiner becomes a copy of one replica.  Stages with no live replica are left out (the
    caller initialises them another way)."""
    from ..layout import Layout
    from ..layout.transfer import transfer_plan

    live = [[n for n in p if n not in joins] for p in placement]
    old = [p[:1] if drift else p for p in live]
    new = [[n for n in p if n in joins] if live[s] else [] for s, p in enumerate(placement)]
    return transfer_plan(sizes, Layout(partition, old), Layout(partition, new))

