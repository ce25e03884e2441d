"""The MoE combine in Triton: each token's weighted sum of its experts' output rows,

    out[t] = sum over k of topk_weights[t, k] * y[row_of_slot[t, k]]     (row -1: dropped slot)

in float32, slot after slot, stored in out's dtype. Each output row is one program per block of
columns, so y's kept rows are read once and out written once, with no [T, topk, N] temporary
(the torch spec in fp8gemm.moe builds one: at 4096 tokens, top-8 and N = 7168 that is 0.9 GB of
float32 per pass). A dropped slot's row is never read (it may be unwritten: NaN or garbage).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["moe_combine"]

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


def compile_kernels(target) -> list[tuple[str, object]]:
    """The combine kernel (bf16 rows, top-8, as the launch's block and warps) compiled ahead of
    time for `target` (a triton.backends.compiler.GPUTarget; no GPU needed): [(name, kernel)]."""
    from triton.compiler import ASTSource

    consts = dict(TOPK=8, BLOCK_N=BLOCK_N)
    sig = {name: "i32" for name in _combine_kernel.arg_names}
    sig.update(y_ptr="*bf16", row_ptr="*i64", w_ptr="*fp32", out_ptr="*bf16")
    sig.update({name: "constexpr" for name in consts})
    return [(_combine_kernel.__name__,
             triton.compile(ASTSource(_combine_kernel, sig, consts), target=target,
                            options=dict(num_warps=4)))]
