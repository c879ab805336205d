"""Whole-job checkpoints of a swarm: what every node saves, how a step commits, how any layout
resumes from it.

Every ``checkpoint.every`` iterations, and when a phase ends (``checkpoint.final``), every node
saves at the same iteration boundary:

* **what**: its stage's weights, optimizer state and sync-strategy state by global name (naming
  below); per node, JSON with its optimizer record, strategy scalars and torch RNG state; from the
  lowest writer, the job's position: phase, iteration, exact data cursor, config and layout.
* **how**: a :class:`~skiptrain.checkpoint.manager.CheckpointManager` with every stage-holding
  node as a writer.  Replicas of a stage share the writing of its shared tensors by bytes (each
  tensor is written once).  Each node copies its share into reused host buffers (with
  ``checkpoint.overlap`` while the next iteration's forward and backward run; the copy always ends
  before the next optimizer step), then writes and fsyncs it in the background.  The lowest writer
  commits the step once every part is on disk: metadata written and fsynced, the step directory
  renamed into place, then ``LATEST`` replaced atomically.  A crash at any moment leaves the
  previous ``LATEST`` loadable.
* **failures** (recovery mode): a save whose writer left the job is abandoned at the next save,
  which plans over the new writers; while a stage has no replica at all, saves are skipped, so
  every committed checkpoint holds the whole job.

Names.  Replica slot 0 of a stage (the first node of ``placement[stage]``) writes the global names:
``layers.3.attn.wq.weight``, ``optim.exp_avg.<param>``, ``sync.<key>.<param>``.  Slot ``j > 0``
writes its per-replica tensors as ``replica<j>.<name>``: the sync strategy's state always (DeMo's
momentum and error feedback differ between replicas), its weights and optimizer state too when
the strategy lets replicas drift between syncs (DiLoCo, SparseLoCo).  The global names alone are
a whole model and optimizer, which is what ``skiptrain train --resume`` on one node,
``skiptrain export`` and ``skiptrain ckpt`` read.

Resume (:func:`load_node_state`): a node of any layout (other node count, stage count, stage
sizes or partition) reads only its own tensors, byte ranges verified by their checksums.  Replica
slot ``j`` takes saved slot ``j mod n`` of each per-replica tensor (``n`` saved replicas of it).
"""

from __future__ import annotations

import json
import os
import sys
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..checkpoint.format import CheckpointError
from ..checkpoint.manager import CheckpointManager, optimizer_record
from ..checkpoint.plan import SavePlan, TensorSpec
from ..checkpoint.reader import CheckpointReader, dtype_name
from ..checkpoint.state import (decode_torch_rng, encode_torch_rng, load_optimizer, model_tensors,
                                optimizer_tensors, split_optim_name)

SYNC_PREFIX = "sync."
REPLICA_PREFIX = "replica"
CONTENTS = "swarm: every stage's weights, optimizer and sync state; a --resume point for any layout"


def replica_name(slot: int, name: str) -> str:
    """The checkpoint name of replica ``slot``'s copy of the per-replica tensor ``name``."""
    return name if slot == 0 else f"{REPLICA_PREFIX}{slot}.{name}"


def is_weight_name(name: str) -> bool:
    """Whether ``name`` is a model tensor (not optimizer, sync or per-replica state)."""
    return not name.startswith(("optim.", SYNC_PREFIX, REPLICA_PREFIX))


def sync_tensors(strat) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A sync strategy's state as (``sync.<key>.<param>`` tensors, JSON scalars); of a list of
    strategies (a node serving several stages: one each, of one kind), every tensor and the
    first one's scalars."""
    out: dict[str, torch.Tensor] = {}
    scalars: dict[str, Any] = {}
    for one in reversed(_strategies(strat)):
        sd = dict(one.state_dict())
        tensors = sd.pop("tensors", {}) or {}
        out.update({f"{SYNC_PREFIX}{k}.{p}": t for p, ts in tensors.items() for k, t in ts.items()})
        scalars = sd
    return out, scalars


def _strategies(strat) -> list:
    """``strat`` as a list: None, one strategy, or a list of them."""
    if strat is None:
        return []
    return list(strat) if isinstance(strat, (list, tuple)) else [strat]


