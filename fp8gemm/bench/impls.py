"""What the benchmark runs: the inputs of a case, and one callable per implementation.

Implementations (the `impl` names of the result files):

- fp8gemm-cuda, fp8gemm-triton, fp8gemm-reference: the public ops with `backend=` forced.
- cublas-block: cuBLAS through PyTorch with 1x128 A scales and 128x128 B scales, the same
  recipe as fp8gemm (`torch.nn.functional.scaled_mm` with B's scales padded to a multiple of 4
  along K/128; plain `torch._scaled_mm` only where the former is missing).
- cublas-tensor: per-tensor `torch._scaled_mm`, the no-scaling ceiling (its inputs are quantised
  per tensor, so its diff includes that quantisation's error).
- cublas-rowwise-grouped: `torch._scaled_grouped_mm` with per-row scales (contiguous: 2-D A and
  offsets; masked: 3-D A and B).
- torch-bf16: `torch.mm`, `torch._grouped_mm` (contiguous) or `torch.bmm` (masked) on the
  dequantised inputs rounded to bf16.

Every factory returns an `Impl` or raises `Skip` with the reason. Inputs cuBLAS cannot take
(M not a multiple of 4, N not a multiple of 16) are zero-padded and the output sliced back; the
padded rows and columns are counted in its time, never in its diff.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..backends import get_backend, load_error
from ..backends.reference import dequantize
from ..layout import get_col_major_tma_aligned_tensor
from ..problem import GemmKind, GemmProblem, Recipe
from .suites import Case

__all__ = ["Skip", "Impl", "CaseData", "make_data", "make_impl", "reference_output",
           "FP8GEMM_IMPLS", "PEER_IMPLS", "ALL_IMPLS", "DEFAULT_IMPLS", "REFERENCE_MAX_FLOPS",
           "applies", "cublas_block_probe", "BLOCK_WAYS", "WRONG_DIFF"]

FP8GEMM_IMPLS = ("fp8gemm-cuda", "fp8gemm-triton", "fp8gemm-reference")
PEER_IMPLS = ("cublas-block", "cublas-tensor", "cublas-rowwise-grouped", "torch-bf16")
ALL_IMPLS = FP8GEMM_IMPLS + PEER_IMPLS
DEFAULT_IMPLS = ("fp8gemm-cuda", "fp8gemm-triton") + PEER_IMPLS
# The reference backend is a float32 PyTorch loop: only for shapes where it finishes quickly.
REFERENCE_MAX_FLOPS = 2 * 1024 * 4096 * 7168

_OPS_OF = {
    "fp8gemm-cuda": ("dense", "contiguous", "masked"),
    "fp8gemm-triton": ("dense", "contiguous", "masked"),
    "fp8gemm-reference": ("dense", "contiguous", "masked"),
    "cublas-block": ("dense",),
    "cublas-tensor": ("dense",),
    "cublas-rowwise-grouped": ("contiguous", "masked"),
    "torch-bf16": ("dense", "contiguous", "masked"),
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
    output: Callable[[], torch.Tensor]  # the result of the last call, shaped like the reference
    note: str = ""  # how it was called, when that is worth saying


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
class CaseData:
    """Random normal bf16 sources and their fp8gemm quantisation (1x128 A, 128x128 B).

    dense: x [M, K], w [N, K]; contiguous: x [G*m, K], w [G, N, K]; masked: x [G, Mmax, K]."""

    case: Case
    x: torch.Tensor
    w: torch.Tensor
    a: torch.Tensor
    sa: torch.Tensor  # column-major, M padded to 16 bytes: the layout fp8gemm reads directly
    b: torch.Tensor
    sb: torch.Tensor
    m_indices: torch.Tensor | None = None
    masked_m: torch.Tensor | None = None


def make_data(case: Case, device: torch.device, seed: int = 0) -> CaseData:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    m, n, k, groups = case.m, case.n, case.k, case.groups
    if case.op == "dense":
        xs, ws = (m, k), (n, k)
    elif case.op == "contiguous":
        xs, ws = (groups * m, k), (groups, n, k)
    else:
        xs, ws = (groups, m, k), (groups, n, k)
    x = torch.randn(xs, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(ws, device=device, dtype=torch.bfloat16, generator=g)
    a, sa = _quant_groups(x)
    b, sb = _quant_blocks(w)
    data = CaseData(case, x, w, a, get_col_major_tma_aligned_tensor(sa), b, sb)
    if case.op == "contiguous":
        data.m_indices = torch.arange(groups, device=device, dtype=torch.int32).repeat_interleave(m)
    elif case.op == "masked":
        data.masked_m = torch.full((groups,), m, device=device, dtype=torch.int32)
    return data


def _dequant(a, sa, b, sb, dtype):
    """Dequantised 2-D A [rows, K] and B [N, K]."""
    return (dequantize(a, sa, Recipe.GROUP, dtype), dequantize(b, sb, Recipe.BLOCK, dtype))


def reference_output(data: CaseData, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The exact product of the dequantised inputs (float64 unless asked otherwise)."""
    c = data.case
    if c.op == "dense":
        da, db = _dequant(data.a, data.sa, data.b, data.sb, dtype)
        return da @ db.T
    outs = []
    for g in range(c.groups):
        rows = slice(g * c.m, (g + 1) * c.m)
        a_g = data.a[rows] if c.op == "contiguous" else data.a[g]
        sa_g = data.sa[rows] if c.op == "contiguous" else data.sa[g]
        da, db = _dequant(a_g, sa_g, data.b[g], data.sb[g], dtype)
        outs.append(da @ db.T)
    return torch.cat(outs) if c.op == "contiguous" else torch.stack(outs)


