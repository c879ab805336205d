"""A progress bar for a local swarm: follows the run's ``metrics.jsonl`` from the launcher.

Node processes append one JSON line per finished iteration (``phase``, ``step``, ``loss``,
``tokens``); this thread tails the file and shows iterations done, the latest loss, tokens/s and
the ETA (tqdm).  It only reads; if the file is missing or a line is half written it tries again
on the next poll.  Stopping it is idempotent.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path


class SwarmProgress:
    def __init__(self, metrics_path: str | Path, total_steps: int, poll_s: float = 0.5,
                 enabled: bool = True, initial: int = 0):
        """``initial``: iterations already done (a resumed job): the bar starts there and
        follows only the lines written from now on."""
        self.path = Path(metrics_path)
        self.total = total_steps
        self.initial = initial
        self.poll_s = poll_s
        self.enabled = enabled
        self.done = 0  # iterations seen so far
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="swarm-progress", daemon=True)

    def __enter__(self) -> "SwarmProgress":
        if self.enabled:
            self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        from tqdm import tqdm

        # (a log file rather than a terminal, as for a coordinator started by a service: a line every 30 s)
        bar = tqdm(total=self.total, initial=self.initial, unit="it", dynamic_ncols=True, desc="swarm",
                   mininterval=0.1 if sys.stderr.isatty() else 30.0)
        offset, t0, tokens0 = 0, time.time(), None
        if self.initial:
            try:
                offset = self.path.stat().st_size
            except OSError:
                pass
        try:
            while not self._stop.is_set():
                self._stop.wait(self.poll_s)
                try:
                    with open(self.path) as f:
                        f.seek(offset)
                        chunk = f.read()
                except OSError:
                    continue
                complete = chunk[: chunk.rfind("\n") + 1]
                offset += len(complete.encode())
                for line in complete.splitlines():
                    try:
                        row = json.loads(line)
                    except json.JSONDecodeError:
                        continue
                    if "loss" not in row or "step" not in row:
                        continue
                    self.done += 1
                    tokens = row.get("tokens", 0)
                    if tokens0 is None:
                        tokens0, t0 = tokens, time.time()
                    rate = (tokens - tokens0) / max(time.time() - t0, 1e-9)
                    bar.set_postfix(phase=row.get("phase", ""), loss=f"{row['loss']:.3f}", tok_s=f"{rate:,.0f}")
                    bar.update(1)
        finally:
            bar.close()
