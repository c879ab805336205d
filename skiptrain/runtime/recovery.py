"""Recovery without a restart: re-planning for the surviving nodes, the membership
protocol between the coordinator (the launcher) and the nodes, and payload checks on received
tensors.

Failure semantics (what survivors do, torchft style):

* **Who decides.**  The coordinator (:func:`skiptrain.runtime.launcher.launch` with
  ``job.rt.recover``) is the only authority on membership.  It holds no model state: only the
  rendezvous store, the child processes and the current generation.  It declares a node dead
  when the process exits or is killed, when its heartbeat is older than
  ``job.rt.heartbeat_deadline_s``, or when a node reports it as a *bad peer* (a payload rejected by
  :func:`check_payload`).  A dead node that is still running (hung, bad) is SIGKILLed by PID
  first (fencing: it can never come back with stale state, and every gloo connection to it
  resets, so survivors blocked on it fail within milliseconds instead of the group timeout).
  It then publishes generation ``g+1``: ``gen/<g+1> = {"alive": [...], "dead": {node: cause},
  ...}``, signed with the coordinator's member key, then the counter ``gen = g+1``.  Nodes act
  only on signed records (:func:`generation_record`); the counter only says where to look.
* **What survivors do.**  Every node watches ``gen`` (:class:`GenerationWatch`, one store read
  per heartbeat interval).  A new generation, or any transport/gloo error of its own, makes the
  node abandon the current iteration (all micro-batches of it, not only those that touched the
  lost node: simpler, and measured in ``docs/failures.md``).  It reports what it saw
  (``report/<g>/<node>``: the peer it suspects, the cause, the time), waits for the
  coordinator's next generation, destroys every process group and re-creates them on the fresh
  store prefix ``g<gen>/`` with ranks renumbered over the survivors (node ids never change),
  computes the same :func:`replan` as every other survivor (deterministic: no schedule is sent),
  rebuilds its stage group and DP strategy keeping the optimizer state, and re-runs the
  iteration on the same samples.  Threads blocked in calls of the old groups are abandoned
  (daemon threads; they never touch the new groups).
* **Commit point.**  An iteration is *committed* once any survivor passed the barrier after the
  pipeline (then every node, the dead one included, had finished its tasks and, for a strategy
  that clips after its sync, its stage's sync).  A failure after that point does not re-run the
  pipeline: a survivor holding its finished sync applies it; survivors whose stage sync did not
  finish rewind it and redo it over the surviving replicas of their stage with the gradients
  they hold (the dead node's share of that stage's gradient is then lost; documented).  Before
  the commit point nothing was applied anywhere: every sync that ran is rewound and the
  iteration is re-run from scratch; the data cursor does not advance.
* **Data.**  Micro-batch ids keep their global sample ranges (``cursor + rank(id) * mb``);
  :func:`replan` hands a dead originator's micro-batches to surviving originators, so the same
  global batch is trained: no sample lost, none repeated.
* **Unrecoverable.**  No stage-0 node left (the embedding and head are gone), or no decision
  from the coordinator within ``recover_wait_s``: the node raises
  :class:`~skiptrain.runtime.failure.NodeFailure` and the run stops as before.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from typing import Callable

import torch

from ..optim import squared_norm
from ..schedule.schedule import MicroBatch, Schedule
from .failure import NodeFailure
from .membership import open_value, read_count, read_raw, set_member, sign
from .transport import KIND_NAMES


class RecoveryError(NodeFailure):
    """The run cannot continue after a failure (e.g. no stage-0 node left)."""


# ---- re-planning ---------------------------------------------------------------------------

def trained_samples(phase_dir) -> dict[int, list[int]]:
    """Global sample indices trained per committed iteration, read back from every node's
    ``samples_node<r>.jsonl`` in ``phase_dir`` (dead nodes' files included: a line is written only
    for a committed iteration).  The union over iterations must be each index exactly once."""
    from pathlib import Path

    per_it: dict[int, list[int]] = {}
    for f in sorted(Path(phase_dir).glob("samples_node*.jsonl")):
        for line in f.read_text().splitlines():
            d = json.loads(line)
            per_it.setdefault(int(d["iteration"]), []).extend(d["samples"])
    return per_it


def replan(schedule: Schedule, alive: set[int] | list[int], takeover: bool = False) -> Schedule:
    """The schedule for the nodes in ``alive``: same micro-batch ids (same samples), same stages.

    * Placement: dead nodes removed; a stage with no replica left keeps an empty list and is
      skipped by every route (the model is trained with skipping, so a route without that stage
      is a valid, shorter route).
    * Originators: the micro-batches of a dead originator go, in their order, to the surviving
      stage-0 node with the fewest micro-batches so far (ties: lowest id), appended after its own.
    * Routes: a hop on a dead node moves to the surviving replica of that stage with the fewest
      forward passes so far (ties: lowest id); with no replica left the hop is dropped.  The
      visit order of the remaining stages is kept.  A node serving several stages keeps serving
      all of them, and every route is then kept on its nodes (:meth:`Schedule.keep_on_nodes`: a
      hop whose previous node serves its stage stays on that node).

    * ``takeover``: a body stage with no replica left is taken over by the highest-id replica of
      the body stage with the most replicas (at least two; ties: lowest stage) that serves that
      stage alone (a node serving several stages never moves), recorded in
      ``meta["takeover"] = {node: [old stage, new stage]}``; that node's hops of its old stage
      move like a dead node's (it initialises the stage: :func:`checkfree_combine`).

    Deterministic in (``schedule``, ``alive``), so every survivor computes the same result
    without exchanging it.  Raises :class:`RecoveryError` when no stage-0 node survives.
    """
    alive = set(alive)
    placement = [[n for n in p if n in alive] for p in schedule.placement]
    if not placement or not placement[0]:
        raise RecoveryError(f"no stage-0 node left among {sorted(alive)}: nobody holds the embedding "
                            "and head; the run cannot continue", node=None)
    moved = _take_over_empty_stages(placement) if takeover else {}
    meta = dict(schedule.meta)
    meta["replanned_for"] = sorted(alive)
    meta["takeover"] = moved
    return Schedule(placement=placement, micro_batches=_reassign_micro_batches(schedule, placement, alive),
                    memory=schedule.memory, skip_ratio=schedule.skip_ratio, max_swaps=schedule.max_swaps,
                    policy=schedule.policy, method=(schedule.method or "schedule") + "+replan",
                    meta=meta).keep_on_nodes()


def _reassign_micro_batches(schedule: Schedule, placement: list[list[int]], alive: set[int]) -> list[MicroBatch]:
    """:func:`replan`'s micro-batches on the surviving ``placement``: every route re-routed
    (:func:`_surviving_route`), a dead originator's micro-batches handed, in their order, to the
    stage-0 node with the fewest so far (ties: lowest id) and put after the kept ones."""
    serves = {(s, n) for s, p in enumerate(placement) for n in p}
    load, per_orig = _surviving_loads(schedule, placement, alive, serves)
    kept: list[MicroBatch] = []
    moved_mbs: list[MicroBatch] = []
    for mb in schedule.micro_batches:
        route = _surviving_route(mb.route, placement, serves, load)
        if mb.originator in alive:
            kept.append(MicroBatch(mb.id, mb.originator, route, 0.0))
        else:
            o = min(placement[0], key=lambda x: (per_orig[x], x))
            per_orig[o] += 1
            load[o] += 1
            moved_mbs.append(MicroBatch(mb.id, o, route, 0.0))
    return kept + moved_mbs


def _surviving_loads(schedule: Schedule, placement: list[list[int]], alive: set[int],
                     serves: set[tuple[int, int]]) -> tuple[Counter, Counter]:
    """What the survivors already carry of ``schedule``: forward passes per node (originated
    micro-batches and hops they still serve) and micro-batches per surviving originator."""
    load: Counter = Counter({n: 0 for p in placement for n in p})
    per_orig: Counter = Counter({n: 0 for n in placement[0]})
    for mb in schedule.micro_batches:
        if mb.originator in alive:
            per_orig[mb.originator] += 1
            load[mb.originator] += 1
        for s, n in mb.route:
            if (s, n) in serves:
                load[n] += 1
    return load, per_orig


def _surviving_route(route: list[tuple[int, int]], placement: list[list[int]], serves: set[tuple[int, int]],
                     load: Counter) -> list[tuple[int, int]]:
    """``route`` on the survivors: a hop a survivor still serves stays; one on a lost node moves
    to the replica of its stage with the fewest forward passes (ties: lowest id; ``load`` counts
    it); one of a stage with no replica left is dropped."""
    out: list[tuple[int, int]] = []
    for s, n in route:
        if (s, n) in serves:
            out.append((s, n))
            continue
        if not placement[s]:
            continue                                     # stage gone: skip it
        r = min(placement[s], key=lambda x: (load[x], x))
        load[r] += 1
        out.append((s, r))
    return out


def _take_over_empty_stages(placement: list[list[int]]) -> dict[int, list[int]]:
    """:func:`replan`'s takeover, in place on ``placement``: ``{node: [old stage, new stage]}``."""
    moved: dict[int, list[int]] = {}
    count = Counter(n for p in placement for n in p)
    for s in range(1, len(placement)):
        if placement[s]:
            continue
        donors = [t for t in range(1, len(placement))
                  if len(placement[t]) >= 2 and any(count[n] == 1 for n in placement[t])]
        if not donors:
            break
        t = max(donors, key=lambda x: (len(placement[x]), -x))
        n = max(x for x in placement[t] if count[x] == 1)
        placement[t].remove(n)
        placement[s].append(n)
        moved[n] = [t, s]
    return moved


