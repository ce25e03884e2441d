"""The problem description every layer shares: scale recipes and the frozen GEMM problem.

The ops layer turns user input into a `GemmProblem` plus *normalised* tensors (see `Recipe`), and
hands both to a backend. Backends and config heuristics key everything on the problem.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["Recipe", "GemmKind", "GemmProblem", "FP8_DTYPES", "OUT_DTYPES", "SCALE_BLOCK", "ceil_div",
           "align"]

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float32)
# Elements of K (and, for 128x128 blocks, of N) one scale covers: every recipe but per-tensor and
# per-row scales K in groups of this many, so kernels promote their partial sums at this step.
SCALE_BLOCK = 128


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def align(x: int, y: int) -> int:
    return ceil_div(x, y) * y


class Recipe(enum.Enum):
    """How a scale tensor covers its operand. Normalised scale shapes handed to backends
    (a leading [G] is added for grouped B, and [G, Mmax] replaces [M] for masked A):

    - TENSOR: one scale, shape [1] (grouped B: [G], one per group).
    - ROW: one scale per row (per token for A, per output channel for B), shape [rows].
    - GROUP: 1x128 groups along K, shape [rows, ceil(K/128)], any strides.
    - BLOCK: 128x128 blocks (B only), shape [ceil(N/128), ceil(K/128)].
    """

    TENSOR = "tensor"
    ROW = "row"
    GROUP = "1x128"
    BLOCK = "128x128"


class GemmKind(enum.Enum):
    DENSE = "dense"
    CONTIGUOUS = "contiguous"  # A [sum M, K], m_indices [sum M]
    OFFSETS = "offsets"  # A [sum M, K], offsets [G + 1]
    MASKED = "masked"  # A [G, Mmax, K], masked_m [G]
    K_GROUPED = "k_grouped"  # A [M, sum K], B [N, sum K], ks [G]; out [G, M, N]


_SHORT = {torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2", torch.bfloat16: "bf16",
          torch.float32: "fp32"}


@dataclass(frozen=True)
class GemmProblem:
    """One GEMM family call, without its data. Hashable: a cache key for configs and kernels.

    m is the rows of A as stored: sum of M for contiguous/offsets, Mmax for masked.
    k is K, or for k-grouped the sum of the groups' K (A's columns as stored).
    expected_m is the caller's hint of rows per group for masked (else equal to m).
    """

    kind: GemmKind
    m: int
    n: int
    k: int
    groups: int
    a_dtype: torch.dtype
    b_dtype: torch.dtype
    a_recipe: Recipe
    b_recipe: Recipe
    out_dtype: torch.dtype
    has_c: bool = False
    expected_m: int = 0

    def __str__(self) -> str:
        g = f"G={self.groups} " if self.kind is not GemmKind.DENSE else ""
        em = f" expected_m={self.expected_m}" if self.kind is GemmKind.MASKED else ""
        c = " +C" if self.has_c else ""
        return (f"{self.kind.value} {g}M={self.m} N={self.n} K={self.k}{em} "
                f"A={_SHORT[self.a_dtype]}/{self.a_recipe.value} "
                f"B={_SHORT[self.b_dtype]}/{self.b_recipe.value} -> {_SHORT[self.out_dtype]}{c}")
