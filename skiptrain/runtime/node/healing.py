"""Healing a node's swarm: recovery from a failed peer, takeover and CheckFree, joins.

Two entry points, called by the node's loop:

* :meth:`Healer.at_boundary` (recovery mode, at the start of every iteration): switch to a join
  generation the coordinator published, all nodes together, before any work of the iteration.
  The joined node's state comes from live replicas (by name), else from the stage's checkpoint
  when young enough, else CheckFree from its neighbours.
* :meth:`Healer.recover` (after an iteration failed with a recoverable error: a peer died, hung
  past its deadline or sent a bad payload): report, wait for the coordinator's next generation,
  re-form the groups over the survivors, re-plan (a stage left without a replica is skipped, or
  taken over), settle the iteration's sync, and adopt the repaired layout.

Failure semantics: an error naming this node itself, or any error outside recovery mode, is not
recoverable (:meth:`Healer.recoverable`) and ends the process.  A further failure while
recovering starts the recovery again from the schedule before the failure and the newer
generation.  A node fenced out of the new generation raises
:class:`~skiptrain.runtime.recovery.RecoveryError`.  An iteration committed by some node is not
run again; one that no node committed is.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time

import torch
import torch.distributed as dist

from ..failure import NodeFailure
from .layout import warm_up
from .state import Attempt, PhaseState, StopRequested


class Healer:
    """Recovery and joins of one node (see the module's docstring)."""

    def __init__(self, node):
        self.node = node
        self.control = node.control
        self.pre_join: tuple[int, object] | None = None   # (joiner, schedule before its join)
        self.any_committed = False     # some node committed the iteration being recovered
        self.last_gnorm: dict[int, float] = {}   # last pre-sync gradient norm per stage (CheckFree weights)

    def at_boundary(self, st: "PhaseState", a: "Attempt") -> None:
        """Iteration boundary (recovery mode): every node learns the newest join generation any of
        them has seen (this all-reduce is also the start barrier) and they all switch to it
        together, before any work of the iteration (a joined node enters here: the all-reduce is
        repeated after a join).  A failure during the switch raises; the caller recovers
        (:meth:`recover`) and the node keeps the layout it had."""
        paused = None
        while True:
            flag = torch.tensor([self.control.link.watch.join_seen], dtype=torch.int64)
            self.control.sync(dist.all_reduce, flag, dist.ReduceOp.MAX)
            if int(flag.item()) <= self.control.gen:
                if len(self.control.alive) >= self.node.job.rt.min_nodes:
                    self.resume_after_pause(st, paused)
                    return
                paused = self.pause(st, paused)
                continue
            self.apply_join(st, int(flag.item()), a.step_count)
            st.record.setdefault("joins", []).append({"gen": self.control.gen, "iteration": st.it,
                                                      "placement": st.sched.placement})
            st.replan_pending = True

    def recover(self, st: "PhaseState", a: "Attempt", e: BaseException) -> None:
        """Recover from ``e`` (a peer failed or misbehaved): report, re-form over the survivors,
        re-plan, settle the iteration's sync.  A further failure while recovering (a peer dying
        during the re-forming) starts the recovery again from the pre-failure schedule and the
        newer generation; a failure after a takeover switched this node's stage is not handled
        (the stage stays switched)."""
        t_fail = time.time()
        attempts = 0
        while True:
            try:
                attempts += 1
                self.node.hook(st.ph.name, st.it, "recover", st)
                redone = self.recover_once(st, a, e)
                break
            except Exception as e2:  # noqa: BLE001
                if not self.recoverable(e2):
                    raise
                e = e2
        if self.any_committed and a.entry is None and a.res is not None:
            st.record["iterations"].append({"events": [], "n_processed": a.res.n_processed, "t_end": 0.0,
                                            "samples": sorted(a.samples), "gen": self.control.gen})
            self.node.report.log_samples(st.out_dir, st.ph.name, st.it, a.samples)
        st.record["recoveries"].append({
            "gen": self.control.gen, "iteration": st.it, "cause": str(e)[:300], "committed": a.committed,
            "attempts": attempts, "redo_sync": redone, "rewound_sync": a.rewound, "alive": list(self.control.alive), "t_fail": t_fail,
            "t_resumed": time.time(), "recover_s": time.time() - t_fail})

    def recover_once(self, st: "PhaseState", a: "Attempt", e: BaseException) -> bool:
        """One recovery attempt; returns whether the iteration's sync was re-done."""
        new_sched, _ = self.regenerate(e, st.sched, st.it, a.committed, st.ph.name)
        self.rewind_sync(st, a)
        self.node.stage_of = new_sched.stage_of()
        took = new_sched.meta.get("takeover") or {}
        was_moved = self.node.rank in took
        rep = None
        if took:                # every survivor takes part; only the taker's stage changes
            model, stage, rep = self.takeover(new_sched, took, st.model, st.stage, st.ph.name, st.it)
            if was_moved:
                st.model, st.stage = model, stage
                st.record.setdefault("takeovers", []).append(rep)
                st.record["stage"] = st.stage
        if was_moved:           # a node that took over a stage serves that one alone
            st.groups, st.strat = self.node.layout.stage_groups(new_sched, st.stage, st.model, None, a.step_count)
            st.opt = self.node.layout.optimizer(st.model, st.strat)
            self.stage_from_checkpoint(rep, new_sched, st.stage, st.model, st.opt, st.strat)
        else:                   # every stage this node serves, each keeping its strategy's state
            # (a finished sync, held or applied, keeps the step it counted; otherwise the attempt's)
            st.groups, st.strats = self.node.layout.hosted_groups(new_sched, st.stages, st.model, st.strats,
                                                                  None if a.exchanged is not None else a.step_count)
        redone = self.settle(a.committed, a.applied or was_moved, st.it, st.model, st.strats, st.opt, a.lr,
                             None if was_moved else a.res, None if was_moved else a.exchanged)
        self.node.layout.adopt(st, new_sched)   # published before the ack: the coordinator reads it after all acks
        self.control.link.ack()
        st.replan_pending = True
        return redone

    def rewind_sync(self, st: "PhaseState", a: "Attempt") -> None:
        """Put back the strategies' state from before this attempt's sync (``a.sync_state``) when
        the sync is not to be applied as it is: the iteration was committed nowhere (it runs
        again), or this node's sync did not finish (the committed iteration's step is redone over
        the survivors).  Once per attempt: a later recovery of it does not rewind again."""
        if a.sync_state is None or a.applied or (self.any_committed and a.exchanged is not None):
            return
        for s, sd in a.sync_state.items():
            st.strats[s].load_state_dict(sd)
        a.sync_state, a.exchanged, a.rewound = None, None, True

    def recoverable(self, e: BaseException) -> bool:
        from ..recovery import RecoveryError

        if not self.node.job.rt.recover or isinstance(e, RecoveryError):
            return False
        return isinstance(e, RuntimeError) and getattr(e, "node", None) != self.node.rank

    def regenerate(self, e: BaseException, sched, it: int, committed: bool, phase: str):
        """Report, wait for the coordinator's next generation, re-form the groups over the
        survivors and re-plan.  Returns the new schedule."""
        from ..recovery import BadPayload, RecoveryError, replan, report_failure, wait_generation

        suspect = getattr(e, "node", None)
        if suspect is None:
            suspect = getattr(e, "peer", None)
        print(f"skiptrain node {self.node.rank}: generation {self.control.gen}, iteration {it} of {phase}: "
              f"{type(e).__name__}: {str(e).splitlines()[0][:200]}; abandoning the iteration", file=sys.stderr,
              flush=True)
        report_failure(self.control.store, self.control.gen, self.node.rank, suspect, str(e), bad_peer=isinstance(e, BadPayload))
        gen, info = wait_generation(self.control.store, self.control.gen, 2 * self.node.job.rt.timeout_s + (self.node.job.rt.heartbeat_deadline_s or 0),
                                    self.control.link.coord_key)
        if self.node.rank not in info["alive"]:
            raise RecoveryError(f"node {self.node.rank}: fenced out of generation {gen} by the coordinator",
                                node=self.node.rank)
        if self.pre_join is not None and self.pre_join[0] in info.get("cancelled", []):
            sched = self.pre_join[1]               # the join was cancelled: back to the schedule before it
        self.pre_join = None
        self.node.regroup(gen, info["alive"])
        # agree whether the iteration was committed anywhere (then it is not re-run)
        flag = torch.tensor([1 if committed else 0], dtype=torch.int64)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        self.any_committed = bool(flag.item())
        new = replan(sched, self.control.alive, takeover=self.node.job.rt.takeover)
        print(f"skiptrain node {self.node.rank}: generation {gen}: alive {self.control.alive}, dead "
              f"{ {k: v[:80] for k, v in info['dead'].items()} }; placement {new.placement}", file=sys.stderr,
              flush=True)
        return new, True

    def settle(self, committed: bool, stepped: bool, it: int, model, strats: dict, opt, lr: float,
                res, exchanged=None) -> bool:
        """After re-forming: a committed iteration this node did not step is stepped now: its
        finished sync (``exchanged``) applied, or, where its sync did not finish, synced over the
        surviving replicas with the gradients held; otherwise gradients are dropped.  (That
        re-done step clips by the norm of this node's stages: the other stages stepped already.)
        ``strats``: the strategy of each stage this node serves (the re-formed ones)."""
        from ..step import HostedStage, apply_step, optimizer_step

        from ..recovery import RecoveryError

        redone = False
        self.node.ckpt.wait_snapshot()
        if model is not None:
            need = torch.tensor([0 if stepped else 1, 1 if stepped else 0], dtype=torch.int64)
            if self.any_committed:
                seen = {}
                for s, strat in sorted(strats.items()):      # every stage group first (ascending: no
                    seen[s] = need.clone().to(strat.tr.device)   # deadlock), on its backend's device
                    dist.all_reduce(seen[s], op=dist.ReduceOp.MAX, group=strat.tr.group)
                for s, got in seen.items():
                    got = got.cpu()
                    if got[0] and got[1]:
                        raise RecoveryError(f"node {self.node.rank}: replicas of stage {s} disagree whether "
                                            f"iteration {it} was applied", node=None)
                    need = torch.maximum(need, got)
                hosted = [HostedStage(s, strat, res.processed.get(s, 0), strat.world)
                          for s, strat in sorted(strats.items())] if res is not None else []
                done = {h.stage: (h, u) for h, u in exchanged.updates} if exchanged is not None else {}
                if need[0] and done and set(done) == {h.stage for h in hosted}:   # the re-formed strategies finish it
                    for h in hosted:
                        h.sync.carry_step(done[h.stage][0].sync)
                    apply_step(dataclasses.replace(exchanged, hosted=hosted, updates=[(h, done[h.stage][1]) for h in hosted]),
                               opt, lr, self.node.cfg.train.grad_clip)
                    redone = True
                elif need[0] and res is not None:
                    optimizer_step(hosted, opt, lr, self.node.cfg.train.grad_clip)
                    redone = True
            for p in model.parameters():
                p.grad = None
        return redone

    def takeover(self, sched, took: dict, model, stage, phase: str = "", it: int = 0):
        """Every survivor takes part in initialising each taken-over stage (:meth:`init_stage`:
        the stage's checkpoint when young enough, else CheckFree from the neighbours); the
        taking-over node builds the stage.  Returns (model, stage, report or None)."""
        cfg = self.node.cfg
        report = None
        targets = {v[1] for v in took.values()}
        for n_t, (old, s) in sorted(took.items()):
            new = None
            if self.node.rank == n_t:
                new = self.node.layout.build_stage(s, sched.memory)
            rep = self.init_stage(sched, s, n_t, model, new, phase, it, exclude=targets)
            if self.node.rank != n_t:
                continue
            warm_up(new, s, cfg, self.node.device)
            report = {"gen": self.control.gen, "stage": s, "from_stage": old, **rep}
            print(f"skiptrain node {self.node.rank}: takes over stage {s} (was stage {old}); init {rep['init']}, "
                  f"neighbours {rep['neighbours']} weights {[round(c, 3) for c in rep['coef']]}", file=sys.stderr,
                  flush=True)
            model, stage = new, s
        return model, stage, report

    def init_stage(self, sched, s: int, taker: int, model, new, phase: str, it: int,
                    exclude: set[int] = frozenset()) -> dict:
        """Collective over every node: initialise stage ``s`` (no live replica) on ``taker`` into
        ``new``.  The taker looks at the job's latest checkpoint (:mod:`.job_checkpoint`); if it is
        at most ``job.rt.ckpt_max_age`` iterations old, the stage's weights are loaded from it (the
        caller loads its optimizer and sync state once they exist: :meth:`stage_from_checkpoint`),
        else CheckFree: the first replica of each adjacent body stage broadcasts its stage weights
        and last gradient norm, and the taker sets layer ``j`` to their gradient-norm-weighted
        average (a copy with one neighbour, the seed's init with none).  The decision goes to
        every node by a broadcast from the taker.  Returns the report (taker; ``{}`` elsewhere)."""
        from ..recovery import checkfree_combine, stage_tensors

        use_ckpt, age, ck = self._checkpoint_decision(taker, it)
        if use_ckpt:
            if self.node.rank != taker:
                return {}
            from ..job_checkpoint import load_node_state
            load_node_state(ck[1], new)
            return {"init": "checkpoint", "checkpoint": str(ck[1]), "checkpoint_age": age,
                    "max_age": self.node.job.rt.ckpt_max_age, "neighbours": [], "grad_norms": [], "coef": []}
        got = self._neighbour_stages(sched, s, taker, model, exclude)
        if self.node.rank != taker:
            return {}
        mine = stage_tensors(new, s)
        size = sum(p.numel() for _, _, p in mine)
        got = [g for g in got if g[1].numel() == size]        # same layer count only
        coef: list[float] = []
        if got:
            flat, coef = checkfree_combine([g[1] for g in got], [g[2] for g in got])
            off = 0
            with torch.no_grad():
                for _, _, p in mine:
                    p.copy_(flat[off:off + p.numel()].view_as(p))
                    off += p.numel()
            init = "checkfree" if len(got) > 1 else "copy of the only neighbour"
        else:
            init = "fresh (seed init: no neighbour stage with the same layer count)"
        if ck is None:
            why = ("none: checkpoints are off (checkpoint.every = 0)" if not self.node.cfg.checkpoint.every
                   else "none committed yet")
        else:
            why = f"{ck[1]} is {age} iteration(s) old, more than ckpt_max_age = {self.node.job.rt.ckpt_max_age}"
        return {"init": init, "neighbours": [g[0] for g in got], "grad_norms": [g[2] for g in got], "coef": coef,
                "checkpoint": why, "checkpoint_age": age}

    def _checkpoint_decision(self, taker: int, it: int):
        """Collective: whether ``taker`` initialises its stage from the job's latest checkpoint
        (at most ``ckpt_max_age`` iterations old at iteration ``it``), broadcast from the taker.
        Returns (use it, its age or None, the taker's (step, path) or None)."""
        dec = torch.zeros(2, dtype=torch.float64)            # [use checkpoint, its age]
        ck = None
        if self.node.rank == taker:
            ck = self.node.ckpt.latest()
            if ck is not None:
                dec[1] = it - ck[0]
                dec[0] = 1.0 if it - ck[0] <= self.node.job.rt.ckpt_max_age else 0.0
            else:
                dec[1] = -1
        dist.broadcast(dec, self.control.rank_of[taker])
        return bool(dec[0] > 0), None if dec[1] < 0 else int(dec[1]), ck

    def _neighbour_stages(self, sched, s: int, taker: int, model, exclude) -> list:
        """Collective: the first replica of each live adjacent body stage of ``s`` broadcasts its
        stage weights (flat) and last gradient norm; the taker gets [(stage, weights, norm)]."""
        from ..recovery import stage_tensors

        S, got = len(sched.placement), []
        for x in (s - 1, s + 1):
            if not (1 <= x < S and sched.placement[x]) or x in exclude:
                continue
            src = sched.placement[x][0]
            hdr = torch.zeros(2, dtype=torch.float64)
            flat = None
            if self.node.rank == src:
                flat = torch.cat([p.detach().reshape(-1) for _, _, p in stage_tensors(model, x)]).cpu()   # gloo: host
                hdr = torch.tensor([flat.numel(), self.last_gnorm.get(x, 0.0)], dtype=torch.float64)
            dist.broadcast(hdr, self.control.rank_of[src])
            buf = flat if self.node.rank == src else torch.empty(int(hdr[0]))
            dist.broadcast(buf, self.control.rank_of[src])
            if self.node.rank == taker:
                got.append((x, buf, float(hdr[1])))
        return got

    def stage_from_checkpoint(self, rep: dict | None, sched, stage: int, model, opt, strat) -> None:
        """A stage initialised from the job's checkpoint (:meth:`init_stage`) also takes its
        optimizer and sync state from it, once they exist on this node."""
        if not rep or rep.get("init") != "checkpoint":
            return
        from ..job_checkpoint import load_node_state

        load_node_state(rep["checkpoint"], model, opt, strat, sched.placement[stage].index(self.node.rank))
        rep["restored"] = ["weights"] + (["optimizer"] if opt is not None else []) + (["sync"] if strat is not None else [])

    def join_phase(self, st: "PhaseState", joining: dict) -> None:
        """A node joining a running job: its state from a live replica (or the stage's checkpoint
        / CheckFree when the stage had none), then the next iteration."""
        t_j = time.time()
        resume, rep = self.join_transfer(st.sched, {self.node.rank: st.stage}, st.model, st.strat, st.opt, st.ph, st.idx,
                                          0, 0)
        st.it, st.cursor = resume["it"], resume["cursor"]
        st.record["joined"] = {"gen": self.control.gen, "stage": st.stage, "iteration": st.it,
                               "choice": joining.get("choice"), "transfer_s": time.time() - t_j, **(rep or {})}
        print(f"skiptrain node {self.node.rank}: joined at iteration {st.it} as a replica of stage {st.stage}; "
              f"state: {(rep or {}).get('init')}", file=sys.stderr, flush=True)
        self.control.link.ack()

    def pause(self, st: "PhaseState", since: float | None) -> float:
        """Fewer live nodes than ``runtime.min_nodes``: the swarm trains nothing and waits at this
        boundary, all nodes together, for nodes to join (a stop request still ends it).  Returns
        when the pause began."""
        if since is None:
            since = time.time()
            print(f"skiptrain node {self.node.rank}: paused before iteration {st.it}: {len(self.control.alive)} live "
                  f"node(s), fewer than runtime.min_nodes = {self.node.job.rt.min_nodes}; waiting for nodes to join",
                  file=sys.stderr, flush=True)
        stop, _, _ = self.control.start.agree(wait=False)
        if stop:
            raise StopRequested(f"node {self.node.rank}: the launcher asked to stop")
        time.sleep(self.node.job.rt.heartbeat_s)
        return since

    def resume_after_pause(self, st: "PhaseState", since: float | None) -> None:
        if since is not None:
            st.record.setdefault("pauses", []).append({"iteration": st.it, "paused_s": round(time.time() - since, 3),
                                                       "nodes": len(self.control.alive)})
            print(f"skiptrain node {self.node.rank}: resumed after a pause of {time.time() - since:.1f} s with "
                  f"{len(self.control.alive)} live nodes", file=sys.stderr, flush=True)

    def apply_join(self, st: "PhaseState", target: int, step_count: int) -> None:
        """At an iteration boundary, every node switches to join generation ``target``: re-forms
        the groups with the joining node(s), (in a freezing job: the lowest node sends the freeze
        rule's state and the layout in force, ``elastic.state_dict()``), takes the coordinator's
        schedule, rebuilds the groups of its stages keeping their strategies' and its optimizer
        state, takes part in the joiner's state transfer, and adopts the new layout.  On failure
        ``st`` keeps the layout in force."""
        from ...schedule.schedule import Schedule
        from ..recovery import read_generation

        node, control = self.node, self.control
        self.pre_join = None
        recs = [read_generation(control.store, g, control.link.coord_key) for g in range(control.gen + 1, target + 1)]
        if any(r.get("kind") != "join" for r in recs):
            raise NodeFailure(f"node {node.rank}: membership changed at the iteration boundary", node=None)
        joins = {int(k): int(v) for r in recs for k, v in r["join"].items()}
        new = Schedule.from_dict(recs[-1]["schedule"])
        t = time.time()
        if node.rank == min(control.alive):
            control.store.set(f"join/go/{target}", repr(t))    # the joiners enter the new groups now
        node.regroup(target, recs[-1]["alive"])
        if st.elastic is not None:
            control.broadcast_json(st.elastic.state_dict())
        node.stage_of = new.stage_of()
        groups, strats = node.layout.hosted_groups(new, st.stages, st.model, st.strats, step_count)
        self.join_transfer(new, joins, st.model, list(strats.values()) or None, st.opt, st.ph, st.idx, st.it,
                           st.cursor)
        self.pre_join = (max(joins), st.sched)
        node.layout.adopt(st, new, groups=groups, strats=strats)
        control.link.ack()
        print(f"skiptrain node {node.rank}: generation {target}: node(s) {sorted(joins)} joined "
              f"(stages {sorted(set(joins.values()))}); placement {new.placement}; {time.time() - t:.3f} s",
              file=sys.stderr, flush=True)

    def join_transfer(self, sched, joins: dict[int, int], model, strat, opt, ph, phase_idx: int, it: int,
                       cursor: int):
        """Collective over the new generation: rank 0 (the lowest existing node) broadcasts where
        the run is (phase, iteration, data cursor); every node shares the byte sizes of its
        stage's state by name; then the layout-change core plans the moves
        (:func:`~skiptrain.runtime.join_placement.join_transfers`: each tensor from the least-loaded live
        replica) and they travel point to point in the one wire format (weights, optimizer and
        sync state by name, :func:`~skiptrain.runtime.transition.move_state`).  A joiner on a
        stage with no live replica initialises it by :meth:`init_stage` (checkpoint or CheckFree).
        Returns (resume info, report on a joiner)."""
        from ...model.partition import partition_layers
        from ..job_checkpoint import load_stage_state, replicas_drift
        from ..join_placement import join_transfers
        from ..transition import gather_state, move_state, stage_sizes

        pos = torch.tensor([phase_idx, it, cursor], dtype=torch.int64)
        dist.broadcast(pos, 0)
        resume = {"phase": int(pos[0]), "it": int(pos[1]), "cursor": int(pos[2])}
        report = None
        sizes: dict[str, int] = {}
        mine = stage_sizes(model, opt, strat) if self.node.rank not in joins else {}
        for _, blob in self.control.gather_bytes(json.dumps(mine).encode()):
            sizes.update(json.loads(blob.decode()))
        for j, s in sorted(joins.items()):
            if any(n not in joins for n in sched.placement[s]):
                continue
            rep = self.init_stage(sched, s, j, model, model if self.node.rank == j else None, ph.name, resume["it"],
                                   exclude=set(joins.values()))
            if self.node.rank == j:
                report = rep
                self.stage_from_checkpoint(rep, sched, s, model, opt, strat)
        # (a node with no stage is in no message of the plan, whatever partition it assumes)
        part = model.partition if model is not None else partition_layers(self.node.cfg.model)
        plan = join_transfers(sizes, part, sched.placement, joins, drift=replicas_drift(strat))
        t = time.time()
        blobs = move_state(self.node.rank, plan, self.control.rank_of, model, opt, strat, lambda: None)
        if self.node.rank in joins and blobs:
            tensors, record, scalars = gather_state(None, None, None, blobs, set(sizes))
            load_stage_state(model, opt, strat, tensors, record, scalars)
            mine = [tr for tr in plan if tr.dst == self.node.rank]
            report = {"init": "state of the live replica(s): weights, optimizer and sync state",
                      "from_nodes": sorted(tr.src for tr in mine), "bytes": sum(tr.nbytes for tr in mine),
                      "recv_s": time.time() - t, "optimizer_step": strat.step_count if strat is not None else None}
        return resume, report

