"""FP8 quantisation kernels in Triton: per token (1x128), per block (128x128), SiLU*mul fused
with per-token quantisation (the middle of an MoE expert), and the transposing quantisers of the
backward GEMMs (x^T per 1x128 group along T, w^T per 128x128 block) reading x and w untransposed.

Same arithmetic as the PyTorch versions in fp8gemm.quant:
    amax  = max(|x| over the group, 1e-4)
    scale = amax / fmt_max                    (pow2_scale: 2 ** ceil(log2(amax / fmt_max)))
    q     = clamp(x / scale, -fmt_max, fmt_max) cast to FP8 (round to nearest even)
Scales are FP32 dequantisation multipliers (x ~= q * scale). Per-token scales are written
directly in the column-major, TMA-aligned layout the GEMMs read: shape [M, ceil(K/128)], strides
(1, align(M, 4)).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from ...layout import empty_token_scales
from ...problem import SCALE_BLOCK, ceil_div
from ._aot import compile_ahead

__all__ = ["quantize_per_token", "quantize_per_block", "silu_mul_quantize_per_token",
           "quantize_per_token_transposed", "quantize_per_block_transposed"]

AMAX_FLOOR = tl.constexpr(1e-4)
_FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


# ---------------------------------------------------------------------------------------------
# kernels


@triton.jit
def _scale_of(amax, FMT_MAX: tl.constexpr, POW2: tl.constexpr):
    amax = tl.maximum(amax, AMAX_FLOOR)
    ratio = amax / FMT_MAX
    if POW2:
        # NOTE: log2 is approximate; correct the exponent so that scale >= ratio (no clipping).
        scale = tl.exp2(tl.ceil(tl.log2(ratio)))
        scale = tl.where(scale < ratio, scale * 2.0, scale)
        scale = tl.where(scale * 0.5 >= ratio, scale * 0.5, scale)
    else:
        scale = ratio
    return scale


@triton.jit
def _round_to_fp8_grid(v, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    """Round |v| <= fmt_max to the nearest FP8 value (ties to even), in FP32 arithmetic.
    NOTE: used under the interpreter only, whose float->fp8 cast mis-rounds (127.4 -> 64 in e4m3);
    on a GPU the hardware cast does this rounding."""
    e = tl.maximum(tl.floor(tl.log2(tl.abs(v))), MIN_EXP)
    step = tl.exp2(e - MANT_BITS)
    magic = 12582912.0  # 1.5 * 2^23: adding it rounds an FP32 below 2^22 to an integer, ties even
    return ((v / step + magic) - magic) * step


@triton.jit
def _to_fp8(q, dtype, SOFT_ROUND: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr):
    if SOFT_ROUND:
        q = _round_to_fp8_grid(q, MANT_BITS, MIN_EXP)
    return q.to(dtype)


@triton.jit
def _quant_rows_kernel(x_ptr, q_ptr, s_ptr, rows_ptr, M, K, I,
                       stride_xb, stride_xm, stride_xk, stride_qb, stride_qm,
                       stride_sb, stride_sm, stride_sk,
                       SILU_MUL: tl.constexpr, FMT_MAX: tl.constexpr, POW2: tl.constexpr,
                       SOFT_ROUND: tl.constexpr, MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                       BLOCK_M: tl.constexpr, GROUP_K: tl.constexpr, MASKED: tl.constexpr):
    """One [BLOCK_M, GROUP_K] tile: a per-row amax, a scale per row, the FP8 values.
    SILU_MUL: the tile's values are silu(x[:, k]) * x[:, I + k] (K == I).
    MASKED: matrix b has rows_ptr[b] rows (clamped to [0, M]); the others are not read, take an
    all-zero group's scale and keep their FP8 values unwritten."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kb = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    x_ptr += batch * stride_xb
    q_ptr += batch * stride_qb
    s_ptr += batch * stride_sb
    offs_k = kb * GROUP_K + tl.arange(0, GROUP_K)
    rows = M
    if MASKED:
        rows = tl.minimum(tl.maximum(tl.load(rows_ptr + batch), 0), M)
    mask = (offs_m < rows)[:, None] & (offs_k < K)[None, :]
    ptrs = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :] * stride_xk
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    if SILU_MUL:
        up = tl.load(ptrs + I * stride_xk, mask=mask, other=0.0).to(tl.float32)
        x = x / (1.0 + tl.exp(-x)) * up
    scale = _scale_of(tl.max(tl.abs(x), axis=1), FMT_MAX, POW2)
    q = tl.clamp(x / scale[:, None], -FMT_MAX, FMT_MAX)
    tl.store(q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + offs_k[None, :],
             _to_fp8(q, q_ptr.dtype.element_ty, SOFT_ROUND, MANT_BITS, MIN_EXP), mask=mask)
    tl.store(s_ptr + offs_m * stride_sm + kb * stride_sk, scale, mask=offs_m < M)


