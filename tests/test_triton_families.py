"""The Triton backend's kernel families on the CPU (no GPU, no interpreter needed): which family
and config the heuristics choose, the family seam the backend dispatches through, configs and
the autotune cache."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

pytest.importorskip("triton")

import fp8gemm.backends.triton as tb  # noqa: E402
from fp8gemm.backends.family import DeviceFacts, choose_family  # noqa: E402
from fp8gemm.backends.triton import fp8_gemm, tuning  # noqa: E402
from fp8gemm.problem import GemmKind, GemmProblem, Recipe, ceil_div  # noqa: E402

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
H200 = DeviceFacts("NVIDIA H200", (9, 0), 132, 232448)
FACTS = {"h200": H200, "h200_100sms": dataclasses.replace(H200, num_sms=100),
         "h20": DeviceFacts("NVIDIA H20", (9, 0), 78, 232448),
         "l40s": DeviceFacts("NVIDIA L40S", (8, 9), 142, 101376),
         "interpreter": tb.INTERPRETER_FACTS}
needs_gluon = pytest.mark.skipif(tb.gluon_fp8_gemm is None, reason="Triton without Gluon's Hopper API")


def _problem(kind=GemmKind.DENSE, m=4096, n=4096, k=7168, groups=1, ra=Recipe.GROUP,
             rb=Recipe.BLOCK, out=torch.bfloat16, has_c=False, expected_m=0, a=E4M3, b=E4M3):
    return GemmProblem(kind, m, n, k, groups, a, b, ra, rb, out, has_c, expected_m or m)


# ---------------------------------------------------------------------------------------------
# the heuristics' choices, pinned

# (device, problem, the family and config the heuristics choose). Problem: kind, M, N, K, groups,
# expected_m, A format/recipe, B format/recipe, out dtype, +C. The DeepSeek-V3 dense and grouped
# shapes of fp8gemm.bench.suites on every device, its irregular shapes on the sm_90 parts, and
# other kinds, recipes and formats; the table holds the choices the heuristics were tuned to, so
# a refactoring that changes any of them fails here.
PINNED = [
    ('h200', 'dense 64 2112 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=4 group=8 programs=132 tma'),
    ('h200', 'dense 64 24576 1536 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=96 tma flat'),
    ('h200', 'dense 64 32768 512 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=128 tma flat'),
    ('h200', 'dense 64 7168 16384 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=4 group=8 programs=112 tma'),
    ('h200', 'dense 64 4096 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=7 group=8 programs=112 tma'),
    ('h200', 'dense 64 7168 2048 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=112 tma flat'),
    ('h200', 'dense 128 2112 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=7 group=8 programs=126 tma'),
    ('h200', 'dense 128 24576 1536 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=132 tma flat'),
    ('h200', 'dense 128 32768 512 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=132 tma flat'),
    ('h200', 'dense 128 7168 16384 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=2 group=8 programs=112 tma'),
    ('h200', 'dense 128 4096 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=4 group=8 programs=128 tma'),
    ('h200', 'dense 128 7168 2048 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x128 stages=5 warps=4 split=1 group=8 programs=112 tma flat'),
    ('h200', 'dense 4096 2112 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'dense 4096 24576 1536 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'dense 4096 32768 512 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'dense 4096 7168 16384 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'contiguous 32768 4096 7168 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'contiguous 32768 7168 2048 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'contiguous 32768 4096 7168 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'contiguous 32768 7168 2048 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'masked 1024 4096 7168 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'masked 1024 7168 2048 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'masked 512 4096 7168 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'masked 512 7168 2048 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'masked 256 4096 7168 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'masked 256 7168 2048 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'dense 1 200 320 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=4 tma flat'),
    ('h200', 'dense 1 200 7168 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=14 group=8 programs=56 tma'),
    ('h200', 'dense 1 576 320 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=9 tma flat'),
    ('h200', 'dense 1 576 7168 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=14 group=8 programs=126 tma'),
    ('h200', 'dense 1 2112 320 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=33 tma flat'),
    ('h200', 'dense 1 2112 7168 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=14 group=8 programs=126 tma'),
    ('h200', 'dense 37 200 320 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=4 tma flat'),
    ('h200', 'dense 37 200 7168 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=14 group=8 programs=56 tma'),
    ('h200', 'dense 37 576 320 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=9 tma flat'),
    ('h200', 'dense 37 576 7168 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=14 group=8 programs=126 tma'),
    ('h200', 'dense 37 2112 320 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=33 tma flat'),
    ('h200', 'dense 37 2112 7168 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=14 group=8 programs=126 tma'),
    ('h200', 'dense 130 200 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8 tma flat'),
    ('h200', 'dense 130 200 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=4'),
    ('h200', 'dense 130 576 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=18 tma flat'),
    ('h200', 'dense 130 576 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=10'),
    ('h200', 'dense 130 2112 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=66 tma flat'),
    ('h200', 'dense 130 2112 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=34'),
    ('h200', 'dense 1000 200 320 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=32 tma flat'),
    ('h200', 'dense 1000 200 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=16'),
    ('h200', 'dense 1000 576 320 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=72 tma flat'),
    ('h200', 'dense 1000 576 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=40'),
    ('h200', 'dense 1000 2112 320 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=264 tma flat'),
    ('h200', 'dense 1000 2112 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=264 tma'),
    ('h200', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e5m2/128x128 fp32 +C',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=264 tma'),
    ('h200', 'dense 4096 4096 7168 1 4096 e4m3/tensor e4m3/tensor bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=132 tma'),
    ('h200', 'dense 4096 4096 7168 1 4096 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=132 tma'),
    ('h200', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/1x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=132 tma'),
    ('h200', 'dense 64 4096 7168 1 64 e5m2/row e4m3/128x128 fp32 +C',
     'persistent 64x256 stages=4 warps=8 split=7 group=8 programs=112 tma'),
    ('h200', 'dense 1000 201 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=32 tma'),
    ('h200', 'dense 1000 2112 7000 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=264'),
    ('h200', 'dense 256 2112 7168 1 256 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=34'),
    ('h200', 'dense 130 576 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=10'),
    ('h200', 'dense 130 576 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=18 tma flat'),
    ('h200', 'dense 8192 8192 512 1 8192 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'offsets 8192 4096 7168 8 8192 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=132 tma'),
    ('h200', 'offsets 256 4096 7168 8 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=132 tma'),
    ('h200', 'contiguous 8192 4096 7168 8 8192 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=132 tma'),
    ('h200', 'contiguous 512 7168 2048 4 512 e4m3/1x128 e4m3/128x128 fp32',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=132 tma'),
    ('h200', 'masked 4096 4096 7168 4 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x128 stages=5 warps=4 split=1 group=8 programs=132 tma'),
    ('h200', 'masked 4096 7168 2048 4 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200', 'masked 256 4096 7168 16 200 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=132'),
    ('h200_100sms', 'dense 64 2112 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=8 group=8 programs=72 tma'),
    ('h200_100sms', 'dense 64 24576 1536 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=96 tma flat'),
    ('h200_100sms', 'dense 64 32768 512 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=100 tma flat'),
    ('h200_100sms', 'dense 64 7168 16384 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=2 group=8 programs=56 tma'),
    ('h200_100sms', 'dense 64 4096 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=4 group=8 programs=64 tma'),
    ('h200_100sms', 'dense 64 7168 2048 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x128 stages=5 warps=4 split=1 group=8 programs=56 tma flat'),
    ('h200_100sms', 'dense 128 2112 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=4 group=8 programs=72 tma'),
    ('h200_100sms', 'dense 128 24576 1536 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=100 tma flat'),
    ('h200_100sms', 'dense 128 32768 512 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=100 tma flat'),
    ('h200_100sms', 'dense 128 7168 16384 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=56 tma'),
    ('h200_100sms', 'dense 128 4096 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=2 group=8 programs=64 tma'),
    ('h200_100sms', 'dense 128 7168 2048 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=56 tma flat'),
    ('h200_100sms', 'dense 4096 2112 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'dense 4096 24576 1536 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'dense 4096 32768 512 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'dense 4096 7168 16384 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'contiguous 32768 4096 7168 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'contiguous 32768 7168 2048 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'contiguous 32768 4096 7168 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'contiguous 32768 7168 2048 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'masked 1024 4096 7168 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'masked 1024 7168 2048 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'masked 512 4096 7168 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'masked 512 7168 2048 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'masked 256 4096 7168 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'masked 256 7168 2048 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e5m2/128x128 fp32 +C',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=200 tma'),
    ('h200_100sms', 'dense 4096 4096 7168 1 4096 e4m3/tensor e4m3/tensor bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=100 tma'),
    ('h200_100sms', 'dense 4096 4096 7168 1 4096 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=100 tma'),
    ('h200_100sms', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/1x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=100 tma'),
    ('h200_100sms', 'dense 64 4096 7168 1 64 e5m2/row e4m3/128x128 fp32 +C',
     'persistent 64x256 stages=4 warps=8 split=4 group=8 programs=64 tma'),
    ('h200_100sms', 'dense 1000 201 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=32 tma'),
    ('h200_100sms', 'dense 1000 2112 7000 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=200'),
    ('h200_100sms', 'dense 256 2112 7168 1 256 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=34'),
    ('h200_100sms', 'dense 130 576 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=10'),
    ('h200_100sms', 'dense 130 576 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=18 tma flat'),
    ('h200_100sms', 'dense 8192 8192 512 1 8192 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'offsets 8192 4096 7168 8 8192 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=100 tma'),
    ('h200_100sms', 'offsets 256 4096 7168 8 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=100 tma'),
    ('h200_100sms', 'contiguous 8192 4096 7168 8 8192 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=100 tma'),
    ('h200_100sms', 'contiguous 512 7168 2048 4 512 e4m3/1x128 e4m3/128x128 fp32',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=100 tma'),
    ('h200_100sms', 'masked 4096 4096 7168 4 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=100 tma'),
    ('h200_100sms', 'masked 4096 7168 2048 4 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h200_100sms', 'masked 256 4096 7168 16 200 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=100'),
    ('h20', 'dense 64 2112 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=8 group=8 programs=72 tma'),
    ('h20', 'dense 64 24576 1536 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=78 tma flat'),
    ('h20', 'dense 64 32768 512 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=78 tma flat'),
    ('h20', 'dense 64 7168 16384 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=2 group=8 programs=56 tma'),
    ('h20', 'dense 64 4096 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=4 group=8 programs=64 tma'),
    ('h20', 'dense 64 7168 2048 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x128 stages=5 warps=4 split=1 group=8 programs=56 tma flat'),
    ('h20', 'dense 128 2112 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=4 group=8 programs=72 tma'),
    ('h20', 'dense 128 24576 1536 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=78 tma flat'),
    ('h20', 'dense 128 32768 512 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=78 tma flat'),
    ('h20', 'dense 128 7168 16384 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=56 tma'),
    ('h20', 'dense 128 4096 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=2 group=8 programs=64 tma'),
    ('h20', 'dense 128 7168 2048 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=56 tma flat'),
    ('h20', 'dense 4096 2112 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'dense 4096 24576 1536 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'dense 4096 32768 512 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'dense 4096 7168 16384 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'contiguous 32768 4096 7168 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'contiguous 32768 7168 2048 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'contiguous 32768 4096 7168 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'contiguous 32768 7168 2048 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'masked 1024 4096 7168 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'masked 1024 7168 2048 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'masked 512 4096 7168 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'masked 512 7168 2048 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'masked 256 4096 7168 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'masked 256 7168 2048 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'dense 1 200 320 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=4 tma flat'),
    ('h20', 'dense 1 200 7168 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=14 group=8 programs=56 tma'),
    ('h20', 'dense 1 576 320 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=9 tma flat'),
    ('h20', 'dense 1 576 7168 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x128 stages=5 warps=4 split=14 group=8 programs=70 tma'),
    ('h20', 'dense 1 2112 320 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=33 tma flat'),
    ('h20', 'dense 1 2112 7168 1 1 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=8 group=8 programs=72 tma'),
    ('h20', 'dense 37 200 320 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=4 tma flat'),
    ('h20', 'dense 37 200 7168 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=14 group=8 programs=56 tma'),
    ('h20', 'dense 37 576 320 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=9 tma flat'),
    ('h20', 'dense 37 576 7168 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=8 group=8 programs=72 tma'),
    ('h20', 'dense 37 2112 320 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=6 warps=4 split=1 group=8 programs=33 tma flat'),
    ('h20', 'dense 37 2112 7168 1 37 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=8 group=8 programs=72 tma'),
    ('h20', 'dense 130 200 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8 tma flat'),
    ('h20', 'dense 130 200 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=4'),
    ('h20', 'dense 130 576 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=18 tma flat'),
    ('h20', 'dense 130 576 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=10'),
    ('h20', 'dense 130 2112 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=66 tma flat'),
    ('h20', 'dense 130 2112 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=34'),
    ('h20', 'dense 1000 200 320 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=32 tma flat'),
    ('h20', 'dense 1000 200 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=16'),
    ('h20', 'dense 1000 576 320 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=72 tma flat'),
    ('h20', 'dense 1000 576 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=40'),
    ('h20', 'dense 1000 2112 320 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'dense 1000 2112 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e5m2/128x128 fp32 +C',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=156 tma'),
    ('h20', 'dense 4096 4096 7168 1 4096 e4m3/tensor e4m3/tensor bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=78 tma'),
    ('h20', 'dense 4096 4096 7168 1 4096 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=78 tma'),
    ('h20', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/1x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=78 tma'),
    ('h20', 'dense 64 4096 7168 1 64 e5m2/row e4m3/128x128 fp32 +C',
     'persistent 64x256 stages=4 warps=8 split=4 group=8 programs=64 tma'),
    ('h20', 'dense 1000 201 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=32 tma'),
    ('h20', 'dense 1000 2112 7000 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=156'),
    ('h20', 'dense 256 2112 7168 1 256 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=34'),
    ('h20', 'dense 130 576 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=10'),
    ('h20', 'dense 130 576 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=18 tma flat'),
    ('h20', 'dense 8192 8192 512 1 8192 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'offsets 8192 4096 7168 8 8192 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=78 tma'),
    ('h20', 'offsets 256 4096 7168 8 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=78 tma'),
    ('h20', 'contiguous 8192 4096 7168 8 8192 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=78 tma'),
    ('h20', 'contiguous 512 7168 2048 4 512 e4m3/1x128 e4m3/128x128 fp32',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=78 tma'),
    ('h20', 'masked 4096 4096 7168 4 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=78 tma'),
    ('h20', 'masked 4096 7168 2048 4 4096 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('h20', 'masked 256 4096 7168 16 200 e4m3/1x128 e4m3/128x128 bf16',
     'gluon 128x128 stages=6 warps=4 group=8 programs=78'),
    ('l40s', 'dense 64 2112 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x128 stages=2 warps=4 split=8 group=8 programs=136'),
    ('l40s', 'dense 64 24576 1536 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=1 group=8 programs=96 flat'),
    ('l40s', 'dense 64 32768 512 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=1 group=8 programs=128 flat'),
    ('l40s', 'dense 64 7168 16384 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=4 group=8 programs=112'),
    ('l40s', 'dense 64 4096 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=7 group=8 programs=112'),
    ('l40s', 'dense 64 7168 2048 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x64 stages=4 warps=4 split=1 group=8 programs=112 flat'),
    ('l40s', 'dense 128 2112 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=7 group=8 programs=126'),
    ('l40s', 'dense 128 24576 1536 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=1 group=8 programs=142 flat'),
    ('l40s', 'dense 128 32768 512 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=1 group=8 programs=142 flat'),
    ('l40s', 'dense 128 7168 16384 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=2 group=8 programs=112'),
    ('l40s', 'dense 128 4096 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=4 group=8 programs=128'),
    ('l40s', 'dense 128 7168 2048 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x128 stages=2 warps=4 split=1 group=8 programs=112 flat'),
    ('l40s', 'dense 4096 2112 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'dense 4096 24576 1536 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'dense 4096 32768 512 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284 flat'),
    ('l40s', 'dense 4096 7168 16384 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'contiguous 32768 4096 7168 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'contiguous 32768 7168 2048 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'contiguous 32768 4096 7168 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'contiguous 32768 7168 2048 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'masked 1024 4096 7168 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'masked 1024 7168 2048 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'masked 512 4096 7168 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'masked 512 7168 2048 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'masked 256 4096 7168 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'masked 256 7168 2048 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e5m2/128x128 fp32 +C',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'dense 4096 4096 7168 1 4096 e4m3/tensor e4m3/tensor bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'dense 4096 4096 7168 1 4096 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/1x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'dense 64 4096 7168 1 64 e5m2/row e4m3/128x128 fp32 +C',
     'persistent 64x256 stages=2 warps=8 split=7 group=8 programs=112'),
    ('l40s', 'dense 1000 201 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=32'),
    ('l40s', 'dense 1000 2112 7000 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=264'),
    ('l40s', 'dense 256 2112 7168 1 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=66'),
    ('l40s', 'dense 130 576 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=18'),
    ('l40s', 'dense 130 576 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=18 flat'),
    ('l40s', 'dense 8192 8192 512 1 8192 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284 flat'),
    ('l40s', 'offsets 8192 4096 7168 8 8192 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'offsets 256 4096 7168 8 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'contiguous 8192 4096 7168 8 8192 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'contiguous 512 7168 2048 4 512 e4m3/1x128 e4m3/128x128 fp32',
     'persistent 64x256 stages=2 warps=8 split=1 group=8 programs=142'),
    ('l40s', 'masked 4096 4096 7168 4 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x128 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'masked 4096 7168 2048 4 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=2 warps=4 split=1 group=8 programs=284'),
    ('l40s', 'masked 256 4096 7168 16 200 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=2 warps=8 split=1 group=8 programs=142'),
    ('interpreter', 'dense 64 2112 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 64 24576 1536 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4 flat'),
    ('interpreter', 'dense 64 32768 512 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4 flat'),
    ('interpreter', 'dense 64 7168 16384 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 64 4096 7168 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 64 7168 2048 1 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4 flat'),
    ('interpreter', 'dense 128 2112 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 128 24576 1536 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4 flat'),
    ('interpreter', 'dense 128 32768 512 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4 flat'),
    ('interpreter', 'dense 128 7168 16384 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 128 4096 7168 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 128 7168 2048 1 128 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4 flat'),
    ('interpreter', 'dense 4096 2112 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'dense 4096 24576 1536 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'dense 4096 32768 512 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8 flat'),
    ('interpreter', 'dense 4096 7168 16384 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'contiguous 32768 4096 7168 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'contiguous 32768 7168 2048 4 32768 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'contiguous 32768 4096 7168 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'contiguous 32768 7168 2048 8 32768 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'masked 1024 4096 7168 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'masked 1024 7168 2048 1 1024 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'masked 512 4096 7168 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'masked 512 7168 2048 2 512 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'masked 256 4096 7168 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'masked 256 7168 2048 4 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'dense 4096 7168 2048 1 4096 e4m3/1x128 e5m2/128x128 fp32 +C',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'dense 4096 4096 7168 1 4096 e4m3/tensor e4m3/tensor bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 4096 4096 7168 1 4096 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 4096 4096 7168 1 4096 e4m3/1x128 e4m3/1x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 64 4096 7168 1 64 e5m2/row e4m3/128x128 fp32 +C',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'dense 1000 201 7168 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'dense 1000 2112 7000 1 1000 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'dense 256 2112 7168 1 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'dense 130 576 7168 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'dense 130 576 320 1 130 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8 flat'),
    ('interpreter', 'dense 8192 8192 512 1 8192 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8 flat'),
    ('interpreter', 'offsets 8192 4096 7168 8 8192 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'offsets 256 4096 7168 8 256 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'contiguous 8192 4096 7168 8 8192 e4m3/row e4m3/row bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'contiguous 512 7168 2048 4 512 e4m3/1x128 e4m3/128x128 fp32',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'masked 4096 4096 7168 4 64 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 64x256 stages=4 warps=8 split=1 group=8 programs=4'),
    ('interpreter', 'masked 4096 7168 2048 4 4096 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x64 stages=4 warps=4 split=1 group=8 programs=8'),
    ('interpreter', 'masked 256 4096 7168 16 200 e4m3/1x128 e4m3/128x128 bf16',
     'persistent 128x128 stages=5 warps=8 split=1 group=8 programs=4'),
]

_DTYPES = {"e4m3": E4M3, "e5m2": E5M2, "bf16": torch.bfloat16, "fp32": torch.float32}
_RECIPES = {r.value: r for r in Recipe}


def _parse(text: str) -> GemmProblem:
    kind, m, n, k, groups, em, a, b, out, *c = text.split()
    (da, ra), (db, rb) = a.split("/"), b.split("/")
    return GemmProblem(GemmKind(kind), int(m), int(n), int(k), int(groups), _DTYPES[da],
                       _DTYPES[db], _RECIPES[ra], _RECIPES[rb], _DTYPES[out], c == ["+C"], int(em))


def _describe(cfg) -> str:
    if isinstance(cfg, fp8_gemm.PersistentConfig):
        return (f"persistent {cfg.block_m}x{cfg.block_n} stages={cfg.num_stages} "
                f"warps={cfg.num_warps} split={cfg.split_k} group={cfg.group_m} "
                f"programs={cfg.num_programs}{' tma' if cfg.use_tma else ''}"
                f"{' flat' if cfg.flatten else ''}")
    return (f"gluon {cfg.block_m}x{cfg.block_n} stages={cfg.num_stages} warps={cfg.num_warps} "
            f"group={cfg.group_m} programs={cfg.num_programs}")


@needs_gluon
def test_heuristic_choices_are_pinned():
    wrong = []
    for device, text, want in PINNED:
        prob, facts = _parse(text), FACTS[device]
        family = tb.family_for(prob, facts)
        cfg = family.select_config(prob, facts)
        assert isinstance(cfg, family.Config)
        if _describe(cfg) != want:
            wrong.append(f"{device} {text}: {_describe(cfg)}, pinned {want}")
    assert not wrong, "\n".join(wrong)
    assert sum("gluon" in want for _, _, want in PINNED) > 50  # both families are exercised


# ---------------------------------------------------------------------------------------------
# the family table and the dispatch


def test_families_in_order_of_preference():
    names = [f.name for f in tb.FAMILIES]
    want = ["k_grouped_fp8_gemm", "fp8_gemm_persistent"]
    if tb.gluon_fp8_gemm is not None:
        want.insert(0, "gluon_fp8_gemm_1d2d")
    assert names == want
    for fam in tb.FAMILIES:
        assert dataclasses.is_dataclass(fam.Config)
        assert fam.Config.__dataclass_params__.frozen


def test_supports_is_choose_family_and_keeps_every_reason():
    """Every dense and m-grouped kind, recipe pair and format pair runs; what does not says
    why (k-grouped problems: tests/test_k_grouped.py)."""
    for kind in (k for k in GemmKind if k is not GemmKind.K_GROUPED):
        for ra in (Recipe.TENSOR, Recipe.ROW, Recipe.GROUP):
            for rb in Recipe:
                for da in (E4M3, E5M2):
                    prob = _problem(kind, 64, 64, 64, 2, ra, rb, torch.float32, a=da)
                    assert tb.supports(prob) is None, prob
                    assert tb.family_for(prob, tb.INTERPRETER_FACTS) is fp8_gemm.FAMILY
    bad = [(_problem(a=torch.float16), "operands must be FP8"),
           (_problem(out=torch.float16), "out dtype must be bf16 or fp32"),
           (_problem(ra=Recipe.BLOCK), "A recipe 128x128 is not one of"),
           (_problem(kind=GemmKind.MASKED, groups=4, has_c=True), "implemented for dense GEMMs only"),
           (_problem(kind=GemmKind.OFFSETS, groups=1025), "at most 1024 groups, got 1025")]
    for prob, why in bad:
        reason = tb.supports(prob)
        assert reason == choose_family(tb.FAMILIES, prob)[1]
        assert why in reason.split("fp8_gemm_persistent: ")[-1], reason


@needs_gluon
def test_gluon_takes_large_m_fine_grained_on_sm90():
    """Large-M dense A 1x128 x B 128x128 on sm_90 takes the Gluon kernel when its TMA rows fit;
    with C, an sm_89 part, K % 16 != 0 or out rows not 16-byte multiples, the persistent one."""
    gluon = tb.gluon_fp8_gemm.FAMILY
    for m, n, k, out in [(4096, 7168, 16384, torch.bfloat16), (129, 2112, 1024, torch.float32)]:
        prob = _problem(m=m, n=n, k=k, out=out)
        assert tb.family_for(prob, H200) is gluon
        cfg = gluon.select_config(prob, H200)
        assert (cfg.block_m, cfg.block_n, cfg.num_warps) == (128, 128, 4)
        # the stage ring and the epilogue tile fit shared memory
        assert cfg.num_stages * 2 * 128 * 128 + 128 * 128 * out.itemsize <= H200.smem_per_block
        assert cfg.num_programs == min(H200.num_sms, ceil_div(m, 128) * ceil_div(n, 128))
        cands = gluon.candidate_configs(prob, H200)
        assert cands[0] is cfg and all(isinstance(c, gluon.Config) for c in cands)
    ada = dataclasses.replace(H200, capability=(8, 9))
    grp = Recipe.GROUP
    for m, n, k, ra, has_c, facts, why in [
            (4096, 4096, 7168, grp, True, H200, "no c"),
            (4096, 4096, 7168, grp, False, ada, "sm_90 only"),
            (4096, 4096, 7000, grp, False, H200, "K must be a positive multiple of 16"),
            (4096, 4096, 0, grp, False, H200, "K must be a positive multiple of 16"),
            (4096, 4100, 7168, grp, False, H200, "multiples of 16 bytes"),
            (4096, 4096, 7168, Recipe.ROW, False, H200, "A 1x128 x B 128x128 scales only"),
            (128, 4096, 7168, grp, False, H200, "large M only"),
            # one partial wave with short K: the Gluon kernel's fixed cost shows
            (129, 2112, 320, grp, False, H200, "one partial wave"),
            # 136 tiles of 128x128 take two waves; 128x64 tiles two programs an SM, one
            (1000, 2112, 7168, grp, False, H200, "fewer waves")]:
        prob = _problem(m=m, n=n, k=k, ra=ra, has_c=has_c)
        assert tb.family_for(prob, facts) is fp8_gemm.FAMILY, prob
        assert why in (gluon.supports(prob) or gluon.declines(prob, facts)), prob
    assert "interpreter" in gluon.declines(_problem(), tb.INTERPRETER_FACTS)
    for kind, m, groups, em in [(GemmKind.CONTIGUOUS, 32768, 4, 0), (GemmKind.MASKED, 512, 2, 512)]:
        prob = _problem(kind, m, 7168, 2048, groups, expected_m=em)
        assert tb.family_for(prob, H200) is gluon, prob
    assert "offsets" in gluon.supports(_problem(GemmKind.OFFSETS, 8192, groups=8))


@needs_gluon
def test_contiguous_further_groups_config():
    """After the Gluon kernel, a contiguous GEMM's further groups run the persistent kernel with
    the same tile and grid, two warpgroups and a pipeline that leaves room for its epilogue."""
    glu = tb.gluon_fp8_gemm
    prob = _problem(GemmKind.CONTIGUOUS, 32768, 7168, 2048, 4)
    cfg = glu.select_config(prob, H200)
    twin = glu.further_groups_config(cfg)
    assert twin == fp8_gemm.PersistentConfig(128, 128, cfg.group_m, 1, min(cfg.num_stages, 5), 8,
                                             True, cfg.num_programs)


def test_print_configs_prints_what_runs(monkeypatch, capsys):
    """FP8GEMM_PRINT_CONFIGS prints the family and config that the call then runs."""
    ran = []
    for fam in tb.FAMILIES:
        monkeypatch.setattr(fam, "run", lambda cfg, prob, *args, fam=fam: ran.append((fam, cfg)),
                            raising=False)
    monkeypatch.setenv("FP8GEMM_PRINT_CONFIGS", "1")
    monkeypatch.setattr(tb, "device_facts", lambda device: H200)
    x = torch.zeros(1)
    probs = [_problem(m=4096, n=4096, k=7168), _problem(m=64, n=2112, k=7168, expected_m=61),
             _problem(GemmKind.MASKED, 256, 4096, 7168, 4, expected_m=200),
             _problem(GemmKind.K_GROUPED, 4096, 7168, 8 * 4096, 8, rb=Recipe.GROUP,
                      out=torch.float32, has_c=True)]
    for prob in probs:
        tb._configs.pop((prob, H200), None)
        capsys.readouterr()
        tb._run(prob, x, x, x, x, x, None, None)
        family, cfg = ran[-1]
        line = capsys.readouterr().out
        assert f"-> {family.name} {cfg} (heuristic" in line, line
        assert isinstance(cfg, family.Config) and family is tb.family_for(prob, H200)
    assert {f for f, _ in ran} == set(tb.FAMILIES)


# ---------------------------------------------------------------------------------------------
# the persistent kernel's heuristic


def test_heuristic_small_m_splits_k():
    for m, n, k in [(64, 2112, 7168), (128, 4096, 7168), (64, 7168, 16384)]:
        prob = _problem(m=m, n=n, k=k)
        assert tb.family_for(prob, H200) is fp8_gemm.FAMILY
        cfg = fp8_gemm.FAMILY.select_config(prob, H200)
        tiles = ceil_div(m, cfg.block_m) * ceil_div(n, cfg.block_n)
        assert cfg.split_k > 1, cfg
        assert tiles * cfg.split_k <= 2 * H200.num_sms and cfg.num_programs <= H200.num_sms
        kb = ceil_div(k, 128)
        assert kb % cfg.split_k == 0 and kb // cfg.split_k >= 2  # even K ranges
        assert cfg.use_tma
        assert fp8_gemm.FAMILY.select_config(prob, H200) is cfg  # cached
        with pytest.raises(dataclasses.FrozenInstanceError):
            cfg.split_k = 1


def test_heuristic_large_m():
    """The persistent kernel's large-M choices (recipes the Gluon kernel does not take)."""
    fam = fp8_gemm.FAMILY
    for m, n, k in [(4096, 7168, 16384), (4096, 2112, 7168), (4096, 32768, 512)]:
        cfg = fam.select_config(_problem(m=m, n=n, k=k, ra=Recipe.ROW), H200)
        assert cfg.split_k == 1 and cfg.block_m == 128
        stage_bytes = (cfg.block_m + cfg.block_n) * 128
        per_sm = cfg.num_programs // H200.num_sms
        assert cfg.num_programs == per_sm * H200.num_sms and per_sm in (1, 2)
        # the pipelines of all programs on one SM fit its shared memory
        assert per_sm * (cfg.num_stages * stage_bytes + 2048) <= H200.smem_per_block + 1024
        assert per_sm == 1 or cfg.num_warps == 4  # two programs: one warpgroup each (registers)
        assert cfg.flatten == (k <= 4 * 128)
        assert (cfg.block_n == 64) == (n <= 2304 or k <= 2048)
    # unaligned K: no tensor descriptors; an sm_89 part has none either
    assert not fam.select_config(_problem(k=7000), H200).use_tma
    assert not fam.select_config(_problem(), dataclasses.replace(H200, capability=(8, 9))).use_tma
    # grouped: no split-K; masked tiles by expected_m
    prob = _problem(GemmKind.MASKED, 1024, 4096, 7168, 4, expected_m=32)
    cfg = fam.select_config(prob, H200)
    assert cfg.split_k == 1 and cfg.block_m == 64
    cands = fam.candidate_configs(prob, H200)
    assert cands[0] == cfg and len(set(cands)) == len(cands) > 3
    assert all(c.split_k == 1 and not c.flatten for c in cands)