# ---- taking over a stage (CheckFree) -------------------------------------------------------

def stage_tensors(model, stage: int) -> list[tuple[int, str, "torch.nn.Parameter"]]:
    """``(layer position in the stage, name inside the block, parameter)`` of ``stage``'s layers,
    sorted: the same order for every stage with the same number of layers, which is how a
    neighbour's layer ``j`` maps onto the taken-over stage's layer ``j``."""
    pos = {str(i): j for j, i in enumerate(model.partition.layers(stage))}
    out = []
    for name, p in model.named_parameters():
        parts = name.split(".", 2)
        if parts[0] == "layers" and parts[1] in pos:
            out.append((pos[parts[1]], parts[2], p))
    return sorted(out, key=lambda t: (t[0], t[1]))


def stage_grad_norms(model, stages: list[int]) -> dict[int, float]:
    """The gradient norm of each of ``stages`` of ``model`` (a node's stages): what CheckFree
    weighs a neighbour stage by (:func:`checkfree_combine`), for that stage alone also on a node
    that serves several."""
    return {s: squared_norm(p.grad for _, p in model.stage_named_parameters(s)) ** 0.5 for s in stages}


def checkfree_combine(flats: list[torch.Tensor], grad_norms: list[float]) -> tuple[torch.Tensor, list[float]]:
    """CheckFree initialisation of a lost stage from its neighbours' (flattened) weights: the
    average weighted by the neighbours' last gradient norms (equal weights when every norm is 0
    or not finite); returns the weights and the coefficients used."""
    g = [x if x == x and x > 0 and x != float("inf") else 0.0 for x in grad_norms]
    tot = sum(g)
    coef = [x / tot for x in g] if tot > 0 else [1.0 / len(flats)] * len(flats)
    out = torch.zeros_like(flats[0])
    for c, f in zip(coef, flats):
        out += c * f
    return out, coef


