"""TensorBoard event files of a run (``log.tensorboard=true``), written from its run directory.

:class:`TensorBoardLog` follows the run directory from a thread of the launcher (or the
coordinator of hosts), like the progress bar: every :data:`POLL_S` seconds it reads the rows of
``metrics.jsonl`` it has not written yet, the membership events and the nodes' live totals
(:func:`~skiptrain.watch.state.run_state`'s readers), and writes them to
``RUN_DIR/tensorboard/`` with torch's ``SummaryWriter``; :meth:`close` makes a last pass (the
final validation point, the events of the run's end).  The nodes never wait on it.

Tags (the x axis is the iteration): ``loss/train``, ``loss/val``, ``lr``, ``tokens_per_s``,
``time/iteration_s``, ``time/comm_s``, ``time/checkpoint_stall_s`` (the slowest node's stalls so
far), ``bytes/dp_payload``, ``bytes/dp_dense_fp32`` (what a dense fp32 all-reduce would send),
``bytes/activations_sent`` and ``bytes/activations_fp32`` (per iteration), and ``membership``
(text: one entry per failure, join or refusal).

Failure semantics: without the ``tensorboard`` package the run is refused before it starts
(:func:`check_available`: one line naming the extra to install).
"""

from __future__ import annotations

import threading
from pathlib import Path

from ..errors import UserError

#: Seconds between two passes over the run directory.
POLL_S = 1.0
#: The event files' directory in the run directory.
TB_DIR = "tensorboard"
#: Every scalar tag written (the TensorBoard test reads each back).
SCALAR_TAGS = ("loss/train", "loss/val", "lr", "tokens_per_s", "time/iteration_s", "time/comm_s",
               "time/checkpoint_stall_s", "bytes/dp_payload", "bytes/dp_dense_fp32", "bytes/activations_sent",
               "bytes/activations_fp32")
TEXT_TAG = "membership"


def check_available() -> None:
    """Refuse ``log.tensorboard=true`` without the tensorboard package (before a run starts)."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise UserError("log.tensorboard=true needs the tensorboard package: pip install 'skiptrain[tensorboard]' "
                        "(or tensorboard==2.21.0), or drop the setting") from None


class TensorBoardLog:
    """Follows ``run_dir`` and writes its event files (see the module's docstring)."""

    def __init__(self, run_dir: str | Path, poll_s: float = POLL_S):
        from torch.utils.tensorboard import SummaryWriter

        check_available()
        self.run_dir = Path(run_dir)
        self.writer = SummaryWriter(log_dir=str(self.run_dir / TB_DIR), flush_secs=5)
        self.poll_s = poll_s
        self.step = 0               # iterations written
        self.val_step = 0
        self.events = 0             # membership events written
        self.prev = None            # (time, tokens) of the last row written
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tensorboard-log", daemon=True)

    def start(self) -> "TensorBoardLog":
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop following, make a last pass and close the files."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.write_new()
        self.writer.close()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.write_new()

    def write_new(self) -> None:
        """Write what the run directory holds that was not written yet."""
        from ..runtime.event_log import membership_events
        from ..runtime.live import load_live_records
        from .state import load_plan, read_jsonl

        rows = read_jsonl(self.run_dir / "metrics.jsonl")
        live = load_live_records(self.run_dir, "train")
        _, sched, cfg = load_plan(self.run_dir)
        act = activation_per_iteration(self.run_dir, cfg, sched)
        for r in rows:
            if "loss" in r and r.get("step", 0) > self.step:
                self.write_iteration(r, act)
            elif "val_loss" in r and r.get("step", 0) > self.val_step:
                self.writer.add_scalar("loss/val", r["val_loss"], r["step"])
                self.val_step = r["step"]
        if live and self.step:
            w = self.writer
            w.add_scalar("time/checkpoint_stall_s", max(x["totals"].get("ckpt_s", 0.0) for x in live), self.step)
            iters = max(1, max(x["totals"].get("iterations", 0) for x in live))
            w.add_scalar("bytes/dp_dense_fp32", sum(x["totals"].get("dense_fp32_bytes", 0) for x in live) / iters,
                         self.step)
        for e in membership_events(self.run_dir)[self.events:]:
            self.writer.add_text(TEXT_TAG, f"node {e['node']}: {e['kind']} (generation {e['gen']}): {e['cause']}",
                                 self.step)
            self.events += 1
        self.writer.flush()

    def write_iteration(self, r: dict, act: dict | None) -> None:
        w, step = self.writer, r["step"]
        w.add_scalar("loss/train", r["loss"], step)
        for tag, key in (("lr", "lr"), ("time/iteration_s", "iteration_s"), ("time/comm_s", "comm_s"),
                         ("bytes/dp_payload", "payload_bytes")):
            if key in r:
                w.add_scalar(tag, r[key], step)
        if "tok_s" in r:                          # (the one-process trainer's rows say it)
            w.add_scalar("tokens_per_s", r["tok_s"], step)
        elif self.prev is not None and r.get("time", 0) > self.prev[0]:
            w.add_scalar("tokens_per_s", (r.get("tokens", 0) - self.prev[1]) / (r["time"] - self.prev[0]), step)
        if act is not None:
            w.add_scalar("bytes/activations_sent", act["sent_bytes"], step)
            w.add_scalar("bytes/activations_fp32", act["fp32_bytes"], step)
        self.prev = (r.get("time", 0), r.get("tokens", 0))
        self.step = step


def activation_per_iteration(run_dir: Path, cfg, sched) -> dict | None:
    from .state import activation_bytes_cached

    return activation_bytes_cached(run_dir, cfg, sched) if cfg is not None and sched is not None else None
