"""A LLaMA-style decoder that can be cut into pipeline stages and run along any route.

Read top to bottom: RMSNorm, rotary embeddings, attention (grouped-query), SwiGLU feed-forward,
the residual block, then :class:`StagedLM`.

Stages.  Stage 0 holds the token embedding, the first ``partition[0]`` layers, the final norm,
the LM head and the loss: every micro-batch starts and ends there.  Body stages ``1..S-1`` hold
contiguous blocks of the remaining layers.  A *route* lists the body stages a micro-batch visits,
in order; skipping a stage means its layers are not applied (the residual stream passes through
unchanged), which is why the decoder is pre-norm with residual blocks.

Global names.  Parameters are named exactly as in an unsplit model (``tok_emb.weight``,
``layers.7.attn.wq.weight``, ``norm.weight``, ``head.weight``) whichever stages a module holds,
so checkpoints, exports and data-parallel peers agree on names under any layout.  A module
that holds only some stages (a pipeline node) has the same parameter values as the corresponding
slice of the full model because every parameter is initialised from its own seed, derived from
the run seed and the parameter's global name.

Devices.  ``StagedLM(cfg, stages=[s], device=...)`` allocates only stage ``s`` on ``device``.
On ``device="meta"`` nothing is allocated and nothing initialised (shapes only: memory
estimates, layout checks); :meth:`StagedLM.materialize` then allocates the stage on a real
device and initialises it with exactly the values a CPU build would hold (every parameter is
drawn on the CPU from its own generator and copied over).
"""

from __future__ import annotations

import math
import zlib
from typing import Iterable, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ModelConfig
from .partition import Partition, partition_layers


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables of shape (seq_len, head_dim // 2)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[..., 2i], x[..., 2i+1]) of x: (batch, heads, seq, head_dim)."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[: x.shape[-2]], sin[: x.shape[-2]]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.kv_heads, self.head_dim = cfg.n_heads, cfg.kv_heads, cfg.head_dim
        self.wq = nn.Linear(cfg.d_model, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.d_model, cfg.kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           enable_gqa=self.kv_heads != self.n_heads)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.hidden, bias=False)
        self.w2 = nn.Linear(cfg.hidden, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """One transformer layer: two pre-norm residual blocks. Pipelines are only ever cut between layers."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


def _param_seed(seed: int, name: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_parameters(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Initialise every parameter from a seed derived from (run seed, global name).

    Norm weights start at 1; other weights are normal(0, init_std), output projections of each
    residual block scaled by 1/sqrt(2 * n_layers) (GPT-2 style) so deep stacks start stable.
    """
    for name, p in module.named_parameters():
        with torch.no_grad():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            g = torch.Generator().manual_seed(_param_seed(seed, name))
            std = cfg.init_std
            if name.endswith(("attn.wo.weight", "ffn.w2.weight")):
                std /= math.sqrt(2 * cfg.n_layers)
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * std)


def is_meta(module: nn.Module) -> bool:
    """True when any parameter of ``module`` lives on the meta device (shapes only, no storage)."""
    return any(p.is_meta for p in module.parameters())


