"""The object a trainer or pipeline node uses: ``save`` (asynchronous) and ``load``/``restore``.

One :class:`CheckpointManager` per writer process (rank).  A single-process trainer uses the
defaults (rank 0 is the only writer and the coordinator)::

    mgr = CheckpointManager(run_dir / "checkpoints", keep=3)
    stall = mgr.save(step, mgr.training_tensors(model, opt), state={...})   # returns after the snapshot
    ...
    mgr.close()                                                              # waits for the last save

A multi-process run gives every node the same ``ranks`` (all writers), the global ``specs``
(every tensor's name, dtype and shape) and ``holders`` (tensor name -> ranks holding a replica).
Each node then computes the same :func:`~skiptrain.checkpoint.plan.plan_save`, snapshots only the
pieces assigned to it, writes them in the background, and the coordinator (lowest rank) commits
once every rank's part is on disk.  Nodes need no process group to save.  Writers that share no
file system give a ``sink`` (:class:`PartSink`): each sends its part there once it is on its
disk, and the lowest writer sends the commit's record instead of committing.

Semantics of :meth:`CheckpointManager.save`:

* blocks for: the previous save (saves never overlap; normally long finished), planning (cached)
  and the snapshot copy into reused host buffers.  The returned float is that blocked time;
* the background thread writes, fsyncs and (on the coordinator) commits and prunes to ``keep``;
* an error in the background (disk full, a rank that never finished) is raised by the next
  ``save``/``wait``/``close``; an I/O error (disk full, read-only directory) becomes a one-line
  :class:`CheckpointError` naming the last committed checkpoint, and the failed save's ``.tmp-``
  directory is removed (a rank that never finished leaves it, for the next coordinator to clean).
* saving a step that is already committed is a no-op (the state is the same after a resume).
"""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

import torch

from . import store
from .format import CheckpointError, NonFiniteCheckpoint, step_dir_name, tmp_dir_name
from .plan import DEFAULT_CHUNK_BYTES, SavePlan, TensorSpec, plan_save
from .reader import CheckpointReader, dtype_name
from .snapshot import HostSnapshot
from .state import load_optimizer, model_tensors, optimizer_state_names, optimizer_tensors
from .writer import BackgroundWriter, commit, write_part


def specs_of(tensors: Mapping[str, torch.Tensor]) -> list[TensorSpec]:
    return [TensorSpec(n, dtype_name(t.dtype), tuple(t.shape)) for n, t in tensors.items()]


class PartSink(Protocol):
    """Where a writer's parts go when the commit is made elsewhere (writers on hosts that share
    no file system): :meth:`part` after the rank's part is on its local disk (``tmp``: the step's
    temporary directory), :meth:`commit` from the lowest writer with what the commit writes."""

    def part(self, step: int, rank: int, tmp: Path) -> None: ...

    def commit(self, step: int, ranks: list[int], state: dict[str, Any], layout: dict[str, Any],
               names: list[str]) -> None: ...