def _bf16_operands(data: CaseData) -> tuple[torch.Tensor, torch.Tensor]:
    """The dequantised inputs in bf16, shaped like x and w."""
    c = data.case
    da = dequantize(data.a.reshape(-1, c.k), data.sa.reshape(-1, data.sa.shape[-1]),
                    Recipe.GROUP).to(torch.bfloat16).reshape(data.a.shape)
    if c.op == "dense":
        db = dequantize(data.b, data.sb, Recipe.BLOCK).to(torch.bfloat16)
    else:
        db = torch.stack([dequantize(data.b[g], data.sb[g], Recipe.BLOCK)
                          for g in range(c.groups)]).to(torch.bfloat16)
    return da, db


# ---------------------------------------------------------------------------------------------
# fp8gemm's own backends.


def _problem(c: Case) -> GemmProblem:
    kind = {"dense": GemmKind.DENSE, "contiguous": GemmKind.CONTIGUOUS,
            "masked": GemmKind.MASKED}[c.op]
    rows = c.total_m if c.op == "contiguous" else c.m
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
    if not mod.is_available(data.a.device):
        raise Skip(f"not available on {torch.cuda.get_device_name(data.a.device)}")
    why = mod.supports(_problem(c))
    if why is not None:
        raise Skip(f"does not support the problem: {why}")
    a, b = (data.a, data.sa), (data.b, data.sb)
    if c.op == "dense":
        out = torch.empty(c.m, c.n, device=data.a.device, dtype=torch.bfloat16)
        fn = lambda: fp8gemm.fp8_gemm_nt(a, b, out, backend=name)  # noqa: E731
    elif c.op == "contiguous":
        out = torch.empty(c.total_m, c.n, device=data.a.device, dtype=torch.bfloat16)
        fn = lambda: fp8gemm.m_grouped_fp8_gemm_nt_contiguous(  # noqa: E731
            a, b, out, data.m_indices, backend=name)
    else:
        out = torch.empty(c.groups, c.m, c.n, device=data.a.device, dtype=torch.bfloat16)
        fn = lambda: fp8gemm.m_grouped_fp8_gemm_nt_masked(  # noqa: E731
            a, b, out, data.masked_m, c.m, backend=name)
    return Impl(impl, fn, lambda: out)


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
    a, sa = _quant_rows(data.x)
    b, sb = _quant_rows(data.w)  # [G, N, K], [G, N]
    bt = b.transpose(-2, -1)  # [G, K, N], column-major per group
    holder: list = [None]
    if c.op == "contiguous":
        offs = (torch.arange(1, c.groups + 1, device=a.device, dtype=torch.int32) * c.m)

        def fn():
            holder[0] = torch._scaled_grouped_mm(a, bt, sa, sb, offs=offs,
                                                 out_dtype=torch.bfloat16)
    else:
        def fn():
            holder[0] = torch._scaled_grouped_mm(a, bt, sa, sb, out_dtype=torch.bfloat16)
    return Impl("cublas-rowwise-grouped", fn, lambda: holder[0])


def _torch_bf16(data: CaseData) -> Impl:
    c = data.case
    da, db = _bf16_operands(data)
    if c.op == "dense":
        out = torch.empty(c.m, c.n, device=da.device, dtype=torch.bfloat16)
        fn = lambda: torch.mm(da, db.t(), out=out)  # noqa: E731
        return Impl("torch-bf16", fn, lambda: out, note="torch.mm")
    if c.op == "masked":
        out = torch.empty(c.groups, c.m, c.n, device=da.device, dtype=torch.bfloat16)
        fn = lambda: torch.bmm(da, db.transpose(1, 2), out=out)  # noqa: E731
        return Impl("torch-bf16", fn, lambda: out, note="torch.bmm")
    if not hasattr(torch, "_grouped_mm"):
        raise Skip("torch._grouped_mm is missing")
    offs = torch.arange(1, c.groups + 1, device=da.device, dtype=torch.int32) * c.m
    dbt = db.transpose(-2, -1)
    holder: list = [None]

    def fn():
        holder[0] = torch._grouped_mm(da, dbt, offs=offs)

    return Impl("torch-bf16", fn, lambda: holder[0], note="torch._grouped_mm")


_FACTORIES = {
    "cublas-tensor": _cublas_tensor,
    "cublas-rowwise-grouped": _cublas_rowwise_grouped,
    "torch-bf16": _torch_bf16,
}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def make_impl(impl: str, data: CaseData, block_way: str | None = None) -> Impl:
    """The implementation ready to call (already called once), or Skip with the reason.
    `block_way` fixes how cublas-block is called (one of `BLOCK_WAYS`; default: the first of
    them that runs)."""
    if impl not in ALL_IMPLS:
        raise ValueError(f"impl must be one of {ALL_IMPLS}, got {impl!r}")
    if not applies(impl, data.case.op):
        raise Skip(f"not a {data.case.op} implementation")
    try:
        if impl in FP8GEMM_IMPLS:
            made = _fp8gemm(impl, data)
        elif impl == "cublas-block":
            made = _cublas_block(data, block_way)
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
