"""Chunked orthonormal DCT-II: the transform DeMo compresses momentum in.

A parameter tensor is cut into chunks: 2-D tensors into ``e_r x e_c`` blocks, 1-D tensors (and
every other rank, flattened) into runs of ``e`` elements, where an edge is ``min(chunk, dim)``.
A dimension that the edge does not divide is zero-padded up to the next multiple, so every
chunk has the same shape.  Each chunk is transformed with the orthonormal DCT-II
(``Y = D_r X D_c^T``), which preserves the Euclidean norm and is inverted by its transpose.

:class:`ChunkedDCT` maps a parameter-shaped tensor to a ``(n_chunks, chunk_numel)`` coefficient
matrix (chunk-major, row-major inside a chunk) and back; ``inverse`` crops the padding away.
With ``use_dct=False`` the same chunking applies with the identity instead of the DCT, so the
rest of the optimizer is unchanged (DeMo's "DCT off" ablation).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch


@lru_cache(maxsize=32)
def dct_matrix(n: int) -> torch.Tensor:
    """Orthonormal DCT-II matrix ``D`` (n x n): ``D @ x`` transforms, ``D.T @ y`` inverts."""
    k = torch.arange(n, dtype=torch.float64).unsqueeze(1)
    i = torch.arange(n, dtype=torch.float64).unsqueeze(0)
    d = torch.cos(math.pi * (2 * i + 1) * k / (2 * n)) * math.sqrt(2.0 / n)
    d[0] /= math.sqrt(2.0)
    return d.float()


def _ceil_to(x: int, m: int) -> int:
    return (x + m - 1) // m * m


class ChunkedDCT:
    """The chunk geometry of one parameter shape, and its forward/inverse transform."""

    def __init__(self, shape: tuple[int, ...] | torch.Size, chunk: int, use_dct: bool = True,
                 device: torch.device | str = "cpu"):
        if chunk < 1:
            raise ValueError(f"chunk size must be >= 1, got {chunk}")
        self.shape = tuple(int(s) for s in shape)
        self.use_dct = use_dct
        numel = math.prod(self.shape)
        if len(self.shape) == 2:
            rows, cols = self.shape
        else:  # 1-D (and scalars / higher ranks, flattened): chunks of `chunk` elements
            rows, cols = 1, numel
        self.rows, self.cols = rows, cols
        self.er, self.ec = min(chunk, rows), min(chunk, cols)
        self.pr, self.pc = _ceil_to(rows, self.er), _ceil_to(cols, self.ec)
        self.nr, self.nc = self.pr // self.er, self.pc // self.ec
        self.n_chunks = self.nr * self.nc
        self.chunk_numel = self.er * self.ec
        if use_dct:
            self._dr, self._dc = dct_matrix(self.er).to(device), dct_matrix(self.ec).to(device)

    @property
    def padded(self) -> bool:
        return (self.pr, self.pc) != (self.rows, self.cols)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Parameter-shaped ``x`` -> coefficients ``(n_chunks, chunk_numel)`` (float32)."""
        x = x.detach().float().reshape(self.rows, self.cols)
        if self.padded:
            x = torch.nn.functional.pad(x, (0, self.pc - self.cols, 0, self.pr - self.rows))
        blocks = x.reshape(self.nr, self.er, self.nc, self.ec).permute(0, 2, 1, 3)
        if self.use_dct:
            blocks = self._dr @ blocks @ self._dc.T
        return blocks.reshape(self.n_chunks, self.chunk_numel).contiguous()

    def inverse(self, coeffs: torch.Tensor) -> torch.Tensor:
        """Coefficients ``(n_chunks, chunk_numel)`` -> parameter-shaped tensor (padding cropped)."""
        blocks = coeffs.reshape(self.nr, self.nc, self.er, self.ec)
        if self.use_dct:
            blocks = self._dr.T @ blocks @ self._dc
        x = blocks.permute(0, 2, 1, 3).reshape(self.pr, self.pc)
        if self.padded:
            x = x[: self.rows, : self.cols]
        return x.reshape(self.shape)