class CheckpointManager:
    def __init__(self, root: str | Path, keep: int = 3, rank: int = 0, ranks: Sequence[int] | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, commit_timeout: float = 600.0,
                 clean: bool = True, sink: "PartSink | None" = None):
        self.root = Path(root)
        self.sink = sink
        self.keep = keep
        self.rank = rank
        self.ranks = sorted(set(ranks or [rank]))
        if rank not in self.ranks:
            raise ValueError(f"rank {rank} is not among the writer ranks {self.ranks}")
        self.coordinator = self.ranks[0]
        self.chunk_bytes = chunk_bytes
        self.commit_timeout = commit_timeout
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            if clean and self.is_coordinator:
                store.clean_stale(self.root)
        except OSError as e:
            raise CheckpointError(f"cannot use the checkpoint directory {self.root}: {e.strerror}; make it "
                                  "writable or set checkpoint.dir") from None
        self.snapshot = HostSnapshot()
        self.writer = BackgroundWriter()
        self._plan_key: Any = None
        self._plan: SavePlan | None = None
        self._snapshot_done: threading.Event | None = None
        self._hooked: dict[int, Any] = {}
        self._cancel = threading.Event()
        self.last_stall_s = 0.0
        self.refused: list[str] = []   # why saves were not committed (NaN or infinite values), for the caller to say
        self.snapshot_wait_s = 0.0  # total time callers spent blocked in wait_snapshot()
        # perf_counter() marks of the latest save: start, snapshot_done, written, committed
        self.last_timings: dict[str, float] = {}

    @property
    def is_coordinator(self) -> bool:
        return self.rank == self.coordinator

    # ---- saving ---------------------------------------------------------------------------

    @staticmethod
    def training_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                         ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """(named tensors, JSON optimizer record) for a model and its optimizer."""
        tensors = model_tensors(model)
        record: dict[str, Any] = {}
        if optimizer is not None:
            opt_t, record = optimizer_tensors(model.named_parameters(), optimizer)
            tensors.update(opt_t)
        return tensors, record

    def save_training(self, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                      state: dict[str, Any] | None = None, **kw: Any) -> float:
        """:meth:`save` of a model's parameters and its optimizer's state (by the same names).

        The optimizer's JSON record (hyper-parameters by parameter name) is stored as this
        rank's ``rank_state["optimizer"]``, so every replica's groups survive a multi-rank save.
        """
        tensors, record = self.training_tensors(model, optimizer)
        if kw.get("overlap") and optimizer is not None and id(optimizer) not in self._hooked:
            # the only in-place change of parameters and optimizer state in a training step
            def hook(*_: Any) -> None:
                self.wait_snapshot()

            self._hooked[id(optimizer)] = optimizer.register_step_pre_hook(hook)
        rank_state = dict(kw.pop("rank_state", None) or {})
        if optimizer is not None:
            rank_state["optimizer"] = record
        return self.save(step, tensors, state, rank_state=rank_state, **kw)

    def plan(self, specs: Sequence[TensorSpec], holders: Mapping[str, Sequence[int]] | None) -> SavePlan:
        key = (tuple(specs), None if holders is None else tuple(sorted((n, tuple(h)) for n, h in holders.items())))
        if key != self._plan_key:
            self._plan = plan_save(specs, holders, self.chunk_bytes, ranks=self.ranks)
            self._plan_key = key
        assert self._plan is not None
        return self._plan

    def save(self, step: int, tensors: Mapping[str, torch.Tensor], state: dict[str, Any] | None = None,
             *, specs: Sequence[TensorSpec] | None = None, holders: Mapping[str, Sequence[int]] | None = None,
             rank_state: dict[str, Any] | None = None, layout: dict[str, Any] | None = None,
             blocking: bool = False, overlap: bool = False, plan: SavePlan | None = None) -> float:
        """Snapshot this rank's share of ``tensors`` and write it in the background.

        ``tensors`` are this rank's live tensors by global name; ``specs``/``holders`` describe
        the whole run (default: ``tensors`` alone, all held by this rank).  ``state`` (JSON) is
        stored by the coordinator, ``rank_state`` (JSON) per rank.  Returns the seconds the caller
        was blocked.

        ``overlap=True`` moves the snapshot copy onto the background thread too, so it runs while
        the next forward/backward does; the caller must then call :meth:`wait_snapshot` before
        changing any saved tensor in place (``save_training`` hooks ``optimizer.step`` to do it).
        JSON ``state`` is captured at the call either way.  ``plan``: the :meth:`plan` of the
        run's specs and holders, kept by a caller that saves the same tensors again and again
        (``specs`` and ``holders`` are then not read).
        """
        t0 = time.perf_counter()
        self.writer.wait()
        if (self.root / step_dir_name(step) / "metadata.json").is_file():
            self.last_stall_s = time.perf_counter() - t0
            return self.last_stall_s
        if plan is None:
            specs = list(specs) if specs is not None else specs_of(tensors)
            if holders is None and len(self.ranks) > 1:
                raise ValueError("several writer ranks need holders (tensor name -> ranks)")
            if holders is None:
                holders = {s.name: [self.rank] for s in specs}
            plan = self.plan(specs, holders)
        mine = plan.names_for(self.rank)
        missing = [n for n in mine if n not in tensors]
        if missing:
            raise ValueError(f"rank {self.rank} is assigned {missing[:3]} but does not hold them")
        sources = {n: tensors[n] for n in mine}
        done = threading.Event()
        if not overlap:
            buffers = self.snapshot.take(sources)
            done.set()
        self._snapshot_done = done
        snapshot = self.snapshot
        lay = {"writers": self.ranks, "bytes_per_rank": {str(r): b for r, b in plan.bytes_per_rank().items()},
               **(layout or {})}
        root, rank, ranks, keep, timeout = self.root, self.rank, self.ranks, self.keep, self.commit_timeout
        coordinator, sink, refused = self.is_coordinator, self.sink, self.refused
        self._cancel = cancel = threading.Event()
        st = dict(state or {})
        if overlap:
            buffers = None

        timings = {"start": t0}
        self.last_timings = timings

        def job() -> Path | None:
            nonlocal buffers
            if not done.is_set():
                try:
                    buffers = snapshot.take(sources)
                finally:
                    done.set()
            timings["snapshot_done"] = time.perf_counter()
            try:
                write_part(root, step, rank, plan, buffers, rank_state, snapshot.nonfinite(mine))
                timings["written"] = time.perf_counter()
                if sink is not None:            # (the commit is made where the parts are sent)
                    sink.part(step, rank, root / tmp_dir_name(step))
                    if coordinator:
                        sink.commit(step, ranks, st, lay, sorted(plan.specs))
                    return None
                if coordinator:
                    return commit(root, step, ranks, plan, st, lay, keep, timeout, timings, cancel)
            except NonFiniteCheckpoint as e:      # (the run goes on: its last good checkpoint stays)
                refused.append(str(e))
            except OSError as e:
                raise save_failed(root, step, e) from None
            return None

        self.writer.start(job)
        self.last_stall_s = time.perf_counter() - t0
        if blocking:
            self.writer.wait()
        return self.last_stall_s

    def wait_snapshot(self) -> float:
        """Block until the running save's snapshot is taken (no-op if none); returns seconds waited."""
        done, self._snapshot_done = self._snapshot_done, None
        if done is None or done.is_set():
            return 0.0
        t0 = time.perf_counter()
        done.wait()
        dt = time.perf_counter() - t0
        self.snapshot_wait_s += dt
        return dt

    def wait(self) -> Path | None:
        """Block until the running save (if any) is on disk; re-raise its error."""
        return self.writer.wait()

    def close(self) -> None:
        self.wait()

    def abandon(self) -> str | None:
        """Give up the running save if it cannot complete (a writer left the job): the
        coordinator stops waiting for missing parts, the step stays uncommitted and the last
        committed checkpoint stays ``LATEST``.  Returns the abandoned save's error, if any."""
        self._cancel.set()
        try:
            self.writer.wait()
        except CheckpointError as e:
            return str(e)
        return None

    # ---- loading --------------------------------------------------------------------------

    def latest(self) -> Path | None:
        return store.latest(self.root)

    def committed(self) -> list[tuple[int, Path]]:
        return store.list_committed(self.root)

    @staticmethod
    def restore(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                ) -> CheckpointReader:
        """Load ``model`` (in place) and ``optimizer`` from the checkpoint at ``path`` (dir or root).

        Only this model's tensors (its stages, whatever layout saved them) are read.  Returns the
        reader, whose ``step`` and ``state`` carry the rest of the training state.
        """
        reader = CheckpointReader(path)
        live = model_tensors(model)
        reader.read_into(live)
        if optimizer is not None:
            names = optimizer_state_names(reader.meta.tensors, [n for n, _ in model.named_parameters()])
            opt_t = reader.read_many(names)
            load_optimizer(optimizer, model.named_parameters(), opt_t, optimizer_record(reader.state))
        return reader