@triton.jit
def _quant_cols_kernel(x_ptr, q_ptr, s_ptr, T, C, stride_xb, stride_xt, stride_xc, stride_qb,
                       stride_qc, stride_sb, stride_sc, stride_sk,
                       FMT_MAX: tl.constexpr, POW2: tl.constexpr, SOFT_ROUND: tl.constexpr,
                       MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr,
                       GROUP_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """x [T, C] -> q [C, T], s [C, ceil(T/GROUP_T)]: one [GROUP_T, BLOCK_C] tile read along C
    (x's rows), an amax down each column, the FP8 tile transposed into q's rows."""
    offs_c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    kb = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    x_ptr += batch * stride_xb
    q_ptr += batch * stride_qb
    s_ptr += batch * stride_sb
    offs_t = kb * GROUP_T + tl.arange(0, GROUP_T)
    mask = (offs_t < T)[:, None] & (offs_c < C)[None, :]
    x = tl.load(x_ptr + offs_t[:, None].to(tl.int64) * stride_xt + offs_c[None, :] * stride_xc,
                mask=mask, other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.abs(x), axis=0), FMT_MAX, POW2)
    q = _to_fp8(tl.clamp(x / scale[None, :], -FMT_MAX, FMT_MAX), q_ptr.dtype.element_ty,
                SOFT_ROUND, MANT_BITS, MIN_EXP)
    tl.store(q_ptr + offs_c[:, None].to(tl.int64) * stride_qc + offs_t[None, :], tl.trans(q),
             mask=(offs_c < C)[:, None] & (offs_t < T)[None, :])
    tl.store(s_ptr + offs_c * stride_sc + kb * stride_sk, scale, mask=offs_c < C)


@triton.jit
def _quant_block_kernel(x_ptr, q_ptr, s_ptr, N, K, stride_xb, stride_xn, stride_xk, stride_qb,
                        stride_qn, stride_sb, stride_sn, stride_sk,
                        FMT_MAX: tl.constexpr, POW2: tl.constexpr, SOFT_ROUND: tl.constexpr,
                        MANT_BITS: tl.constexpr, MIN_EXP: tl.constexpr, BLOCK: tl.constexpr,
                        TRANSPOSE: tl.constexpr):
    """One [BLOCK, BLOCK] block: one amax, one scale, the FP8 values; with TRANSPOSE the block
    goes to q^T [K, N] (stride_qn: its row stride) and its scale to s[kb, nb] (stride_sn, stride_sk
    the scales' strides along N and K blocks, as without)."""
    nb = tl.program_id(0)
    kb = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    x_ptr += batch * stride_xb
    q_ptr += batch * stride_qb
    s_ptr += batch * stride_sb
    offs_n = nb * BLOCK + tl.arange(0, BLOCK)
    offs_k = kb * BLOCK + tl.arange(0, BLOCK)
    mask = (offs_n < N)[:, None] & (offs_k < K)[None, :]
    x = tl.load(x_ptr + offs_n[:, None].to(tl.int64) * stride_xn + offs_k[None, :] * stride_xk,
                mask=mask, other=0.0).to(tl.float32)
    scale = _scale_of(tl.max(tl.max(tl.abs(x), axis=1), axis=0), FMT_MAX, POW2)
    q = _to_fp8(tl.clamp(x / scale, -FMT_MAX, FMT_MAX), q_ptr.dtype.element_ty, SOFT_ROUND,
                MANT_BITS, MIN_EXP)
    if TRANSPOSE:
        tl.store(q_ptr + offs_k[:, None].to(tl.int64) * stride_qn + offs_n[None, :], tl.trans(q),
                 mask=(offs_k < K)[:, None] & (offs_n < N)[None, :])
    else:
        tl.store(q_ptr + offs_n[:, None].to(tl.int64) * stride_qn + offs_k[None, :], q, mask=mask)
    tl.store(s_ptr + nb * stride_sn + kb * stride_sk, scale)


