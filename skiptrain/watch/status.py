"""``skiptrain status RUN_DIR``: the dashboard's facts as one terminal screen (or JSON), for ssh."""

from __future__ import annotations


def _mib(b: float | None) -> str:
    return "-" if b is None else f"{b / 2**20:,.1f} MiB"


def _num(x, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def idea_lines(fig: dict) -> list[str]:
    """One line per idea: what it did so far."""
    out = []
    if "skip" in fig:
        s = fig["skip"]
        out.append(f"  skip routes   {s['skipped']:,} stage visits skipped ({s['skipped_per_iteration']} of "
                   f"{s['full_visits_per_iteration']} per iteration)")
    if "activations" in fig:
        a = fig["activations"]
        out.append(f"  activations   {a['slow_hops']} of {a['hops']} hops carry {a['codec']}: {_mib(a['saved_bytes'])} "
                   "saved so far")
    d = fig["dp"]
    ratio = f" ({d['ratio']:g}x fewer)" if d["ratio"] else ""
    out.append(f"  data parallel {_mib(d['payload_bytes'])} sent; a dense fp32 all-reduce: "
               f"{_mib(d['dense_fp32_bytes'])}{ratio}")
    f = fig["freezing"]
    out.append(f"  freezing      {f['frozen_layers']} layers frozen ({f['freezes']} freezes, {f['undos']} undos); "
               f"activation cache: {f['cache_hits']:,} hits, {f['prefills']} prefills")
    c = fig["checkpoints"]
    out.append(f"  checkpoints   {len(c['committed'])} committed {c['committed'][-5:]}; training stalled "
               f"{c['stall_s']:.3f} s on them (slowest node)")
    return out


def render(st: dict) -> str:
    """The state (:func:`~skiptrain.watch.state.run_state`) as text, about one screen."""
    last = st["last"] or {}
    lines = [f"{st['run_dir']}: {st['line']}",
             f"iteration {st['iterations_done']}/{st['iterations_total']}, generation {_num(st['generation'], '{}')}, "
             f"loss {_num(last.get('loss'))}, median iteration {_num(st['median_iteration_s'])} s", "",
             f"  {'node':>4}  {'host':<16} {'stages':<8} {'state':<10} {'lease age':>10} {'last it':>8}"]
    for n in st["nodes"]:
        age = "-" if n["lease_age_s"] is None else f"{n['lease_age_s']:.1f}/{n['lease_s'] or 0:g} s"
        stages = "+".join(map(str, n["stages"])) or "-"
        lines.append(f"  {n['node']:>4}  {str(n['host'] or '-')[:16]:<16} {stages:<8} {n['state']:<10} {age:>10} "
                     f"{_num(n['last_iteration'], '{}'):>8}")
    n = len(st["membership"])
    lines += ["", f"membership ({n} events{', the last 8' if n > 8 else ''}):"]
    for e in st["membership"][-8:]:
        who = "coordinator" if e["node"] is None else f"node {e['node']}"
        lines.append(f"  {who}: {e['kind']} (generation {e['gen']}): {e['cause']}")
    lines += ["", "what each idea did:"] + idea_lines(st["ideas"])
    return "\n".join(lines)


def status_json(st: dict) -> dict:
    """The state without its long series (loss points and timelines): what ``--json`` prints."""
    return {k: v for k, v in st.items() if k not in ("loss", "val", "gantt")}
