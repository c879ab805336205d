"""Admission of a node to a run in recovery mode, once, before it creates any process group.

The node answers the join challenge (HMAC of a fresh nonce
with the run's secret: :func:`~skiptrain.runtime.join.node_join`), and waits for the first
generation's record, signed by the coordinator; a node joining a running job waits instead until
the coordinator placed it and its nodes took the join up.

Failure semantics: a node the coordinator did not admit, or whose join was never taken up,
raises :class:`~skiptrain.runtime.join.JoinRefused` (the process exits with ``EXIT_REFUSED``);
a wait that runs out raises as the store's wait does.
"""

from __future__ import annotations

import sys

from ..membership import coordinator_key


def admit(control, joining: bool) -> dict | None:
    """Recovery mode: admission by challenge-response before any process group; then the
    generation's alive set decides the ranks.  A node joining a running job (``joining``)
    waits until the coordinator placed it and its nodes took the join up; returns its
    placement (``gen``, ``schedule``, ``phase``, ``stage``, ``choice``), else None."""
    from ..join import JoinRefused, node_join, secret_from_env, wait_for_join, wait_for_placement
    from ..recovery import wait_record

    rank, store, wait_s = control.rank, control.store, max(60.0, control.job.rt.timeout_s)
    secret = secret_from_env()
    control.link.coord_key = coordinator_key(secret)   # it signs the generations
    node_join(store, rank, secret, wait_s)
    placed, gen = None, 0
    if joining:
        gen, info = wait_for_placement(store, rank, secret, max(600.0, control.job.rt.timeout_s))
        placed = {"gen": gen, "schedule": info["schedule"], "phase": int(info["phase"]),
                  "stage": int(info["join"][str(rank)]), "choice": info.get("choice")}
        print(f"skiptrain node {rank}: admitted; joins generation {gen} as a replica of stage "
              f"{placed['stage']} ({(info.get('choice') or {}).get('rule')})", file=sys.stderr, flush=True)
    else:
        info = wait_record(store, 0, control.link.coord_key, wait_s)
    if rank not in info["alive"]:
        raise JoinRefused(f"node {rank}: not admitted to generation {gen}", node=rank)
    if placed is not None and wait_for_join(store, rank, secret, f"join/go/{gen}",
                                            max(600.0, control.job.rt.timeout_s)) is None:
        raise JoinRefused(f"node {rank}: placed in generation {gen}, but its nodes never took "
                          "the join up", node=rank)
    control.set_members(gen, info["alive"])
    return placed
