"""What the benchmark runs: the inputs of a case, and one callable per implementation.

Implementations (the `impl` names of the result files):

- fp8gemm-cuda, fp8gemm-triton, fp8gemm-reference: the public ops with `backend=` forced (for
  moe_layer: `fp8gemm.nn.Fp8MoE` with FP8GEMM_BACKEND set while it runs).
- cublas-block: cuBLAS through PyTorch with 1x128 A scales and 128x128 B scales, the same
  recipe as fp8gemm (`torch.nn.functional.scaled_mm` with B's scales padded to a multiple of 4
  along K/128; plain `torch._scaled_mm` only where the former is missing); for wgrad 1x128
  scales on both operands and fp32 out (skipped where K % 16 != 0, which cuBLAS refuses).
- cublas-block-loop: the wgrad cuBLAS call once per expert (k_grouped_wgrad; experts with no
  token are left at zero, as cuBLAS takes no K = 0).
- cublas-tensor: per-tensor `torch._scaled_mm`, the no-scaling ceiling (its inputs are quantised
  per tensor, so its diff includes that quantisation's error).
- cublas-rowwise-grouped: `torch._scaled_grouped_mm` with per-row scales (contiguous, offsets:
  2-D A of the data rows and offsets; masked: 3-D A and B).
- torch-bf16: `torch.mm`, `torch._grouped_mm` (contiguous, offsets, moe_layer) or `torch.bmm`
  (masked) on the dequantised inputs rounded to bf16.
- deepgemm: DeepGEMM's Python package, when `import deep_gemm` works (its directory on
  PYTHONPATH); its A-scale layout is made outside the timed call, and its JIT compiles on the
  warm-up call.

Every factory returns an `Impl` or raises `Skip` with the reason. Inputs cuBLAS cannot take
(M not a multiple of 4, N not a multiple of 16) are zero-padded and the output sliced back; the
padded rows and columns are counted in its time, never in its diff. Every `Impl.output()` holds
only the rows that carry data, in the order of `reference_output` (padding rows of the
contiguous layout and rows past masked_m are left out), so one diff compares them all.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..backends import get_backend, load_error
from ..backends.reference import dequantize
from ..layout import CONTIGUOUS_M_ALIGNMENT, get_col_major_tma_aligned_tensor
from ..problem import GemmKind, GemmProblem, Recipe
from .suites import DENSE_LIKE_OPS, MOE_LAYER, OPS, Case

__all__ = ["Skip", "Impl", "CaseData", "make_data", "make_impl", "reference_output",
           "FP8GEMM_IMPLS", "PEER_IMPLS", "ALL_IMPLS", "DEFAULT_IMPLS", "REFERENCE_MAX_FLOPS",
           "applies", "cublas_block_probe", "BLOCK_WAYS", "WGRAD_BLOCK_WAYS", "WRONG_DIFF",
           "DEEPGEMM_BUSY_US", "GRAPH_MAX_TOKENS", "case_problem", "k_grouped_operands"]

FP8GEMM_IMPLS = ("fp8gemm-cuda", "fp8gemm-triton", "fp8gemm-reference")
PEER_IMPLS = ("cublas-block", "cublas-tensor", "cublas-rowwise-grouped", "cublas-block-loop",
              "torch-bf16", "deepgemm")
ALL_IMPLS = FP8GEMM_IMPLS + PEER_IMPLS
DEFAULT_IMPLS = ("fp8gemm-cuda", "fp8gemm-triton") + PEER_IMPLS
# The reference backend is a float32 PyTorch loop: only for shapes where it finishes quickly.
REFERENCE_MAX_FLOPS = 2 * 1024 * 4096 * 7168
# DeepGEMM encodes its tensor maps in Python on every call (70-170 us of host time, more when
# the process is busy): the GPU is kept busy at least this long before its start event.
DEEPGEMM_BUSY_US = 500.0
# DeepGEMM's smallest tile height: its masked kernel stores whole tiles through one 2-D view of
# the [G, Mmax, N] output, so Mmax not a multiple of its BLOCK_M spills into the next group.
DEEPGEMM_MIN_BLOCK_M = 64
# moe_layer at up to this many tokens is decode: captured in a CUDA graph and replayed.
GRAPH_MAX_TOKENS = 128

_OPS_OF = {
    "fp8gemm-cuda": OPS,
    "fp8gemm-triton": OPS,
    "fp8gemm-reference": OPS,
    "cublas-block": ("dense", "dgrad", "wgrad"),
    "cublas-tensor": ("dense", "dgrad"),
    "cublas-rowwise-grouped": ("contiguous", "offsets", "masked"),
    "cublas-block-loop": ("k_grouped_wgrad",),
    "torch-bf16": ("dense", "dgrad", "contiguous", "offsets", "masked", "moe_layer"),
    "deepgemm": ("dense", "dgrad", "contiguous", "masked", "wgrad", "k_grouped_wgrad",
                 "moe_layer"),
}

_E4M3, _E4M3_MAX = torch.float8_e4m3fn, 448.0
_BLOCK = 128
_AMAX_FLOOR = 1e-4


class Skip(Exception):
    """This implementation cannot run this case here; the message says why."""


@dataclass
class Impl:
    name: str
    fn: Callable[[], object]  # runs the op into preallocated buffers
    output: Callable[[], torch.Tensor]  # the data rows of the last call, shaped like the reference
    note: str = ""  # how it was called, when that is worth saying
    busy_us: float = 0.0  # keep the GPU busy at least this long before the start event
    # Pieces of the call timed on their own (moe_layer: "GEMMs", "quantisation"), each
    # runnable after fn has run once.
    parts: dict[str, Callable[[], object]] = field(default_factory=dict)


def applies(impl: str, op: str) -> bool:
    return op in _OPS_OF[impl]


# ---------------------------------------------------------------------------------------------
# Inputs. Quantised here with plain PyTorch (the rule of fp8gemm.quant), so a broken kernel in a
# backend under development cannot spoil the inputs every implementation shares.


def _ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def _quant_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, K] -> fp8 [..., R, K] and 1x128 scales [..., R, ceil(K/128)] (row-major)."""
    k = x.shape[-1]
    kb = _ceil_div(k, _BLOCK)
    xg = F.pad(x.float(), (0, kb * _BLOCK - k)).unflatten(-1, (kb, _BLOCK))
    s = xg.abs().amax(-1).clamp_min(_AMAX_FLOOR) / _E4M3_MAX
    q = (xg / s.unsqueeze(-1)).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3).flatten(-2)[..., :k]
    return q.contiguous(), s.contiguous()


