"""Layout helpers: TMA alignment, column-major scales, contiguous-layout alignment, SM count."""

from __future__ import annotations

import pytest
import torch

import fp8gemm
from fp8gemm import layout
from fp8gemm.layout import k_group_columns, k_groups_on_blocks
from fp8gemm.problem import SCALE_BLOCK, ceil_div
from helpers import hopper_available


@pytest.mark.parametrize("x,elem,expect", [
    (0, 4, 0), (1, 4, 4), (4, 4, 4), (37, 4, 40), (130, 4, 132),
    (37, 2, 40), (37, 1, 48), (16, 1, 16), (3, 8, 4), (5, 16, 5),
])
def test_get_tma_aligned_size(x, elem, expect):
    """x elements of `elem` bytes, rounded up to a multiple of 16 bytes."""
    assert fp8gemm.get_tma_aligned_size(x, elem) == expect


@pytest.mark.parametrize("elem", (0, 3, 32))
def test_get_tma_aligned_size_bad_element_size(elem):
    with pytest.raises(ValueError, match="element_size"):
        fp8gemm.get_tma_aligned_size(10, elem)


@pytest.mark.parametrize("m,kb", [(1, 1), (1, 3), (37, 1), (37, 3), (128, 56), (130, 2)])
def test_col_major_tma_aligned_tensor_2d(m, kb):
    s = torch.randn(m, kb)
    t = fp8gemm.get_col_major_tma_aligned_tensor(s)
    mp = fp8gemm.get_tma_aligned_size(m, 4)
    assert torch.equal(t, s) and t.shape == s.shape and t.dtype == s.dtype
    assert t.stride(0) == 1 or m == 1
    if kb > 1:
        assert t.stride(1) == mp
    assert layout.is_col_major_tma_aligned(t)
    assert fp8gemm.get_col_major_tma_aligned_tensor(t) is t  # already aligned: no copy


def test_col_major_tma_aligned_tensor_3d():
    s = torch.randn(3, 37, 5)
    t = fp8gemm.get_col_major_tma_aligned_tensor(s)
    assert torch.equal(t, s) and t.stride() == (5 * 40, 1, 40)
    assert fp8gemm.get_col_major_tma_aligned_tensor(t) is t
    assert layout.is_col_major_tma_aligned(t[1])  # so is each batch slice
    assert not layout.is_col_major_tma_aligned(s)


def test_col_major_not_aligned_inputs_are_converted():
    """Row-major, column-major without padding, and transposed-but-unpadded inputs all come
    back aligned with the same values."""
    s = torch.randn(37, 3)
    unpadded = s.T.contiguous().T  # column-major, stride 37: not a multiple of 4
    assert not layout.is_col_major_tma_aligned(s)
    assert not layout.is_col_major_tma_aligned(unpadded)
    for x in (s, unpadded):
        t = fp8gemm.get_col_major_tma_aligned_tensor(x)
        assert t is not x and torch.equal(t, s) and t.stride() == (1, 40)
    s = torch.randn(40, 3).T.contiguous().T  # M = 40 is already padded: returned as is
    assert fp8gemm.get_col_major_tma_aligned_tensor(s) is s


def test_col_major_bad_input():
    with pytest.raises(ValueError, match="s must"):
        fp8gemm.get_col_major_tma_aligned_tensor(torch.randn(5))


def test_m_alignment_for_contiguous_layout():
    """A positive power of two; the contiguous MoE dispatch pads to it by default."""
    align = fp8gemm.get_m_alignment_for_contiguous_layout()
    assert isinstance(align, int) and align > 0 and align & (align - 1) == 0
    lay = fp8gemm.moe_dispatch_contiguous(torch.randn(5, 8), torch.tensor([[0], [1], [0], [1],
                                                                          [1]]), 2)
    assert lay.x.shape[0] == 2 * align and (lay.offsets % align == 0).all()


@pytest.fixture
def restore_num_sms():
    saved = layout._SmCount.override
    yield
    layout._SmCount.override = saved


