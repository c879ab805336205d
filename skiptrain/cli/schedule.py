"""``skiptrain simulate``: plan and simulate one iteration with every method, side by side.

Prints a table of iteration times (and ratios to the full pipeline) for the planner and all
baselines, and optionally writes the JSON ``{"methods": {name: {"iteration_s": ...}}, "planner_s":
...}``, the planner's schedule, and a Gantt PNG of the planner's simulated timeline.
"""

from __future__ import annotations

import argparse
import json

from ..config import MAX_MB_PER_ORIGINATOR, MAX_MEMORY_CREDITS, MAX_NODES, MAX_TASK_S, ConfigError, skip_count
from ..net.topology import load_topology
from ..schedule.actcodec import CODECS
from ..schedule.compare import METHODS, compare, format_table
from ..schedule.cost import DEFAULT_TASK_S, DP_MODES, DP_TOPOLOGIES, CostModel
from ..schedule.gantt import draw_gantt
from ..schedule.placement import check_sizes
from ..schedule.planner import PlanConfig
from ..schedule.schedule import ScheduleError
from .options import IMAGE_SUFFIXES, write_output


#: simulate's numeric flags: (flag, lowest, highest or None, unit), checked before the cost model and
#: the planner are built, so that an error names the flag typed, not the field it feeds (a flag left
#: unset, None, is not checked: the planner chooses).
LIMITS = (("--stages", 1, MAX_NODES, ""), ("--skip", 0.0, 1.0, ""), ("--max-swaps", 0, 2, ""),
          ("--memory", 1, MAX_MEMORY_CREDITS, ""),
          ("--micro-batches", 1, MAX_MB_PER_ORIGINATOR, ""), ("--samples", 1, None, ""),
          ("--seq-len", 1, None, ""), ("--d-model", 1, None, ""), ("--dtype-bytes", 1, None, ""),
          ("--layers-per-stage", 0, None, ""),
          ("--s-per-sample-layer", 0.0, MAX_TASK_S, "a number of seconds "),
          ("--hop-overhead", 0.0, MAX_TASK_S, "a number of seconds "),
          ("--task-overhead", 0.0, MAX_TASK_S, "two numbers of seconds "),
          ("--act-fast-gbps", 0.0, None, "a number of GB/s "),
          ("--max-evals", 0, None, ""), ("--time-limit", 0.0, None, "a number of seconds "))


def check_limits(args: argparse.Namespace) -> None:
    """Refuse a numeric flag outside :data:`LIMITS` (nan included), a ``--skip`` that leaves routes no body
    stage on ``--stages`` stages and ``--stage-sizes`` that do not list ``--stages`` stages, naming the flags."""
    for flag, lo, hi, unit in LIMITS:
        value = getattr(args, flag[2:].replace("-", "_"))
        values = value if isinstance(value, tuple) else (value,)
        if value is not None and not all(lo <= v and (hi is None or v <= hi) for v in values):
            where = f"in [{lo:g}, {hi:g}]" if hi is not None else f">= {lo:g}"
            raise ScheduleError(f"{flag} {value} must be {unit}{where}")
    try:
        skip_count(args.skip, args.stages)
    except ConfigError as e:
        raise ScheduleError(f"--skip {args.skip} with --stages {args.stages}: {e}") from None
    sizes = args.stage_sizes
    if sizes is not None and len(sizes) != args.stages:
        raise ScheduleError(f"--stage-sizes {','.join(map(str, sizes))} lists {len(sizes)} stage(s), but --stages "
                            f"is {args.stages}; give one size per stage (or --stages {len(sizes)})")