def _quant_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] -> fp8 [..., N, K] and 128x128 scales [..., ceil(N/128), ceil(K/128)]."""
    n, k = w.shape[-2:]
    nb, kb = _ceil_div(n, _BLOCK), _ceil_div(k, _BLOCK)
    wp = F.pad(w.float(), (0, kb * _BLOCK - k, 0, nb * _BLOCK - n))
    blocks = wp.unflatten(-1, (kb, _BLOCK)).unflatten(-3, (nb, _BLOCK))
    s = blocks.abs().amax(dim=(-3, -1)).clamp_min(_AMAX_FLOOR) / _E4M3_MAX
    q = (blocks / s[..., :, None, :, None]).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3)
    return q.flatten(-2).flatten(-3, -2)[..., :n, :k].contiguous(), s.contiguous()


def _quant_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., R, K] -> fp8 and one scale per row [..., R]."""
    s = x.float().abs().amax(-1).clamp_min(_AMAX_FLOOR) / _E4M3_MAX
    q = (x.float() / s.unsqueeze(-1)).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3)
    return q.contiguous(), s.contiguous()


def _quant_tensor(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (x.float().abs().amax().clamp_min(_AMAX_FLOOR) / _E4M3_MAX).reshape(())
    return (x.float() / s).clamp(-_E4M3_MAX, _E4M3_MAX).to(_E4M3), s.contiguous()


@dataclass
class MoeData:
    """One rank's expert layer: tokens, their routing over every rank's experts (ids of other
    ranks' experts are dropped, as expert parallelism does), the experts' weights quantised per
    128x128 block, the same weights dequantised in bf16, and an `Fp8MoE` holding them."""

    x: torch.Tensor  # [T, H] bf16
    topk_ids: torch.Tensor  # [T, topk] int64 over all experts; the local ones are 0 .. G-1
    topk_weights: torch.Tensor  # [T, topk] float32
    w13: torch.Tensor  # [G, 2I, H] fp8
    s13: torch.Tensor  # [G, ceil(2I/128), ceil(H/128)]
    w2: torch.Tensor  # [G, H, I] fp8
    s2: torch.Tensor
    w13_bf16: torch.Tensor  # the dequantised weights, as torch-bf16 multiplies them
    w2_bf16: torch.Tensor
    module: torch.nn.Module  # fp8gemm.nn.Fp8MoE with the same weights
    expected_m: int  # the mean local rows per expert, the masked kernels' hint

    @property
    def width(self) -> int:
        return self.w2.shape[2]


@dataclass
class CaseData:
    """Random normal bf16 sources and their quantisation: A per 1x128 group, B per 128x128
    block (per 1x128 group for wgrad and k_grouped_wgrad).

    a, sa, b, sb are what fp8gemm's op takes, sa column-major with M padded to 16 bytes:
    dense, wgrad, dgrad: a [M, K], b [N, K] (wgrad: sb [N, ceil(K/128)], column-major like sa;
    dgrad: x = dY [T, N_out], w = W^T [K_in, N_out], b its fp8 copy with 128x128 scales);
    contiguous: a [R, K], each group padded to 128 rows (padding rows zero, m_indices -1);
    offsets: a [T, K], the data rows alone, with offsets [G + 1]; masked: a [G, mmax, K] with
    masked_m [G]; k_grouped_wgrad: a and b flat, expert after expert (A_g [M, K_g] and
    B_g [N, K_g]), scales [sum ceil(K_g/128), M] and [.., N] (K blocks first), and `experts`
    the per-expert (a_g, sa_g, b_g, sb_g) views; moe_layer: `moe`.
    x_rows, a_rows, sa_rows: the data rows [T, K] of contiguous and offsets (what the peers
    take, with `offsets`); `rows`: where each sits in the padded contiguous `a`.
    """

    case: Case
    x: torch.Tensor | None = None
    w: torch.Tensor | None = None
    a: torch.Tensor | None = None
    sa: torch.Tensor | None = None
    b: torch.Tensor | None = None
    sb: torch.Tensor | None = None
    m_indices: torch.Tensor | None = None
    masked_m: torch.Tensor | None = None
    offsets: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    x_rows: torch.Tensor | None = None
    a_rows: torch.Tensor | None = None
    sa_rows: torch.Tensor | None = None
    experts: list = field(default_factory=list)
    moe: MoeData | None = None

    def data_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The rows of an output in the op's layout that carry data, as `reference_output`
        orders them (contiguous: padding rows dropped; masked: rows past masked_m dropped)."""
        op = self.case.op
        if op == "contiguous":
            return out.index_select(0, self.rows)
        if op == "masked":
            return torch.cat([out[g, :n] for g, n in enumerate(self.case.group_sizes)])
        return out

    def no_data_rows(self, out: torch.Tensor) -> torch.Tensor:
        """The rows of an output in the op's layout that carry no data (contiguous: padding
        rows; masked: rows at or past masked_m; none for the others), flattened to [rows, N]."""
        op = self.case.op
        if op == "contiguous":
            keep = torch.ones(out.shape[0], dtype=torch.bool, device=out.device)
            keep[self.rows] = False
            return out[keep]
        if op == "masked":
            return torch.cat([out[g, n:] for g, n in enumerate(self.case.group_sizes)])
        return out[:0].reshape(0, out.shape[-1])


def _u8_cat(ts: list[torch.Tensor]) -> torch.Tensor:
    """fp8 tensors flattened and concatenated (through uint8: cat of fp8 is not everywhere)."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in ts]).view(ts[0].dtype)


def make_data(case: Case, device: torch.device, seed: int = 0) -> CaseData:
    g = torch.Generator(device=device)
    g.manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, device=device, dtype=torch.bfloat16, generator=g)

    c = case
    if c.op == "moe_layer":
        return _moe_data(c, device, g)
    if c.op == "k_grouped_wgrad":
        return _k_grouped_data(c, rand)
    if c.op == "dgrad":
        return _dgrad_data(c, rand)
    if c.op in ("dense", "wgrad"):
        x, w = rand(c.m, c.k), rand(c.n, c.k)
        a, sa = _quant_groups(x)
        if c.op == "wgrad":
            b, sb = _quant_groups(w)
            sb = get_col_major_tma_aligned_tensor(sb)
        else:
            b, sb = _quant_blocks(w)
        return CaseData(c, x, w, a, get_col_major_tma_aligned_tensor(sa), b, sb)
    sizes = c.group_sizes
    x = rand(c.groups, c.mmax, c.k) if c.op == "masked" else rand(c.total_m, c.k)
    w = rand(c.groups, c.n, c.k)
    a, sa = _quant_groups(x)
    b, sb = _quant_blocks(w)
    data = CaseData(c, x, w, a, get_col_major_tma_aligned_tensor(sa), b, sb)
    if c.op == "masked":
        data.masked_m = torch.tensor(sizes, device=device, dtype=torch.int32)
        return data
    ends = torch.tensor(sizes, dtype=torch.int64).cumsum(0)
    data.offsets = torch.cat([torch.zeros(1, dtype=torch.int64), ends]).to(device, torch.int32)
    data.x_rows, data.a_rows, data.sa_rows = x, a, sa
    if c.op == "contiguous":
        align = CONTIGUOUS_M_ALIGNMENT
        padded = [_round_up(s, align) for s in sizes]
        starts = [sum(padded[:i]) for i in range(len(padded))]
        rows = torch.cat([torch.arange(p, p + s, dtype=torch.int64)
                          for p, s in zip(starts, sizes)]).to(device)
        total = sum(padded)
        ap = torch.zeros(total, c.k, device=device, dtype=torch.uint8)
        ap[rows] = a.view(torch.uint8)
        sap = torch.ones(total, sa.shape[1], device=device, dtype=torch.float32)
        sap[rows] = sa
        m_indices = torch.full((total,), -1, device=device, dtype=torch.int32)
        m_indices[rows] = torch.repeat_interleave(
            torch.arange(c.groups, dtype=torch.int32), torch.tensor(sizes)).to(device)
        data.a, data.sa = ap.view(a.dtype), get_col_major_tma_aligned_tensor(sap)
        data.m_indices, data.rows = m_indices, rows
    return data


