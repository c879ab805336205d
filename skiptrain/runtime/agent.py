"""``skiptrain node``: the supervisor of one host's node in a run that spans hosts.

It is started on its own on each host, in any order, and shares nothing with the coordinator but
the network and the run's secret.  :class:`NodeAgent` loops:

1. connect to the coordinator's store, retrying with backoff until it answers (at most
   ``wait_s``), and read the job the coordinator signed (a wrong secret is refused here);
2. check this host's data set against the job's (by fingerprint), pick the address to advertise
   (the route to the coordinator, or ``--advertise``) and the interface that holds it, for gloo;
3. take a node id and start the node process, ``python -m <the job's node module> --join``, with
   its own run directory under ``work_dir`` (no file system is shared), and wait for it (a
   supervisor that ``skiptrain launch`` forked, :func:`main`, forks its node at once, and the
   node writes into the run directory itself);
4. ship the node's outputs to the coordinator (its file server) and sign its exit report (:mod:`.shipping`,
   :func:`~skiptrain.runtime.fencing.report_exit`);
5. when the node finished the job: exit 0.  When it stopped because its lease ran out (a cut
   link, a stopped host, a coordinator whose host died: then it waits for one started with
   ``--resume``), stopped because the run had no coordinator for too long (it waits likewise),
   was not admitted (it came after the first generation had formed) or
   failed on its own while the run goes on, start again as a new node (a new id and incarnation,
   healed from a live replica by the join), at most ``rejoins`` times.

Failure semantics: bad input (an address, a data set, a secret) ends it with exit status 2 and
one line, and so does a coordinator that does not answer within ``wait_s``; after ``rejoins``
new nodes it exits with the last node's status.  Each node's files live in
``work_dir/<run id>/node<id>``, so an earlier run's are never sent to a new coordinator (under
``skiptrain launch``, on the coordinator's host: in the run directory itself, nothing shipped).
It signals only the node process it
started itself, which also dies with it (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from .addresses import check_advertised, check_reachable, interface_of, route_address
from .failure import EXIT_FENCED, EXIT_NO_COORDINATOR, describe_exit
from .fencing import report_exit
from .fork_server import fork_process, forked_here
from .join import EXIT_REFUSED, SECRET_ENV, request_node_id
from .membership import coordinator_key, member_key
from .shipping import ship_outputs
from .store import closing
from .store_client import open_run, parse_address

#: First and longest pause between attempts to reach the coordinator (seconds).
BACKOFF_S = (0.25, 3.0)


@dataclass
class AgentOptions:
    coordinator: str                  # HOST:PORT of the coordinator's store
    secret: str
    work_dir: Path
    data: str | None = None           # this host's copy of the data set (default: the job's path)
    advertise: str | None = None      # the address peers reach this host at (default: the route's)
    wait_s: float = 120.0             # how long to keep trying to reach the coordinator
    rejoins: int = 3                  # new incarnations after a self-fencing or a failure
    node_id: int | None = None        # the first node's id, when the coordinator reserved it
    shared_run_dir: bool = False      # on the coordinator's host (``skiptrain launch``): the node
                                      # writes into the run directory itself, nothing is shipped


class NodeAgent:
    """One host's node supervisor (see the module's docstring)."""

    def __init__(self, opts: AgentOptions):
        self.opts = opts
        self.host, self.port = parse_address(opts.coordinator)
        self.child: subprocess.Popen | None = None
        self.run_dir = opts.work_dir

    def run(self) -> int:
        os.environ[SECRET_ENV] = self.opts.secret
        code = 1
        for attempt in range(self.opts.rejoins + 1):
            store, job = self.connect()
            env, data = self.prepare(job)
            try:
                node = self.opts.node_id if attempt == 0 and self.opts.node_id is not None else request_node_id(store)
            except RuntimeError:             # (the store went away between the two calls: anew)
                continue
            self.run_dir = Path(job.run_dir) if self.opts.shared_run_dir else \
                self.opts.work_dir / job.run_id / f"node{node}"
            code = self.run_node(node, env, data, job.node_module)
            self.deliver(store, node, code, job)
            if code == 0:
                return 0
            if attempt < self.opts.rejoins:
                why = {EXIT_FENCED: "its lease ran out", EXIT_REFUSED: "not admitted",
                       EXIT_NO_COORDINATOR: "the run had no coordinator for too long; waiting for one started "
                                            "with --resume"}.get(code, describe_exit(code))
                print(f"skiptrain node: node {node} stopped ({why}); joining again as a new node",
                      file=sys.stderr, flush=True)
        return code

    def deliver(self, store, node: int, code: int, job) -> None:
        """The node's exit report and outputs to the coordinator.  While they cannot be sent (the
        coordinator is away, its file server with it, or the link broke) it tries again with
        backoff through a new connection, for up to the job's ``coordinator_wait_s`` plus
        ``wait_s`` (a coordinator started with ``--resume`` takes them).  A coordinator that does
        not come, or one that took the run over from a checkpoint (another run id: these outputs
        are past its checkpoint), leaves them in the work directory, said in one line."""
        run_id = job.run_id
        budget = self.opts.wait_s + job.rt.coordinator_wait_s
        end, pause, tries = time.monotonic() + budget, BACKOFF_S[0], 0
        while not self.after(store, node, code, run_id, say=tries == 0):
            if time.monotonic() + pause > end:
                print(f"skiptrain node: gave up sending node {node}'s outputs after {budget:g} s; they stay in "
                      f"{self.run_dir}", file=sys.stderr, flush=True)
                return
            tries += 1
            time.sleep(pause)
            pause = min(BACKOFF_S[1], pause * 1.5)
            try:
                store, now = self.connect()
            except UserError as e:
                print(f"skiptrain node: node {node}'s outputs stay in {self.run_dir}: {e}", file=sys.stderr, flush=True)
                return
            if now.run_id != run_id:
                print(f"skiptrain node: node {node}'s outputs stay in {self.run_dir}: a new coordinator took the run "
                      "over from its checkpoint", file=sys.stderr, flush=True)
                return

    def connect(self):
        """The store client and the job, retrying with backoff until the coordinator answers (the
        ``wait_s`` count from the moment a closing store of the run, which stopped its nodes for want
        of a coordinator, is gone: a new coordinator can only start then)."""
        from .join import JoinRefused
        from .job import Job

        end = time.monotonic() + self.opts.wait_s
        pause = BACKOFF_S[0]
        while True:
            try:
                _, _, store, job = open_run(self.opts.coordinator)
                if closing(store, coordinator_key(self.opts.secret)):
                    end = max(end, time.monotonic() + self.opts.wait_s)
                    raise RuntimeError("the run's store is closing: its nodes stopped for want of a coordinator")
                return store, Job.from_dict(job)
            except JoinRefused as e:
                raise UserError(f"the coordinator at {self.opts.coordinator} refused this node: {e}") from None
            except RuntimeError as e:
                if time.monotonic() + pause > end:
                    raise UserError(f"no coordinator answered at {self.opts.coordinator} within "
                                    f"{self.opts.wait_s:g} s ({str(e).splitlines()[0]}); start it with "
                                    "`skiptrain coordinator --bind HOST:PORT`, or check the address") from None
                time.sleep(pause)
                pause = min(BACKOFF_S[1], pause * 1.5)

    def prepare(self, job) -> tuple[dict, str]:
        """The node process's environment and this host's data set, checked against the job."""
        from ..data.dataset import TokenDataset

        data = self.opts.data or job.data_path
        want = job.meta.get("data_fingerprint")
        have = TokenDataset.open(data).fingerprint()
        if want and have != want:
            raise UserError(f"the data set at {data} is not the job's (fingerprint {have[:12]} here, {want[:12]} "
                            "in the job): prepare the same data set on this host, or point --data at it")
        addr = self.opts.advertise or route_address(self.host, self.port)
        check_advertised(addr, self.host)
        check_reachable(addr, self.host, self.port)
        env = dict(os.environ, GLOO_SOCKET_IFNAME=interface_of(addr), SKIPTRAIN_ADVERTISE=addr,
                   SKIPTRAIN_STORE_HOSTED="1", SKIPTRAIN_DETACHED="0", OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2]),
                                             os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env, data

    def run_node(self, node: int, env: dict, data: str, module: str = "skiptrain.runtime.node") -> int:
        """Start node ``node``'s process, running ``module`` (the job's node module), its files
        under ``self.run_dir`` (one folder per run and node, never one an earlier run wrote;
        the run directory itself for ``shared_run_dir``), and wait for it; its exit status."""
        run_dir = self.run_dir
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        env = dict(env, SKIPTRAIN_NODE_ID=str(node), SKIPTRAIN_DATA=data)
        if not self.opts.shared_run_dir:
            env["SKIPTRAIN_WORK_DIR"] = str(run_dir)
        log = run_dir / "logs" / (f"node{node}.log" if self.opts.shared_run_dir else "node.log")
        print(f"skiptrain node: node {node} starting (advertising {env['SKIPTRAIN_ADVERTISE']} on "
              f"{env['GLOO_SOCKET_IFNAME']}); log: {log}", file=sys.stderr, flush=True)
        argv = ["--join", self.opts.coordinator]
        if forked_here():                # (its imports are loaded: a forked node starts at once)
            self.child = fork_process(module, argv, env, log)
        else:
            with open(log, "ab") as out:
                self.child = subprocess.Popen([sys.executable, "-m", module, *argv], env=env,
                                              stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            return self.child.wait()
        except KeyboardInterrupt:
            self.child.send_signal(signal.SIGTERM)
            raise

    def after(self, store, node: int, code: int, run_id: str, say: bool = True) -> bool:
        """Ship the node's outputs and sign its exit report; False when they could not be sent (the
        reason said in one line when ``say``)."""
        key = member_key(self.opts.secret, node)
        try:
            report_exit(store, key, node, code)        # (first: the coordinator acts on it at once)
            sent = 0 if self.opts.shared_run_dir else \
                ship_outputs(store, key, coordinator_key(self.opts.secret), node, self.run_dir, run_id)
        except Exception as e:  # noqa: BLE001 - the coordinator or the link is gone
            if say:
                print(f"skiptrain node: could not send node {node}'s outputs to the coordinator "
                      f"({str(e).splitlines()[0][:240]}); they are in {self.run_dir}",
                      file=sys.stderr, flush=True)
            return False
        print(f"skiptrain node: node {node} {describe_exit(code)}" +
              ("" if self.opts.shared_run_dir else f"; sent {sent} bytes of outputs"), file=sys.stderr, flush=True)
        return True


def main(argv: list[str]) -> int:
    """``skiptrain launch``'s supervisor of one local node, forked by the launcher's fork server:
    ``--coordinator HOST:PORT``, the secret from the environment, its node id (reserved by the
    launcher) from ``RANK``.  It is the supervisor ``skiptrain node`` runs, on the coordinator's
    host: its node writes into the run directory itself, so nothing is shipped, and a node that
    failed is not brought back (the swarm goes on without it)."""
    import argparse

    ap = argparse.ArgumentParser(prog="skiptrain launch's node supervisor")
    ap.add_argument("--coordinator", required=True)
    args = ap.parse_args(argv)
    try:
        return NodeAgent(AgentOptions(args.coordinator, os.environ[SECRET_ENV], Path("."), rejoins=0,
                                      node_id=int(os.environ["RANK"]), shared_run_dir=True)).run()
    except UserError as e:
        print(f"skiptrain node: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":          # (a supervisor exec'd afresh: SKIPTRAIN_FRESH_NODES=1)
    sys.exit(main(sys.argv[1:]))
