"""scripts/copy_floor.py on the CPU: the shapes it times and the bytes it copies."""

from __future__ import annotations

import pytest
import torch

from fp8gemm.bench.suites import Case
from helpers import load_script

cf = load_script("scripts/copy_floor.py")


def test_default_shapes_are_the_dense_suite_decode_shapes():
    shapes = cf.default_shapes()
    assert len(shapes) == 12 and {m for m, _, _ in shapes} == {64, 128}
    assert (64, 2112, 7168) in shapes and (128, 7168, 16384) in shapes


def test_a_copy_of_half_the_bytes_moves_the_gemm_s_bytes():
    """Each byte copied is read and written once: half of min_bytes (fp8 A and B, scales, bf16
    out) moves all of them."""
    c = Case("copy-floor", "dense", 64, 2112, 7168)
    assert c.min_bytes >= 2112 * 7168 + 64 * 7168 + 2 * 64 * 2112
    assert 2 * (c.min_bytes // 2) in (c.min_bytes, c.min_bytes - 1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run times copies")
def test_without_a_gpu_it_says_so():
    assert cf.main(["--shapes", "64x2112x7168"]) == 2