def save_failed(root: Path, step: int, err: OSError) -> CheckpointError:
    """The one-line error of a save that hit an I/O error (disk full, read-only directory, ...).

    The save's uncommitted ``.tmp-`` directory is removed; committed checkpoints are untouched.
    """
    shutil.rmtree(Path(root) / tmp_dir_name(step), ignore_errors=True)
    last = store.latest(root, warn=False)
    kept = f"the last committed checkpoint is {last}" if last is not None else "no checkpoint was committed yet"
    where = f" ({err.filename})" if err.filename else ""
    return CheckpointError(f"saving the checkpoint of step {step} failed: {err.strerror or err}{where}; nothing of "
                           f"it was kept and {kept}; free disk space or make {root} writable, then --resume")


def optimizer_record(state: Mapping[str, Any]) -> dict[str, Any] | None:
    """Merge the optimizer records of all ranks (each knows the groups of its own parameters)."""
    records = [r["optimizer"] for _, r in sorted(state.get("ranks", {}).items()) if "optimizer" in r]
    if not records:
        return None
    merged: dict[str, Any] = {"class": records[0].get("class"), "param_groups": [], "scalars": {}}
    for rec in records:
        merged["param_groups"].extend(rec.get("param_groups", []))
        merged["scalars"].update(rec.get("scalars", {}))
    return merged
