"""K-grouped FP8 GEMM: per group (expert) g, out[g] = c[g] + A_g . B_g^T, the groups packed along K.

The MoE weight gradient: group g's K is the number of tokens routed to expert g, so K varies by
group (0 included) and is known only on the device.
"""

from __future__ import annotations

import torch
from torch.compiler import is_compiling

from ..backends import select_backend
from ..problem import SCALE_BLOCK, GemmKind, GemmProblem, Recipe, ceil_div
from ._common import (check_device, check_fp8, check_scale_values, check_values_now,
                      contiguous_operand, prepare_out, run_into, shape_str, split_operand)

__all__ = ["k_grouped_fp8_gemm_nt_contiguous", "check_k_grouped"]


def k_grouped_fp8_gemm_nt_contiguous(a, b, out: torch.Tensor | None, ks: torch.Tensor, *,
                                     c: torch.Tensor | None = None,
                                     backend: str = "auto") -> torch.Tensor:
    """out[g] = c[g] + (A_g * sa_g) @ (B_g * sb_g)^T for every group g, in one launch, FP32.

    Group g owns K_g = ks[g] consecutive columns of A and of B, the groups one after another:
    A_g = A[:, off_g : off_g + K_g] with off_g = ks[0] + ... + ks[g - 1]. Its scales are 1x128
    groups along K that start afresh at off_g: group g's ceil(K_g / 128) scale columns follow
    those of the groups before it, and its last block may be short.

    This is the layout of an MoE weight gradient dW_g = dY_g^T . X_g: with the tokens of each
    expert together along the token axis (the contiguous or offsets layout of the forward pass),
    one transpose of dY [sum T, M] and of X [sum T, N] gives A = dY^T [M, sum T] and
    B = X^T [N, sum T], and quantising them in 1x128 groups along the tokens of each expert
    gives the scales. (Where every ks[g] is a multiple of 128, those groups are the plain 1x128
    groups of the whole [M, sum K] row.)

    DeepGEMM's k_grouped_wgrad_gemm_fp8_fp8_fp32_nt takes group g as a [M, K_g] block of its
    own (the blocks one after another in a flat tensor), scales [sum ceil(K_g/128), M] with K
    blocks first, the K sizes as a host list, and launches one GEMM per group, accumulating
    into out. Its scale tensor, transposed, is this op's sa (a column-major [M, sum kb] view of
    the same memory); its operands are not this op's A (fp8gemm.compat.deep_gemm takes them in
    its layout). Accumulating as it does is c=out.

    Args:
        a: (A, sa). A [M, sum K] float8_e4m3fn or float8_e5m2, K-major (any strides are
            accepted; a non-contiguous A is copied). sa float32 [M, sum ceil(K_g/128)], any
            strides (column-major, as `quantize_per_token` writes, reads best).
        b: (B, sb). B [N, sum K] fp8 (either format), K-major; sb float32
            [N, sum ceil(K_g/128)].
        out: float32 [G, M, N] to write, or None to allocate. Every element is written, also
            for groups with K_g = 0 (out[g] = c[g], or 0).
        ks: int32 [G] on a's device: K_g, the token count of each group, any values >= 0 that
            sum to A's K. Read on the device only (no host synchronisation; safe to capture in
            a CUDA graph). Checked on the CPU, or on a GPU with FP8GEMM_CHECK_VALUES=1; unchecked,
            values that do not add up give wrong results but never a read outside a, b or their
            scales (each group is clamped to the columns that remain).
        c: optional float32 [G, M, N] added to the products; may be `out` itself (accumulate).
        backend: "auto", "cuda" (A e4m3 or e5m2, B e4m3), "triton" or "reference"; FP8GEMM_BACKEND
            overrides "auto".

    Returns:
        out, float32 [G, M, N].
    """
    if is_compiling():
        return _k_grouped_traced(a, b, out, ks, c, backend)
    a_t, sa, b_t, sb, (g, m, n, sum_k, _num_kb), device = check_k_grouped(a, b, out, ks, c)
    out = prepare_out(out, (g, m, n), torch.float32, device)
    if g == 0 or m == 0 or n == 0:
        return out
    if sum_k == 0:
        return out.copy_(c) if c is not None else out.zero_()
    problem = GemmProblem(GemmKind.K_GROUPED, m, n, sum_k, g, a_t.dtype, b_t.dtype, Recipe.GROUP,
                          Recipe.GROUP, torch.float32, has_c=c is not None)
    impl = select_backend(problem, device, backend)
    a_t, b_t = contiguous_operand(a_t), contiguous_operand(b_t)
    c_is_out = c is out
    if c is not None and not c_is_out:
        c = c.contiguous()
    ks = ks.contiguous()
    return run_into(out, lambda dst: impl.k_grouped_fp8_gemm_nt_contiguous(
        a_t, sa, b_t, sb, dst, dst if c_is_out else c, ks, problem))