def _dgrad_data(c: Case, rand) -> CaseData:
    """dX [T, K_in] = dY [T, N_out] . W [N_out, K_in]: A = dY in 1x128 groups along N_out, and
    B = W^T [K_in, N_out] K-major in 128x128 blocks. The 128x128 blocks of W^T are those of W
    transposed, with the same amax: quantising W^T gives exactly W's fp8 values and scales,
    transposed (and laid out K-major for the GEMM, as a quantise-and-transpose kernel would)."""
    dy, w = rand(c.m, c.k), rand(c.k, c.n)
    q, s = _quant_blocks(w)
    b = q.view(torch.uint8).t().contiguous().view(q.dtype)
    a, sa = _quant_groups(dy)
    return CaseData(c, dy, w.t().contiguous(), a, get_col_major_tma_aligned_tensor(sa), b,
                    s.t().contiguous())


def _k_grouped_data(c: Case, rand) -> CaseData:
    """Expert g: A_g [M, K_g] and B_g [N, K_g] with 1x128 scales along K (tokens)."""
    qa = [_quant_groups(rand(c.m, k)) for k in c.group_sizes]
    qb = [_quant_groups(rand(c.n, k)) for k in c.group_sizes]
    a, b = _u8_cat([q for q, _ in qa]), _u8_cat([q for q, _ in qb])
    sa = torch.cat([s.t() for _, s in qa]).contiguous()  # [sum kb, M]
    sb = torch.cat([s.t() for _, s in qb]).contiguous()
    data = CaseData(c, a=a, sa=sa, b=b, sb=sb)
    off = kb_off = 0
    for k in c.group_sizes:
        kb = _ceil_div(k, _BLOCK)
        # NOTE: the scale views [M, kb] have strides (1, M): column-major, TMA-aligned for
        # M % 4 == 0, as quantize_per_token returns them.
        data.experts.append((a[off * c.m:(off + k) * c.m].view(c.m, k),
                             sa[kb_off:kb_off + kb].t(),
                             b[off * c.n:(off + k) * c.n].view(c.n, k),
                             sb[kb_off:kb_off + kb].t()))
        off, kb_off = off + k, kb_off + kb
    return data


