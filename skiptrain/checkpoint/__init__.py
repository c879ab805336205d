"""skiptrain.checkpoint: reshardable, asynchronous, crash-consistent checkpoints (docs/checkpoint.md).

Modules, each with one job:

* ``format``   metadata schema (global tensor names -> dtype, shape, shards with CRC-32), version, errors
* ``plan``     deterministic byte-balanced assignment of shards to the ranks holding each tensor
* ``store``    directory protocol: atomic writes, committed listing, LATEST, keep-last-k, cleanup
* ``writer``   per-rank data files, the commit (fsync, rename, LATEST), the background writer thread
* ``snapshot`` copies into reused host buffers (the only part of a save the loop waits for)
* ``reader``   byte-range reads straight into destination tensors, checksums verified
* ``state``    model/optimizer/RNG state <-> named tensors + JSON by global names
* ``manager``  ``CheckpointManager``: what a trainer or pipeline node uses
* ``training`` the single-process trainer's periodic saves and exact ``--resume``
* ``reshard``, ``export``, ``cli``: ``skiptrain ckpt ls|inspect|verify|reshard`` and ``skiptrain export``

This package imports nothing eagerly, so torch-free writer processes (``format``, ``plan``,
``store``, ``writer``) start fast.
"""