# ---------------------------------------------------------------------------------------------
# configs


def test_configs_reject_what_the_kernels_cannot_run():
    base = dict(block_m=64, block_n=64, group_m=8, split_k=1, num_stages=2, num_warps=4,
                use_tma=False, num_programs=3)
    for bad in (dict(block_m=48), dict(block_n=8), dict(split_k=0), dict(num_programs=0),
                dict(num_warps=3)):
        with pytest.raises(ValueError, match="invalid PersistentConfig"):
            fp8_gemm.PersistentConfig(**{**base, **bad})
    cfg = fp8_gemm.PersistentConfig(**base)
    with pytest.raises(ValueError, match="dense GEMMs only"):
        fp8_gemm.check_config(dataclasses.replace(cfg, split_k=2), _problem(GemmKind.MASKED, groups=2))
    with pytest.raises(ValueError, match="K % 16 == 0"):
        fp8_gemm.check_config(dataclasses.replace(cfg, use_tma=True), _problem(k=200))
    with pytest.raises(ValueError, match="empty K range"):
        fp8_gemm.check_config(dataclasses.replace(cfg, split_k=4), _problem(k=5 * 128))
    with pytest.raises(TypeError, match="PersistentConfig"):
        fp8_gemm.check_config(object(), _problem())
    if tb.gluon_fp8_gemm is not None:
        glu = tb.gluon_fp8_gemm.GluonConfig
        for bad in (dict(block_m=64), dict(block_n=256), dict(num_stages=1), dict(num_programs=0)):
            with pytest.raises(ValueError, match="invalid GluonConfig"):
                glu(**{**dict(block_m=128, block_n=128, num_stages=4, group_m=8,
                              num_programs=132), **bad})
        assert {f.name for f in dataclasses.fields(glu)} == {"block_m", "block_n", "num_stages",
                                                            "group_m", "num_programs"}


