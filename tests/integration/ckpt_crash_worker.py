"""Child process for tests/integration/test_checkpoint_crash.py: a zygote that forks savers on request.

Imports only numpy and skiptrain's torch-free writer modules, so it starts fast; each ``go``
line on stdin forks a saver process (prints its pid), which cleans stale entries like a restarted
coordinator, then saves steps ``latest + 1, latest + 2, ...`` forever, each tensor filled with the
step number, with two simulated writer ranks (threads) and an asynchronous commit by rank 0.  The
test SIGKILLs the saver at a random moment; the zygote reaps it and prints ``reaped``.
"""

import os
import sys
import threading

import numpy as np

from skiptrain.checkpoint import store
from skiptrain.checkpoint.plan import TensorSpec, plan_save
from skiptrain.checkpoint.writer import BackgroundWriter, commit, write_part

SHAPES = {"emb": (512, 256), "layers.0.w": (256, 256), "layers.1.w": (256, 300), "norm": (256,),
          "optim.step.emb": ()}


def saver(root: str) -> None:
    store.clean_stale(root)
    last = store.latest(root)
    step = (store.step_of(last.name) if last else 0) + 1
    specs = [TensorSpec(n, "float32", s) for n, s in SHAPES.items()]
    plan = plan_save(specs, {n: [0, 1] for n in SHAPES}, chunk_bytes=128 << 10)
    bufs = {n: np.zeros(s, np.float32) for n, s in SHAPES.items()}
    writer = BackgroundWriter()
    while True:
        writer.wait()
        for b in bufs.values():  # the "snapshot": every tensor holds the step number
            b.fill(step)

        def job(step=step):
            t1 = threading.Thread(target=write_part, args=(root, step, 1, plan, bufs, {"r": 1}))
            t1.start()
            write_part(root, step, 0, plan, bufs, {"r": 0})
            t1.join()
            commit(root, step, [0, 1], plan, {"step": step}, {"writers": [0, 1]}, keep=2)

        writer.start(job)
        step += 1


def main() -> None:
    root = sys.argv[1]
    for line in sys.stdin:
        if line.strip() != "go":
            break
        pid = os.fork()
        if pid == 0:
            try:
                saver(root)
            finally:
                os._exit(1)
        print(pid, flush=True)
        os.waitpid(pid, 0)
        print("reaped", flush=True)


if __name__ == "__main__":
    main()
