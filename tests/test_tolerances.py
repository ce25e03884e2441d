"""The basis of the tolerance table in tests/helpers.py, measured: each rounding the table names
costs what its basis says (2^-2p / 12 for p significant bits, round to nearest), and stays under
the bound it justifies."""

from __future__ import annotations

import pytest
import torch

from helpers import E4M3, E5M2, TOLERANCES, calc_diff

# (format, significant bits p, the table entry whose basis is this rounding)
ROUNDINGS = [(torch.bfloat16, 8, ("gemm", torch.bfloat16)), (E4M3, 4, ("quantise", E4M3)),
             (E5M2, 3, ("quantise", E5M2))]


def _normal(n=1 << 18):
    """Normal values, kept clear of the fp8 formats' subnormals and maxima (|x| in about
    [2^-3, 2^7]), where round to nearest keeps p significant bits."""
    x = torch.randn(n, dtype=torch.float64)
    return x[(x.abs() > 2**-5) & (x.abs() < 32)] * 4


@pytest.mark.parametrize("dtype,p,key", ROUNDINGS, ids=["bf16", "e4m3", "e5m2"])
def test_round_to_nearest_costs_what_the_basis_says(dtype, p, key):
    x = _normal()
    d = calc_diff(x.to(dtype), x)
    assert 0.7 * 2.0 ** (-2 * p) / 12 < d < 1.3 * 2.0 ** (-2 * p) / 12, d
    assert d < 2.0 ** (-2 * p) / 2  # the worst case
    assert d < TOLERANCES[key].bound


def test_truncation_to_bf16_fits_the_interpreter_bound():
    """Truncating float32 -> bf16 (what the Triton interpreter's cast does): 4x the error of
    rounding, 2^-14 / 12, under the interpreter's bound and under its worst case 2^-15."""
    x = _normal().float()
    t = (x.view(torch.int32) & ~0xFFFF).view(torch.float32)
    d = calc_diff(t, x)
    assert 0.7 * 2.0**-14 / 12 < d < 1.3 * 2.0**-14 / 12, d
    assert d < 2.0**-15 < TOLERANCES["gemm interpreted", torch.bfloat16].bound


def test_every_entry_states_its_basis():
    for key, tol in TOLERANCES.items():
        assert 0 < tol.bound < 1 and tol.measure and len(tol.basis) > 40, key