class StagedLM(nn.Module):
    """The decoder, or the part of it held by some stages.

    ``stages=None`` builds the whole model (every stage).  A pipeline node builds only its own
    stage(s), e.g. ``StagedLM(cfg, stages=[3])``; stage 0's module also owns the embedding, final
    norm and head.  ``device="meta"`` builds shapes only (see the module doc and
    :meth:`materialize`).
    """

    def __init__(self, cfg: ModelConfig, stages: Iterable[int] | None = None,
                 partition: Partition | None = None, seed: int = 0,
                 device: str | torch.device = "cpu"):
        super().__init__()
        cfg.check()
        self.cfg, self.seed = cfg, seed
        self.partition = partition or partition_layers(cfg)
        self.stages = sorted(set(range(cfg.n_stages) if stages is None else stages))
        for s in self.stages:
            if not 0 <= s < cfg.n_stages:
                raise ValueError(f"stage {s} does not exist (model has {cfg.n_stages} stages)")
        self.layer_ids = [i for s in self.stages for i in self.partition.layers(s)]
        device = torch.device(device)
        with device:   # modules allocate (or, on meta, only describe) their tensors there
            if 0 in self.stages:
                self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
            # ModuleDict keyed by the global layer index keeps names identical to the unsplit model.
            self.layers = nn.ModuleDict({str(i): Block(cfg) for i in self.layer_ids})
            if 0 in self.stages:
                self.norm = RMSNorm(cfg.d_model, cfg.norm_eps)
                self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.seq_len, cfg.head_dim, cfg.rope_theta)
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        if device.type != "meta":
            init_parameters(self, cfg, seed)

    def materialize(self, device: str | torch.device = "cpu") -> "StagedLM":
        """Allocate a meta-built module on ``device`` and initialise it (same values as a CPU build)."""
        device = torch.device(device)
        self.to_empty(device=device)
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.head_dim, self.cfg.rope_theta)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)
        init_parameters(self, self.cfg, self.seed)
        return self

    # ---- the pieces a pipeline node runs -------------------------------------------------

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Stage 0, first half: token embedding and stage 0's layers."""
        return self.run_stage(0, self.tok_emb(tokens))

    def run_stage(self, stage: int, h: torch.Tensor) -> torch.Tensor:
        """Apply one stage's layers to the residual stream ``h`` (batch, seq, d_model)."""
        return self.run_layers(h, self.partition.layers(stage))

    def run_layers(self, h: torch.Tensor, layer_ids: Iterable[int]) -> torch.Tensor:
        """Apply layers ``layer_ids`` (global indices, in order) to the residual stream ``h``."""
        for i in layer_ids:
            h = self.layers[str(i)](h, self.rope_cos, self.rope_sin)
        return h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Stage 0, second half: final norm and LM head."""
        return self.head(self.norm(h))

    @staticmethod
    def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))

    # ---- whole routes in one process ------------------------------------------------------

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor | None = None,
                route: Sequence[int] | None = None):
        """Run stage 0, then the body stages of ``route`` in order (default: all, ascending).

        Returns logits, or ``(logits, loss)`` when ``targets`` is given.
        """
        h = self.embed(tokens)
        for s in (range(1, self.partition.n_stages) if route is None else route):
            if s == 0:
                raise ValueError("stage 0 is implicit at both ends of a route; list body stages only")
            h = self.run_stage(s, h)
        logits = self.logits(h)
        if targets is None:
            return logits
        return logits, self.loss(logits, targets)

    def stage_named_parameters(self, stage: int) -> list[tuple[str, nn.Parameter]]:
        """(global name, parameter) owned by one stage (stage 0: also embedding, final norm, head)."""
        prefixes = tuple(f"layers.{i}." for i in self.partition.layers(stage))
        if stage == 0:
            prefixes += ("tok_emb.", "norm.", "head.")
        return [(n, p) for n, p in self.named_parameters() if n.startswith(prefixes)]

    def stage_parameters(self, stage: int) -> list[nn.Parameter]:
        """Parameters owned by one stage (stage 0 includes embedding, final norm and head)."""
        return [p for _, p in self.stage_named_parameters(stage)]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    @torch.no_grad()
    def generate(self, tokens: torch.Tensor, max_new_tokens: int, temperature: float = 0.8,
                 top_k: int | None = 50, route: Sequence[int] | None = None,
                 generator: torch.Generator | None = None) -> torch.Tensor:
        """Sample continuations of ``tokens`` (batch, t); the context is cropped to seq_len."""
        for _ in range(max_new_tokens):
            tokens = torch.cat([tokens, self.sample_next(tokens, temperature, top_k, route, generator)], dim=1)
        return tokens

    @torch.no_grad()
    def sample_next(self, tokens: torch.Tensor, temperature: float = 0.8, top_k: int | None = 50,
                    route: Sequence[int] | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
        """The next token of every row of ``tokens`` (batch, t): greedy at temperature 0, else
        sampled from the top ``top_k`` logits; (batch, 1)."""
        logits = self(tokens[:, -self.cfg.seq_len:], route=route)[:, -1, :].float()
        if temperature < torch.finfo(logits.dtype).tiny:   # 0, or so small it is 0 in the logits' dtype: greedy
            return logits.argmax(-1, keepdim=True)
        # (shifted so the largest is 0: a tiny temperature then gives -inf, never inf - inf = nan)
        logits = (logits - logits.amax(-1, keepdim=True)) / temperature
        if top_k:
            kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
