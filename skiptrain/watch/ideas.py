"""What each idea did in a run so far, from its run directory: skipped stage visits, activation
bytes on slow links, data-parallel bytes against a dense fp32 all-reduce, frozen layers, and
checkpoints with the stall they cost.  Used by the dashboard, ``skiptrain status`` and the demo's
summary (one computation of each figure)."""

from __future__ import annotations

from pathlib import Path


def skip_savings(sched, iterations: int) -> dict:
    """Body-stage visits of the schedule's micro-batches against a full pipeline, per iteration
    and over ``iterations``."""
    body = len(sched.placement) - 1
    visited = sum(len(m.route) for m in sched.micro_batches)
    full = body * len(sched.micro_batches)
    return {"micro_batches": len(sched.micro_batches), "body_stages": body, "visits_per_iteration": visited,
            "full_visits_per_iteration": full, "skipped_per_iteration": full - visited,
            "skipped": (full - visited) * iterations, "route_lengths": sorted({len(m.route) for m in sched.micro_batches})}


def activation_bytes(cfg, sched, topo, cost) -> dict:
    """Per iteration: the hops of the schedule's routes (activations forward, their gradients
    backward), those on slow links of ``topo`` under ``cost`` (they carry ``runtime.act_codec``),
    and the bytes sent against fp32 on every hop."""
    from ..schedule.actcodec import encoded_bytes

    rows, d = cfg.train.micro_batch * cfg.model.seq_len, cfg.model.d_model
    hops = [(a, b) for m in sched.micro_batches for a, b in zip([m.originator] + m.nodes, m.nodes + [m.originator])]
    slow = [h for h in hops if cost.hop_codec(topo, *h) != "fp32"]
    fp32 = 2 * len(hops) * rows * d * 4
    sent = fp32 - 2 * len(slow) * (rows * d * 4 - encoded_bytes(cfg.runtime.act_codec, rows, d))
    return {"codec": cfg.runtime.act_codec, "hops": len(hops), "slow_hops": len(slow), "fp32_bytes": fp32,
            "sent_bytes": sent}


def dp_savings(live_records: list[dict]) -> dict:
    """Data-parallel bytes every node contributed so far, against a dense fp32 all-reduce of the
    same replicated stages (the nodes' live totals)."""
    pay = sum(int(r.get("totals", {}).get("payload_bytes", 0)) for r in live_records)
    dense = sum(int(r.get("totals", {}).get("dense_fp32_bytes", 0)) for r in live_records)
    return {"payload_bytes": pay, "dense_fp32_bytes": dense, "ratio": round(dense / pay, 2) if pay else None}


def freezing(elastic_rows: list[dict], live_records: list[dict] = ()) -> dict:
    """Layers frozen now, the freezes and the undos so far (``elastic.jsonl``'s transitions), and
    the activation-cache hits of the nodes' caches (their live totals)."""
    frozen, freezes, undos, prefills = 0, 0, 0, 0
    for r in elastic_rows:
        act = r.get("action")
        if act == "transition":
            before, after = int(r.get("frozen_before", 0)), int(r.get("frozen_after", 0))
            freezes += after > before
            undos += after < before
            frozen = after
        elif act == "undo":
            undos += 1
        elif act == "prefill":
            prefills += 1
    hits = sum(int(r.get("totals", {}).get("cache_hits", 0)) for r in live_records)
    return {"frozen_layers": frozen, "freezes": freezes, "undos": undos, "prefills": prefills, "cache_hits": hits}


def checkpoints(run_dir: Path, live_records: list[dict]) -> dict:
    """Committed checkpoints (their iterations) and the seconds the slowest node's training loop
    stalled on checkpoints so far."""
    from ..checkpoint import store as ckstore

    steps = [s for s, _ in ckstore.list_committed(Path(run_dir) / "checkpoints")]
    stall = max((float(r.get("totals", {}).get("ckpt_s", 0.0)) for r in live_records), default=0.0)
    return {"committed": steps, "stall_s": round(stall, 4)}