# ---------------------------------------------------------------------------------------------
# wrappers


def _fmt(fmt: str) -> torch.dtype:
    if fmt not in _FORMATS:
        raise ValueError(f"fmt must be one of {sorted(_FORMATS)}, got {fmt!r}")
    return _FORMATS[fmt]


# NOTE: read once, as triton.jit reads it when the kernels below are defined: the interpreter
# (software rounding) or compiled kernels for the whole process.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _fmt_meta(dtype: torch.dtype) -> dict:
    """Constexprs of the FP8 format: its max, and for the interpreter's software rounding the
    mantissa bits and the smallest normal exponent (cached: this runs on every launch; callers
    never change the dict)."""
    mant, min_exp = (3, -6) if dtype is torch.float8_e4m3fn else (2, -14)
    return dict(FMT_MAX=torch.finfo(dtype).max, SOFT_ROUND=_INTERPRET, MANT_BITS=mant,
                MIN_EXP=min_exp)


def _check_input(name: str, x: torch.Tensor) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"{name} must be [..., rows, K] (at least 2-D), got shape {list(x.shape)}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{name} must be bf16, fp16 or fp32, got {x.dtype}")


def _as_3d(x: torch.Tensor) -> torch.Tensor:
    """[..., R, C] -> [B, R, C] (a view when the leading dims allow it)."""
    return x.reshape(-1, *x.shape[-2:])


# NOTE: the batch is the grid's z dimension, which CUDA caps at 65535: larger batches launch in
# slices of at most this many matrices.
_MAX_GRID_Z = 65535


def _batches(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor):
    """Per launch: (x, q, s, matrices, and the strides of each as [B, R, C]). 2-D tensors go as
    they are with a batch stride of 0 (no views: this runs on every activation quantisation);
    more dims as [B, R, C] views, in slices of at most _MAX_GRID_Z matrices."""
    if x.dim() == 2:
        yield x, q, s, 1, (0, *x.stride()), (0, *q.stride()), (0, *s.stride())
        return
    x3, q3, s3 = _as_3d(x), _as_3d(q), _as_3d(s)
    batch = x3.shape[0]
    for lo in range(0, batch, _MAX_GRID_Z):
        bs = slice(lo, min(batch, lo + _MAX_GRID_Z))
        xb, qb, sb = x3[bs], q3[bs], s3[bs]
        yield xb, qb, sb, xb.shape[0], xb.stride(), qb.stride(), sb.stride()


def _k_offsets_fit(x: torch.Tensor) -> bool:
    """Whether the kernels' 32-bit offsets along K (k * stride) reach all of x's last dim.
    NOTE: row and batch offsets are 64-bit; K offsets pass 2^31 only for a view whose last dim
    is strided by the size of a > 2^31-element tensor (a transposed one): such x is copied."""
    return (x.shape[-1] - 1) * x.stride(-1) < 2**31


