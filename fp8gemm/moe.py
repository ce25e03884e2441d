"""MoE layout helpers: router output -> grouped-GEMM layouts, and the weighted combine back.

Token-choice routing gives `topk_ids [T, topk]` (expert of each of a token's k slots; ids outside
[0, G) are dropped, as expert parallelism does with experts held elsewhere) and `topk_weights`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .layout import get_m_alignment_for_contiguous_layout

__all__ = ["ContiguousLayout", "MaskedLayout", "moe_dispatch_contiguous", "moe_combine_contiguous",
           "moe_dispatch_masked", "moe_combine_masked"]

# On a GPU the combine and its gradients run as Triton kernels (backends/triton/moe.py); the torch
# code is their specification and runs elsewhere and while torch.compile traces. On the H200 at
# the moe-layer suite's 4096 tokens (one rank's 32 experts of DeepSeek-V3), timed against the
# torch code in one run (scripts/moe_triton_ab.py): the combine 69 us against 2366, the whole
# Fp8MoE layer 1565 us against 3994; at 128 tokens 7 us against 96. Off: the torch code everywhere.
TRITON_COMBINE = True
# The masked dispatch likewise (two launches where the torch code makes about thirty small ones
# on a few thousand slots at decode; scripts/moe_triton_ab.py --switch dispatch times both), up
# to the slots x experts that backends/triton/moe.py's `dispatch_fits` takes. Off: the torch code
# everywhere.
TRITON_DISPATCH = True


@dataclass(frozen=True)
class ContiguousLayout:
    """Rows of x permuted so each expert's rows are together, each group padded to `alignment`.

    x: [R, K] permuted rows (padding rows are zero); m_indices: int32 [R], expert of each row,
    -1 for padding; offsets: int32 [G + 1], start row of each expert's (padded) run, offsets[G]
    = R; row_of_slot: int64 [T, topk], the row holding each (token, slot), -1 if dropped;
    token_of_row: int64 [R], the token each row holds (0 for padding rows), with which
    `x2.index_select(0, token_of_row)` lays out any other per-token rows x2 the same way.
    """

    x: torch.Tensor
    m_indices: torch.Tensor
    offsets: torch.Tensor
    row_of_slot: torch.Tensor
    token_of_row: torch.Tensor


@dataclass(frozen=True)
class MaskedLayout:
    """x: [G, Mmax, K] with expert g's tokens in rows :masked_m[g] (the rest zero, unless
    dispatched with zero_rest=False); masked_m:
    int32 [G]; row_of_slot: int64 [T, topk], flat index g * Mmax + row of each slot, -1 if
    dropped or beyond Mmax; token_of_row: int64 [G, Mmax], the token each row holds (0 past
    masked_m), with which `x2.index_select(0, token_of_row.flatten())` lays out any other
    per-token rows x2 the same way."""

    x: torch.Tensor
    masked_m: torch.Tensor
    row_of_slot: torch.Tensor
    token_of_row: torch.Tensor


def _check_routing(x: torch.Tensor, topk_ids: torch.Tensor, num_groups: int) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        raise ValueError(f"x must be a [T, K] tensor, got {getattr(x, 'shape', type(x).__name__)}")
    if not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be a [T, topk] tensor, got "
                         f"{getattr(topk_ids, 'shape', type(topk_ids).__name__)}")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"topk_ids must be torch.int32 or torch.int64, got {topk_ids.dtype}")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_ids must have T = {x.shape[0]} rows like x, got {topk_ids.shape[0]}")
    if topk_ids.device != x.device:
        raise ValueError(f"topk_ids must be on {x.device} like x, got {topk_ids.device}")
    if not isinstance(num_groups, int) or num_groups < 1:
        raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")


def _sort_slots(topk_ids: torch.Tensor, num_groups: int):
    """Slots sorted by expert (stable: token order within an expert), with each slot's rank
    inside its expert. Dropped slots sort into a last bucket `num_groups`."""
    flat = topk_ids.flatten().long()
    flat = torch.where((flat >= 0) & (flat < num_groups), flat, num_groups)
    # NOTE: a radix sort makes one pass per key byte: 16-bit keys take 2 passes where int64
    # takes 8 (on the H200, 8 passes over a prefill's 32768 slots took 44 us).
    keys = flat.to(torch.int16) if num_groups < 2 ** 15 else flat
    order = torch.sort(keys, stable=True).indices
    expert = flat[order]
    # NOTE: each expert's first slot, by a binary search in the sorted experts: no atomics (a
    # scatter_add of 32768 ones into 33 counters took 23 us on the H200), no data-dependent size
    # (bincount's host synchronisation), so the masked path stays free of synchronisation.
    starts = torch.searchsorted(expert, torch.arange(num_groups + 2, device=flat.device))
    counts = starts[1:] - starts[:-1]
    rank = torch.arange(flat.numel(), device=flat.device) - starts[expert]
    return order, expert, rank, counts[:num_groups]


def moe_dispatch_contiguous(x: torch.Tensor, topk_ids: torch.Tensor, num_groups: int,
                            alignment: int | None = None) -> ContiguousLayout:
    """Build the contiguous layout for `m_grouped_fp8_gemm_nt_contiguous` (or `_offsets` with
    alignment=1, which needs no padding). x may be any dtype (bf16 before quantisation, or fp8
    / fp32 scale rows after it). Reads the per-expert counts on the host to size the result
    (one synchronisation); use the masked layout where that must be avoided."""
    _check_routing(x, topk_ids, num_groups)
    if alignment is None:
        alignment = get_m_alignment_for_contiguous_layout()
    if not isinstance(alignment, int) or alignment < 1:
        raise ValueError(f"alignment must be a positive int, got {alignment!r}")
    order, expert, rank, counts = _sort_slots(topk_ids, num_groups)
    dev, slots, g = x.device, topk_ids.numel(), num_groups
    padded = (counts + alignment - 1) // alignment * alignment
    offsets = torch.zeros(g + 1, dtype=torch.int64, device=dev)
    offsets[1:] = torch.cumsum(padded, 0)
    # NOTE: everything but the rows themselves is built before the one synchronisation, on
    # buffers sized for the most rows there can be (every slot kept, every group padded), so
    # after it the host launches two kernels and the GPU hardly waits for the host (the bubble
    # an eager prefill layer pays). Index `top` is scratch, for the dropped slots' writes.
    top = slots + g * (alignment - 1)
    kept = expert < g
    dest = torch.where(kept, offsets[expert.clamp_max(g - 1)] + rank, top)
    m_indices = torch.full((top + 1,), -1, dtype=torch.int32, device=dev)
    m_indices[dest] = expert.to(torch.int32)
    token = torch.zeros(top + 1, dtype=torch.int64, device=dev)
    token[dest] = order // topk_ids.shape[1]
    row_of_slot = torch.empty(slots, dtype=torch.int64, device=dev)
    row_of_slot[order] = torch.where(kept, dest, -1)
    # each group's padding rows, offsets[g] + counts[g] + j for j < padded[g] - counts[g]; the
    # other entries go to a scratch row past the end once the row count is known
    j = torch.arange(alignment, device=dev)
    pad = offsets[:-1, None] + counts[:, None] + j
    pad = torch.where(j < (padded - counts)[:, None], pad, top + 1).flatten()
    rows, n_kept = torch.stack([offsets[-1], counts.sum()]).tolist()  # the synchronisation
    fp8 = x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)  # (no CPU fp8 kernels for these)
    xs = x.view(torch.uint8) if fp8 else x
    if rows == 0:
        xp = xs.new_zeros(0, x.shape[1])
    else:
        # one gather of every row from its token (padding rows from token 0), and of one scratch
        # row; then the padding rows zeroed by index. On the H200 an index_put of the kept rows
        # into zeros, and a row-masked fill of the result, each took 3-4x the gather's time.
        xp = xs.index_select(0, token[:rows + 1])
        if rows > n_kept:
            xp.index_fill_(0, pad.clamp_max_(rows), 0)
        xp = xp[:rows]
    return ContiguousLayout(xp.view(x.dtype) if fp8 else xp, m_indices[:rows],
                            offsets.to(torch.int32), row_of_slot.view(topk_ids.shape),
                            token[:rows])


def moe_dispatch_masked(x: torch.Tensor, topk_ids: torch.Tensor, num_groups: int,
                        max_m: int | None = None, *, zero_rest: bool = True) -> MaskedLayout:
    """Build the masked layout for `m_grouped_fp8_gemm_nt_masked`, with no host synchronisation
    (CUDA-graph safe). max_m defaults to T, which always suffices for distinct top-k experts;
    slots beyond max_m in an expert are dropped (capacity limit). zero_rest=False leaves x's
    rows past masked_m unwritten (any values) instead of zero, for consumers that read only the
    rows below masked_m (the masked GEMM; `silu_mul_quantize_per_token(masked_m=)`): at decode
    most of the G x max_m rows hold no token, and the fill writes all of them."""
    _check_routing(x, topk_ids, num_groups)
    t = x.shape[0]
    if max_m is None:
        max_m = t
    if not isinstance(max_m, int) or max_m < 0:
        raise ValueError(f"max_m must be a non-negative int, got {max_m!r}")
    if _triton_dispatch_runs(x, topk_ids, num_groups):
        from .backends.triton.moe import masked_dispatch

        xm, masked_m, row_of_slot, token_of_row = masked_dispatch(x, topk_ids, num_groups, max_m,
                                                                  zero_rest)
        return MaskedLayout(xm.view(num_groups, max_m, x.shape[1]), masked_m,
                            row_of_slot.view(topk_ids.shape), token_of_row.view(num_groups, max_m))
    order, expert, rank, counts = _sort_slots(topk_ids, num_groups)
    kept = (expert < num_groups) & (rank < max_m)
    flat_row = torch.where(kept, expert.clamp_max(num_groups - 1) * max_m + rank, -1)
    # NOTE: index_copy with a fixed-size index keeps shapes static; dropped slots go to a
    # scratch row past the end, sliced away.
    rows = num_groups * max_m
    dest = torch.where(kept, flat_row, rows)
    token = order // topk_ids.shape[1]
    xm = (torch.zeros if zero_rest else torch.empty)((rows + 1, x.shape[1]), dtype=x.dtype,
                                                     device=x.device)
    src = x[token]
    if xm.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):  # index_copy_ has no CPU fp8 kernel
        xm, src = xm.view(torch.uint8), src.view(torch.uint8)
    xm.index_copy_(0, dest, src)
    xm = xm.view(x.dtype)
    token_of_row = torch.zeros(rows + 1, dtype=torch.int64, device=x.device)
    token_of_row.index_copy_(0, dest, token)
    row_of_slot = torch.empty(topk_ids.numel(), dtype=torch.int64, device=x.device)
    row_of_slot[order] = flat_row
    masked_m = counts.clamp_max(max_m).to(torch.int32)
    return MaskedLayout(xm[:-1].view(num_groups, max_m, x.shape[1]), masked_m,
                        row_of_slot.view(topk_ids.shape), token_of_row[:-1].view(num_groups, max_m))


def _combine(y_rows: torch.Tensor, row_of_slot: torch.Tensor, topk_weights: torch.Tensor):
    if not isinstance(topk_weights, torch.Tensor) or topk_weights.shape != row_of_slot.shape:
        raise ValueError(f"topk_weights must have shape {list(row_of_slot.shape)}, got "
                         f"{getattr(topk_weights, 'shape', type(topk_weights).__name__)}")
    if topk_weights.device != y_rows.device:
        raise ValueError(f"topk_weights must be on {y_rows.device} like y, got "
                         f"{topk_weights.device}")
    if _triton_combine_runs(y_rows):
        return _TritonCombine.apply(y_rows, row_of_slot, topk_weights)
    return _combine_torch(y_rows, row_of_slot, topk_weights)


class _TritonCombine(torch.autograd.Function):
    """The Triton combine and its gradients (each row is one slot's: what the dispatch builds)."""

    @staticmethod
    def forward(ctx, y_rows, row_of_slot, topk_weights):
        from .backends.triton.moe import moe_combine

        ctx.save_for_backward(y_rows, row_of_slot, topk_weights)
        return moe_combine(y_rows, row_of_slot, topk_weights)

    @staticmethod
    def backward(ctx, grad_out):
        from .backends.triton.moe import moe_combine_backward

        y_rows, row_of_slot, topk_weights = ctx.saved_tensors
        gy, gw = moe_combine_backward(grad_out, y_rows, row_of_slot, topk_weights,
                                      ctx.needs_input_grad[0], ctx.needs_input_grad[2])
        return gy, None, gw


def _triton_runs_for(t: torch.Tensor) -> bool:
    """A Triton kernel on t: a CUDA tensor on a GPU Triton runs on, outside torch.compile's
    tracing (which traces the torch code, each kernel's specification)."""
    if not t.is_cuda or torch.compiler.is_compiling():
        return False
    from .backends import triton_runs_on

    return triton_runs_on(t.device.index if t.device.index is not None
                          else torch.cuda.current_device())


def _triton_dispatch_runs(x: torch.Tensor, topk_ids: torch.Tensor, num_groups: int) -> bool:
    """The Triton masked dispatch, for the sizes it takes."""
    if not TRITON_DISPATCH or not _triton_runs_for(x):
        return False
    from .backends.triton.moe import dispatch_fits

    return dispatch_fits(topk_ids.numel(), num_groups)


def _triton_combine_runs(y_rows: torch.Tensor) -> bool:
    """The Triton combine, on rows of unit column stride."""
    return TRITON_COMBINE and y_rows.stride(-1) == 1 and _triton_runs_for(y_rows)


def _combine_torch(y_rows: torch.Tensor, row_of_slot: torch.Tensor, topk_weights: torch.Tensor):
    valid = (row_of_slot >= 0).unsqueeze(-1)
    if y_rows.shape[0] == 0:  # every slot dropped: nothing to gather
        y_rows = y_rows.new_zeros(1, y_rows.shape[1])
    gathered = y_rows[row_of_slot.clamp_min(0)].float()  # [T, topk, N]
    # NOTE: a dropped slot gathers some row that may be unwritten (NaN, garbage): select, not
    # multiply by a zero weight, so it contributes nothing.
    terms = torch.where(valid, gathered * topk_weights.float().unsqueeze(-1), 0.0)
    return terms.sum(dim=1).to(y_rows.dtype)


def moe_combine_contiguous(y: torch.Tensor, layout: ContiguousLayout,
                           topk_weights: torch.Tensor) -> torch.Tensor:
    """y [R, N] from the grouped GEMM -> [T, N]: sum over slots of weight * expert output,
    in float32, returned in y's dtype. Dropped slots contribute nothing. No host
    synchronisation. With TRITON_COMBINE on a GPU one Triton kernel reads each kept row of y once
    and writes [T, N] once (and one more computes the gradients)."""
    if y.dim() != 2 or y.shape[0] != layout.x.shape[0]:
        raise ValueError(f"y must be [R, N] with R = {layout.x.shape[0]}, got {list(y.shape)}")
    return _combine(y, layout.row_of_slot, topk_weights)


def moe_combine_masked(y: torch.Tensor, layout: MaskedLayout,
                       topk_weights: torch.Tensor) -> torch.Tensor:
    """y [G, Mmax, N] from the masked GEMM -> [T, N], as `moe_combine_contiguous`."""
    g, mmax = layout.x.shape[:2]
    if y.dim() != 3 or tuple(y.shape[:2]) != (g, mmax):
        raise ValueError(f"y must be [G, Mmax, N] = [{g}, {mmax}, N], got {list(y.shape)}")
    return _combine(y.reshape(g * mmax, y.shape[-1]), layout.row_of_slot, topk_weights)