def _k_grouped_traced(a, b, out, ks, c, backend) -> torch.Tensor:
    """The op while torch.compile traces: the custom op (checked on the fake tensors by its fake
    implementation), copied into `out` when one is given (checked here)."""
    check_k_grouped(a, b, out, ks, c)
    a_t, a_s = split_operand("a", a)
    b_t, b_s = split_operand("b", b)
    y = torch.ops.fp8gemm.k_grouped_fp8_gemm_nt_contiguous(a_t, a_s, b_t, b_s, ks, c, backend)
    return y if out is None else out.copy_(y)


def check_k_grouped(a, b, out, ks, c):
    """The checks of k_grouped_fp8_gemm_nt_contiguous (metadata; ks and scale values where
    check_values_now allows) -> (a_t, sa, b_t, sb, (G, M, N, sum K, scale columns), device)."""
    a_t, a_s = split_operand("a", a)
    b_t, b_s = split_operand("b", b)
    check_fp8("a", a_t, 2, "[M, sum K]")
    check_fp8("b", b_t, 2, "[N, sum K]")
    (m, sum_k), (n, b_k) = a_t.shape, b_t.shape
    if b_k != sum_k:
        raise ValueError(f"b must be [N, sum K] with sum K = {sum_k} as in a, got "
                         f"{shape_str(b_t.shape)}")
    device = a_t.device
    check_device("b", b_t, device)
    if not isinstance(ks, torch.Tensor):
        raise TypeError(f"ks must be a torch.int32 tensor [G] of K sizes, got {type(ks).__name__}")
    if ks.dtype != torch.int32:
        raise TypeError(f"ks must be torch.int32, got {ks.dtype}")
    if ks.dim() != 1:
        raise ValueError(f"ks must be 1-D [G] (one K size per group), got shape "
                         f"{shape_str(ks.shape)}")
    g = ks.shape[0]
    check_device("ks", ks, device)
    num_kb = _check_scales(a_s, b_s, m, n, sum_k, g, device)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a tensor, got {type(out).__name__}")
        if out.dtype != torch.float32:
            raise TypeError(f"out must be torch.float32 (the k-grouped GEMM accumulates in "
                            f"FP32), got {out.dtype}")
        prepare_out(out, (g, m, n), torch.float32, device)
    if c is not None:
        if not isinstance(c, torch.Tensor) or c.dtype != torch.float32:
            raise TypeError(f"c must be a torch.float32 tensor, got "
                            f"{getattr(c, 'dtype', type(c).__name__)}")
        if tuple(c.shape) != (g, m, n):
            raise ValueError(f"c must have shape [G, M, N] = [{g}, {m}, {n}], got "
                             f"{shape_str(c.shape)}")
        check_device("c", c, device)
    if g and check_values_now(ks):
        _check_ks_values(ks.tolist(), sum_k, num_kb)
    return a_t, a_s, b_t, b_s, (g, m, n, sum_k, num_kb), device


def _check_scales(sa, sb, m: int, n: int, sum_k: int, g: int, device) -> int:
    """Both scales 1x128 along K, [rows, S] with one S; S (sum of ceil(K_g/128), which depends
    on the values of ks) within what G groups of sum K columns can have. Returns S."""
    for name, s in (("a", sa), ("b", sb)):
        if s.dtype != torch.float32:
            raise TypeError(f"{name} scales must be torch.float32, got {s.dtype}")
        check_device(f"{name} scales", s, device)
    if g == 0 and sum_k:
        raise ValueError(f"ks has no groups (G = 0), so a and b must have sum K = 0 columns, "
                         f"got {sum_k}")
    # NOTE: sum ceil(K_g/128) = (sum K + the padding of each group's last block) / 128, and a
    # group pads by at most 127; no group has more blocks than columns.
    lo = ceil_div(sum_k, SCALE_BLOCK)
    hi = min(sum_k, (sum_k + (SCALE_BLOCK - 1) * g) // SCALE_BLOCK)
    rng = f"{lo}" if lo == hi else f"S in [{lo}, {hi}]"
    for name, s, rows in (("a", sa, m), ("b", sb, n)):
        if s.dim() != 2 or s.shape[0] != rows or not lo <= s.shape[1] <= hi:
            raise ValueError(
                f"{name} scales must be 1x128 groups along each group's K, [{rows}, "
                f"sum ceil(ks/128)] ({rng} for sum K = {sum_k} over G = {g} groups), got "
                f"{shape_str(s.shape)}")
    if sb.shape[1] != sa.shape[1]:
        raise ValueError(f"b scales must have the K blocks of a's, [{n}, {sa.shape[1]}], got "
                         f"{shape_str(sb.shape)}")
    check_scale_values("a", sa)
    check_scale_values("b", sb)
    return int(sa.shape[1])


def _check_ks_values(ks: list[int], sum_k: int, num_kb: int) -> None:
    shown = ks if len(ks) <= 9 else ks[:4] + ["..."] + ks[-4:]
    if min(ks) < 0 or sum(ks) != sum_k:
        raise ValueError(f"ks must be non-negative K sizes that sum to a's K = {sum_k}, got "
                         f"{shown} (sum {sum(ks)})")
    blocks = sum(ceil_div(k, SCALE_BLOCK) for k in ks)
    if blocks != num_kb:
        raise ValueError(f"the scales must have sum ceil(ks/128) = {blocks} K blocks for ks = "
                         f"{shown}, got {num_kb}")