def _rows_launch(x, k, silu_i, fmt, pow2_scales, col_major_scales, masked_m=None):
    dtype = _fmt(fmt)
    if not _k_offsets_fit(x):
        x = x.contiguous()
    lead, m = tuple(x.shape[:-2]), x.shape[-2]
    kb = ceil_div(k, SCALE_BLOCK)
    q = torch.empty((*lead, m, k), dtype=dtype, device=x.device)
    s = empty_token_scales(lead, m, kb, col_major_scales, x.device)
    if q.numel() == 0:
        return q, s
    # NOTE: a transposed view (K strided, the rows contiguous) reads each tile column as BLOCK_M
    # contiguous elements: 64 rows make those 128-byte lines. On the H200 against a bf16 copy at
    # 4096x7168, x^T: 77 % of its bandwidth with 64 rows, 74 % with 32; x itself 82 % either way.
    block_m = 64 if x.stride(-1) != 1 else 32
    lo = 0
    for xb, qb, sb, batch, xs, qs, ss in _batches(x, q, s):
        _quant_rows_kernel[(ceil_div(m, block_m), kb, batch)](
            xb, qb, sb, masked_m[lo:] if masked_m is not None else xb, m, k, silu_i, *xs,
            *qs[:2], *ss, SILU_MUL=silu_i > 0, POW2=bool(pow2_scales), **_fmt_meta(dtype),
            BLOCK_M=block_m, GROUP_K=SCALE_BLOCK, MASKED=masked_m is not None, num_warps=4)
        lo += batch
    return q, s


