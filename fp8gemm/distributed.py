"""Expert parallelism: an FP8 MoE layer whose experts are spread over a torch.distributed group.

Rank r of a group of W ranks holds the L = G / W experts [r * L, (r + 1) * L) of a G-expert
SwiGLU MoE (`fp8gemm.nn.Fp8MoE` for its local experts). One step, on every rank at once:

    quantise x once per 1x128 group -> pack each token into one wire row (fp8 bytes, float32
    scales, local expert id) -> group the (token, slot) rows by destination rank ->
    all_to_all_single -> group the received rows by local expert -> grouped FP8 GEMMs ->
    rows back in received order -> all_to_all_single back -> sum over each token's slots
    times its router weights.

Two layouts, as for Fp8MoE:

- "contiguous" (prefill): uneven splits. The per-destination row counts are exchanged first
  (all_to_all_single on a [W] count tensor) and read on the host to size the transfer; the
  local experts run the contiguous grouped GEMM. Any number of tokens per rank, 0 included.
  Four small host reads per step: the exchanged counts and the sizes of the three
  dispatches (by rank; values and scales by expert).
- "masked" (decode): every buffer has a fixed size and the counts stay on the device, so the
  step never synchronises with the host and can be captured in a CUDA graph. A rank sends at
  most `capacity` rows to each rank (W equal splits of `capacity` rows) and each local expert
  takes at most `expert_capacity` of the rows it receives (the masked GEMM's Mmax). Capacity
  policy: rows past either limit are dropped, never an error (an error would need the host);
  a dropped slot contributes nothing to its token, as an id outside [0, G) does. A source
  keeps its slots for a destination in (token, slot) order; an expert keeps received rows in
  (source rank, token, slot) order. `EpStep.dropped` counts both kinds on the device. The
  defaults never drop.

The wire row (`WireFormat`) carries the fp8 bytes, the float32 scales and the slot's local
expert id as raw bytes in one uint8 tensor, so one collective moves all three, and every
transport can carry it (gloo has no fp8 types; NCCL gets the same bytes). Results travel back
in bf16 (the grouped GEMMs' output). The received rows are grouped by expert into a
contiguous fp8 matrix and its scales, so `compute` is the grouped GEMMs alone; moving the
outputs back into received order is part of `combine`.

Overlap and SM reservation: NCCL's kernels take SMs of their own while they run. To run a
transfer beside the GEMMs, reserve SMs for it with `fp8gemm.set_num_sms(total - reserved)`
(every persistent kernel then launches at most that many CTAs) and split the step into its
three stages, `dispatch`, `compute`, `combine`, for two micro-batches: issue `compute` of one
on the compute stream before `dispatch`/`combine` of the other on a second stream, so the
all-to-all of one overlaps the GEMMs of the other. The collectives run on NCCL's stream, ordered
after the stream they are called from; the prefill's host reads wait for that stream only.
`set_num_sms` is one setting for the whole process; the kernels' configs are chosen again
after it changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from . import quant
from .layout import TMA_ALIGN_BYTES
from .moe import (ContiguousLayout, MaskedLayout, moe_combine_contiguous, moe_combine_masked,
                  moe_dispatch_contiguous, moe_dispatch_masked)
from .nn import Fp8MoE
from .problem import SCALE_BLOCK, ceil_div

__all__ = ["WireFormat", "EpStep", "Fp8EPMoE"]

_F32_BYTES = 4


def _align(nbytes: int) -> int:
    return ceil_div(nbytes, TMA_ALIGN_BYTES) * TMA_ALIGN_BYTES


@dataclass(frozen=True)
class WireFormat:
    """One (token, slot) row as it travels: uint8 [row_bytes] =
    [hidden fp8 bytes | pad | ceil(hidden/128) float32 scales | int32 local expert + 1 | pad].

    The fp8 bytes start the row and every row is a multiple of 16 bytes long, so the fp8 part
    of a block of rows is a TMA-ready [R, hidden] matrix (row stride row_bytes) without a copy;
    the scales start 16-byte aligned, so they view as float32. Expert id 0 marks an empty row
    (the masked buffers are zero-filled)."""

    hidden: int
    dtype: torch.dtype = torch.float8_e4m3fn

    @property
    def scale_blocks(self) -> int:
        return ceil_div(self.hidden, SCALE_BLOCK)

    @property
    def scale_offset(self) -> int:
        return _align(self.hidden)

    @property
    def id_offset(self) -> int:
        return self.scale_offset + _F32_BYTES * self.scale_blocks

    @property
    def row_bytes(self) -> int:
        return _align(self.id_offset + _F32_BYTES)

    def pack(self, a: torch.Tensor, sa: torch.Tensor) -> torch.Tensor:
        """a fp8 [T, hidden], sa float32 [T, ceil(hidden/128)] (any strides) -> uint8
        [T, row_bytes] with expert id 0 (empty) in every row."""
        rows = torch.zeros(a.shape[0], self.row_bytes, dtype=torch.uint8, device=a.device)
        rows[:, :self.hidden] = a.view(torch.uint8)
        words = rows.view(torch.float32)
        start = self.scale_offset // _F32_BYTES
        words[:, start:start + self.scale_blocks] = sa
        return rows

    def unpack(self, rows: torch.Tensor):
        """uint8 [..., row_bytes] -> views (a fp8 [..., hidden], sa float32
        [..., ceil(hidden/128)], local expert int32 [...] with -1 for an empty row)."""
        a = rows[..., :self.hidden].view(self.dtype)
        words = rows.view(torch.float32)
        start = self.scale_offset // _F32_BYTES
        sa = words[..., start:start + self.scale_blocks]
        ids = rows.view(torch.int32)[..., self.id_offset // _F32_BYTES] - 1
        return a, sa, ids

    def write_ids(self, rows: torch.Tensor, row_of_slot: torch.Tensor,
                  local_ids: torch.Tensor) -> None:
        """Write each slot's local expert into its row of rows [R, row_bytes] (row_of_slot
        [T, topk] from a dispatch, -1 for a slot without a row). Fixed shapes, no host
        synchronisation: slots without a row write to a scratch entry past the end."""
        r = rows.shape[0]
        column = torch.zeros(r + 1, dtype=torch.int32, device=rows.device)
        index = torch.where(row_of_slot >= 0, row_of_slot, r).flatten()
        column.scatter_(0, index, (local_ids + 1).to(torch.int32).flatten())
        rows.view(torch.int32)[:, self.id_offset // _F32_BYTES] = column[:r]


@dataclass
class EpStep:
    """One step of `Fp8EPMoE` between its stages (`dispatch` -> `compute` -> `combine`).

    send: this rank's (token, slot) rows grouped by destination rank (the `fp8gemm.moe`
    layout whose `row_of_slot` the combine reads); recv: uint8 [R, row_bytes] rows received;
    experts: the layout of the received rows grouped by local expert (its `row_of_slot`
    [R, 1] maps each received row to its row there, -1 for an empty or dropped one), with
    a, sa the rows' fp8 values and float32 scales in that layout (contiguous [R', H] and
    [R', ceil(H/128)], or masked [L, Mmax, H] and [L, Mmax, ceil(H/128)]);
    tokens_per_expert: int32 [L] rows each local expert computes, on the device; splits:
    (send, recv) row counts per rank (contiguous layout; None for masked); dropped: int64 [2] on the device, this step's rows
    dropped for `capacity` (sent by this rank) and for `expert_capacity` (received by it)."""

    layout: str
    send: ContiguousLayout | MaskedLayout
    recv: torch.Tensor
    experts: ContiguousLayout | MaskedLayout
    a: torch.Tensor
    sa: torch.Tensor
    tokens_per_expert: torch.Tensor
    splits: tuple[list[int], list[int]] | None
    dropped: torch.Tensor
    topk_weights: torch.Tensor
    out_dtype: torch.dtype
    expected_m: int


def _distributed():
    import torch.distributed as dist

    return dist


class Fp8EPMoE(nn.Module):
    """A SwiGLU MoE of `num_experts` fp8 experts spread evenly over the ranks of `group`
    (default: the world group), routed by the caller as `fp8gemm.nn.Fp8MoE`:

        y[t] = sum_k topk_weights[t, k] * W2[e] . (silu(W1[e] x) * W3[e] x),  e = topk_ids[t, k]

    with e a global expert id; rank r holds experts [r * L, (r + 1) * L), L = num_experts / W,
    in `self.experts` (an Fp8MoE of L experts). Every rank of the group calls forward (or the
    three stages) together, each with its own tokens. Inference only (no autograd through the
    collectives). See the module docstring for the data path and the capacity policy.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, group=None,
                 fmt: str = "e4m3", device=None):
        super().__init__()
        dist = _distributed()
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError("Fp8EPMoE needs an initialised torch.distributed process group "
                             "(call torch.distributed.init_process_group first)")
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if not isinstance(num_experts, int) or num_experts < 1 or num_experts % self.world_size:
            raise ValueError(f"num_experts must be a positive multiple of the group's "
                             f"{self.world_size} ranks, got {num_experts!r}")
        self.num_experts, self.hidden, self.intermediate, self.fmt = (
            num_experts, hidden, intermediate, fmt)
        self.local_experts = num_experts // self.world_size
        self.first_expert = self.rank * self.local_experts
        self.experts = Fp8MoE(self.local_experts, hidden, intermediate, fmt=fmt, device=device)
        self.wire = WireFormat(hidden, quant.fp8_dtype(fmt)[0])

    @torch.no_grad()
    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        """Quantise this rank's experts: w13 [G, 2I, H] and w2 [G, H, I] for all G experts
        (the rank takes its own), or [L, 2I, H] and [L, H, I] for its L local ones."""
        g, l = self.num_experts, self.local_experts
        if w13.dim() == 3 and w13.shape[0] == g and w2.dim() == 3 and w2.shape[0] == g:
            lo = self.first_expert
            w13, w2 = w13[lo:lo + l], w2[lo:lo + l]
        elif not (w13.dim() == 3 and w13.shape[0] == l and w2.dim() == 3 and w2.shape[0] == l):
            raise ValueError(f"w13 and w2 must hold all {g} experts or this rank's {l}, got "
                             f"{list(w13.shape)} and {list(w2.shape)}")
        self.experts.load_weights(w13, w2)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                layout: str = "auto", capacity: int | None = None,
                expert_capacity: int | None = None,
                expected_m: int | None = None) -> torch.Tensor:
        """x [T, H], topk_ids [T, topk] global expert ids (ids outside [0, G) dropped),
        topk_weights [T, topk] -> [T, H] in x's dtype; T may differ between ranks for the
        contiguous layout.

        layout: "contiguous" (uneven splits, sized on the host), "masked" (fixed buffers, no
        host synchronisation: CUDA-graph safe), or "auto": masked while a CUDA graph is being
        captured, else contiguous. Masked only: `capacity` rows per destination rank (the
        same value on every rank; default T * min(topk, L), which never drops when every rank
        passes the same T), `expert_capacity` rows per local expert (default W * min(T,
        capacity), which never drops), `expected_m` the masked GEMM's hint."""
        step = self.dispatch(x, topk_ids, topk_weights, layout=layout, capacity=capacity,
                             expert_capacity=expert_capacity, expected_m=expected_m)
        return self.combine(step, self.compute(step))

    # -- the three stages -----------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 layout: str = "auto", capacity: int | None = None,
                 expert_capacity: int | None = None, expected_m: int | None = None) -> EpStep:
        """Quantise x, send each (token, slot) row to the rank of its expert, and group the
        received rows by local expert (arguments as `forward`)."""
        self._check_inputs(x, topk_ids, topk_weights)
        if layout == "auto":
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
            layout = "masked" if capturing else "contiguous"
        if layout not in ("contiguous", "masked"):
            raise ValueError(f"layout must be 'auto', 'contiguous' or 'masked', got {layout!r}")
        a, sa = quant.quantize_per_token(x, self.fmt, col_major_scales=False)
        rows = self.wire.pack(a, sa)
        g, l = self.num_experts, self.local_experts
        ids = topk_ids.long()
        routed = (ids >= 0) & (ids < g)
        dest = torch.where(routed, ids // l, -1)
        local = ids - dest * l
        if layout == "contiguous":
            for name, v in (("capacity", capacity), ("expert_capacity", expert_capacity)):
                if v is not None:
                    raise ValueError(f"{name} is for layout='masked' (the contiguous layout "
                                     f"sends every row), got {name}={v!r}")
            return self._dispatch_contiguous(rows, dest, local, topk_weights, x.dtype)
        return self._dispatch_masked(rows, dest, local, routed, topk_weights, x.dtype,
                                     capacity, expert_capacity, expected_m)

    def compute(self, step: EpStep) -> torch.Tensor:
        """The local experts' grouped GEMMs on the received rows -> bf16 in the expert layout
        ([R', H] contiguous or [L, Mmax, H] masked): exactly what the one-process layer runs
        on the same rows."""
        if step.layout == "contiguous":
            return self.experts.experts_grouped(step.a, step.sa, step.experts.m_indices,
                                                "contiguous")
        return self.experts.experts_masked(step.a, step.sa, step.tokens_per_expert,
                                           step.expected_m)

    def combine(self, step: EpStep, y: torch.Tensor) -> torch.Tensor:
        """Put the expert outputs y (from `compute(step)`) back in received order, send them
        back and sum each token's slots times its router weights -> [T, H] in x's dtype."""
        dist = _distributed()
        y = y.reshape(-1, self.hidden)
        row = step.experts.row_of_slot[:, 0]  # each received row's row in the expert layout
        if y.shape[0] == 0:  # no local rows: every received row gets zeros
            y_recv = y.new_zeros(row.shape[0], self.hidden)
        else:  # NOTE: select, not multiply: a masked row past masked_m is unwritten (may be NaN)
            y_recv = torch.where((row >= 0)[:, None], y[row.clamp_min(0)], 0.0)
        if step.layout == "contiguous":
            send_splits, recv_splits = step.splits
            back = y_recv.new_empty(sum(send_splits), self.hidden)
            dist.all_to_all_single(back, y_recv, send_splits, recv_splits, group=self.group)
            out = moe_combine_contiguous(back, step.send, step.topk_weights)
        else:
            back = torch.empty_like(y_recv)
            dist.all_to_all_single(back, y_recv, group=self.group)
            out = moe_combine_masked(back.view(*step.send.x.shape[:2], self.hidden), step.send,
                                     step.topk_weights)
        return out.to(step.out_dtype)

    # -- internals --------------------------------------------------------------------------

    def _check_inputs(self, x, topk_ids, topk_weights) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, {self.hidden}], got "
                             f"{list(getattr(x, 'shape', [])) or type(x).__name__}")
        if (not isinstance(topk_ids, torch.Tensor) or topk_ids.dim() != 2
                or topk_ids.shape[0] != x.shape[0]):
            raise ValueError(f"topk_ids must be [T, topk] with T = {x.shape[0]}, got "
                             f"{list(getattr(topk_ids, 'shape', [])) or type(topk_ids).__name__}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_ids must be torch.int32 or torch.int64, got {topk_ids.dtype}")
        if (not isinstance(topk_weights, torch.Tensor)
                or tuple(topk_weights.shape) != tuple(topk_ids.shape)):
            raise ValueError(f"topk_weights must have topk_ids' shape {list(topk_ids.shape)}, got "
                             f"{list(getattr(topk_weights, 'shape', [])) or type(topk_weights)}")

    def _by_expert(self, recv: torch.Tensor, expert_capacity: int | None):
        """Received wire rows -> (layout by local expert, fp8 values and scales in it, each
        row's local expert). The values and the scales are grouped apart (one helper call
        each), so the GEMMs read a contiguous fp8 matrix: grouping the whole wire rows would
        leave a strided one, which the grouped ops copy before their kernels run."""
        a, sa, ids = self.wire.unpack(recv)
        l = self.local_experts
        if expert_capacity is None:
            lay = moe_dispatch_contiguous(a.view(torch.uint8), ids[:, None], l)
            scales = moe_dispatch_contiguous(sa, ids[:, None], l).x
        else:
            lay = moe_dispatch_masked(a.view(torch.uint8), ids[:, None], l, expert_capacity)
            scales = moe_dispatch_masked(sa, ids[:, None], l, expert_capacity).x
        return lay, lay.x.view(self.wire.dtype), scales, ids

    def _dispatch_contiguous(self, rows, dest, local, topk_weights, out_dtype) -> EpStep:
        dist = _distributed()
        w, l = self.world_size, self.local_experts
        # rows grouped by destination rank, token order within (moe_dispatch: one host sync)
        send = moe_dispatch_contiguous(rows, dest, w, alignment=1)
        self.wire.write_ids(send.x, send.row_of_slot, local)
        send_counts = (send.offsets[1:] - send.offsets[:-1]).long()
        recv_counts = torch.empty_like(send_counts)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        send_splits, recv_splits = torch.stack([send_counts, recv_counts]).tolist()
        recv = rows.new_empty(sum(recv_splits), self.wire.row_bytes)
        dist.all_to_all_single(recv, send.x, recv_splits, send_splits, group=self.group)
        experts, a, sa, recv_ids = self._by_expert(recv, None)
        counts = torch.zeros(l, dtype=torch.int64, device=rows.device)
        counts.scatter_add_(0, recv_ids.long(), torch.ones_like(recv_ids, dtype=torch.int64))
        dropped = torch.zeros(2, dtype=torch.int64, device=rows.device)
        return EpStep("contiguous", send, recv, experts, a, sa, counts.to(torch.int32),
                      (send_splits, recv_splits), dropped, topk_weights, out_dtype, 0)

    def _dispatch_masked(self, rows, dest, local, routed, topk_weights, out_dtype, capacity,
                         expert_capacity, expected_m) -> EpStep:
        dist = _distributed()
        w, l = self.world_size, self.local_experts
        t, topk = dest.shape
        capacity = t * min(topk, l) if capacity is None else capacity
        _check_count("capacity", capacity)
        if expert_capacity is None:
            expert_capacity = w * min(t, capacity)
        _check_count("expert_capacity", expert_capacity)
        # [W, capacity, row] send buffers; slots past capacity for a rank are dropped
        send = moe_dispatch_masked(rows, dest, w, capacity)
        self.wire.write_ids(send.x.view(w * capacity, self.wire.row_bytes), send.row_of_slot,
                            local)
        recv = torch.empty_like(send.x)
        dist.all_to_all_single(recv, send.x, group=self.group)
        recv = recv.view(w * capacity, self.wire.row_bytes)
        experts, a, sa, recv_ids = self._by_expert(recv, expert_capacity)
        dropped = torch.stack([(routed & (send.row_of_slot < 0)).sum(),
                               ((recv_ids >= 0) & (experts.row_of_slot[:, 0] < 0)).sum()])
        if expected_m is None:
            expected_m = max(1, min(expert_capacity, t * topk // l))
        return EpStep("masked", send, recv, experts, a, sa, experts.masked_m, None, dropped,
                      topk_weights, out_dtype, expected_m)


def _check_count(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