def _moe_data(c: Case, device: torch.device, g: torch.Generator) -> CaseData:
    """Tokens routed to top-k of groups * ranks experts by random router scores; weights
    scaled by 1/sqrt(fan-in) so activations stay near unit size."""
    from ..nn import Fp8MoE

    t, h, i, experts = c.m, c.n, c.k, c.groups
    topk, all_experts = MOE_LAYER.topk, c.groups * MOE_LAYER.ranks
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16, generator=g)
    scores = torch.randn(t, all_experts, device=device, generator=g).softmax(-1)
    weights, ids = scores.topk(topk, dim=-1)
    weights = weights / weights.sum(-1, keepdim=True)
    module = Fp8MoE(experts, h, i, device=device)
    q13, s13, q2, s2, d13, d2 = [], [], [], [], [], []
    for _ in range(experts):  # one expert at a time: the float32 temporaries stay small
        w13 = torch.randn(2 * i, h, device=device, dtype=torch.bfloat16, generator=g) * h ** -0.5
        w2 = torch.randn(h, i, device=device, dtype=torch.bfloat16, generator=g) * i ** -0.5
        for (q, s), qs, ss, ds in ((_quant_blocks(w13), q13, s13, d13),
                                   (_quant_blocks(w2), q2, s2, d2)):
            qs.append(q)
            ss.append(s)
            ds.append(dequantize(q, s, Recipe.BLOCK).to(torch.bfloat16))
    stack = torch.stack
    u8 = [stack([q.view(torch.uint8) for q in qs]).view(_E4M3) for qs in (q13, q2)]
    module.load_weights(stack(d13), stack(d2))
    moe = MoeData(x, ids, weights.float(), u8[0], stack(s13), u8[1], stack(s2), stack(d13),
                  stack(d2), module, max(1, t * topk // all_experts))
    return CaseData(c, moe=moe)


def _dequant(a, sa, b, sb, dtype, b_recipe=Recipe.BLOCK):
    """Dequantised 2-D A [rows, K] and B [N, K]."""
    return dequantize(a, sa, Recipe.GROUP, dtype), dequantize(b, sb, b_recipe, dtype)


def reference_output(data: CaseData, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The exact product of the dequantised inputs (float64 unless asked otherwise), holding
    the data rows only (see `CaseData.data_rows`); for moe_layer the layer on the dequantised
    weights with unquantised activations."""
    c = data.case
    if c.op == "moe_layer":
        return _moe_reference(data.moe, dtype)
    if c.op in ("dense", "dgrad", "wgrad"):
        rb = Recipe.GROUP if c.op == "wgrad" else Recipe.BLOCK
        da, db = _dequant(data.a, data.sa, data.b, data.sb, dtype, rb)
        return da @ db.T
    if c.op == "k_grouped_wgrad":
        outs = []
        for a_g, sa_g, b_g, sb_g in data.experts:
            da, db = _dequant(a_g, sa_g, b_g, sb_g, dtype, Recipe.GROUP)
            outs.append(da @ db.T)
        return torch.stack(outs)
    outs = []
    o = data.offsets.tolist() if data.offsets is not None else None
    for g, n in enumerate(c.group_sizes):
        if c.op == "masked":
            a_g, sa_g = data.a[g, :n], data.sa[g, :n]
        else:
            a_g, sa_g = data.a_rows[o[g]:o[g + 1]], data.sa_rows[o[g]:o[g + 1]]
        da, db = _dequant(a_g, sa_g, data.b[g], data.sb[g], dtype)
        outs.append(da @ db.T)
    return torch.cat(outs)


def _moe_reference(md: MoeData, dtype: torch.dtype) -> torch.Tensor:
    t, h = md.x.shape
    out = torch.zeros(t, h, device=md.x.device, dtype=dtype)
    x = md.x.to(dtype)
    i = md.width
    for e in range(md.w13.shape[0]):
        tok, slot = (md.topk_ids == e).nonzero(as_tuple=True)
        if tok.numel() == 0:
            continue
        w13 = dequantize(md.w13[e], md.s13[e], Recipe.BLOCK, dtype)
        w2 = dequantize(md.w2[e], md.s2[e], Recipe.BLOCK, dtype)
        hid = x[tok] @ w13.T
        y = (F.silu(hid[:, :i]) * hid[:, i:]) @ w2.T
        out.index_add_(0, tok, y * md.topk_weights[tok, slot].to(dtype).unsqueeze(-1))
    return out


def _bf16_operands(data: CaseData) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantised inputs in bf16: A's data rows ([M, K]; [T, K] for contiguous and
    offsets; [G, mmax, K] for masked) and B ([N, K] or [G, N, K])."""
    c = data.case
    a, sa = (data.a_rows, data.sa_rows) if data.a_rows is not None else (data.a, data.sa)
    da = dequantize(a.reshape(-1, c.k), sa.reshape(-1, sa.shape[-1]),
                    Recipe.GROUP).to(torch.bfloat16).reshape(a.shape)
    if c.op in DENSE_LIKE_OPS:
        db = dequantize(data.b, data.sb, Recipe.BLOCK).to(torch.bfloat16)
    else:
        db = torch.stack([dequantize(data.b[g], data.sb[g], Recipe.BLOCK)
                          for g in range(c.groups)]).to(torch.bfloat16)
    return da, db


# ---------------------------------------------------------------------------------------------
# fp8gemm's own backends.


def case_problem(c: Case) -> GemmProblem:
    """The GemmProblem fp8gemm's backends get for a case as make_data lays it out (a contiguous
    case's rows padded per group to CONTIGUOUS_M_ALIGNMENT; masked: [G, mmax, K])."""
    if c.op == "moe_layer":
        raise ValueError("a moe_layer case runs a pipeline of GEMMs, not one problem")
    if c.op in ("wgrad", "k_grouped_wgrad"):
        kind, k, groups = ((GemmKind.K_GROUPED, sum(c.group_sizes), c.groups)
                           if c.op == "k_grouped_wgrad" else (GemmKind.DENSE, c.k, 1))
        return GemmProblem(kind, c.m, c.n, k, groups, _E4M3, _E4M3, Recipe.GROUP, Recipe.GROUP,
                           torch.float32, has_c=True)
    kind = {"dense": GemmKind.DENSE, "dgrad": GemmKind.DENSE, "contiguous": GemmKind.CONTIGUOUS,
            "offsets": GemmKind.OFFSETS, "masked": GemmKind.MASKED}[c.op]
    if c.op == "contiguous":
        rows = sum(_round_up(size, CONTIGUOUS_M_ALIGNMENT) for size in c.group_sizes)
    else:
        rows = c.mmax if c.op == "masked" else c.total_m
    return GemmProblem(kind, rows, c.n, c.k, c.groups, _E4M3, _E4M3, Recipe.GROUP, Recipe.BLOCK,
                       torch.bfloat16, expected_m=c.m if c.op == "masked" else 0)


def _fp8gemm(impl: str, data: CaseData) -> Impl:
    import fp8gemm

    name = impl.removeprefix("fp8gemm-")
    c = data.case
    if name == "reference" and c.flops > REFERENCE_MAX_FLOPS:
        raise Skip(f"reference backend only up to {REFERENCE_MAX_FLOPS:.2g} flops")
    mod = get_backend(name)
    if mod is None:
        raise Skip(f"cannot import: {load_error(name)}")
    device = _device(data)
    if not mod.is_available(device):
        raise Skip(f"not available on {_device_name(device)}")
    if c.op == "moe_layer":
        return _fp8gemm_moe_layer(impl, name, data)
    why = mod.supports(case_problem(data.case))
    if why is not None:
        raise Skip(f"does not support the problem: {why}")
    if c.op == "k_grouped_wgrad":
        return _fp8gemm_k_grouped(impl, name, data)
    a, b = (data.a, data.sa), (data.b, data.sb)
    dev, bf16 = data.a.device, torch.bfloat16
    note = ""
    if c.op in DENSE_LIKE_OPS:
        out = torch.empty(c.m, c.n, device=dev, dtype=bf16)
        fn = lambda: fp8gemm.fp8_gemm_nt(a, b, out, backend=name)  # noqa: E731
        if c.op == "dgrad":
            note = "fp8_gemm_nt(dY, W^T): the forward GEMM on the transposed weight"
    elif c.op == "wgrad":
        out = torch.zeros(c.m, c.n, device=dev, dtype=torch.float32)
        fn = lambda: fp8gemm.fp8_gemm_nt(a, b, out, c=out, backend=name)  # noqa: E731
        note = "out += A . B^T (c = out), as DeepGEMM's wgrad; cuBLAS writes out without reading it"
    elif c.op == "contiguous":
        out = torch.empty(data.a.shape[0], c.n, device=dev, dtype=bf16)
        fn = lambda: fp8gemm.m_grouped_fp8_gemm_nt_contiguous(  # noqa: E731
            a, b, out, data.m_indices, backend=name)
    elif c.op == "offsets":
        out = torch.empty(c.total_m, c.n, device=dev, dtype=bf16)
        fn = lambda: fp8gemm.m_grouped_fp8_gemm_nt_offsets(  # noqa: E731
            a, b, out, data.offsets, backend=name)
    else:
        out = torch.empty(c.groups, c.mmax, c.n, device=dev, dtype=bf16)
        fn = lambda: fp8gemm.m_grouped_fp8_gemm_nt_masked(  # noqa: E731
            a, b, out, data.masked_m, c.m, backend=name)
    return Impl(impl, fn, lambda: data.data_rows(out), note=note)


def k_grouped_operands(data: CaseData) -> tuple[torch.Tensor, ...]:
    """(a, sa, b, sb, ks) of a k_grouped_wgrad case as the op takes them: the experts side by
    side along K, A [M, sum K_g] (what transposing the token-major activations gives) and
    B [N, sum K_g], their scales [rows, sum ceil(K_g/128)] the transposed [sum kb, rows] ones
    (column-major views), ks [G] int32 on the device."""
    c = data.case
    ks = torch.tensor(c.group_sizes, device=data.a.device, dtype=torch.int32)
    return (_k_cat([e[0] for e in data.experts]), data.sa.t(),
            _k_cat([e[2] for e in data.experts]), data.sb.t(), ks)


def _fp8gemm_k_grouped(impl: str, name: str, data: CaseData) -> Impl:
    """The public k-grouped op: every expert's weight gradient in one call."""
    import fp8gemm

    c = data.case
    out = torch.zeros(c.groups, c.m, c.n, device=data.a.device, dtype=torch.float32)
    # NOTE: the operands are made here, outside the timed call.
    a, sa, b, sb, ks = k_grouped_operands(data)
    fn = lambda: fp8gemm.k_grouped_fp8_gemm_nt_contiguous(  # noqa: E731
        (a, sa), (b, sb), out, ks, c=out, backend=name)
    return Impl(impl, fn, lambda: out,
                note="k_grouped_fp8_gemm_nt_contiguous, out += A_g . B_g^T, A [M, sum K_g]")


def _k_cat(ts: list[torch.Tensor]) -> torch.Tensor:
    """fp8 [rows, K_g] tensors side by side, [rows, sum K_g] (through uint8, as `_u8_cat`)."""
    return torch.cat([t.view(torch.uint8) for t in ts], dim=1).view(ts[0].dtype)


def _device(data: CaseData) -> torch.device:
    return data.moe.x.device if data.moe is not None else data.a.device


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def _is_sm90(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) == (9, 0))


# ---------------------------------------------------------------------------------------------
# cuBLAS through PyTorch.


def _round_up(x: int, y: int) -> int:
    return _ceil_div(x, y) * y


def _pad_rows(t: torch.Tensor, rows: int, value: float = 0.0) -> torch.Tensor:
    """t with rows appended up to `rows` (fp8 rows are zero, float rows hold `value`)."""
    if t.shape[0] == rows:
        return t
    if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        out = torch.zeros((rows,) + tuple(t.shape[1:]), device=t.device, dtype=torch.uint8)
        out[: t.shape[0]] = t.view(torch.uint8)
        return out.view(t.dtype)
    out = torch.full((rows,) + tuple(t.shape[1:]), value, device=t.device, dtype=t.dtype)
    out[: t.shape[0]] = t
    return out


def _check_k(c: Case) -> None:
    if c.k % 16:
        raise Skip(f"cuBLAS FP8 needs K % 16 == 0, K = {c.k}")


def _block_scale_a(sa: torch.Tensor) -> torch.Tensor:
    """[M, kb] A scales with strides (1, M): column-major and unpadded, as cuBLAS reads them."""
    return sa.t().contiguous().t() if sa.shape[1] > 1 else sa.contiguous()


def _block_scale_b(sb: torch.Tensor, layout: str) -> torch.Tensor:
    """B's [nb, kb] scales as the scale of mat_b = B.T ([K, N], column-major), K/128 first:
    "plain": [kb, nb], strides (1, kb); "padded": [kb4, nb], strides (1, kb4), kb4 = kb rounded
    up to 4, the extra rows zero (what torch's scaled_mm checks); "padded-view": [kb, nb],
    strides (1, kb4)."""
    nb, kb = sb.shape
    if layout == "plain":
        return sb.contiguous().t()
    buf = torch.zeros(nb, _round_up(kb, 4), device=sb.device, dtype=torch.float32)
    buf[:, :kb] = sb
    return buf.t() if layout == "padded" else buf.t()[:kb]


# How cublas-block is called, tried in this order (the first that runs is used).
BLOCK_WAYS = ("F.scaled_mm, B scales padded to K/128 % 4", "F.scaled_mm, B scales padded view",
               "F.scaled_mm, B scales plain", "torch._scaled_mm (v1), B scales plain")


def _block_call(way: str, a, sa, bt, sb, out_holder: list) -> Callable[[], None]:
    layout = "padded" if "padded to" in way else "padded-view" if "view" in way else "plain"
    sb_ = _block_scale_b(sb, layout)
    if way.startswith("F.scaled_mm"):
        if not hasattr(F, "scaled_mm"):
            raise Skip("torch.nn.functional.scaled_mm is missing")
        st = F.ScalingType

        def fn():
            out_holder[0] = F.scaled_mm(a, bt, sa, st.BlockWise1x128, sb_, st.BlockWise128x128,
                                        output_dtype=torch.bfloat16)
    else:
        def fn():
            out_holder[0] = torch._scaled_mm(a, bt, sa, sb_, out_dtype=torch.bfloat16)
    return fn


def _cublas_block(data: CaseData, way: str | None = None) -> Impl:
    c = data.case
    _check_k(c)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability(data.a.device) != (9, 0):
        raise Skip("cuBLAS 1x128/128x128 scaling runs on sm_90 only")
    mp, np_ = _round_up(c.m, 4), _round_up(c.n, 16)
    a = _pad_rows(data.a, mp)
    sa = _block_scale_a(_pad_rows(data.sa.contiguous(), mp, 1.0))
    bt = _pad_rows(data.b, np_).t()  # [K, N'] column-major; N' has the same ceil(N/128)
    holder: list = [None]
    errors = []
    for w in (BLOCK_WAYS if way is None else (way,)):
        try:
            fn = _block_call(w, a, sa, bt, data.sb, holder)
            fn()
        except Exception as e:  # noqa: BLE001 - any failure means: try the next way
            errors.append(f"{w}: {_first_line(e)}")
            continue
        pads = [f"M={mp}"] * (mp != c.m) + [f"N={np_}"] * (np_ != c.n)
        note = w + (f"; inputs padded to {', '.join(pads)}" if pads else "")
        return Impl("cublas-block", fn, lambda: holder[0][: c.m, : c.n], note=note)
    raise Skip("; ".join(errors))


# How cuBLAS is called with 1x128 scales on both operands (wgrad), tried on a small problem in
# this order (the first right one is used; bf16 out only where no fp32 way runs, and then the
# note says so). mat_b = B^T [K, N]: its scales are [K/128, N] row-major, i.e. B's [N, K/128]
# column-major.
WGRAD_BLOCK_WAYS = ("F.scaled_mm, 1x128 x 1x128, fp32 out",
                    "torch._scaled_mm (v1), 1x128 x 1x128, fp32 out",
                    "F.scaled_mm, 1x128 x 1x128, bf16 out")
_WGRAD_PROBE = (256, 384, 640)  # M, N, K: K/128 = 5, not a multiple of 4


def _wgrad_mm(way: str) -> tuple[Callable, Callable]:
    """(prepare, mm): prepare(a [M, K], sa [M, K/128], b [N, K], sb [N, K/128]) gives the
    operands as cuBLAS takes them (scales in any layout; run it outside the timing), and
    mm(*prepared) is a . b^T."""
    if way.startswith("F.scaled_mm") and not hasattr(F, "scaled_mm"):
        raise Skip("torch.nn.functional.scaled_mm is missing")
    dtype = torch.float32 if way.endswith("fp32 out") else torch.bfloat16

    def prepare(a, sa, b, sb):
        return a, b.t(), _block_scale_a(sa), _block_scale_a(sb).t()

    if way.startswith("F.scaled_mm"):
        st = F.ScalingType

        def mm(a, bt, sa, sbt):
            return F.scaled_mm(a, bt, sa, st.BlockWise1x128, sbt, st.BlockWise1x128,
                               output_dtype=dtype)
    else:
        def mm(a, bt, sa, sbt):
            return torch._scaled_mm(a, bt, sa, sbt, out_dtype=dtype)
    return prepare, mm


_wgrad_choice: dict = {}


def _wgrad_way(device: torch.device) -> str:
    """The first of WGRAD_BLOCK_WAYS that runs and is right on a small problem, once per
    device; Skip with every way's outcome when none is."""
    if device not in _wgrad_choice:
        from ..quant import calc_diff

        m, n, k = _WGRAD_PROBE
        gen = torch.Generator(device=device)
        gen.manual_seed(3)
        (a, sa), (b, sb) = (_quant_groups(torch.randn(r, k, device=device, generator=gen))
                            for r in (m, n))
        ref = _dequant(a, sa, b, sb, torch.float64, Recipe.GROUP)
        ref = ref[0] @ ref[1].T
        tried = []
        for way in WGRAD_BLOCK_WAYS:
            try:
                prepare, mm = _wgrad_mm(way)
                diff = calc_diff(mm(*prepare(a, sa, b, sb)), ref)
            except Exception as e:  # noqa: BLE001 - any failure means: try the next way
                tried.append(f"{way}: {_first_line(e)}")
                continue
            if diff < WRONG_DIFF:
                _wgrad_choice[device] = (way, "")
                break
            tried.append(f"{way}: wrong (diff {diff:.1e})")
        else:
            _wgrad_choice[device] = (None, "; ".join(tried))
    way, why = _wgrad_choice[device]
    if way is None:
        raise Skip(f"no way of calling cuBLAS 1x128 x 1x128 is right here: {why}")
    return way


def _cublas_sm90(data: CaseData, what: str) -> None:
    if not _is_sm90(_device(data)):
        raise Skip(f"cuBLAS {what} scaling runs on sm_90 only")


def _cublas_wgrad(data: CaseData) -> Impl:
    c = data.case
    _check_k(c)
    _cublas_sm90(data, "1x128 x 1x128")
    way = _wgrad_way(data.a.device)
    prepare, mm = _wgrad_mm(way)
    args = prepare(data.a, data.sa, data.b, data.sb)
    holder: list = [None]

    def fn():
        holder[0] = mm(*args)

    return Impl("cublas-block", fn, lambda: holder[0], note=way)


def _cublas_block_loop(data: CaseData) -> Impl:
    c = data.case
    bad = [k for k in c.group_sizes if k % 16]
    if bad:
        raise Skip(f"cuBLAS FP8 needs K % 16 == 0, expert token counts {bad}")
    _cublas_sm90(data, "1x128 x 1x128")
    way = _wgrad_way(data.a.device)
    prepare, mm = _wgrad_mm(way)
    holder = [torch.zeros(c.m, c.n, device=data.a.device, dtype=torch.float32)
              for _ in data.experts]
    calls = [(g, prepare(*e)) for g, e in enumerate(data.experts) if e[0].shape[1]]

    def fn():
        for g, args in calls:
            holder[g] = mm(*args)

    empty = c.groups - len(calls)
    return Impl("cublas-block-loop", fn, lambda: torch.stack(holder),
                note=f"{way}, one call per expert"
                + (f" with tokens (the {empty} without are zeros)" if empty else ""))


def _cublas_tensor(data: CaseData) -> Impl:
    c = data.case
    _check_k(c)
    np_ = _round_up(c.n, 16)
    a, sa = _quant_tensor(data.x)
    b, sb = _quant_tensor(_pad_rows(data.w, np_))
    bt = b.t()
    holder: list = [None]

    def fn():
        holder[0] = torch._scaled_mm(a, bt, sa, sb, out_dtype=torch.bfloat16)

    return Impl("cublas-tensor", fn, lambda: holder[0][:, : c.n],
                note=f"padded to N={np_}" if np_ != c.n else "")


def _cublas_rowwise_grouped(data: CaseData) -> Impl:
    c = data.case
    _check_k(c)
    if c.n % 16:
        raise Skip(f"torch._scaled_grouped_mm needs N % 16 == 0, N = {c.n}")
    if not hasattr(torch, "_scaled_grouped_mm"):
        raise Skip("torch._scaled_grouped_mm is missing")
    b, sb = _quant_rows(data.w)  # [G, N, K], [G, N]
    bt = b.transpose(-2, -1)  # [G, K, N], column-major per group
    holder: list = [None]
    if c.op == "masked":
        a, sa = _quant_rows(data.x)

        def fn():
            holder[0] = torch._scaled_grouped_mm(a, bt, sa, sb, out_dtype=torch.bfloat16)
    else:
        # NOTE: the data rows with their group ends: cuBLAS needs no padding rows.
        a, sa = _quant_rows(data.x_rows)
        ends = data.offsets[1:]

        def fn():
            holder[0] = torch._scaled_grouped_mm(a, bt, sa, sb, offs=ends,
                                                 out_dtype=torch.bfloat16)
    return Impl("cublas-rowwise-grouped", fn,
                lambda: data.data_rows(holder[0]) if c.op == "masked" else holder[0])


def _torch_bf16(data: CaseData) -> Impl:
    c = data.case
    if c.op == "moe_layer":
        return _bf16_moe_layer(data)
    da, db = _bf16_operands(data)
    if c.op in DENSE_LIKE_OPS:
        out = torch.empty(c.m, c.n, device=da.device, dtype=torch.bfloat16)
        fn = lambda: torch.mm(da, db.t(), out=out)  # noqa: E731
        return Impl("torch-bf16", fn, lambda: out, note="torch.mm")
    if c.op == "masked":
        out = torch.empty(c.groups, c.mmax, c.n, device=da.device, dtype=torch.bfloat16)
        fn = lambda: torch.bmm(da, db.transpose(1, 2), out=out)  # noqa: E731
        return Impl("torch-bf16", fn, lambda: data.data_rows(out),
                    note="torch.bmm (every row up to Mmax)")
    if not hasattr(torch, "_grouped_mm"):
        raise Skip("torch._grouped_mm is missing")
    ends = data.offsets[1:]
    dbt = db.transpose(-2, -1)
    holder: list = [None]

    def fn():
        holder[0] = torch._grouped_mm(da, dbt, offs=ends)

    return Impl("torch-bf16", fn, lambda: holder[0], note="torch._grouped_mm on the data rows")


# ---------------------------------------------------------------------------------------------
# DeepGEMM.


def _import_deep_gemm():
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001 - a broken install fails in many ways
        raise Skip(f"cannot import deep_gemm ({_first_line(e)}): put DeepGEMM's package "
                   "directory on PYTHONPATH") from e
    return deep_gemm


def _deepgemm(data: CaseData) -> Impl:
    dg = _import_deep_gemm()
    device = _device(data)
    if not _is_sm90(device):
        raise Skip(f"DeepGEMM runs on sm_90 only, not on {_device_name(device)}")
    c = data.case
    if c.op == "moe_layer":
        return _deepgemm_moe_layer(dg, data)
    # NOTE: its A-scale layout, made here (a no-op for these inputs), outside the timed call.
    sa = dg.get_col_major_tma_aligned_tensor(data.sa) if c.op != "k_grouped_wgrad" else data.sa
    a, b = (data.a, sa), (data.b, data.sb)
    dev, bf16 = data.a.device, torch.bfloat16
    note = ""
    if c.op in DENSE_LIKE_OPS:
        out = torch.empty(c.m, c.n, device=dev, dtype=bf16)
        fn = lambda: dg.gemm_fp8_fp8_bf16_nt(a, b, out)  # noqa: E731
    elif c.op == "contiguous":
        out = torch.empty(data.a.shape[0], c.n, device=dev, dtype=bf16)
        fn = lambda: dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(  # noqa: E731
            a, b, out, data.m_indices)
    elif c.op == "masked":
        out = torch.empty(c.groups, c.mmax, c.n, device=dev, dtype=bf16)
        fn = lambda: dg.m_grouped_gemm_fp8_fp8_bf16_nt_masked(  # noqa: E731
            a, b, out, data.masked_m, c.m)
        if c.groups > 1 and c.mmax % DEEPGEMM_MIN_BLOCK_M:
            note = (f"Mmax = {c.mmax} is not a multiple of its BLOCK_M (64 or more): its TMA store "
                    "writes whole blocks, so a group's tile also writes the next group's first "
                    "rows (it checks Mmax % BLOCK_M only when Mmax > BLOCK_M)")
    elif c.op == "wgrad":
        b = (data.b, dg.get_col_major_tma_aligned_tensor(data.sb))
        out = torch.zeros(c.m, c.n, device=dev, dtype=torch.float32)
        fn = lambda: dg.wgrad_gemm_fp8_fp8_fp32_nt(a, b, out)  # noqa: E731
        note = "out += A . B^T"
    else:
        out = torch.zeros(c.groups, c.m, c.n, device=dev, dtype=torch.float32)
        ks = list(c.group_sizes)
        fn = lambda: dg.k_grouped_wgrad_gemm_fp8_fp8_fp32_nt(a, b, out, ks)  # noqa: E731
        note = "out[g] += A_g . B_g^T, one launch per expert (its Python loop)"
    return Impl("deepgemm", fn, lambda: data.data_rows(out), note=note, busy_us=DEEPGEMM_BUSY_US)


# ---------------------------------------------------------------------------------------------
# moe_layer: one rank's DeepSeek-V3 expert layer, end to end. Prefill runs eagerly on the
# contiguous layout (its dispatch reads the expert counts on the host, one synchronisation);
# decode (<= GRAPH_MAX_TOKENS tokens) on the masked layout, captured in a CUDA graph and
# replayed. Every implementation computes the same layer: route, [quantise,] w13 GEMM, SwiGLU,
# [quantise,] w2 GEMM, weighted combine.


def _decode(data: CaseData) -> bool:
    return data.case.m <= GRAPH_MAX_TOKENS


def _layer_how(data: CaseData) -> str:
    if not _decode(data):
        return "prefill: contiguous layout, eager"
    return "decode: masked layout" + (", in a CUDA graph" if data.moe.x.is_cuda else "")


@contextlib.contextmanager
def _backend_env(name: str):
    """FP8GEMM_BACKEND=name while the block runs (Fp8MoE has no backend argument)."""
    old = os.environ.get("FP8GEMM_BACKEND")
    os.environ["FP8GEMM_BACKEND"] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ["FP8GEMM_BACKEND"]
        else:
            os.environ["FP8GEMM_BACKEND"] = old


def _layer_call(run: Callable[[], torch.Tensor], graph: bool):
    """(fn, output) for a layer: eager, or captured once in a CUDA graph (after warm-up calls
    on a side stream, which compile every kernel) and replayed."""
    if not graph:
        holder: list = [None]

        def fn():
            holder[0] = run()
        return fn, lambda: holder[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            run()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        static = run()
    return g.replay, lambda: static


def _fp8_pipeline(md: MoeData, gemm: Callable, masked: bool):
    """(run, parts) of the fp8 layer with `gemm(a, sa, w, sw, out, layout)` as the grouped
    GEMM: run() -> [T, H]; parts "GEMMs" and "quantisation" on buffers made by one pass."""
    import fp8gemm

    g, i, h = md.w13.shape[0], md.width, md.x.shape[1]

    def dispatch():
        """Fp8MoE's order: the tokens quantised, then their fp8 rows and scales laid out."""
        a, sa = fp8gemm.quantize_per_token(md.x)
        if masked:
            lay = fp8gemm.moe_dispatch_masked(a, md.topk_ids, g, zero_rest=False)
            rows = lay.token_of_row.flatten()
        else:
            lay = fp8gemm.moe_dispatch_contiguous(a, md.topk_ids, g)
            rows = lay.token_of_row
        sa = get_col_major_tma_aligned_tensor(
            sa.index_select(0, rows).view(*lay.x.shape[:-1], -1))
        return lay, sa

    def middle(lay):
        """The first GEMM's output buffer, and its SiLU·mul quantisation. Contiguous: zeros, as
        the fp8gemm ops allocate (the quantiser reads the padding rows, which no GEMM writes);
        masked: unzeroed, its rows past masked_m unread (as Fp8MoE does)."""
        shape, kw = (*lay.x.shape[:-1], 2 * i), dict(dtype=md.x.dtype, device=md.x.device)
        mid = torch.empty(shape, **kw) if masked else torch.zeros(shape, **kw)
        return mid, lambda: fp8gemm.silu_mul_quantize_per_token(
            mid, masked_m=lay.masked_m if masked else None)

    def run():
        lay, sa = dispatch()
        mid, quantise = middle(lay)
        gemm(lay.x, sa, md.w13, md.s13, mid, lay)
        a2, sa2 = quantise()
        y = torch.empty(*lay.x.shape[:-1], h, dtype=md.x.dtype, device=md.x.device)
        gemm(a2, sa2, md.w2, md.s2, y, lay)
        combine = fp8gemm.moe_combine_masked if masked else fp8gemm.moe_combine_contiguous
        return combine(y, lay, md.topk_weights).to(md.x.dtype)

    lay, sa = dispatch()
    mid, quantise = middle(lay)
    gemm(lay.x, sa, md.w13, md.s13, mid, lay)
    a2, sa2 = quantise()
    y = torch.empty(*lay.x.shape[:-1], h, dtype=md.x.dtype, device=md.x.device)

    def gemms():
        gemm(lay.x, sa, md.w13, md.s13, mid, lay)
        gemm(a2, sa2, md.w2, md.s2, y, lay)

    def quantisation():
        fp8gemm.quantize_per_token(md.x)
        quantise()

    return run, {"GEMMs": gemms, "quantisation": quantisation}


def _fp8gemm_moe_layer(impl: str, name: str, data: CaseData) -> Impl:
    import fp8gemm

    md, masked = data.moe, _decode(data)

    def run():
        with _backend_env(name):
            return md.module(md.x, md.topk_ids, md.topk_weights,
                             layout="masked" if masked else "contiguous",
                             expected_m=md.expected_m)

    def gemm(a, sa, w, sw, out, lay):
        if masked:
            fp8gemm.m_grouped_fp8_gemm_nt_masked((a, sa), (w, sw), out, lay.masked_m,
                                                 md.expected_m, backend=name)
        else:
            fp8gemm.m_grouped_fp8_gemm_nt_contiguous((a, sa), (w, sw), out, lay.m_indices,
                                                     backend=name)

    graph = masked and md.x.is_cuda
    fn, output = _layer_call(run, graph)
    _, parts = _fp8_pipeline(md, gemm, masked)
    return Impl(impl, fn, output, parts=parts, note="fp8gemm.nn.Fp8MoE, " + _layer_how(data))


def _deepgemm_moe_layer(dg, data: CaseData) -> Impl:
    md, masked = data.moe, _decode(data)

    def gemm(a, sa, w, sw, out, lay):
        if masked:
            dg.m_grouped_gemm_fp8_fp8_bf16_nt_masked((a, sa), (w, sw), out, lay.masked_m,
                                                     md.expected_m)
        else:
            dg.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous((a, sa), (w, sw), out, lay.m_indices)

    run, parts = _fp8_pipeline(md, gemm, masked)
    fn, output = _layer_call(run, masked)
    return Impl("deepgemm", fn, output, parts=parts, busy_us=DEEPGEMM_BUSY_US,
                note="fp8gemm's routing and quantisers around DeepGEMM's grouped GEMMs, "
                + _layer_how(data))


def _bf16_moe(md: MoeData, static: bool):
    """(run, gemms) of the bf16 layer on torch._grouped_mm over the routed rows sorted by
    expert. static: every slot keeps a row (shapes fixed, no host synchronisation: CUDA-graph
    safe; rows past the local ones are not computed and are masked out of the combine); else
    the local rows alone, counted on the host."""
    t, h = md.x.shape
    g, i = md.w13_bf16.shape[0], md.width
    topk = md.topk_ids.shape[1]
    w13t, w2t = md.w13_bf16.transpose(-2, -1), md.w2_bf16.transpose(-2, -1)

    def route():
        flat = md.topk_ids.flatten()
        local = (flat >= 0) & (flat < g)
        key = torch.where(local, flat, g)
        order = torch.sort(key, stable=True).indices
        counts = torch.zeros(g + 1, dtype=torch.int64, device=flat.device)
        counts.scatter_add_(0, key, torch.ones_like(key))
        ends = torch.cumsum(counts[:g], 0).to(torch.int32)
        if not static:
            order = order[: int(ends[-1])]
        return order, ends, local[order]

    def experts(xs, ends):
        mid = torch._grouped_mm(xs, w13t, offs=ends)
        return torch._grouped_mm(F.silu(mid[:, :i]) * mid[:, i:], w2t, offs=ends)

    def run():
        order, ends, local = route()
        tok = order // topk
        y = experts(md.x[tok], ends).float() * md.topk_weights.flatten()[order].unsqueeze(-1)
        if static:
            y = torch.where(local.unsqueeze(-1), y, 0.0)
        out = torch.zeros(t, h, device=md.x.device, dtype=torch.float32)
        return out.index_add_(0, tok, y).to(md.x.dtype)

    order, ends, _ = route()
    xs = md.x[order // topk]
    return run, lambda: experts(xs, ends)


def _bf16_moe_layer(data: CaseData) -> Impl:
    if not hasattr(torch, "_grouped_mm"):
        raise Skip("torch._grouped_mm is missing")
    md, masked = data.moe, _decode(data)
    graph = masked and md.x.is_cuda
    run, gemms = _bf16_moe(md, static=graph)
    fn, output = _layer_call(run, graph)
    return Impl("torch-bf16", fn, output, parts={"GEMMs": gemms},
                note="torch._grouped_mm on the routed rows sorted by expert, " + _layer_how(data))


_FACTORIES = {
    "cublas-tensor": _cublas_tensor,
    "cublas-rowwise-grouped": _cublas_rowwise_grouped,
    "cublas-block-loop": _cublas_block_loop,
    "torch-bf16": _torch_bf16,
    "deepgemm": _deepgemm,
}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    what = text[0] if text else ""
    if not what and e.__traceback__ is not None:  # a bare `assert`: show its source line
        line = traceback.extract_tb(e.__traceback__)[-1].line
        what = f"{line}" if line else ""
    return f"{type(e).__name__}: {what}"[:300]


def make_impl(impl: str, data: CaseData, block_way: str | None = None) -> Impl:
    """The implementation ready to call (already called once: that call compiles what it
    JIT-compiles, outside any timing), or Skip with the reason. `block_way` fixes how
    cublas-block is called on dense (one of `BLOCK_WAYS`; default: the first of them that
    runs)."""
    if impl not in ALL_IMPLS:
        raise ValueError(f"impl must be one of {ALL_IMPLS}, got {impl!r}")
    if not applies(impl, data.case.op):
        raise Skip(f"not a {data.case.op} implementation")
    try:
        if impl in FP8GEMM_IMPLS:
            made = _fp8gemm(impl, data)
        elif impl == "cublas-block":
            made = _cublas_wgrad(data) if data.case.op == "wgrad" else _cublas_block(data,
                                                                                    block_way)
        else:
            made = _FACTORIES[impl](data)
        made.fn()  # compiles, loads, and fails here rather than while timed
    except Skip:
        raise
    except Exception as e:  # noqa: BLE001 - a backend under development may fail in any way
        raise Skip(f"failed: {_first_line(e)}") from e
    return made


# A diff above this marks a wrong result (a correct FP8 GEMM with FP32 promotion lands near 1e-6).
WRONG_DIFF = 1e-3
_PROBE_SHAPES = ((128, 256, 512), (128, 256, 384), (64, 2112, 7168))


def cublas_block_probe(device: torch.device) -> tuple[str | None, list[tuple[str, str, str]]]:
    """How each way of calling cuBLAS block-wise fares at small shapes, one of them with K/128
    not a multiple of 4 (where the old `_scaled_mm` is known to go wrong).

    Returns (the first way right at every probe shape or None, [(shape, way, "diff 1.2e-06" or
    the error)])."""
    from ..quant import calc_diff

    rows, good = [], {w: True for w in BLOCK_WAYS}
    for m, n, k in _PROBE_SHAPES:
        data = make_data(Case("probe", "dense", m, n, k), device, seed=1)
        ref = reference_output(data)
        for way in BLOCK_WAYS:
            try:
                impl = _cublas_block(data, way)
                impl.fn()
                diff = calc_diff(impl.output(), ref)
                good[way] &= diff < WRONG_DIFF
                rows.append((f"{m}x{n}x{k}", way, f"diff {diff:.1e}"))
            except Skip as e:
                good[way] = False
                rows.append((f"{m}x{n}x{k}", way, str(e)))
    return next((w for w in BLOCK_WAYS if good[w]), None), rows