# ---- bad peers -----------------------------------------------------------------------------

class BadPayload(NodeFailure):
    """A received tensor failed :func:`check_payload`; ``node`` is the sender."""


def blame_sender(e, nodes: list[int], rank: int) -> Exception:
    """A :class:`BadPayload` naming the node that sent non-finite values to a DP sum (``e``: the
    transport's ``NonFiniteContribution``; ``nodes``: node id by global rank), so the sender is
    blamed and not a node downstream of it; ``e`` itself when it names no sender (an overflow)."""
    if not e.ranks:
        return e
    senders = [nodes[g] for g in e.ranks]
    return BadPayload(f"node {rank}: rejected the DP sync: node(s) {senders} sent non-finite gradients",
                      node=senders[0])


def check_payload(kind: int, tensor: torch.Tensor, src: int, expected_shape: tuple[int, ...] | None,
                  mb: int, rank: int) -> None:
    """Reject an activation/gradient with the wrong dtype, shape or non-finite values, naming the
    sender.  Raises :class:`BadPayload` (the sender is then treated as failed)."""
    what = f"{KIND_NAMES[kind]} of micro-batch {mb} from node {src}"
    if tensor.dtype != torch.float32:
        raise BadPayload(f"node {rank}: rejected {what}: dtype {tensor.dtype}, expected float32", node=src)
    if expected_shape is not None and tuple(tensor.shape) != tuple(expected_shape):
        raise BadPayload(f"node {rank}: rejected {what}: shape {tuple(tensor.shape)}, expected "
                         f"{tuple(expected_shape)}", node=src)
    if not bool(torch.isfinite(tensor).all()):
        bad = int((~torch.isfinite(tensor)).sum())
        raise BadPayload(f"node {rank}: rejected {what}: {bad} non-finite value(s)", node=src)


