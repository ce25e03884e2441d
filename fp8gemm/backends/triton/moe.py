"""The MoE masked dispatch and combine in Triton.

The dispatch lays the routed rows out as `fp8gemm.moe.moe_dispatch_masked` specifies (its torch
code is the specification, bit for bit) in two launches where the torch code makes about thirty
small ones: one program ranks every slot within its expert (a running one-hot prefix sum over
the slots in token order: the torch code's stable sort) and writes the row maps and the counts;
then one program per slot and block of columns copies the token's row to its place.

The combine: each token's weighted sum of its experts' output rows,

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

from ._aot import compile_ahead

__all__ = ["masked_dispatch", "dispatch_fits", "moe_combine", "moe_combine_backward"]

BLOCK_N = 1024
# The ranking program holds [BLOCK_S, BLOCK_G] one-hot counts (BLOCK_G: the experts rounded up to
# a power of two): DISPATCH_TILE elements, 16 per thread of its 4 warps.
DISPATCH_TILE = 2048
# Its work grows with slots x experts in one program (one SM): it takes the decode sizes (top-8
# of 256 tokens over 32 local experts is 1 << 16) and leaves larger ones to the torch code.
DISPATCH_MAX_WORK = 1 << 17
DISPATCH_MAX_GROUPS = 1024
DISPATCH_BLOCK_BYTES = 1024


def dispatch_fits(slots: int, num_groups: int) -> bool:
    """Whether `masked_dispatch` takes this many slots and experts."""
    g = triton.next_power_of_2(max(num_groups, 1))
    return num_groups <= DISPATCH_MAX_GROUPS and slots * g <= DISPATCH_MAX_WORK


@triton.jit
def _masked_route_kernel(ids_ptr, row_of_slot_ptr, token_of_row_ptr, masked_m_ptr, S, G, MAX_M,
                         TOPK: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_G: tl.constexpr,
                         BLOCK_Z: tl.constexpr):
    """One program: slot s (token s // TOPK) of expert e gets rank = the slots of e before it,
    row e * MAX_M + rank if that is below MAX_M (else it is dropped, -1, as a slot of no expert
    in [0, G)); masked_m[e] = min(slots of e, MAX_M); token_of_row: each kept slot's token, 0 on
    the other rows."""
    num_rows = G * MAX_M
    for r0 in range(0, num_rows, BLOCK_Z):
        r = r0 + tl.arange(0, BLOCK_Z)
        tl.store(token_of_row_ptr + r, tl.zeros([BLOCK_Z], dtype=tl.int64), mask=r < num_rows)
    tl.debug_barrier()  # (the zeros land before any thread writes a token over them)
    experts = tl.arange(0, BLOCK_G)
    seen = tl.zeros([BLOCK_G], dtype=tl.int32)
    for s0 in range(0, S, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        valid = s < S
        e = tl.load(ids_ptr + s, mask=valid, other=-1)
        e = tl.where((e >= 0) & (e < G), e, -1).to(tl.int32)  # (compared before narrowing)
        hot = (e[:, None] == experts[None, :]).to(tl.int32)
        before = tl.cumsum(hot, axis=0) - hot + seen[None, :]
        rank = tl.sum(hot * before, axis=1)
        seen += tl.sum(hot, axis=0)
        kept = (e >= 0) & (rank < MAX_M)
        row = tl.where(kept, e.to(tl.int64) * MAX_M + rank, -1)
        tl.store(row_of_slot_ptr + s, row, mask=valid)
        tl.store(token_of_row_ptr + tl.maximum(row, 0), (s // TOPK).to(tl.int64),
                 mask=valid & kept)
    tl.store(masked_m_ptr + experts, tl.minimum(seen, MAX_M), mask=experts < G)


@triton.jit
def _masked_rows_kernel(x_ptr, row_of_slot_ptr, out_ptr, ROW_BYTES, stride_x, stride_out,
                        TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """Slot s's token row (bytes) to its row of the layout; a dropped slot copies nothing."""
    s = tl.program_id(0)
    row = tl.load(row_of_slot_ptr + s)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = (cols < ROW_BYTES) & (row >= 0)
    v = tl.load(x_ptr + (s // TOPK).to(tl.int64) * stride_x + cols, mask=m)
    tl.store(out_ptr + tl.maximum(row, 0) * stride_out + cols, v, mask=m)


def masked_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, num_groups: int, max_m: int,
                    zero_rest: bool):
    """x [T, K] (any dtype), topk_ids [T, topk] int32/int64 on x's device (checked by the caller,
    `dispatch_fits`) -> (x laid out [G * max_m, K], masked_m int32 [G], row_of_slot int64
    [T * topk], token_of_row int64 [G * max_m]), as `fp8gemm.moe.moe_dispatch_masked` builds
    them; x's rows past masked_m zero with zero_rest, else unwritten."""
    t, topk = topk_ids.shape
    slots, rows, k = t * topk, num_groups * max_m, x.shape[1]
    dev = x.device
    xm = (torch.zeros if zero_rest else torch.empty)((rows, k), dtype=x.dtype, device=dev)
    masked_m = torch.empty(num_groups, dtype=torch.int32, device=dev)
    row_of_slot = torch.empty(slots, dtype=torch.int64, device=dev)
    token_of_row = torch.empty(rows, dtype=torch.int64, device=dev)
    block_g = triton.next_power_of_2(max(num_groups, 1))
    _masked_route_kernel[(1,)](
        topk_ids.contiguous(), row_of_slot, token_of_row, masked_m, slots, num_groups, max_m,
        TOPK=max(topk, 1), BLOCK_S=max(DISPATCH_TILE // block_g, 2), BLOCK_G=block_g,
        BLOCK_Z=1024, num_warps=4)
    if slots and rows and k:
        xb = (x if x.stride(-1) == 1 else x.contiguous()).view(torch.uint8)
        xmb = xm.view(torch.uint8)
        row_bytes = xb.shape[1]
        _masked_rows_kernel[(slots, triton.cdiv(row_bytes, DISPATCH_BLOCK_BYTES))](
            xb, row_of_slot, xmb, row_bytes, xb.stride(0), xmb.stride(0), TOPK=topk,
            BLOCK=DISPATCH_BLOCK_BYTES, num_warps=4)
    return xm, masked_m, row_of_slot, token_of_row


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
    """The combine kernels, forward and backward (bf16 rows, top-8), and the masked dispatch's
    two (int64 ids, 32 experts, top-8), with the launches' blocks and warps, compiled ahead of
    time for `target` (a triton.backends.compiler.GPUTarget; no GPU needed): [(name, kernel)]."""
    consts = dict(TOPK=8, BLOCK_N=BLOCK_N)
    both = dict(consts, NEED_GY=True, NEED_GW=True)
    route = dict(TOPK=8, BLOCK_S=DISPATCH_TILE // 32, BLOCK_G=32, BLOCK_Z=1024)
    return [compile_ahead(_combine_kernel, consts, target, y_ptr="*bf16", row_ptr="*i64",
                          w_ptr="*fp32", out_ptr="*bf16"),
            compile_ahead(_combine_backward_kernel, both, target, g_ptr="*bf16", y_ptr="*bf16",
                          row_ptr="*i64", w_ptr="*fp32", gy_ptr="*bf16", gw_ptr="*fp32"),
            compile_ahead(_masked_route_kernel, route, target, ids_ptr="*i64",
                          row_of_slot_ptr="*i64", token_of_row_ptr="*i64", masked_m_ptr="*i32"),
            compile_ahead(_masked_rows_kernel, dict(TOPK=8, BLOCK=DISPATCH_BLOCK_BYTES), target,
                          x_ptr="*u8", row_of_slot_ptr="*i64", out_ptr="*u8")]
