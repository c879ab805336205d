"""``skiptrain coordinator`` and ``skiptrain node``: one run across hosts, one command per host.

On one machine, the coordinator: it plans the job, publishes it, admits nodes by the join
challenge, decides generations and re-plans, and assembles the run directory (it holds no model
state)::

    skiptrain coordinator --bind HOST0:29500 --out runs/h --join-secret-file run.secret --preset tiny

On every other machine, in any order (each retries until the coordinator answers)::

    skiptrain node --coordinator HOST0:29500 --join-secret-file run.secret

Checkpoints are committed in the coordinator's run directory.  If the coordinator's process dies
and its host lives, the run's store (a process of its own) keeps serving and the nodes train on;
``skiptrain coordinator --bind HOST0:29500 --out runs/h --join-secret-file run.secret --resume``
takes the live run over.  If no coordinator comes within ``runtime.coordinator_wait_s``, or the
coordinator's host dies, the nodes stop and wait for one (``--wait``), and ``--resume`` continues
the run from its newest committed checkpoint.

The secret file is made by the coordinator when it does not exist yet (copy it to the hosts), or
by the user beforehand.  docs/multihost.md: ports, addresses, what happens when a host or the
link goes away.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import UserError


def cmd_coordinator(args: argparse.Namespace) -> int:
    from ..runtime.addresses import AddressError, resolve
    from ..runtime.join import read_secret_file
    from ..runtime.membership import listen_socket
    from ..runtime.store_client import parse_address
    from ..train.rundir import claim_run_dir
    from .launch import adopt_swarm_run, train_swarm
    from .options import config_from_args

    try:
        host, port = parse_address(args.bind)
        host = resolve(host)
    except (ValueError, AddressError) as e:
        raise UserError(f"--bind: {e}") from None
    cfg = config_from_args(args, **{"data.path": args.data, "train.steps": args.steps,
                                    "runtime.nodes": args.nodes, "runtime.heartbeat_deadline_s": args.heartbeat_deadline,
                                    "runtime.min_nodes": args.min_nodes})
    cfg.runtime.recover = True          # a run across hosts always survives failed nodes
    cfg.check()
    if not args.overwrite:      # (a run already there is refused before anything is written)
        claim_run_dir(args.out, resume=args.resume is not None)
    if args.resume is not None and _live(args.out, host, port, args.join_secret_file):
        adopt_swarm_run(args.out, (host, port), read_secret_file(args.join_secret_file, make=False))
        return 0
    try:
        listen_socket(host, port).close()        # (the store binds there once the job is planned)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e}); pick a free port, or an address "
                        "of this host") from None
    secret = read_secret_file(args.join_secret_file, make=True)
    train_swarm(cfg, cfg.data.path, args.out, echo=True, overwrite=args.overwrite, resume=args.resume,
                hosts={"bind": (host, port), "secret": secret})
    return 0


def _live(out: str, host: str, port: int, secret_file: str) -> bool:
    """Whether the run in ``out`` is alive at ``host:port`` (its coordinator died, its store and
    nodes train on), so ``--resume`` takes it over rather than resuming from a checkpoint."""
    import json

    from ..runtime.join import read_secret_file
    from ..runtime.store import live_run

    try:
        run_id = str(json.loads((Path(out) / "job.json").read_text())["meta"]["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return False
    try:
        return live_run(host, port, read_secret_file(secret_file, make=False), run_id)
    except RuntimeError as e:
        raise UserError(f"--resume: {e}") from None


def cmd_node(args: argparse.Namespace) -> int:
    from ..runtime.addresses import AddressError
    from ..runtime.agent import AgentOptions, NodeAgent

    from ..runtime.join import read_secret_file

    secret = read_secret_file(args.join_secret_file, make=False)
    try:
        agent = NodeAgent(AgentOptions(args.coordinator, secret, Path(args.work_dir), data=args.data,
                                       advertise=args.advertise, wait_s=args.wait, rejoins=args.rejoins))
        return agent.run()
    except (ValueError, AddressError) as e:
        raise UserError(str(e)) from None


def register(sub) -> None:
    from .options import add_config_args

    p = sub.add_parser("coordinator", help="coordinate a run whose nodes are on other hosts (no model state here)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, default_preset="tiny")
    p.add_argument("--bind", required=True, metavar="HOST:PORT",
                   help="the IPv4 address the nodes reach this coordinator at (one address of this host) and a free port")
    p.add_argument("--out", required=True, help="run directory: the whole run is assembled here")
    p.add_argument("--overwrite", action="store_true", help="replace the run already in --out")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="CHECKPOINT",
                   help="take over the run in --out: the live run when its store still serves at --bind (its "
                        "coordinator's process died, its host lives: the nodes trained on), else from its newest "
                        "committed checkpoint or CHECKPOINT (its config.toml unless --config is given), which the "
                        "nodes waiting for a coordinator join")
    p.add_argument("--join-secret-file", required=True, metavar="F",
                   help="the run's secret; a new one is written there when F does not exist")
    p.add_argument("--nodes", type=int, default=None, help="nodes the job is planned for (config runtime.nodes)")
    p.add_argument("--data", default=None, help="prepared data directory (config data.path)")
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--min-nodes", type=int, default=None, metavar="N",
                   help="below N live nodes, training pauses until nodes join (config runtime.min_nodes; 0: never)")
    p.add_argument("--heartbeat-deadline", type=float, default=None, metavar="S",
                   help="the shortest lease of a node, in seconds (config runtime.heartbeat_deadline_s)")
    p.set_defaults(func=cmd_coordinator, written_paths=("--out",), writes_run_dir=True)

    p = sub.add_parser("node", help="run this host's node of a run that a `skiptrain coordinator` coordinates",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coordinator", required=True, metavar="HOST:PORT", help="the coordinator's --bind address")
    p.add_argument("--join-secret-file", required=True, metavar="F", help="the run's secret (copied from the coordinator)")
    p.add_argument("--data", default=None, help="this host's copy of the prepared data set (default: the job's path)")
    p.add_argument("--advertise", default=None, metavar="ADDR",
                   help="the address peers reach this host at (default: this host's address on its route to the coordinator)")
    p.add_argument("--work-dir", default="skiptrain-node", help="where this host keeps its node's files and logs")
    p.add_argument("--wait", type=float, default=120.0, metavar="S",
                   help="keep trying to reach the coordinator this long before giving up")
    p.add_argument("--rejoins", type=int, default=3,
                   help="times this host's node joins again as a new node after it was cut off or failed")
    p.set_defaults(func=cmd_node, written_paths=("--work-dir",))