# ---- membership protocol (store keys) --------------------------------------------------------

def publish_generation(store, gen: int, alive: list[int], dead: dict[int, str], info: dict | None = None,
                       key: bytes | None = None) -> None:
    """Coordinator side: announce generation ``gen`` (the record first, then the counter).  The
    record is signed with ``key``, the coordinator's member key (a run with a secret), so nodes
    act on no generation a process without the secret wrote (:func:`generation_record`)."""
    name = f"gen/{gen}"
    store.set(name, sign(key, name, json.dumps({"alive": sorted(alive), "dead": {str(k): v for k, v in dead.items()},
                                                "t": time.time(), **(info or {})})))
    store.set("gen", str(gen))


def current_generation(store) -> int:
    """The generation counter: only a hint of where to look (anyone reaching the store can write
    it); the records behind it decide (:func:`generation_record`, :func:`latest_generation`).
    -1 when it is absent or not a number (deleted or overwritten by such a process): never a
    blocking read, never an exception."""
    n = read_count(store, "gen")
    return -1 if n is None else n


_FORGED_SEEN: set[tuple[str, str]] = set()


def generation_record(store, gen: int, key: bytes | None) -> dict | None:
    """The record of generation ``gen`` (``alive``, ``dead`` by node id, ``kind``, ...), or None
    when it is absent, malformed, or not signed with ``key`` (the coordinator's member key; None:
    a run without a secret, records are plain).  A forged record is printed once per process and
    never acted on."""
    name = f"gen/{gen}"
    raw = read_raw(store, name)
    if raw is None:
        return None
    value = open_value(key, name, raw)
    try:
        d = json.loads(value) if value is not None else None
        d["alive"] = [int(n) for n in d["alive"]]
        d["dead"] = {int(k): str(v) for k, v in d["dead"].items()}
    except (TypeError, ValueError, KeyError, AttributeError):
        d = None
    if d is None and (name, raw) not in _FORGED_SEEN:
        _FORGED_SEEN.add((name, raw))
        print(f"skiptrain: ignored {name}: not a generation record signed by the run's coordinator "
              "(written by a process without the run's secret)", file=sys.stderr, flush=True)
    return d


def read_generation(store, gen: int, key: bytes | None = None) -> dict:
    """:func:`generation_record` of a generation the caller knows was published; raises
    :class:`RecoveryError` when it is not there or not the coordinator's."""
    d = generation_record(store, gen, key)
    if d is None:
        raise RecoveryError(f"generation {gen} has no record signed by the run's coordinator in the store "
                            "(a process without the run's secret overwrote it, or the store lost it)", node=None)
    return d


def wait_record(store, gen: int, key: bytes | None, timeout_s: float, poll_s: float = 0.02) -> dict:
    """The coordinator's record of generation ``gen`` once it is in the store (anything else
    written there is waited past); raises :class:`RecoveryError` after ``timeout_s``."""
    deadline = time.time() + timeout_s
    while (rec := generation_record(store, gen, key)) is None:
        if time.time() > deadline:
            raise RecoveryError(f"no generation {gen} from the coordinator within {timeout_s:g} s", node=None)
        time.sleep(poll_s)
    return rec


def latest_generation(store, key: bytes | None) -> int:
    """The newest generation with a valid record, found by reading the records upwards from 0
    (generations are numbered densely; the counter itself is not trusted); -1 when there is none."""
    g = -1
    while generation_record(store, g + 1, key) is not None:
        g += 1
    return g


