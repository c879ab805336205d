"""The config, the start and the end of a phase on one node.

:func:`use_config` sets the node's config (the job's, with the phase's overrides) and the data
sources that depend on it.

:func:`begin_phase` builds what the node holds for a phase (its :class:`~.state.PhaseState`):
the schedule it starts in (the coordinator's for a joiner, the phase's repaired for the nodes
alive), its stages on its device, the groups and sync strategies of its stages, one optimizer,
the emulation seam, the checkpointer, the drift monitor and freezing when on; then a joiner takes
its state from live replicas, a resumed job its checkpoint, and the layout is adopted
(:meth:`~.layout.NodeLayout.adopt`).  :func:`end_phase` writes what the phase leaves: the final
checkpoint, dumps, the first replica's stage weights; then the phase's groups are torn down.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

from ...dp.strategy import sync_summary
from ..emulation import Emulation
from ..job import Phase
from ..job_checkpoint import open_node_checkpoints, resume_node, save_node_checkpoint
from .state import PhaseState


def use_config(node, phase_config: dict | None) -> None:
    """``node.cfg``: the job's config with the phase's overrides; the data sources that depend on it."""
    from ...config import apply_dict, config_from_dict
    from ...data.loader import SampleSource

    cfg = node.cfg = config_from_dict(node.job.config)
    if phase_config:
        apply_dict(cfg, phase_config, "phase config")
    if cfg.train.init_from:     # a pre-trained model decides the shapes
        from ...checkpoint.hf_import import model_config_for_data
        cfg.model = model_config_for_data(cfg.train.init_from, cfg.model, node.ds.vocab_size)
    else:
        cfg.model.vocab_size = node.ds.vocab_size
    node.cfg_json = cfg.to_dict()    # what every checkpoint of the phase records (set only here)
    node.src = SampleSource(node.ds.tokens("train"), cfg.model.seq_len, seed=cfg.train.seed,
                            name=node.ds.split_name("train"))
    node.val_src = SampleSource(node.ds.tokens("val"), cfg.model.seq_len, shuffle=False,
                                name=node.ds.split_name("val"))


def begin_phase(node, ph: Phase, phase_idx: int) -> PhaseState:
    """Build this node's stage, groups, strategy, optimizer and executor for ``ph``; a node
    joining a running job also takes its state and position from a live replica here."""
    from ...net.topology import Topology
    from ...schedule.cost import CostModel

    if ph.config or phase_idx:
        use_config(node, ph.config)
    cfg, rank = node.cfg, node.rank
    joining = node.joining if node.joining is not None and node.joining["phase"] == phase_idx else None
    node.joining = None
    sched = _phase_schedule(node, ph, joining)
    node.stage_of = sched.stage_of()
    stages = sched.stages_of().get(rank, [])
    cost = CostModel.from_dict(ph.cost) if ph.cost else None
    topo = Topology.from_dict(ph.topology) if ph.topology else None
    # joining a freezing job: the freeze rule's state and the layout in force (partition,
    # frozen depth) from the lowest node, before this node builds its stage
    frozen = node.control.broadcast_json(None) if joining is not None and cfg.elastic.enabled else None
    model = node.layout.build_phase_model(stages, sched.memory, frozen) if stages else None
    emulation = node.layout.emulation = Emulation(ph, topo, cost, rank)
    groups, strats = node.layout.hosted_groups(sched, stages, model, {})
    out_dir = node.run_dir / "phases" / ph.name
    out_dir.mkdir(parents=True, exist_ok=True)
    st = PhaseState(ph=ph, idx=phase_idx, sched=sched, stages=stages, model=model, strats=strats,
                    opt=node.layout.optimizer(model, next(iter(strats.values()), None)), groups=groups, cost=cost,
                    topo=topo,
                    emulation=emulation, out_dir=out_dir,
                    order={mb.id: i for i, mb in enumerate(sorted(sched.micro_batches, key=lambda m: m.id))},
                    record={"rank": rank, "stage": stages[0] if stages else None, "stages": stages,
                            "iterations": [], "recoveries": []},
                    # after a recovery generation (or a join) the planner re-plans the routes for
                    # the nodes that remain; every node sets this flag on its own and the stats
                    # gather makes them agree (a column of the gathered stats)
                    replan_pending=joining is not None)
    st.gb = len(st.order) * cfg.train.micro_batch
    node.ckpt = open_node_checkpoints(node, ph)
    _phase_components(node, st, frozen)
    if joining is not None:
        node.healer.join_phase(st, joining)
    elif node.job.resume and node.job.resume["phase"] == phase_idx:
        resume_node(node, st)
    # after the freezing state (stage 0 may start from the frozen prefix; a resumed freezing job:
    # the layout it was in); a joiner's layout is the coordinator's already
    node.layout.adopt(st, st.sched, publish=joining is None)
    return st


def _phase_schedule(node, ph: Phase, joining: dict | None):
    """The schedule this node starts ``ph`` in: the coordinator's for a joiner, else the
    phase's, repaired for the nodes alive when some are missing."""
    from ...schedule.schedule import Schedule

    if joining is not None:
        return Schedule.from_dict(joining["schedule"])
    sched = Schedule.from_dict(ph.schedule)
    if sorted(node.control.alive) != list(range(node.world)):
        from ..recovery import replan
        sched = replan(sched, node.control.alive)
    return sched


def _phase_components(node, st: PhaseState, frozen: dict | None) -> None:
    """The phase's optional components: the drift monitor and the swarm's freezing (a resumed
    job: the layout the checkpoint was in; a joiner: the layout the lowest node sent)."""
    cost, topo = st.cost, st.topo
    if node.job.rt.drift_threshold > 0 and cost is not None and topo is not None:
        from ..drift import DriftMonitor
        st.drift = DriftMonitor(node.rank, topo.n, cost, topo, st.emulation.bytes_scale, node.job.rt.drift_alpha)
    if node.cfg.elastic.enabled:
        from ..freezing import SwarmFreezing
        st.elastic = SwarmFreezing(node, st)
        if frozen is not None:
            st.elastic.take_layout(frozen)


def end_phase(node, st: PhaseState) -> None:
    """The final checkpoint (also when stopped early), dumps (tests), the stage's weights
    (first replica), and the phase's groups torn down."""
    model = st.model
    if node.stopped or node.cfg.checkpoint.final:
        save_node_checkpoint(node, st, st.it, st.cursor)
    node.ckpt.close()
    if st.strats:
        st.record["sync_summary"] = sync_summary(list(st.strats.values()), model.num_parameters())
        (st.out_dir / f"node{node.rank}.json").write_text(json.dumps(st.record))
    if model is not None:
        if st.ph.dump:
            torch.save({n: p.detach().cpu().clone() for n, p in model.named_parameters()},
                       st.out_dir / f"params_node{node.rank}.pt")
        for stage in st.stages if st.ph.save_weights else ():
            if node.rank == st.sched.placement[stage][0]:
                from safetensors.torch import save_file

                parts = node.run_dir / "parts"
                parts.mkdir(parents=True, exist_ok=True)
                names = {n for n, _ in model.stage_named_parameters(stage)}
                save_file({n: p.detach().cpu().contiguous() for n, p in model.state_dict().items()
                           if n in names}, str(parts / f"stage{stage}.safetensors"))
    dist.barrier()
    node.layout.drop_groups(st.groups)