def test_set_get_num_sms(restore_num_sms):
    fp8gemm.set_num_sms(7)
    assert fp8gemm.get_num_sms() == 7
    fp8gemm.set_num_sms(1)
    assert fp8gemm.get_num_sms() == 1
    fp8gemm.set_num_sms(None)  # back to the device's count
    if hopper_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        assert fp8gemm.get_num_sms() == props.multi_processor_count
    elif not torch.cuda.is_available():
        with pytest.raises(RuntimeError, match="set_num_sms"):
            fp8gemm.get_num_sms()


@pytest.mark.parametrize("bad", (0, -1, True, 1.5, "8"))
def test_set_num_sms_rejects(bad, restore_num_sms):
    fp8gemm.set_num_sms(5)
    with pytest.raises(ValueError, match="num_sms"):
        fp8gemm.set_num_sms(bad)
    assert fp8gemm.get_num_sms() == 5  # a rejected value changes nothing


@pytest.mark.parametrize("ks", [(1000, 37, 0, 129, 8192, 4096, 0, 17), (16384, 3, 0), (128, 256),
                                (0, 5)])
def test_k_group_columns_move_each_group_to_a_block(ks):
    """Column j of group g lands at 128 * (k-blocks of the groups before g) + (j - its start);
    the padded operand holds every value once, zeros elsewhere."""
    sum_k, blocks = sum(ks), sum(ceil_div(k, SCALE_BLOCK) for k in ks)
    dst = k_group_columns(torch.tensor(ks, dtype=torch.int32), sum_k, blocks)
    want, kb = [], 0
    for k in ks:
        want += [SCALE_BLOCK * kb + j for j in range(k)]
        kb += ceil_div(k, SCALE_BLOCK)
    assert dst.tolist() == want
    t = torch.randint(1, 255, (3, sum_k), dtype=torch.uint8)
    padded = k_groups_on_blocks(t, dst, blocks)
    assert padded.shape == (3, SCALE_BLOCK * blocks) and padded.stride(0) % 16 == 0
    assert torch.equal(padded[:, dst], t) and int((padded != 0).sum()) == 3 * sum_k


def test_k_group_columns_keep_stray_values_inside():
    """ks that disagree with the operand (too short, too long, negative): the kernels' clamp
    (each group to the columns that remain), and columns of no group or past the scale blocks
    go to the spare column."""
    spare = SCALE_BLOCK * 2
    short = k_group_columns(torch.tensor([100, 50], dtype=torch.int32), 300, 2).tolist()
    assert short[:100] == list(range(100)) and short[100:150] == list(range(128, 178))
    assert set(short[150:]) == {spare}
    long = k_group_columns(torch.tensor([-4, 100, 500], dtype=torch.int32), 300, 2).tolist()
    assert long[:100] == list(range(100)) and long[100:228] == list(range(128, 256))
    assert set(long[228:]) == {spare}


@pytest.mark.parametrize("lead", [(), (3,), (2, 5)])
def test_empty_token_scales_layouts(lead):
    """Column-major: the strides, and the storage, of columns padded to 16 bytes (what
    get_col_major_tma_aligned_tensor returns as it is); row-major: contiguous."""
    for m in (1, 5, 37, 64):
        for kb in (1, 3):
            s = layout.empty_token_scales(lead, m, kb, True, torch.device("cpu"))
            mp = layout.get_tma_aligned_size(m, 4)
            assert s.shape == (*lead, m, kb) and s.dtype == torch.float32
            assert s.stride()[-2:] == (1, mp) and layout.is_col_major_tma_aligned(s)
            assert layout.get_col_major_tma_aligned_tensor(s) is s
            assert s.untyped_storage().nbytes() == 4 * kb * mp * (torch.Size(lead).numel())
            r = layout.empty_token_scales(lead, m, kb, False, torch.device("cpu"))
            assert r.shape == (*lead, m, kb) and r.is_contiguous()