def report_failure(store, gen: int, rank: int, suspect: int | None, cause: str, bad_peer: bool = False) -> None:
    """Node side: what this node saw (the coordinator uses ``bad_peer`` reports to fence); signed
    with this node's member key, so the coordinator acts only on reports of admitted nodes."""
    set_member(store, rank, f"report/{gen}/{rank}", json.dumps({"rank": rank, "node": suspect, "cause": cause[:500],
                                                                "bad_peer": bad_peer, "t": time.time()}))


def wait_generation(store, after: int, timeout_s: float, key: bytes | None = None,
                    poll_s: float = 0.02) -> tuple[int, dict]:
    """Wait until the coordinator published a generation newer than ``after`` that is not a pure
    join (a failure is always followed by a membership change; a join generation published just
    before it is cancelled by it); return it and its record (only a record signed with ``key``
    counts: :func:`generation_record`)."""
    deadline = time.time() + timeout_s
    while True:
        g = current_generation(store)
        rec = generation_record(store, g, key) if g > after else None
        if rec is not None and rec.get("kind", "change") != "join":
            return g, rec
        if time.time() > deadline:
            raise RecoveryError(f"no new membership from the coordinator within {timeout_s:g} s after a "
                                f"failure in generation {after}", node=None)
        time.sleep(poll_s)


class GenerationWatch:
    """Polls ``gen`` in the store every ``interval_s``; calls ``on_change(gen)`` once for every
    generation newer than :attr:`gen` (the node sets :attr:`gen` after re-forming) that changes
    membership; only records signed with ``key`` (the coordinator's) count.  A *join* generation
    (only adds nodes) does not abort anything: it is recorded in :attr:`join_seen`, and the nodes
    switch to it together at the next iteration boundary.
    Store errors are left to the heartbeat, which stops the node when the store is gone."""

    def __init__(self, store, interval_s: float, on_change: Callable[[int], None], key: bytes | None = None):
        self.store, self.interval_s, self.on_change, self.key = store, interval_s, on_change, key
        self.gen = 0
        self._seen = 0
        self.join_seen = 0
        self._checked = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="genwatch", daemon=True)

    def start(self) -> "GenerationWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def newer(self) -> bool:
        """Whether a generation newer than the one this node runs in was seen."""
        return self._seen > self.gen

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                g = current_generation(self.store)
            except Exception:  # noqa: BLE001
                continue
            first = max(self.gen, self._seen, self._checked) + 1
            kinds = []
            for x in range(first, g + 1):        # up to the first record not (yet) the coordinator's
                rec = generation_record(self.store, x, self.key)
                if rec is None:
                    break
                kinds.append(rec.get("kind", "change"))
            if not kinds:
                continue
            self._checked = last = first + len(kinds) - 1
            if all(k == "join" for k in kinds):
                self.join_seen = last
                continue
            self._seen = last
            self.on_change(last)


# ---- dropping broken process groups ----------------------------------------------------------

_GRAVEYARD: list = []


def abandon_process_groups() -> int:
    """Forget every process group of this process *without shutting them down*, so a new default
    group can be initialised on a fresh store prefix; returns how many were dropped.

    ``dist.destroy_process_group()`` calls ``shutdown()`` on each group, and a gloo group whose
    worker is blocked in a receive from a dead or stopped peer (our transport's receiver thread,
    an unfinished send) can then block the caller indefinitely (seen here: the whole process,
    heartbeat included, stalled in the second recovery of a run).  The groups are kept referenced
    here, so their destructors never run either; their threads and sockets are leaked (a few per
    membership change, bounded by the number of failures)."""
    import torch.distributed.distributed_c10d as c10d

    w = c10d._world
    pgs = list(w.pg_names.keys())
    _GRAVEYARD.extend(pgs)
    c10d._update_default_pg(None)
    w.pg_map.clear()
    w.pg_names.clear()
    w.pg_group_ranks.clear()
    w.pg_backend_config.clear()
    w.pg_to_tag.clear()
    w.tags_to_pg.clear()
    w.pg_coalesce_state.clear()
    c10d._unregister_all_process_groups()
    w.group_count = 0
    return len(pgs)
