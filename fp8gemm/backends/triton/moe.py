"""The MoE combine in Triton: each token's weighted sum of its experts' output rows,

    out[t] = sum over k of topk_weights[t, k] * y[row_of_slot[t, k]]     (row -1: dropped slot)

in float32, slot after slot, stored in out's dtype. Each output row is one program per block of
columns, so y's kept rows are read once and out written once, with no [T, topk, N] temporary
(the torch spec in fp8gemm.moe builds one: at 4096 tokens, top-8 and N = 7168 that is 0.9 GB of
float32 per pass). A dropped slot's row is never read (it may be unwritten: NaN or garbage).
The backward is one program per token: each kept slot writes its row of grad_y (w * grad_out[t])
and its weight's gradient (grad_out[t] . y[row], float32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["moe_combine", "moe_combine_backward"]

BLOCK_N = 1024


@triton.jit
def _combine_kernel(y_ptr, row_ptr, w_ptr, out_ptr, N, stride_y, stride_out,
                    TOPK: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    in_n = cols < N
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k in tl.static_range(TOPK):
        row = tl.load(row_ptr + t * TOPK + k)
        w = tl.load(w_ptr + t * TOPK + k).to(tl.float32)
        v = tl.load(y_ptr + tl.maximum(row, 0) * stride_y + cols, mask=in_n & (row >= 0),
                    other=0.0)
        # (select, not a zero product: a dropped slot's weight may be anything, NaN included)
        acc += tl.where(row >= 0, v.to(tl.float32) * w, 0.0)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=in_n)


@triton.jit
def _combine_backward_kernel(g_ptr, y_ptr, row_ptr, w_ptr, gy_ptr, gw_ptr, N, stride_g, stride_y,
                             stride_gy, TOPK: tl.constexpr, BLOCK_N: tl.constexpr,
                             NEED_GY: tl.constexpr, NEED_GW: tl.constexpr):
    """Token t's slots: grad_y[row] = w * g[t] (every row is one slot's), grad_w[t, k] =
    sum over the columns of g[t] * y[row] in float32, 0 for a dropped slot."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    for k in tl.static_range(TOPK):
        row = tl.load(row_ptr + t * TOPK + k)
        w = tl.load(w_ptr + t * TOPK + k).to(tl.float32)
        kept = row >= 0
        dot = tl.zeros([BLOCK_N], dtype=tl.float32)
        for n0 in range(0, N, BLOCK_N):
            cols = n0 + offs
            m = (cols < N) & kept
            gv = tl.load(g_ptr + t * stride_g + cols, mask=m, other=0.0).to(tl.float32)
            if NEED_GY:
                tl.store(gy_ptr + tl.maximum(row, 0) * stride_gy + cols,
                         (gv * w).to(gy_ptr.dtype.element_ty), mask=m)
            if NEED_GW:
                yv = tl.load(y_ptr + tl.maximum(row, 0) * stride_y + cols, mask=m, other=0.0)
                dot += gv * yv.to(tl.float32)
        if NEED_GW:
            tl.store(gw_ptr + t * TOPK + k, tl.sum(dot, axis=0).to(gw_ptr.dtype.element_ty))


def moe_combine(y_rows: torch.Tensor, row_of_slot: torch.Tensor,
                topk_weights: torch.Tensor) -> torch.Tensor:
    """y_rows [R, N] (unit column stride), row_of_slot int64 [T, topk] (-1: dropped),
    topk_weights [T, topk] -> [T, N] in y_rows' dtype (checked by the caller)."""
    t, topk = row_of_slot.shape
    n = y_rows.shape[1]
    out = torch.empty(t, n, dtype=y_rows.dtype, device=y_rows.device)
    if t == 0 or n == 0:
        return out
    if topk == 0 or y_rows.shape[0] == 0:  # (no rows: every slot is dropped)
        return out.zero_()
    _combine_kernel[(t, triton.cdiv(n, BLOCK_N))](
        y_rows, row_of_slot.contiguous(), topk_weights.contiguous(), out, n, y_rows.stride(0),
        out.stride(0), TOPK=topk, BLOCK_N=BLOCK_N, num_warps=4)
    return out


def moe_combine_backward(grad_out: torch.Tensor, y_rows: torch.Tensor, row_of_slot: torch.Tensor,
                         topk_weights: torch.Tensor, need_y: bool, need_w: bool):
    """The gradients of `moe_combine` for grad_out [T, N]: (grad_y [R, N] in y_rows' dtype, zero
    on the rows no slot names, or None; grad_w [T, topk] in the weights' dtype, or None). Every
    row is named by at most one slot (what the dispatch builds), so no two programs write one
    row of grad_y and the result is deterministic."""
    t, topk = row_of_slot.shape
    n = y_rows.shape[1]
    gy = torch.zeros_like(y_rows, memory_format=torch.contiguous_format) if need_y else None
    gw = torch.zeros(t, topk, dtype=topk_weights.dtype, device=y_rows.device) if need_w else None
    if t and topk and n and y_rows.shape[0]:
        g = grad_out.contiguous()
        _combine_backward_kernel[(t,)](
            g, y_rows, row_of_slot.contiguous(), topk_weights.contiguous(),
            gy if need_y else g, gw if need_w else g, n, g.stride(0), y_rows.stride(0),
            gy.stride(0) if need_y else 0, TOPK=topk, BLOCK_N=BLOCK_N, NEED_GY=need_y,
            NEED_GW=need_w, num_warps=4)
    return gy, gw


def compile_kernels(target) -> list[tuple[str, object]]:
    """The combine kernels, forward and backward (bf16 rows, top-8, as the launches' block and
    warps), compiled ahead of time for `target` (a triton.backends.compiler.GPUTarget; no GPU needed): [(name, kernel)]."""
    from triton.compiler import ASTSource

    consts = dict(TOPK=8, BLOCK_N=BLOCK_N)
    sig = {name: "i32" for name in _combine_kernel.arg_names}
    sig.update(y_ptr="*bf16", row_ptr="*i64", w_ptr="*fp32", out_ptr="*bf16")
    sig.update({name: "constexpr" for name in consts})
    out = [(_combine_kernel.__name__,
            triton.compile(ASTSource(_combine_kernel, sig, consts), target=target,
                           options=dict(num_warps=4)))]
    consts = dict(consts, NEED_GY=True, NEED_GW=True)
    sig = {name: "i32" for name in _combine_backward_kernel.arg_names}
    sig.update(g_ptr="*bf16", y_ptr="*bf16", row_ptr="*i64", w_ptr="*fp32", gy_ptr="*bf16",
               gw_ptr="*fp32")
    sig.update({name: "constexpr" for name in consts})
    out.append((_combine_backward_kernel.__name__,
                triton.compile(ASTSource(_combine_backward_kernel, sig, consts), target=target,
                               options=dict(num_warps=4))))
    return out
