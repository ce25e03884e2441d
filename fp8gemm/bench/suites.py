"""Benchmark suites: the shapes, with the arithmetic and byte counts each result is judged by.

`deepseek-dense` and `deepseek-grouped` are the DeepSeek-V3 shapes DeepGEMM publishes; `irregular` holds shapes no tile divides (M = 1, 37; N = 200; K = 320).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["Case", "SUITES", "OPS", "BASELINE", "suite_cases", "all_suite_names"]

OPS = ("dense", "contiguous", "masked")
# The peer every impl of an op is compared with (ratio = baseline us / impl us).
BASELINE = {"dense": "cublas-block", "contiguous": "cublas-rowwise-grouped", "masked": "torch-bf16"}

_BLOCK = 128


def _ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


@dataclass(frozen=True)
class Case:
    """One benchmark problem. For grouped ops `m` is the rows per group (Mmax for masked, where
    every group is full: masked_m[g] = Mmax), and A holds groups * m rows."""

    suite: str
    op: str  # "dense", "contiguous" or "masked"
    m: int
    n: int
    k: int
    groups: int = 1

    @property
    def total_m(self) -> int:
        return self.m * self.groups

    @property
    def flops(self) -> int:
        return 2 * self.total_m * self.n * self.k

    @property
    def min_bytes(self) -> int:
        """Fewest bytes any implementation of the fp8 problem moves: A and B in fp8, A's 1x128
        and B's 128x128 fp32 scales, the bf16 output, each once."""
        kb = _ceil_div(self.k, _BLOCK)
        g = self.groups if self.op != "dense" else 1
        a = self.total_m * self.k + self.total_m * kb * 4
        b = g * (self.n * self.k + _ceil_div(self.n, _BLOCK) * kb * 4)
        return a + b + self.total_m * self.n * 2

    @property
    def shape(self) -> dict:
        return {"m": self.m, "n": self.n, "k": self.k, "groups": self.groups}

    @property
    def label(self) -> str:
        if self.op == "dense":
            return f"{self.m}x{self.n}x{self.k}"
        return f"{self.groups}x{self.m}, {self.n}x{self.k}"

    def __str__(self) -> str:
        return f"{self.suite}/{self.op} {self.label}"


# DeepSeek-V3 (N, K) pairs of the dense layers, and the M of decode and prefill.
_DENSE_NK = ((2112, 7168), (24576, 1536), (32768, 512), (7168, 16384), (4096, 7168), (7168, 2048))
_DENSE_M = (64, 128, 4096)
_GROUPED_NK = ((4096, 7168), (7168, 2048))
_CONTIGUOUS_GM = ((4, 8192), (8, 4096))
_MASKED_GM = ((1, 1024), (2, 512), (4, 256))
_IRREGULAR_M = (1, 37, 130, 1000)
_IRREGULAR_N = (200, 576, 2112)
_IRREGULAR_K = (320, 7168)
_IRREGULAR_QUICK = ((1, 2112, 7168), (37, 200, 320), (37, 576, 7168), (130, 2112, 320),
                    (1000, 200, 7168), (1000, 2112, 7168))


def _dense(quick: bool) -> list[Case]:
    return [Case("deepseek-dense", "dense", m, n, k) for m in _DENSE_M for n, k in _DENSE_NK]


def _grouped(quick: bool) -> list[Case]:
    cont = [Case("deepseek-grouped", "contiguous", m, n, k, g)
            for g, m in _CONTIGUOUS_GM for n, k in _GROUPED_NK]
    masked = [Case("deepseek-grouped", "masked", m, n, k, g)
              for g, m in _MASKED_GM for n, k in _GROUPED_NK]
    return cont + masked


def _irregular(quick: bool) -> list[Case]:
    shapes = _IRREGULAR_QUICK if quick else itertools.product(_IRREGULAR_M, _IRREGULAR_N,
                                                              _IRREGULAR_K)
    return [Case("irregular", "dense", m, n, k) for m, n, k in shapes]


SUITES = {"deepseek-dense": _dense, "deepseek-grouped": _grouped, "irregular": _irregular}


def all_suite_names() -> tuple[str, ...]:
    return tuple(SUITES)


def suite_cases(name: str, quick: bool = False) -> list[Case]:
    """The cases of one suite, or of every suite for "all". --quick trims only `irregular`:
    the DeepSeek shapes are what every figure is compared on."""
    if name == "all":
        return [c for s in SUITES for c in SUITES[s](quick)]
    if name not in SUITES:
        raise ValueError(f"suite must be one of {('all',) + all_suite_names()}, got {name!r}")
    return SUITES[name](quick)
