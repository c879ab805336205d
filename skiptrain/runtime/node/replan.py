"""Re-planning the routes of the layout in force, between iterations.

After an iteration's statistics are gathered (:mod:`.stats`), the lowest rank re-plans the
routes with the placement fixed, and every node adopts the result for the next iteration:

* after a recovery generation or a join (any node's ``replan`` column set): once, on the static
  topology or, with drift re-planning on, the measured one; adopted when it simulates at least
  5% faster;
* on drift (``runtime.drift_threshold``): when the moving average of the measured iteration
  exceeds the simulated one by the threshold, on the topology with measured compute and link
  factors (the ``drift`` column of :class:`~skiptrain.runtime.drift.DriftMonitor`).

A failed re-plan keeps the routes in force.
"""

from __future__ import annotations

import sys
import time

from ..drift import broadcast_schedule, measured_topology, replan_routes
from .state import PhaseState
from .stats import StatsTable

# CPU-second cap on the planner when it re-plans the routes after a recovery generation, a join
# or a drift past the threshold (rank 0 plans; the swarm waits for it once)
RECOVERY_PLAN_TIME_S = 2.0


class Replanner:
    """Route re-planning of one node (see the module's docstring)."""

    def __init__(self, node):
        self.node = node
        self.control = node.control

    def after_gather(self, st: "PhaseState", table: "StatsTable") -> None:
        """Re-plan the routes after a recovery or join (any node's ``replan`` column set), or on
        drift; the new schedule is adopted for the next iteration."""
        want = table.max("replan") > 0 and st.topo is not None and st.cost is not None
        st.replan_pending = False
        new_sched = None
        if want:
            new_sched, last = self.recovery_replan(table, st.sched, st.it, st.topo, st.cost, st.drift is not None,
                                                    st.drift_state)
            if last is not None:
                st.record.setdefault("replans", []).append({"iteration": st.it + 1, **last})
        elif st.drift is not None:
            new_sched, st.drift_state = self.drift_step(table, st.sched, st.ph, st.it, st.topo, st.cost,
                                                         st.drift_state)
            if new_sched is not None:
                st.record.setdefault("replans", []).append({"iteration": st.it + 1, **st.drift_state["last"]})
        if new_sched is not None:
            self.node.layout.adopt(st, new_sched)

    def drift_step(self, table, sched, ph, it: int, topo, cost, state: dict):
        """After an iteration's stats gather: rank 0 folds the measured iteration time into its
        moving average and, past the threshold, re-plans the routes on the measured topology;
        the decision (and the schedule) is broadcast to every node.  Returns (new schedule or
        None, state)."""
        from ...schedule.schedule import Schedule
        from ...schedule.simulator import simulate
        adopted = None
        if self.control.is_root():
            it_s = table.max("t_end")
            alpha = self.node.job.rt.drift_alpha
            state["ema"] = it_s if "ema" not in state else (1 - alpha) * state["ema"] + alpha * it_s
            if "ref" not in state:
                state["ref"] = simulate(sched, topo, cost, contention=True, dp_sync=False, record=False).iteration_s
            state["n"] = state.get("n", 0) + 1
            # the placement drift re-plans for: the phase's, or the last freeze transition's
            full = sched.placement == (state.get("home") or Schedule.from_dict(ph.schedule).placement)
            ratio = state["ema"] / state["ref"] if state["ref"] > 0 else 1.0
            if full and state["n"] >= 2 and ratio > 1 + self.node.job.rt.drift_threshold:
                mt, compute = self.measured_net(table, topo)
                t = time.time()
                new, cur_s, new_s = replan_routes(sched, mt, cost, self.node.cfg, time_limit_s=RECOVERY_PLAN_TIME_S)
                state["last"] = {"measured_ema_s": round(state["ema"], 4), "reference_s": round(state["ref"], 4),
                                 "ratio": round(ratio, 3), "simulated_current_on_measured_s": cur_s,
                                 "simulated_new_on_measured_s": new_s, "plan_s": round(time.time() - t, 3),
                                 "compute_factors": {str(k): round(v, 3) for k, v in compute.items()},
                                 "adopted": new is not None}
                print(f"skiptrain node {self.node.rank}: iteration {it + 1}: measured {state['ema']:.3f} s vs "
                      f"{state['ref']:.3f} s planned ({ratio:.2f}x): re-planned routes on the measured topology: "
                      f"{cur_s} -> {new_s} s simulated; {'adopted' if new is not None else 'kept'}",
                      file=sys.stderr, flush=True)
                # the reference becomes what the (new or kept) schedule should take on the measured network
                state["ref"] = (new_s if new is not None else cur_s) or state["ref"]
                state["ema"] = state["ref"] if new is not None else state["ema"]
                state["n"] = 0
                if new is not None:
                    adopted = new, state["last"]
        new, last = broadcast_schedule(self.control, adopted)
        if new is not None:
            state["last"] = last
        return new, state

    def recovery_replan(self, table, sched, it: int, topo, cost, measured: bool, drift_state: dict):
        """At the end of the first committed iteration after a recovery generation (or a join):
        rank 0 re-plans the routes of the repaired schedule with its placement fixed
        (:func:`~skiptrain.runtime.drift.replan_routes`, on the static topology, or the measured one
        when drift re-planning is on), with a small planner budget (``RECOVERY_PLAN_TIME_S`` CPU
        seconds); the new routes are adopted when they simulate at least 5% faster and broadcast,
        and every node switches at the next iteration.  Returns (new schedule or None, the record
        entry: rank 0 always, the others when adopted)."""
        adopted = last = None
        if self.control.is_root():
            t_net = self.measured_net(table, topo)[0] if measured else topo
            t = time.time()
            try:
                new, cur_s, new_s = replan_routes(sched, t_net, cost, self.node.cfg, time_limit_s=RECOVERY_PLAN_TIME_S)
            except Exception as e:  # noqa: BLE001 - the repair stays in force
                new, cur_s, new_s = None, None, None
                print(f"skiptrain node {self.node.rank}: post-recovery re-plan failed: {e}", file=sys.stderr, flush=True)
            last = {"trigger": "recovery", "gen": self.control.gen, "topology": "measured" if measured else "static",
                    "simulated_current_s": cur_s, "simulated_new_s": new_s, "plan_s": round(time.time() - t, 3),
                    "adopted": new is not None}
            print(f"skiptrain node {self.node.rank}: generation {self.control.gen}, iteration {it + 1}: re-planned routes for "
                  f"the surviving placement: {cur_s} -> {new_s} s simulated; "
                  f"{'adopted' if new is not None else 'kept the repair'}", file=sys.stderr, flush=True)
            if measured and (new_s if new is not None else cur_s):
                drift_state["ref"] = new_s if new is not None else cur_s
                drift_state["ema"] = drift_state["ref"]
                drift_state["n"] = 0
            if new is not None:
                adopted = new, last
        new, got = broadcast_schedule(self.control, adopted)
        return new, (got if new is not None else last)

    def measured_net(self, table: "StatsTable", topo):
        """The topology with measured compute and link factors (the drift monitor's ``drift``
        column: compute, then one factor per link) in place of the static ones; also the compute
        factors."""
        import numpy as np

        drift = table["drift"].numpy()
        compute = {n: float(drift[i, 0]) for i, n in enumerate(table.nodes)}
        links = np.ones((topo.n, topo.n))
        for i, n in enumerate(table.nodes):
            if n < topo.n:
                links[n, :] = drift[i, 1:1 + topo.n]
        return measured_topology(topo, compute, links), compute

