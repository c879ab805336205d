"""Start N node processes on this machine, watch them, and stop all of them on any failure.

:func:`launch` hosts the rendezvous store (a ``TCPStore`` on 127.0.0.1) in the calling process
(in recovery mode: in a store process of its own, :mod:`.store`) and forks, through this
process's fork server (which imports torch once: :mod:`.node_processes`), one process per node
with the standard torch.distributed environment (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``), one thread each (``OMP_NUM_THREADS=1``):

* in recovery mode, each is the node's supervisor, the one ``skiptrain node`` runs on a host of
  its own (:mod:`.agent`, output in ``RUN_DIR/logs/supervisor<r>.log``): it takes node id ``r``
  (reserved for it), starts the node (``--join``, forked at once) and reports its exit, signed;
  the coordinator treats these nodes exactly as nodes on other hosts, except that they write
  into the run directory itself, and a node that failed is not brought back (``rejoins`` 0: the
  swarm goes on without it; nodes may join with ``skiptrain launch --join``);
* without recovery (fail-fast), each is the node itself (``python -m skiptrain.runtime.node
  --job RUN_DIR/job.json``).

Node ``r``'s output goes to ``RUN_DIR/logs/node<r>.log`` either way.  For several hosts,
``skiptrain coordinator`` runs the same code with no local process (``local`` False) and every
host's ``skiptrain node`` joins it (docs/multihost.md); :func:`adopt` takes a live run over from
its store when its coordinator died.

Failure semantics (the launcher is the authority on which node failed):

* a node that exits non-zero or is killed by a signal, or whose heartbeat (``hb/<r>`` in the
  store) is older than ``job.rt.timeout_s``, or an overall ``timeout_s`` for the whole run, stops
  the run: the launcher waits up to ``grace_s`` for the other nodes to exit on their own, then
  SIGKILLs the rest **by PID**, reaps every child, and raises
  :class:`~skiptrain.runtime.failure.RuntimeFailure` naming the node at fault (a process killed
  by a signal it did not get from the launcher, else a hung node, else the node the error
  reports blame, else the first to exit) with the other nodes' one-line reports;
* children ask the kernel for SIGKILL if the launcher dies (``PR_SET_PDEATHSIG``), and lose the
  store, so no process is left behind either way;
* in recovery mode the coordinator decides instead (:mod:`.coordinator`): it sees each local
  node through its supervisor (:class:`~.node_processes.SupervisedNode`) and SIGKILLs a fenced
  one by killing its supervisor (the node dies with it); the run fails only when no stage-0
  node is left.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

from ..schedule.timeline import Event
from ..signals import sigterm_as_interrupt
from .checkpoint_relay import coordinator_relays, hosts_file_server
from .coordinator import SignOfLife
from .failure import RuntimeFailure
from .job import Job
from .job_checkpoint import checkpoint_roots
from .membership import Verifier, coordinator_key
from .monitor import monitor
from .node_processes import SUPERVISOR_MODULE, SupervisedNode, start_nodes
from .outputs import load_phase_timeline, merge_outputs, prepare_outputs, salvage_checkpoint, stop_store
from .progress import SwarmProgress
from .run_failure import explain_failure
from .shipping import collect_run_outputs
from .store import DeathWatch


@dataclass
class LocalStart:
    """The processes a launch forks here, one per node: ``module``'s ``main(argv)`` with ``env``,
    output in ``logs/<log>``.  With recovery, each is the node's supervisor (the one ``skiptrain
    node`` runs on a host of its own), which takes a node id and starts the node itself; without,
    each is a node of the fail-fast run."""
    module: str
    argv: list[str]
    log: str
    env: dict
    supervised: bool


@dataclass
class LaunchResult:
    run_dir: Path
    wall_s: float
    metrics: list[dict] = field(default_factory=list)
    interrupted: bool = False      # stopped early on Ctrl-C / SIGTERM (every node wrote its stage)

    def phase_metrics(self, phase: str) -> list[dict]:
        """Every metrics line of ``phase``: its iterations and its validation points."""
        return [m for m in self.metrics if m.get("phase") == phase]

    def phase_iterations(self, phase: str) -> list[dict]:
        """The lines of ``phase``'s training iterations (loss, timing, bytes), without its
        validation points (``val_loss`` lines of the in-loop validation)."""
        return [m for m in self.phase_metrics(phase) if "loss" in m]

    def timeline(self, phase: str, iteration: int) -> list[Event]:
        return load_phase_timeline(self.run_dir, phase, iteration)


def launch(job: Job, nodes: int | None = None, timeout_s: float = 3600.0, grace_s: float = 3.0,
           echo: bool = False, join_secret: str | None = None, bind: tuple[str, int] | None = None,
           local: bool = True) -> LaunchResult:
    """Run ``job`` on ``nodes`` local processes (default: the schedules' node count); see module doc.

    Ctrl-C or SIGTERM (in the main thread) first asks the nodes to stop: they agree at the next
    iteration boundary, the first replica of every stage writes its weights and they exit; the
    outputs are merged into ``model.safetensors`` and the result says ``interrupted``.  A second
    signal, or nodes that do not stop within ``2 * runtime.timeout_s + 10`` seconds, stops the
    launch hard: every node process and the store process are killed, nothing is left running;
    then the weights of the job's newest committed checkpoint go to ``model.safetensors``
    (:func:`salvage_checkpoint`) before ``KeyboardInterrupt`` goes up.

    ``job.resume`` continues a job from a checkpoint: the metrics and sample logs written after
    it (by the run that was interrupted) are dropped, every node loads its part and goes on.

    ``bind`` (host, port): the store listens there instead of on a free loopback port.  ``local``
    False (a coordinator of hosts, ``skiptrain coordinator``): no node process is started here;
    every node arrives from its own host (``skiptrain node``), takes an id from 0 on, and ships
    its outputs here when it ends (:mod:`.shipping`).
    """
    with sigterm_as_interrupt():
        try:
            return _launch(job, nodes, timeout_s, grace_s, echo, join_secret, bind, local)
        except KeyboardInterrupt:
            print(f"[launch] interrupted: {salvage_checkpoint(job)}", file=sys.stderr, flush=True)
            raise


def _launch(job: Job, nodes: int | None, timeout_s: float, grace_s: float, echo: bool,
            join_secret: str | None, bind: tuple[str, int] | None, local: bool) -> LaunchResult:
    world = nodes or job.world
    if world < job.world:
        raise RuntimeFailure(f"the job's schedules use {job.world} nodes but only {world} were requested")
    run_dir = Path(job.run_dir)
    prepare_outputs(job, run_dir)
    job_path = job.save(run_dir / "job.json")
    if job.rt.recover:
        from .join import new_secret
        join_secret = join_secret or new_secret()        # recovery mode always admits by challenge
    store, store_proc, listening = _open_store(job, run_dir, world, join_secret, bind)  # noqa: F841 - kept while it serves
    try:
        (run_dir / "join.json").unlink(missing_ok=True)
        if job.rt.recover:
            _publish_for_joiners(job, store, world if local else 0, join_secret)
        host = bind[0] if bind else "127.0.0.1"
        base_env = _node_env(job, run_dir, world, store.port, job.rt.restartable, join_secret, host)
    except BaseException:                  # (a detached store process must not outlive a launch that never ran)
        if store_proc is not None:
            stop_store(store_proc, store, join_secret)
        raise
    start = None
    if local and job.rt.recover:          # a supervisor per node, as `skiptrain node` on a host of its own
        start = LocalStart(SUPERVISOR_MODULE, ["--coordinator", f"{host}:{store.port}"], "supervisor{rank}.log",
                           base_env, supervised=True)
    elif local:                           # fail-fast: the nodes themselves, any failure ends the run
        start = LocalStart(job.node_module, ["--job", str(job_path)], "node{rank}.log", base_env, supervised=False)
    return _coordinate(job, world, store, store_proc, join_secret, timeout_s, grace_s, echo,
                       start=start, remote=not local)


def adopt(job: Job, address: tuple[str, int], join_secret: str, remote: bool, timeout_s: float = math.inf,
          grace_s: float = 3.0, echo: bool = False) -> LaunchResult:
    """Take over a live run whose coordinator died, from the run's store at ``address`` (a process
    of its own: every ``skiptrain coordinator`` and ``--restartable`` run has one).  The membership
    is read back from the store (:func:`~skiptrain.runtime.coordinator.coordinate` with
    ``resume``), no node process is started, and the run ends as :func:`launch` ends it.
    ``remote``: the nodes are on other hosts; their rows and checkpoint slots are taken from
    where the dead coordinator stopped, and their outputs collected at the end.  Raises
    :class:`~skiptrain.runtime.failure.RuntimeFailure` when no store answers there, when it is
    closing (its nodes stopped for want of a coordinator: resume from the checkpoint) or when it
    holds no generation yet."""
    from .store import closing
    from .store_client import connect

    with sigterm_as_interrupt():
        try:
            try:
                store = connect(*address)
            except RuntimeError as e:
                raise RuntimeFailure(f"cannot take the run over: {e}") from None
            store.set_timeout(timedelta(seconds=max(job.rt.timeout_s, 60.0)))
            if closing(store, coordinator_key(join_secret)):
                raise RuntimeFailure("cannot take the run over: its store stopped the nodes for want of a "
                                     "coordinator and is closing; resume the run from its last checkpoint")
            return _coordinate(job, job.world, store, _store_pid(job), join_secret, timeout_s, grace_s, echo,
                               start=None, remote=remote, resume=True)
        except KeyboardInterrupt:
            print(f"[coordinator] interrupted: {salvage_checkpoint(job)}", file=sys.stderr, flush=True)
            raise


def _store_pid(job: Job) -> int | None:
    """The PID of the run's store process on this host, from ``RUN_DIR/store.json`` (None: unknown)."""
    try:
        return int(json.loads((Path(job.run_dir) / "store.json").read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _coordinate(job: Job, world: int, store, store_proc, join_secret: str | None, timeout_s: float, grace_s: float,
                echo: bool, start: LocalStart | None, remote: bool, resume: bool = False) -> LaunchResult:
    """Run the coordinator (or the fail-fast monitor) until the run ends, then collect its outputs
    and end it; ``start``: the processes to start here, one per node."""
    run_dir = Path(job.run_dir)
    t_start = time.time()
    store_watch = DeathWatch(store_proc) if isinstance(store_proc, subprocess.Popen) else None
    alive = SignOfLife(store, coordinator_key(join_secret), job.rt.heartbeat_s) if job.rt.recover else nullcontext()
    try:
        with alive, (hosts_file_server(job, store, join_secret, checkpoint_roots(job)) if remote
                     else nullcontext()) as files:
            with (coordinator_relays(job, store, join_secret, files) if remote else nullcontext()):
                interrupted, err = _run_nodes(job, world, store, store_watch, join_secret, t_start, timeout_s,
                                              grace_s, echo, start, resume)
            if remote:      # (the last generation's members are waited for: they ship as their process ends)
                collect_run_outputs(store, join_secret, run_dir, files, max(30.0, job.rt.timeout_s))
    finally:                # (the run is over: its store process ends, asked to; one this process did not
        if store_watch is not None:                                        # start only when resuming)
            store_watch.stopping()
        if store_proc is not None or resume:
            stop_store(store_proc, store, join_secret)
    wall = time.time() - t_start
    if err is not None:
        raise err
    return _result(job, run_dir, world, wall, interrupted, echo)


def _open_store(job: Job, run_dir: Path, world: int, join_secret: str | None, bind: tuple[str, int] | None):
    """The run's rendezvous store: ``(store, store process or None, listening socket or None)``;
    the caller keeps the socket referenced as long as the store serves.

    In recovery mode the store is a process of its own, so a coordinator that is stopped or
    starved does not stop it (the nodes renew their leases meanwhile).  It dies with this
    launcher unless the run is restartable or its nodes are on other hosts (``bind``): then this
    coordinator may die and be replaced (:func:`adopt`) while the nodes train on, for up to
    ``runtime.coordinator_wait_s``."""
    import torch.distributed as dist

    from .membership import host_store
    if job.rt.recover or bind is not None:
        from .store import start as start_store
        detached = job.rt.restartable or bind is not None
        store_proc, host, port = start_store(run_dir, secret=join_secret, with_parent=not detached, bind=bind,
                                             coordinator_wait_s=job.rt.coordinator_wait_s if detached else 0.0)
        store = dist.TCPStore(host, port, world, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=max(job.rt.timeout_s, 60.0)))
        return store, store_proc, None
    store, listening = host_store(world, max(job.rt.timeout_s, 60.0))   # loopback only
    return store, None, listening


def _publish_for_joiners(job: Job, store, first_id: int, join_secret: str) -> None:
    """Nodes joining (``--join HOST:PORT``, announced in join.json by :func:`_node_env`) take
    ids from ``first_id`` on (the launched nodes' count; 0 when every node comes from another
    host) and read the job here, signed by the coordinator (a joiner trusts no job a process
    without the secret wrote)."""
    from .join import publish_job
    from .membership import MAX_NODE_IDS, raise_count

    raise_count(store, "nodes/next", first_id, MAX_NODE_IDS)
    publish_job(store, job.to_dict(), join_secret)


def _run_nodes(job: Job, world: int, store, store_watch: DeathWatch | None, join_secret: str | None, t_start: float,
               timeout_s: float, grace_s: float, echo: bool, start: LocalStart | None,
               resume: bool = False) -> tuple[bool, RuntimeFailure | None]:
    """Start the processes of ``start`` (None: none here), watch the nodes until the run ends
    (``resume``: a coordinator taking a live run over), then stop every process started here
    that is left and end the run (its secret, its join announcement).  Returns whether it was
    interrupted and the error to raise for a failed run (None: none).  A supervised node is seen
    through its supervisor (:class:`~.node_processes.SupervisedNode`: the exit it reported,
    signed, as a node on another host; killed with its supervisor)."""
    run_dir = Path(job.run_dir)
    started: list = []
    procs: list = []
    forked = None
    failure = err = None
    interrupted = False
    killed_by_us: set[int] = set()
    try:
        if start is not None:
            forked = start_nodes(run_dir / "job.json", start.module, world, run_dir / "logs", start.env,
                                 detached=job.rt.restartable, argv=start.argv, log=start.log)
            started = forked.wait_started()
        procs = started
        if start is not None and start.supervised:     # each node as its supervisor reports it
            verifier = Verifier(join_secret, run_dir / "rejected_writes.jsonl")
            procs = [SupervisedNode(p, r, store, verifier) for r, p in enumerate(started)]
        with SwarmProgress(run_dir / "metrics.jsonl", sum(ph.iterations for ph in job.phases), enabled=echo,
                           initial=job.resume["iteration"] if job.resume else 0):
            try:
                failure = _watch(job, procs, store, world, t_start, timeout_s, run_dir, join_secret, resume)
            except KeyboardInterrupt:
                interrupted = True
                failure = _stop_at_boundary(job, procs, store, join_secret)
            except Exception:  # noqa: BLE001 - a call to a store that died: said below in one line
                if store_watch is None or store_watch.died() is None:
                    raise
        if store_watch is not None and store_watch.died(0.5 if failure else 0.0) is not None:
            failure = {"kind": "store", "code": store_watch.died(), "t": time.time()}
        if failure is not None:
            grace_end = time.time() + grace_s
            while time.time() < grace_end and any(p.poll() is None for p in procs):
                time.sleep(0.05)
    finally:
        if forked is not None and not started:           # (interrupted or timed out while starting)
            started = forked.handles()
        killed_by_us |= _stop_children(started)
        if forked is not None:
            forked.close()
        (run_dir / "join_secret").unlink(missing_ok=True)     # the run is over: nobody may join
        (run_dir / "join.json").unlink(missing_ok=True)
        if failure is not None:                 # explained while the store (fault times) is still up
            err = explain_failure(job, procs, failure, run_dir, store, killed_by_us)
    return interrupted, err


def _watch(job: Job, procs, store, world: int, t_start: float, timeout_s: float, run_dir: Path,
           join_secret: str | None, resume: bool = False) -> dict | None:
    """Watch the nodes until the run ends: the coordinator in recovery mode, else the fail-fast
    monitor; None on success, else a failure description."""
    if job.rt.recover:
        from .coordinator import coordinate
        return coordinate(job, procs, store, world, t_start, timeout_s, run_dir, join_secret, resume=resume)
    return monitor(job, procs, store, world, t_start, timeout_s, run_dir)


def _result(job: Job, run_dir: Path, world: int, wall: float, interrupted: bool, echo: bool) -> LaunchResult:
    """Merge the nodes' outputs and read the metrics back into the launch's result."""
    merge_outputs(job, run_dir)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    done = max((m["step"] for m in metrics if "loss" in m), default=0)
    interrupted = interrupted and done < sum(ph.iterations for ph in job.phases)   # (a stop after the last)
    if interrupted:
        print(f"[launch] interrupted: every node stopped after iteration {done} and wrote its stage; "
              f"{run_dir / 'model.safetensors'} holds iteration {done}", file=sys.stderr, flush=True)
    elif echo:
        print(f"[launch] {world} nodes finished in {wall:.1f} s", flush=True)
    return LaunchResult(run_dir, wall, metrics, interrupted)


def _stop_at_boundary(job: Job, procs, store, secret: str | None) -> dict | None:
    """Ask the nodes to stop at the next iteration boundary (``stop`` in the store, signed in a
    run with a secret) and wait for them to exit; None when all did cleanly, else a failure description (the launch then stops
    hard).  A second Ctrl-C while waiting goes up at once."""
    from .membership import coordinator_key, sign
    from .node.coordinator_link import STOP_KEY

    print("[launch] stopping: every node ends at the next iteration boundary and writes its stage "
          "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
    store.set(STOP_KEY, sign(coordinator_key(secret), STOP_KEY, "1"))   # nodes verify
    watched = _members_now(job, store, len(procs), secret)
    end = time.time() + 2 * job.rt.timeout_s + 10
    while time.time() < end:
        codes = {r: procs[r].poll() for r in watched}
        if all(c == 0 for c in codes.values()):
            return None
        bad = [(r, c) for r, c in codes.items() if c not in (None, 0)]
        if bad:
            return {"kind": "exit", "node": bad[0][0], "code": bad[0][1], "t": time.time()}
        time.sleep(0.05)
    return {"kind": "timeout", "t": time.time()}


def _members_now(job: Job, store, n_procs: int, secret: str | None) -> list[int]:
    """The launched nodes still members of the run: in recovery mode those of the newest
    generation (a node that failed or was fenced earlier is no longer waited for), else all."""
    if not job.rt.recover:
        return list(range(n_procs))
    from .membership import coordinator_key
    from .recovery import generation_record, latest_generation
    key = coordinator_key(secret)
    rec = generation_record(store, latest_generation(store, key), key)
    if rec is None:                            # stopped during admission: every node
        return list(range(n_procs))
    return [r for r in range(n_procs) if r in rec["alive"]]


def _node_env(job: Job, run_dir: Path, world: int, port: int, detached: bool, join_secret: str | None,
              host: str) -> dict:
    """The node processes' environment; in recovery mode also the run's join secret (written to
    ``RUN_DIR/join_secret``, mode 0600, and announced in ``join.json``)."""
    repo_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world),
               SKIPTRAIN_STORE_HOSTED="1", OMP_NUM_THREADS="1", SKIPTRAIN_DETACHED="1" if detached else "0",
               PYTHONPATH=os.pathsep.join([repo_root, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    if job.rt.recover:
        from .join import SECRET_ENV
        env[SECRET_ENV] = join_secret
        sf = run_dir / "join_secret"
        sf.unlink(missing_ok=True)
        fd = os.open(sf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)   # readable by this user only
        os.write(fd, join_secret.encode())
        os.close(fd)
        tmp = run_dir / "join.json.tmp"           # (whole or absent: a joiner reads it as soon as it exists)
        tmp.write_text(json.dumps({"host": host, "port": port, "secret_file": str(sf)}))
        os.replace(tmp, run_dir / "join.json")
    return env


def _stop_children(procs) -> set[int]:
    """SIGKILL the node processes still running and wait for all; returns the ranks killed here.
    A rank whose start is not reported yet (a launch interrupted while starting) is killed too:
    the fork server forks every rank of a launch before it reads the kill."""
    killed = set()
    for r, p in enumerate(procs):
        if p.poll() is None:
            killed.add(r)
            p.kill()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    return killed