def load_sync(strat, tensors: dict[str, torch.Tensor], scalars: dict[str, Any]) -> None:
    """Load :func:`sync_tensors`'s output (plain ``sync.`` names) into ``strat``."""
    by_param: dict[str, dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        key, _, param = name[len(SYNC_PREFIX):].partition(".")
        by_param.setdefault(param, {})[key] = t
    strat.load_state_dict({**scalars, "tensors": by_param})


def replicas_drift(strat) -> bool:
    """Whether the replicas of a sync strategy (or of any of a list of them) drift apart between
    syncs (their weights are then per replica)."""
    return any(getattr(x, "replicas_drift", False) for x in _strategies(strat))


def stage_state(model, opt, strat, slot: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """This node's tensors by checkpoint name (live storage, not copies; see the module doc),
    and its JSON: optimizer record, strategy scalars, torch RNG.  ``strat``: the sync strategy,
    or the list of them of a node serving several stages (replica ``slot`` in each)."""
    drift = replicas_drift(strat)
    shared = model_tensors(model)
    record: dict[str, Any] = {}
    if opt is not None:
        opt_t, record = optimizer_tensors(model.named_parameters(), opt)
        shared.update(opt_t)
    out = {replica_name(slot, n) if drift else n: t for n, t in shared.items()}
    sync, scalars = sync_tensors(strat)
    out.update({replica_name(slot, n): t for n, t in sync.items()})
    return out, {"optimizer": record, "strategy": scalars, "slot": slot,
                 "rng": encode_torch_rng(torch.get_rng_state())}


def load_stage_state(model, opt, strat, tensors: dict[str, torch.Tensor], record: dict[str, Any] | None,
                     scalars: dict[str, Any] | None) -> None:
    """Load what :func:`stage_state` names at slot 0 (parameters, ``optim.*``, ``sync.*``; from
    any mix of senders) into this node's stage.  Raises ``ValueError`` naming a weight that is
    missing or does not fit."""
    own = model_tensors(model)
    for name, t in own.items():
        got = tensors.get(name)
        if got is None or tuple(got.shape) != tuple(t.shape):
            raise ValueError(f"received state lacks weight {name} {tuple(t.shape)} of this stage"
                             if got is None else f"received weight {name} {tuple(got.shape)} does not fit this stage")
    with torch.no_grad():
        for name, t in own.items():
            t.copy_(tensors[name])
    if strat is not None and scalars:
        load_sync(strat, {n: t for n, t in tensors.items() if n.startswith(SYNC_PREFIX)}, scalars)
    if opt is not None and record and record.get("param_groups"):
        load_optimizer(opt, model.named_parameters(), {n: t for n, t in tensors.items() if split_optim_name(n)},
                       record)


def checkpoint_root(job, phase_name: str) -> Path:
    """``checkpoint.dir`` (default ``RUN_DIR/checkpoints``), one sub-directory per phase when the
    job has several."""
    from ..config import config_from_dict

    d = config_from_dict(job.config).checkpoint.dir
    root = Path(d) if d else Path(job.run_dir) / "checkpoints"
    return root / phase_name if len(job.phases) > 1 else root


def checkpoint_roots(job) -> dict[str, Path]:
    """Every phase's :func:`checkpoint_root`, by phase name."""
    return {ph.name: checkpoint_root(job, ph.name) for ph in job.phases}


def check_root_writable(root: Path, node: int) -> None:
    """Refuse, with one line, a checkpoint root this node cannot create or write."""
    probe = root / f".probe-node{node}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, b"ok")
            os.fsync(fd)
        finally:
            os.close(fd)
        probe.unlink()
    except OSError as e:
        raise CheckpointError(f"node {node} cannot write the checkpoint root {root}: {e.strerror}; give every node "
                              "a directory it can write (checkpoint.dir: local disk for a local swarm, a shared "
                              "filesystem across hosts)") from None


class JobCheckpointer:
    """One node's side of the job's checkpoints (see the module doc).

    ``gather(bytes, size=None) -> [(node, bytes)]`` is the node's all-gather over the live nodes
    (``size``: every node sends that many bytes); every node (with a stage or not) calls
    :meth:`save` at the same iteration boundaries."""

    def __init__(self, root: Path, node: int, cfg, timeout_s: float,
                 gather: Callable[..., list[tuple[int, bytes]]], relay: "Relay | None" = None):
        self.root, self.node, self.cfg = Path(root), node, cfg
        self.relay = relay
        self.timeout_s = timeout_s
        self.gather = gather
        self.mgr: CheckpointManager | None = None
        self._writers: tuple = ()
        self._digests: list[tuple[int, int]] | None = None
        self._specs: list[TensorSpec] = []
        self._holders: dict[str, list[int]] = {}
        self._save_plan: SavePlan | None = None     # the manager's plan of _specs/_holders
        self.saved_step = -1
        self.skipped: list[int] = []

    def due(self, iteration: int, n_iterations: int) -> bool:
        """Whether the boundary after ``iteration`` (1-based) saves."""
        every = self.cfg.every
        return bool((every and iteration % every == 0) or (iteration == n_iterations and self.cfg.final))

    @staticmethod
    def digest(tensors: dict[str, torch.Tensor], placement: list[list[int]]) -> int:
        """A 32-bit digest of this node's tensor specs and the writers: when every node's is as
        at the last save, the save plan stands."""
        writers = sorted({n for p in placement for n in p})
        return zlib.crc32(_describe(tensors) + str(writers).encode())

    def save(self, iteration: int, position: dict[str, Any], tensors: dict[str, torch.Tensor],
             node_state: dict[str, Any], placement: list[list[int]], gen: int = 0,
             digests: list[tuple[int, int]] | None = None) -> float:
        """Save the job at ``iteration`` (all nodes of membership generation ``gen`` call this
        together); returns the seconds this node was blocked.  ``position`` is the job's JSON
        (phase, cursor, config, layout).  ``digests``: every node's :meth:`digest`, when the
        caller gathered them already (else one all-gather here).  In a new generation the writers
        start afresh: a save of the previous one that some writer never finished is abandoned."""
        if iteration == self.saved_step:
            return 0.0
        writers = tuple(sorted({n for p in placement for n in p}))
        new_writers = (writers, gen) != self._writers          # the same on every node
        if new_writers:
            self._hand_over(writers)
        if any(not p for p in placement):   # a stage with no node: nothing complete to save
            self._writers = (writers, gen)  # (the last save was handed over: finished or abandoned)
            self._digests = None
            self.skipped.append(iteration)
            return 0.0
        self._plan(tensors, placement, new_writers, digests)
        self._writers = (writers, gen)
        if self.node not in writers:      # (a node without a stage: freed by a freeze, or idle)
            self.mgr = None
            self.saved_step = iteration
            return 0.0
        if self.mgr is None:
            self.mgr = CheckpointManager(self.root, keep=self.cfg.keep, rank=self.node, ranks=list(writers),
                                         commit_timeout=max(600.0, self.timeout_s), clean=False,
                                         sink=self.relay.sink if self.relay is not None else None)
            self._save_plan = None
        if self._save_plan is None:
            self._save_plan = self.mgr.plan(self._specs, self._holders)
        stall = self.mgr.save(iteration, tensors, {**position, "step": iteration, "contents": CONTENTS},
                              plan=self._save_plan, rank_state=node_state, layout={"placement": placement},
                              overlap=self.cfg.overlap)
        self.saved_step = iteration
        self._say_refused()
        return stall

    def _say_refused(self) -> None:
        while self.mgr is not None and self.mgr.refused:
            print(f"skiptrain node {self.node}: {self.mgr.refused.pop(0)}", file=sys.stderr, flush=True)

    def _hand_over(self, writers: tuple[int, ...]) -> None:
        """New writers (or a new generation): finish or abandon the last save, then the lowest new
        writer removes what unfinished saves left.  Three steps, each after an all-gather: the
        writers finish their parts; the old committer commits (every part a live writer will
        ever write is there) or gives up on a writer that left; the directory is cleaned while no
        node writes (the caller's next all-gather ends it)."""
        mgr, self.mgr = self.mgr, None
        committer = mgr is not None and mgr.is_coordinator
        for step in ("parts", "commit"):
            if mgr is not None and committer == (step == "commit"):
                err = mgr.abandon()
                if err:
                    print(f"skiptrain node {self.node}: {err}", file=sys.stderr, flush=True)
            self.gather(b"", 1)
        if self.node == writers[0]:
            from ..checkpoint import store

            store.clean_stale(self.root)

    def _plan(self, tensors: dict[str, torch.Tensor], placement: list[list[int]], new_writers: bool,
              digests: list[tuple[int, int]] | None) -> None:
        """Every node's tensor specs, gathered again only when some node's changed (always with
        new writers: that all-gather also ends :meth:`_hand_over`'s cleaning)."""
        if digests is None:
            mine = self.digest(tensors, placement).to_bytes(4, "little")
            digests = [(n, int.from_bytes(b, "little")) for n, b in self.gather(mine, 4)]
        if digests == self._digests and not new_writers:
            return
        specs: dict[str, TensorSpec] = {}
        holders: dict[str, list[int]] = {}
        for node, blob in self.gather(_describe(tensors)):
            for name, dt, shape in json.loads(blob.decode()):
                specs[name] = TensorSpec(name, dt, tuple(shape))
                holders.setdefault(name, []).append(node)
        self._specs, self._holders, self._digests = list(specs.values()), holders, digests
        self._save_plan = None

    def wait_snapshot(self) -> None:
        """Before anything saved changes in place (the optimizer step): the snapshot is taken."""
        if self.mgr is not None:
            self.mgr.wait_snapshot()

    def latest(self) -> tuple[int, Path] | None:
        """(iteration, path) of the newest committed checkpoint, or None (across hosts: the one the
        coordinator committed last, fetched here)."""
        from ..checkpoint import store

        try:
            p = self.relay.fetch(self.root / "fetched") if self.relay is not None else store.latest(self.root, warn=False)
        except CheckpointError as e:      # (across hosts: none could be fetched; the caller goes on without)
            print(f"skiptrain node {self.node}: {e}", file=sys.stderr, flush=True)
            return None
        return None if p is None else (CheckpointReader(p).step, p)

    def close(self) -> None:
        """Wait for the last save to be on disk (its error, if any, goes up)."""
        if self.mgr is not None:
            self.mgr.close()
            self._say_refused()


def _describe(tensors: dict[str, torch.Tensor]) -> bytes:
    return json.dumps([[n, dtype_name(t.dtype), list(t.shape)] for n, t in sorted(tensors.items())]).encode()


def _saved_slot(names: set[str], name: str, slot: int) -> str:
    """The checkpoint name replica ``slot`` loads ``name`` from: saved slot ``slot mod n``."""
    n = 1
    while replica_name(n, name) in names:
        n += 1
    return replica_name(slot % n, name)


def load_node_state(path: str | Path, model, opt=None, strat=None, slot: int = 0) -> CheckpointReader:
    """Load this node's stage (any layout) from the checkpoint at ``path``: weights, and when
    given, optimizer and sync-strategy state; only its tensors are read, checksums verified.
    A strategy of another kind than the saved one starts from its initial state.  ``strat``
    may be a list (a node serving several stages: each loads its own parameters' state)."""
    reader = CheckpointReader(path)
    names = set(reader.meta.tensors)
    live = model_tensors(model)
    reader.read_into({_saved_slot(names, n, slot): t for n, t in live.items()})
    params = {n for n, _ in model.named_parameters()}
    if opt is not None:
        wanted = {}
        for n in names:
            kp = split_optim_name(n)
            if kp is not None and kp[1] in params:
                wanted[_saved_slot(names, n, slot)] = n
        got = reader.read_many(wanted)
        load_optimizer(opt, model.named_parameters(), {wanted[k]: t for k, t in got.items()},
                       optimizer_record(reader.state))
    ranks = reader.state.get("ranks", {})
    for strat in _strategies(strat):
        scalars = next((r["strategy"] for r in ranks.values() if (r.get("strategy") or {}).get("strategy") == strat.name),
                       None)
        mine = {n for n, _ in strat.named}
        own = [n for n in names if n.startswith(SYNC_PREFIX) and n.partition(".")[2].partition(".")[2] in mine]
        if scalars is not None and own:
            src = {n: _saved_slot(names, n, slot) for n in own}
            got = reader.read_many(src.values())
            load_sync(strat, {n: got[k] for n, k in src.items()}, scalars)
    return reader


def restore_rng(reader: CheckpointReader, node: int, slot: int) -> None:
    """Put back torch's RNG state of ``node`` when it saved the same replica slot."""
    r = reader.state.get("ranks", {}).get(str(node))
    if r and r.get("slot") == slot and r.get("rng"):
        torch.set_rng_state(decode_torch_rng(r["rng"]))


def resume_point(path: str | Path) -> dict[str, Any]:
    """Where a job resumes from checkpoint ``path`` (a step directory or a root: its ``LATEST``):
    ``{"path", "phase", "iteration", "cursor"}``; accepts the single-process trainer's checkpoints."""
    reader = CheckpointReader(path)
    st = reader.state
    data = st.get("data") or {}
    if "cursor" not in data:
        raise CheckpointError(f"checkpoint {reader.path} holds no data cursor (it is not a training checkpoint); "
                              "resume from a checkpoint written by `skiptrain train` or `skiptrain launch`")
    if (st.get("freeze") or {}).get("frozen_layers") and "elastic" not in st:
        raise CheckpointError(f"checkpoint {reader.path} was written by the one-process elastic trainer of an earlier "
                              "version, with frozen layers a run cannot take over; train again into a new run "
                              "directory (or with --overwrite)")
    return {"path": str(reader.path), "phase": int(st.get("phase", 0)), "iteration": int(st.get("iteration", reader.step)),
            "cursor": int(data["cursor"]), "data_fingerprint": st.get("data_fingerprint"),
            "data_path": ((st.get("config") or {}).get("data") or {}).get("path")}


# ---- a node process's checkpoints (the node loop calls these) ----------------------------

@dataclass
class Relay:
    """A node on another host than its coordinator: where its parts go (``sink``) and how it gets
    the checkpoint the coordinator committed last (``fetch(dest_root) -> path or None``)."""
    sink: Any
    fetch: Callable[[Path], Path | None]


def open_node_checkpoints(node, ph) -> "JobCheckpointer":
    """Node ``node``'s checkpointer for phase ``ph``; the root must be writable here.  A node on
    another host than the coordinator (its own run directory) writes its parts under that
    directory and sends them to the coordinator, which commits (:mod:`.checkpoint_relay`)."""
    relay = None
    if node.control.link.remote:
        from .checkpoint_relay import PartShipper, fetch_checkpoint
        from .membership import coordinator_key, key_from_env, secret_from_env

        coord, link = coordinator_key(secret_from_env()), node.control.link
        sink = PartShipper(link.addr, link.port, key_from_env(node.rank), node.rank, ph.name,
                           link.row_publisher().flush, coord, node.job.run_id)
        relay = Relay(sink, lambda dest: fetch_checkpoint(node.control.store, coord, ph.name, dest))
    root = Path(node.job.run_dir) / "checkpoints" / ph.name if relay is not None else checkpoint_root(node.job, ph.name)
    c = node.cfg.checkpoint
    if c.every or c.final or node.job.rt.recover:
        check_root_writable(root, node.rank)
    return JobCheckpointer(root, node.rank, c, node.job.rt.timeout_s, node.control.gather_bytes, relay)


def resume_node(node, st) -> None:
    """Continue the job from its checkpoint (``job.resume``): position, and this node's stage
    state under the current layout."""
    r = node.job.resume
    st.it, st.cursor = int(r["iteration"]), int(r["cursor"])
    if st.model is not None:
        slot = st.slot(node.rank)
        reader = load_node_state(r["path"], st.model, st.opt, list(st.strats.values()), slot)
        restore_rng(reader, node.rank, slot)
    node.ckpt.saved_step = st.it
    print(f"skiptrain node {node.rank}: resumed at iteration {st.it} (data cursor {st.cursor}) from {r['path']}",
          file=sys.stderr, flush=True)


def node_checkpoint_state(node, st) -> tuple:
    """(tensors, node JSON, placement, digest) node ``node`` saves of its phase state ``st``."""
    tensors, node_state = {}, {}
    if st.model is not None:
        slot = st.slot(node.rank)
        tensors, node_state = stage_state(st.model, st.opt, list(st.strats.values()), slot)
        node_state.update(node=node.rank, stage=st.stage, stages=st.stages)
    return tensors, node_state, st.sched.placement, node.ckpt.digest(tensors, st.sched.placement)


def save_node_checkpoint(node, st, done: int, cursor: int, snap: tuple | None = None,
                         digests: list | None = None) -> None:
    """The job's checkpoint after ``done`` iterations of the phase (every node calls this);
    ``digests``: every node's, from the stats gather (else gathered here)."""
    tensors, node_state, placement, _ = snap or node_checkpoint_state(node, st)
    position = {"phase": st.idx, "phase_name": st.ph.name, "iteration": done, "gen": node.control.gen,
                "data_fingerprint": node.job.meta.get("data_fingerprint"),
                "data": {"cursor": cursor, "global_batch": st.gb, "seed": node.cfg.train.seed},
                "config": node.cfg_json, "placement": placement}
    if st.elastic is not None:
        position["elastic"] = st.elastic.state_dict()
    node.ckpt.save(done, position, tensors, node_state, placement, node.control.gen, digests)