def check_stage_sizes(args: argparse.Namespace, n_nodes: int) -> None:
    """Refuse ``--stage-sizes`` the topology's ``n_nodes`` cannot fill, naming the flag."""
    if args.stage_sizes is not None:
        try:
            check_sizes(args.stage_sizes, n_nodes)
        except ScheduleError as e:
            raise ScheduleError(f"--stage-sizes {','.join(map(str, args.stage_sizes))}: {e}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _seconds_pair(text: str) -> tuple[float, float]:
    try:
        f, b = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected FWD,BWD seconds, e.g. 0.13,0.09, got {text!r}") from None
    return f, b


def register(subparsers) -> None:
    p = subparsers.add_parser("simulate", help="plan routes and simulate an iteration (all baselines vs. the planner)",
                              description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--topology", default="geo12", help="preset (geo12, geo12-fixed, cluster, random, random:SEED) or JSON file")
    p.add_argument("--nodes", type=int, default=None, help="number of nodes (default: 20 for geo12, the file's nodes)")
    p.add_argument("--stages", type=int, default=6, help="pipeline stages including stage 0")
    p.add_argument("--stage-sizes", type=_ints, default=None, help="nodes per stage, e.g. 5,3,3,3,3,3 (default: by work)")
    p.add_argument("--skip", type=float, default=0.33, help="skip ratio k")
    p.add_argument("--max-swaps", type=int, default=2, help="neighbour swaps allowed per route")
    p.add_argument("--memory", type=int, default=3,
                   help=f"micro-batches in flight per node (at most {MAX_MEMORY_CREDITS}, as runtime.memory)")
    p.add_argument("--micro-batches", type=int, default=6, help="micro-batches per stage-0 node")
    p.add_argument("--samples", type=int, default=8, help="samples per micro-batch")
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sample")
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--dtype-bytes", type=int, default=4, help="bytes per activation value")
    p.add_argument("--layers-per-stage", type=int, default=4)
    p.add_argument("--s-per-sample-layer", type=float, default=0.055, help="forward seconds per sample per layer")
    p.add_argument("--hop-overhead", type=float, default=0.35, help="fixed seconds per message")
    p.add_argument("--task-overhead", type=_seconds_pair, default=DEFAULT_TASK_S, metavar="FWD,BWD",
                   help="fixed seconds per forward (and loss) task and per backward task; default: the runtime's "
                        "measured overhead in these units (SkipPipe's simulator: 0.13,0.09)")
    p.add_argument("--dp", choices=DP_MODES, default="dense", help="data-parallel sync model")
    p.add_argument("--dp-topology", choices=DP_TOPOLOGIES, default="auto",
                   help="dense sync: one ring (flat), region rings + shard rings across regions (hierarchical), "
                        "or the faster per stage (auto)")
    p.add_argument("--dp-payload-mb", type=float, default=0.0, help="compressed sync payload per replica (MiB)")
    p.add_argument("--act-codec", choices=CODECS, default="fp32",
                   help="activation/gradient encoding on links slower than --act-fast-gbps")
    p.add_argument("--act-fast-gbps", type=float, default=1.0, help="links at least this fast (GB/s) carry fp32")
    p.add_argument("--simplified", action="store_true", help="reference model: no link contention, no DP sync")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-evals", type=int, default=None, help="planner local-search simulations")
    p.add_argument("--time-limit", type=float, default=None, help="planner time cap in seconds")
    p.add_argument("--methods", default=",".join(METHODS), help="comma-separated subset of " + ",".join(METHODS))
    p.add_argument("--json", default=None, help="write results as JSON here")
    p.add_argument("--gantt", default=None, help="write the planner's Gantt chart PNG here")
    p.add_argument("--schedule-out", default=None, help="write the planner's schedule JSON here")
    p.set_defaults(func=run, written_paths=("--json", "--gantt", "--schedule-out"),
                   output_files={"--json": (), "--schedule-out": (), "--gantt": IMAGE_SUFFIXES})


def run(args: argparse.Namespace) -> int:
    check_limits(args)
    topo = load_topology(args.topology, args.nodes, seed=args.seed)
    check_stage_sizes(args, topo.n)
    if not 0 <= args.dp_payload_mb < float("inf"):
        raise ScheduleError(f"--dp-payload-mb {args.dp_payload_mb} must be a finite number of MiB >= 0")
    cost = CostModel(d_model=args.d_model, tokens_per_sample=args.seq_len, samples=args.samples,
                     dtype_bytes=args.dtype_bytes, layers_per_stage=[args.layers_per_stage] * args.stages,
                     s_per_sample_per_layer=args.s_per_sample_layer, hop_overhead_s=args.hop_overhead,
                     dp_mode=args.dp, dp_topology=args.dp_topology, compressed_payload_bytes=int(args.dp_payload_mb * 2 ** 20),
                     act_codec=args.act_codec, act_fast_GBps=args.act_fast_gbps,
                     fwd_task_s=args.task_overhead[0], bwd_task_s=args.task_overhead[1])
    methods = tuple(m.strip() for m in args.methods.split(",") if m.strip())
    bad = [m for m in methods if m not in METHODS]
    if bad or "planner" not in methods:
        raise ScheduleError(f"--methods must include planner and only names from {', '.join(METHODS)}")
    cfg = PlanConfig(n_stages=args.stages, stage_sizes=args.stage_sizes, skip_ratio=args.skip,
                     max_swaps=args.max_swaps, memory=args.memory, mb_per_originator=args.micro_batches,
                     seed=args.seed, max_evals=args.max_evals, time_limit_s=args.time_limit)
    contention = dp_sync = not args.simplified
    if args.dp == "none":
        dp_sync = False
    cmp = compare(topo, cost, cfg, contention=contention, dp_sync=dp_sync, methods=methods,
                  record=args.gantt is not None)
    model = "simplified (no contention, no DP sync)" if args.simplified else \
        f"full (link contention, DP sync {args.dp if dp_sync else 'off'})"
    print(f"topology {topo.name}: {topo.n} nodes, stage sizes {cmp.info['stage_sizes']}, "
          f"{cmp.info['micro_batches']} micro-batches, k={args.skip}, m={args.memory}; model: {model}")
    print(format_table({"iteration_s": cmp.iteration_s()}))
    print(f"planner time: {cmp.planner_s:.2f} s")
    if args.json:
        write_output("--json", args.json, json.dumps(cmp.to_dict(), indent=1, default=str))
        print(f"wrote {args.json}")
    if args.schedule_out:
        write_output("--schedule-out", args.schedule_out, cmp.schedules["planner"].to_json())
        print(f"wrote {args.schedule_out}")
    if args.gantt:
        labels = {nd.id: f"{nd.id} {nd.location} s{s}" for s, p in enumerate(cmp.schedules["planner"].placement)
                  for nd in (topo.nodes[n] for n in p)}
        r = cmp.results["planner"]
        draw_gantt(r.timeline, args.gantt, title=f"planner on {topo.name}: {r.iteration_s:.1f} s/iteration",
                   node_labels=labels)
        print(f"wrote {args.gantt}")
    return 0