def quantize_per_token(x: torch.Tensor, fmt: str = "e4m3", *, pow2_scales: bool = False,
                       col_major_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., M, K] bf16/fp16/fp32 (any strides) -> (q [..., M, K] fp8 row-major, scales
    [..., M, ceil(K/128)] fp32, one per row and 128 of K; column-major TMA-aligned unless
    col_major_scales=False)."""
    _check_input("x", x)
    return _rows_launch(x, x.shape[-1], 0, fmt, pow2_scales, col_major_scales)


def silu_mul_quantize_per_token(x: torch.Tensor, fmt: str = "e4m3", *, pow2_scales: bool = False,
                                col_major_scales: bool = True,
                                masked_m: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., T, 2I] (gate | up) -> quantize_per_token(silu(x[..., :I]) * x[..., I:]) computed in
    FP32: (q [..., T, I] fp8, scales [..., T, ceil(I/128)] fp32). masked_m (int32 [G] contiguous,
    x [G, T, 2I], checked by the caller): the rows at or past masked_m[g] are not read, their
    scales are an all-zero group's and their fp8 values unwritten."""
    _check_input("x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"x must be [..., T, 2I] (gate then up), got an odd last dim {x.shape[-1]}")
    i = x.shape[-1] // 2
    return _rows_launch(x, i, i, fmt, pow2_scales, col_major_scales, masked_m)


def quantize_per_block(w: torch.Tensor, fmt: str = "e4m3", *,
                       pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] bf16/fp16/fp32 (any strides) -> (q [..., N, K] fp8 row-major, scales
    [..., ceil(N/128), ceil(K/128)] fp32 row-major, one per 128x128 block)."""
    _check_input("w", w)
    return _block_launch(w, fmt, pow2_scales, transpose=False)


def quantize_per_block_transposed(w: torch.Tensor, fmt: str = "e4m3", *,
                                  pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any strides) -> quantize_per_block(w^T), bit for bit: (q [..., K, N] fp8
    row-major, scales [..., ceil(K/128), ceil(N/128)]), reading w along its rows."""
    _check_input("w", w)
    return _block_launch(w, fmt, pow2_scales, transpose=True)


def _block_launch(w, fmt, pow2_scales, transpose: bool):
    dtype = _fmt(fmt)
    if not _k_offsets_fit(w):
        w = w.contiguous()
    lead, (n, k) = tuple(w.shape[:-2]), w.shape[-2:]
    nb, kb = ceil_div(n, SCALE_BLOCK), ceil_div(k, SCALE_BLOCK)
    q = torch.empty((*lead, k, n) if transpose else (*lead, n, k), dtype=dtype, device=w.device)
    s = torch.empty((*lead, kb, nb) if transpose else (*lead, nb, kb), dtype=torch.float32,
                    device=w.device)
    if q.numel() == 0:
        return q, s
    # NOTE: a block is read along the rows of w, where its lines are contiguous, also for the
    # transposed result (whose block then goes through shared memory): on the H200 against a
    # bf16 copy at 4096x7168, w^T quantised so ran at 84 % of its bandwidth, read through a
    # transposed view 56-72 %. A view with K strided (a transposed weight) reads less well with
    # 8 warps a block than with 4 (72 % against 56 % at 4096x7168).
    warps = 4 if transpose or w.stride(-1) != 1 else 8
    for wb, qb, sb, batch, ws, qs, ss in _batches(w, q, s):
        s_n, s_k = (ss[2], ss[1]) if transpose else (ss[1], ss[2])
        _quant_block_kernel[(nb, kb, batch)](
            wb, qb, sb, n, k, *ws, *qs[:2], ss[0], s_n, s_k, POW2=bool(pow2_scales),
            BLOCK=SCALE_BLOCK, TRANSPOSE=transpose, num_warps=warps, **_fmt_meta(dtype))
    return q, s


def quantize_per_token_transposed(x: torch.Tensor, fmt: str = "e4m3", *,
                                  pow2_scales: bool = False,
                                  col_major_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., T, C] (any strides) -> quantize_per_token(x^T), bit for bit: (q [..., C, T] fp8
    row-major, scales [..., C, ceil(T/128)], column-major TMA-aligned unless
    col_major_scales=False), reading x along its rows."""
    _check_input("x", x)
    dtype = _fmt(fmt)
    if not _k_offsets_fit(x):
        x = x.contiguous()
    lead, (t, c) = tuple(x.shape[:-2]), x.shape[-2:]
    kb = ceil_div(t, SCALE_BLOCK)
    q = torch.empty((*lead, c, t), dtype=dtype, device=x.device)
    s = empty_token_scales(lead, c, kb, col_major_scales, x.device)
    if q.numel() == 0:
        return q, s
    # NOTE: [128 tokens, 64 channels] tiles, 4 warps: on the H200 against a bf16 copy, 76-83 % of
    # its bandwidth at 4096x7168 (over three runs) and 74-79 % at 7168x2048. The same run that
    # gave 76 % gave 60-73 % for 64 channels at 1-2 warps, 64-73 % for 32 channels at 1-2, 65 % for
    # 16 at 1 and 57 % for 128 at 8 warps. The quantised tile is transposed in shared memory as
    # fp8.
    block_c = 64
    for xb, qb, sb, batch, xs, qs, ss in _batches(x, q, s):
        _quant_cols_kernel[(ceil_div(c, block_c), kb, batch)](
            xb, qb, sb, t, c, *xs, *qs[:2], *ss, POW2=bool(pow2_scales), **_fmt_meta(dtype),
            GROUP_T=SCALE_BLOCK, BLOCK_C=block_c, num_warps=4)
    return q, s


def compile_kernels(target) -> list[tuple[str, object]]:
    """The quantisation kernels (bf16 in, e4m3 out; per token with SiLU*mul, on the masked layout
    and on a transposed view, the transposing ones, per block with power-of-two scales) compiled
    ahead of time for `target` (a triton.backends.compiler.GPUTarget; no GPU needed), with the
    launches' block sizes and warps: [(name, compiled kernel)]."""
    meta = dict(_fmt_meta(torch.float8_e4m3fn), SOFT_ROUND=False)
    cases = [(_quant_rows_kernel, dict(SILU_MUL=True, POW2=False, BLOCK_M=32,
                                       GROUP_K=SCALE_BLOCK, MASKED=False), 4),
             (_quant_rows_kernel, dict(SILU_MUL=True, POW2=False, BLOCK_M=32,
                                       GROUP_K=SCALE_BLOCK, MASKED=True), 4),  # decode MoE
             (_quant_rows_kernel, dict(SILU_MUL=False, POW2=False, BLOCK_M=64,
                                       GROUP_K=SCALE_BLOCK, MASKED=False), 4),  # a transposed view
             (_quant_cols_kernel, dict(POW2=False, GROUP_T=SCALE_BLOCK, BLOCK_C=64), 4),
             (_quant_block_kernel, dict(POW2=True, BLOCK=SCALE_BLOCK, TRANSPOSE=False), 8),
             (_quant_block_kernel, dict(POW2=False, BLOCK=SCALE_BLOCK, TRANSPOSE=True), 4)]
    return [compile_ahead(fn, dict(meta, **consts), target, warps, x_ptr="*bf16",
                          q_ptr="*fp8e4nv", s_ptr="*fp32", rows_ptr="*i32")
            for fn, consts, warps in cases]