# ---------------------------------------------------------------------------------------------
# the autotune cache


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tuning, "_tuned", None)
    return tmp_path


def test_autotune_cache_roundtrip(cache_dir, monkeypatch):
    prob = _problem(m=64)
    for fam in tb.FAMILIES:
        assert tuning.load_tuned(fam, prob, H200) is None
        cfg = fam.candidate_configs(prob, H200)[-1]
        tuning.store_tuned(fam, prob, H200, cfg)
    monkeypatch.setattr(tuning, "_tuned", None)  # as a new process would
    for fam in tb.FAMILIES:
        assert tuning.load_tuned(fam, prob, H200) == fam.candidate_configs(prob, H200)[-1]
    assert len(json.loads((cache_dir / "triton_autotune.json").read_text())) == len(tb.FAMILIES)
    with pytest.raises(ValueError):
        tuning.config_from_json(fp8_gemm.PersistentConfig, {"block_m": 64})


def test_autotune_cache_ignores_invalid_entries(cache_dir):
    """An entry the config rejects (or of another config's fields) counts as a miss."""
    fam = fp8_gemm.FAMILY
    prob = _problem(m=64)
    entry = dict(dataclasses.asdict(fam.select_config(prob, H200)), block_m=48)
    (cache_dir / "triton_autotune.json").write_text(
        json.dumps({tuning._key(fam, prob, H200): entry}))
    assert tuning.load_tuned(fam, prob, H200) is None
    entry = dict(dataclasses.asdict(fam.select_config(prob, H200)), gluon=True)
    (cache_dir / "triton_autotune.json").write_text(
        json.dumps({tuning._key(fam, prob, H200): entry}))
    tuning._tuned = None
    assert tuning.load_tuned(fam, prob, H200) is None


