"""Byte accounting per step: payload, bytes received per node, dense fp32 all-reduce equivalent.

Definitions (``N`` nodes in the group, ``P`` parameters synchronised by the strategy):

* **payload bytes**: what one node contributes to the step's collectives (the all-gathered
  buffer, or the all-reduced tensor's size);
* **bytes received per node**: what one node downloads under the ring algorithms:
  ``(N-1) * B`` for an all-gather of ``B`` bytes per node, ``2 (N-1)/N * S`` for an
  all-reduce of ``S`` bytes;
* **dense fp32 equivalent**: payload ``4P`` and received ``2 (N-1)/N * 4P``, the same
  quantities for a plain fp32 gradient all-reduce with the same ``N``.

Control traffic (consistency hashes, checked every K steps) is counted separately.  A step with
no sync (local steps) has payload 0; ratios averaged over all steps are therefore "per step,
averaged over H", while ``per_sync`` figures count only the steps that synced.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepBytes:
    payload: int = 0
    received: int = 0
    control: int = 0


@dataclass
class ByteAccountant:
    world: int
    n_params: int = 0
    steps: list[StepBytes] = field(default_factory=list)
    _cur: StepBytes = field(default_factory=StepBytes)

    def add_all_gather(self, nbytes: int, control: bool = False) -> None:
        if control:
            self._cur.control += nbytes * max(self.world - 1, 0)
            return
        self._cur.payload += nbytes
        self._cur.received += nbytes * (self.world - 1)

    def add_all_reduce(self, nbytes: int) -> None:
        self._cur.payload += nbytes
        self._cur.received += 2 * (self.world - 1) * nbytes // max(self.world, 1)

    def end_step(self) -> StepBytes:
        s, self._cur = self._cur, StepBytes()
        self.steps.append(s)
        return s

    @property
    def dense_fp32_payload(self) -> int:
        return 4 * self.n_params

    @property
    def dense_fp32_received(self) -> float:
        return 2 * (self.world - 1) / self.world * 4 * self.n_params if self.world > 1 else 0.0

    def summary(self) -> dict:
        n = len(self.steps) or 1
        payload = sum(s.payload for s in self.steps) / n
        received = sum(s.received for s in self.steps) / n
        synced = [s for s in self.steps if s.payload]
        per_sync = sum(s.payload for s in synced) / len(synced) if synced else 0.0
        return {
            "nodes": self.world,
            "params": self.n_params,
            "steps": len(self.steps),
            "syncs": len(synced),
            "payload_bytes_per_step": payload,
            "payload_bytes_per_sync": per_sync,
            "received_bytes_per_step": received,
            "control_bytes_per_step": sum(s.control for s in self.steps) / n,
            "dense_fp32_payload_bytes": self.dense_fp32_payload,
            "dense_fp32_received_bytes": self.dense_fp32_received,
            "ratio_payload_vs_fp32": self.dense_fp32_payload / payload if payload else float("inf"),
            "ratio_received_vs_fp32": self.dense_fp32_received / received if received else float("inf"),
        }