def test_autotune_key_has_sm_count_and_family(cache_dir):
    """A config tuned for 132 SMs (its persistent grid) is not used under set_num_sms(100), and
    one family's entry is not another's."""
    fam = fp8_gemm.FAMILY
    capped = dataclasses.replace(H200, num_sms=100)
    prob = _problem(m=64)
    tuning.store_tuned(fam, prob, H200, fam.select_config(prob, H200))
    assert tuning.load_tuned(fam, prob, H200) is not None
    assert tuning.load_tuned(fam, prob, capped) is None
    assert fam.select_config(prob, capped).num_programs <= 100
    for other in tb.FAMILIES:
        if other is not fam:
            assert tuning.load_tuned(other, prob, H200) is None


def _store_entries(cache_dir: str, first: int, count: int) -> None:
    os.environ["FP8GEMM_CACHE_DIR"] = cache_dir
    tuning._tuned = None
    fam = fp8_gemm.FAMILY
    for m in range(first, first + count):
        prob = _problem(m=m)
        tuning.store_tuned(fam, prob, H200, fam.select_config(prob, H200))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_autotune_store_concurrent_processes(cache_dir):
    """Processes that store entries at the same time keep each other's (read-merge-write under a
    lock file); without the lock, entries written between one process's read and its rename
    would be lost."""
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_store_entries, args=(str(cache_dir), 1 + 25 * i, 25))
             for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    stored = json.loads((cache_dir / "triton_autotune.json").read_text())
    assert len(stored) == 100


def _autotune_on(monkeypatch, tuned, store=lambda fam, p, f, c: None):
    monkeypatch.setenv("FP8GEMM_AUTOTUNE", "1")
    monkeypatch.setattr(tb, "device_facts", lambda device: H200)
    monkeypatch.setattr(tuning, "load_tuned", lambda fam, p, f: None)
    monkeypatch.setattr(tuning, "store_tuned", store)
    monkeypatch.setattr(tuning, "autotune", lambda fam, p, f, args: tuned)


def test_config_under_graph_capture_is_not_remembered(monkeypatch):
    """FP8GEMM_AUTOTUNE=1 and the first call of a problem inside a CUDA-graph capture (or one
    without tensors, as a benchmark asking which config runs): the heuristic's config is used but
    not kept, so the next eager call tunes (and keeps that)."""
    prob = _problem(m=33)
    fam = fp8_gemm.FAMILY
    tuned = fam.candidate_configs(prob, H200)[1]
    capturing = [True]
    _autotune_on(monkeypatch, tuned)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    cuda = torch.device("cuda", 0)
    heuristic = (fam, fam.select_config(prob, H200))
    assert tb.launch_config(prob, cuda, tune_args=()) == heuristic
    assert (prob, H200) not in tb._configs
    capturing[0] = False
    assert tb.launch_config(prob, cuda) == heuristic  # no tensors to time: not remembered either
    assert (prob, H200) not in tb._configs
    assert tb.launch_config(prob, cuda, tune_args=()) == (fam, tuned)
    assert tb._configs[(prob, H200)] == (fam, tuned)
    tb._configs.pop((prob, H200))


def test_autotune_store_failure_is_not_fatal(monkeypatch):
    """A cache directory that cannot be written costs a warning (and a re-tune next process),
    not the GEMM call."""
    prob = _problem(m=35)
    fam = fp8_gemm.FAMILY
    tuned = fam.candidate_configs(prob, H200)[1]

    def read_only(fam, p, f, c):
        raise PermissionError("read-only file system")

    _autotune_on(monkeypatch, tuned, read_only)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.warns(UserWarning, match="not stored"):
        assert tb.launch_config(prob, torch.device("cuda", 0), tune_args=()) == (fam, tuned)
    tb._configs.pop((prob, H200))
