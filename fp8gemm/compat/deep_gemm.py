"""DeepGEMM's Python API on fp8gemm: switching is one import.

    import fp8gemm.compat.deep_gemm as deep_gemm

Both generations of DeepGEMM's names are here, with its conventions: operands are (tensor,
scale) pairs, the output `out`/`d` is always given and written in place, `wgrad` and k-grouped
calls accumulate into their fp32 output, and `m_indices`, `masked_m` and `expected_m` mean what
they mean there. Every call goes to the fp8gemm op of the same meaning, so it also takes what
DeepGEMM refuses (any M, N, K; e5m2; per-tensor and per-channel scales).
Keyword options that tune DeepGEMM's own kernels (`recipe`, `compiled_dims`,
`disable_ue8m0_cast`) are accepted and have no effect: fp8gemm picks its kernels itself.

The NN, TN and TT forms take an operand stored transposed (B as [K, N], A as [K, M]) with its
scales stored the same way ([ceil(K/128), N] and so on), and run as NT on transposed views:
FP8 wgmma reads both operands K-major, so on Hopper such an operand is copied first (DeepGEMM
refuses them there). The psum layout of the contiguous grouped GEMM (`use_psum_layout`:
group g owns rows [align(psum[g-1], 128), psum[g]), the rows between groups belong to none) is
turned into `m_indices` on the device (a few small kernels, no host synchronisation).
"""

from __future__ import annotations

import os
import time

import torch

from .. import layout as _layout
from .. import ops as _ops
from ..problem import SCALE_BLOCK, ceil_div
from ..quant import calc_diff

__all__ = [
    # DeepGEMM's current names
    "fp8_gemm_nt", "fp8_gemm_nn", "fp8_gemm_tn", "fp8_gemm_tt",
    "m_grouped_fp8_gemm_nt_contiguous", "m_grouped_fp8_gemm_nn_contiguous",
    "m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked",
    "k_grouped_fp8_gemm_nt_contiguous", "k_grouped_fp8_gemm_tn_contiguous",
    "transform_sf_into_required_layout", "get_mn_major_tma_aligned_tensor",
    "use_deterministic_algorithms",
    # its older names
    "gemm_fp8_fp8_bf16_nt", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
    "m_grouped_gemm_fp8_fp8_bf16_nt_masked", "wgrad_gemm_fp8_fp8_fp32_nt",
    "k_grouped_wgrad_gemm_fp8_fp8_fp32_nt",
    # utilities
    "ceil_div", "calc_diff", "bench_kineto", "get_col_major_tma_aligned_tensor",
    "get_tma_aligned_size", "get_m_alignment_for_contiguous_layout",
    "get_mk_alignment_for_contiguous_layout", "set_num_sms", "get_num_sms", "install",
]

get_col_major_tma_aligned_tensor = _layout.get_col_major_tma_aligned_tensor
get_mn_major_tma_aligned_tensor = _layout.get_col_major_tma_aligned_tensor
get_m_alignment_for_contiguous_layout = _layout.get_m_alignment_for_contiguous_layout
get_mk_alignment_for_contiguous_layout = _layout.get_m_alignment_for_contiguous_layout
get_num_sms = _layout.get_num_sms


def get_tma_aligned_size(x: int, element_size: int = 4) -> int:
    """x rounded up so that x elements of `element_size` bytes (default fp32) span 16 bytes."""
    return _layout.get_tma_aligned_size(x, element_size)


def set_num_sms(num_sms: int) -> None:
    """Cap the SMs kernels use; 0 or None restores the device's count (as DeepGEMM's 0 does)."""
    _layout.set_num_sms(None if num_sms in (0, None) else num_sms)


def use_deterministic_algorithms() -> None:
    """Accepted for compatibility: fp8gemm's results are always the same bits for the same
    inputs (no atomics; split-K parts are added in a fixed order)."""


def transform_sf_into_required_layout(sf: torch.Tensor, mn: int, k: int, recipe,
                                      num_groups: int | None = None, is_sfa: bool | None = None,
                                      disable_ue8m0_cast: bool = False,
                                      psum_layout=None) -> torch.Tensor:
    """FP32 scales `sf` of an [mn, k] operand (with a leading [num_groups]) in the layout the
    GEMMs read best: 1x128 groups ([.., mn, ceil(k/128)]) column-major and TMA-aligned, 128x128
    blocks ([.., ceil(mn/128), ceil(k/128)]) as they are. `recipe` is (gran_m, gran_n, gran_k)
    with `is_sfa` saying which of gran_m and gran_n is this operand's, or (gran_mn, gran_k).
    Other recipes (UE8M0, 32-wide groups) are Blackwell formats: ValueError. psum_layout
    (which rows the Blackwell packing skips) is accepted and changes nothing here."""
    recipe = tuple(recipe)
    if len(recipe) == 3:
        if is_sfa is None:
            raise ValueError("is_sfa must say which operand sf scales with a 3-value recipe")
        gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
    elif len(recipe) == 2:
        if is_sfa is not None:
            raise ValueError("is_sfa goes with a 3-value recipe (gran_m, gran_n, gran_k), not "
                             f"with {recipe}")
        gran_mn, gran_k = recipe
    else:
        raise ValueError(f"recipe must be (gran_m, gran_n, gran_k) or (gran_mn, gran_k), got "
                         f"{recipe}")
    if (gran_mn, gran_k) not in ((1, SCALE_BLOCK), (SCALE_BLOCK, SCALE_BLOCK)):
        raise ValueError(f"recipe {recipe}: Hopper GEMMs take FP32 scales in 1x128 groups or "
                         f"128x128 blocks, not {gran_mn}x{gran_k}")
    if not isinstance(sf, torch.Tensor) or sf.dtype != torch.float32:
        raise TypeError(f"sf must be a float32 tensor, got {getattr(sf, 'dtype', type(sf))}")
    want = ((num_groups,) if num_groups is not None else ()) + (ceil_div(mn, gran_mn),
                                                                ceil_div(k, gran_k))
    if tuple(sf.shape) != want:
        raise ValueError(f"sf must be {list(want)} for a [{mn}, {k}] operand in {gran_mn}x{gran_k}"
                         f" groups{'' if num_groups is None else f' x {num_groups}'}, got "
                         f"{list(sf.shape)}")
    return get_mn_major_tma_aligned_tensor(sf) if gran_mn == 1 else sf


def _check_out(name: str, out) -> torch.Tensor:
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"{name} must be the output tensor (DeepGEMM writes in place), got "
                        f"{type(out).__name__}")
    return out


# ---------------------------------------------------------------------------------------------
# current names

def fp8_gemm_nt(a, b, d: torch.Tensor, c: torch.Tensor | None = None, *, recipe=None,
                compiled_dims: str = "nk", disable_ue8m0_cast: bool = False) -> None:
    """d = a @ b.T (+ c), a [M, K] and b [N, K] as (fp8, scale) pairs; d bf16 or fp32."""
    _ops.fp8_gemm_nt(a, b, _check_out("d", d), c=c)


def fp8_gemm_nn(a, b, d: torch.Tensor, c: torch.Tensor | None = None, *, recipe=None,
                compiled_dims: str = "nk", disable_ue8m0_cast: bool = False) -> None:
    """d = a @ b (+ c), a [M, K], b stored as [K, N] with its scales stored alike."""
    fp8_gemm_nt(a, _transposed(b), d, c)


def fp8_gemm_tn(a, b, d: torch.Tensor, c: torch.Tensor | None = None, *, recipe=None,
                compiled_dims: str = "nk", disable_ue8m0_cast: bool = False) -> None:
    """d = a.T @ b (+ c), a stored as [K, M] and b as [K, N], scales stored alike."""
    fp8_gemm_nt(_transposed(a), _transposed(b), d, c)


def fp8_gemm_tt(a, b, d: torch.Tensor, c: torch.Tensor | None = None, *, recipe=None,
                compiled_dims: str = "nk", disable_ue8m0_cast: bool = False) -> None:
    """d = a.T @ b.T (+ c), a stored as [K, M] (scales alike), b [N, K]."""
    fp8_gemm_nt(_transposed(a), b, d, c)


def m_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor, *,
                                     recipe=None, compiled_dims: str = "nk",
                                     disable_ue8m0_cast: bool = False,
                                     use_psum_layout: bool = False,
                                     ensure_zero_padding: bool = True,
                                     expected_m_for_psum_layout: int | None = None) -> None:
    """d[i] = a[i] @ b[m_indices[i]].T; rows with m_indices -1 are left as they are. With
    use_psum_layout, m_indices is the psum layout instead: int32 [G], group g owning rows
    [align(psum[g-1], 128), psum[g]) (group 0 from row 0). ensure_zero_padding (a Blackwell
    option) changes nothing: rows of no group are never written."""
    d = _check_out("d", d)
    if use_psum_layout:
        m_indices = _psum_row_groups(m_indices, d.shape[0] if d.dim() == 2 else 0)
    elif expected_m_for_psum_layout is not None:
        raise ValueError("expected_m_for_psum_layout goes with use_psum_layout=True")
    _ops.m_grouped_fp8_gemm_nt_contiguous(a, b, d, m_indices)


def m_grouped_fp8_gemm_nn_contiguous(a, b, d: torch.Tensor, m_indices: torch.Tensor, *,
                                     recipe=None, compiled_dims: str = "nk",
                                     disable_ue8m0_cast: bool = False,
                                     use_psum_layout: bool = False,
                                     ensure_zero_padding: bool = True) -> None:
    """As m_grouped_fp8_gemm_nt_contiguous with b stored as [G, K, N] (scales alike)."""
    m_grouped_fp8_gemm_nt_contiguous(a, _transposed(b), d, m_indices,
                                     use_psum_layout=use_psum_layout)


def m_grouped_fp8_gemm_nt_masked(a, b, d: torch.Tensor, masked_m: torch.Tensor,
                                 expected_m: int, *, recipe=None, compiled_dims: str = "nk",
                                 disable_ue8m0_cast: bool = False) -> None:
    """d[g, :masked_m[g]] = a[g, :masked_m[g]] @ b[g].T, a [G, Mmax, K]."""
    _ops.m_grouped_fp8_gemm_nt_masked(a, b, _check_out("d", d), masked_m, expected_m)


fp8_m_grouped_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked


def k_grouped_fp8_gemm_nt_contiguous(a, b, d: torch.Tensor, ks, ks_tensor=None,
                                     c: torch.Tensor | None = None, *, recipe=None,
                                     compiled_dims: str = "mn") -> None:
    """d[g] = c[g] + A_g @ B_g.T for groups whose K sizes are `ks`: A_g [M, ks[g]] and
    B_g [N, ks[g]] packed one after another in the flat fp8 tensors of a and b, their scales
    [sum ceil(ks[g]/128), M] and [.., N] (one row per 128 of K). d, c: fp32 [G, M, N];
    c = None accumulates into d, as DeepGEMM's wgrad does."""
    d = _check_out("d", d)
    if c is not None and c is not d:
        d.copy_(c)
    _k_grouped(a, b, d, [int(k) for k in ks])


def k_grouped_fp8_gemm_tn_contiguous(a, b, d: torch.Tensor, ks, ks_tensor: torch.Tensor,
                                     c: torch.Tensor | None = None, *, recipe=None,
                                     compiled_dims: str = "mn",
                                     use_psum_layout: bool = False) -> None:
    """d[g] = (c[g] +) A_g.T @ B_g for the groups of K sizes `ks` (each a multiple of 128):
    A [sum K, M] and B [sum K, N], the groups one after another along their first dimension,
    scales [sum K / 128, M] and [.., N]; d (and c) fp32 [G, M, N]. Without c, d is written, not
    accumulated into. With use_psum_layout, ks_tensor holds the psum layout: group g owns rows
    [align(psum[g-1], 128), psum[g]) of A and B, the rows between groups zeros (as DeepGEMM
    asks). One launch of fp8gemm's k-grouped op on the transposed operands (copied: K-major)."""
    d = _check_out("d", d)
    (a_t, sa), (b_t, sb) = _transposed(a), _transposed(b)
    if use_psum_layout:
        # Each group takes the zero rows up to the next group's start as well: same sums.
        starts = _psum_starts(ks_tensor.to(torch.int64))
        ends = torch.cat([starts[1:], starts.new_full((1,), a_t.shape[1])])
        ks_tensor = (ends - starts).clamp_min(0).to(torch.int32)
    elif ks is not None and any(int(k) % SCALE_BLOCK for k in ks):
        raise ValueError(f"ks must be multiples of {SCALE_BLOCK} (DeepGEMM's K alignment), got "
                         f"{list(ks)}")
    _ops.k_grouped_fp8_gemm_nt_contiguous((a_t, sa), (b_t, sb), d, ks_tensor, c=c)


def _transposed(pair):
    """(tensor, scale) of an operand stored transposed, as the NT form's views: the last two
    dimensions of the tensor swapped, and of a scale with as many dimensions as the tensor
    (stored alike); a scale with fewer (per tensor, per channel, per group) stays."""
    if not isinstance(pair, (tuple, list)) or len(pair) != 2:
        raise TypeError(f"an operand must be a (tensor, scale) pair, got {type(pair).__name__}")
    t, s = pair
    if not isinstance(t, torch.Tensor) or not isinstance(s, torch.Tensor) or t.dim() < 2:
        raise TypeError("an operand stored transposed must be a (tensor, scale) pair of tensors, "
                        "the tensor of two or three dimensions")
    return t.transpose(-1, -2), (s.transpose(-1, -2) if s.dim() == t.dim() else s)


def _psum_starts(ends: torch.Tensor) -> torch.Tensor:
    """Where the groups of a psum layout start: group 0 at 0, group g at psum[g-1] rounded up
    to 128 (int64, on the device)."""
    prev = torch.cat([ends.new_zeros(1), ends[:-1]])
    return (prev + SCALE_BLOCK - 1) // SCALE_BLOCK * SCALE_BLOCK


def _psum_row_groups(psum: torch.Tensor, rows: int) -> torch.Tensor:
    """The m_indices of a psum layout (int32 [G]: group g owns rows [align(psum[g-1], 128),
    psum[g])): the group of each of `rows` rows, -1 for rows of none. Device ops only, so it
    is CUDA-graph safe; values out of order only leave rows to no group (never out of range)."""
    if not isinstance(psum, torch.Tensor) or psum.dim() != 1 or psum.dtype != torch.int32:
        raise ValueError(f"the psum layout must be int32 [G], got "
                         f"{getattr(psum, 'dtype', type(psum).__name__)} "
                         f"{list(getattr(psum, 'shape', []))}")
    ends = psum.to(torch.int64)
    starts = _psum_starts(ends)
    row = torch.arange(rows, device=psum.device)
    g = torch.searchsorted(ends, row, right=True).clamp_max(max(psum.numel() - 1, 0))
    inside = (row >= starts[g]) & (row < ends[g]) if psum.numel() else row < 0
    return torch.where(inside, g, -1).to(torch.int32)


# ---------------------------------------------------------------------------------------------
# older names

def gemm_fp8_fp8_bf16_nt(lhs, rhs, out: torch.Tensor) -> None:
    """out = lhs @ rhs.T in bf16: lhs [M, K] with 1x128 scales, rhs [N, K] with 128x128."""
    _ops.fp8_gemm_nt(lhs, rhs, _check_out("out", out))


def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs, rhs, out: torch.Tensor,
                                              m_indices: torch.Tensor) -> None:
    _ops.m_grouped_fp8_gemm_nt_contiguous(lhs, rhs, _check_out("out", out), m_indices)


def m_grouped_gemm_fp8_fp8_bf16_nt_masked(lhs, rhs, out: torch.Tensor, masked_m: torch.Tensor,
                                          expected_m: int) -> None:
    _ops.m_grouped_fp8_gemm_nt_masked(lhs, rhs, _check_out("out", out), masked_m, expected_m)


def wgrad_gemm_fp8_fp8_fp32_nt(lhs, rhs, out: torch.Tensor) -> None:
    """out += lhs @ rhs.T in fp32, both operands with 1x128 scales ([M, ceil(K/128)] and
    [N, ceil(K/128)])."""
    out = _check_out("out", out)
    _ops.fp8_gemm_nt(lhs, rhs, out, c=out)


def k_grouped_wgrad_gemm_fp8_fp8_fp32_nt(lhs, rhs, out: torch.Tensor, batch_sizes) -> None:
    """out[g] += A_g @ B_g.T for K sizes `batch_sizes` (see k_grouped_fp8_gemm_nt_contiguous)."""
    _k_grouped(lhs, rhs, _check_out("out", out), [int(k) for k in batch_sizes])


def _k_grouped(a, b, d: torch.Tensor, ks: list[int]) -> None:
    (a_flat, a_s), (b_flat, b_s) = a, b
    if d.dim() != 3 or d.shape[0] != len(ks) or d.dtype != torch.float32:
        raise ValueError(f"d must be fp32 [G, M, N] with G = len(ks) = {len(ks)}, got "
                         f"{d.dtype} {list(d.shape)}")
    if any(k < 0 for k in ks):
        raise ValueError(f"ks must be non-negative K sizes, got {ks}")
    m, n = d.shape[1], d.shape[2]
    total_k, total_kb = sum(ks), sum(ceil_div(k, SCALE_BLOCK) for k in ks)
    for name, flat, rows, s in (("a", a_flat, m, a_s), ("b", b_flat, n, b_s)):
        if flat.dim() != 1 or flat.numel() != rows * total_k:
            raise ValueError(f"{name} must be flat with {rows} x sum(ks) = {rows * total_k} "
                             f"elements, got shape {list(flat.shape)}")
        if tuple(s.shape) != (total_kb, rows):
            raise ValueError(f"{name} scales must be [sum ceil(ks/128), {rows}] = "
                             f"[{total_kb}, {rows}], got {list(s.shape)}")
    # NOTE: one GEMM per group, as DeepGEMM's own k-grouped call launches; each group's scales
    # [kb, rows] transposed are the [rows, kb] 1x128 recipe, already column-major.
    off = soff = 0
    for g, k in enumerate(ks):
        kb = ceil_div(k, SCALE_BLOCK)
        if k:
            a_g = a_flat[off * m:(off + k) * m].view(m, k)
            b_g = b_flat[off * n:(off + k) * n].view(n, k)
            _ops.fp8_gemm_nt((a_g, a_s[soff:soff + kb].T), (b_g, b_s[soff:soff + kb].T), d[g],
                             c=d[g])
        off, soff = off + k, soff + kb


# ---------------------------------------------------------------------------------------------
# timing

def bench_kineto(fn, kernel_names=None, num_tests: int = 30, suppress_kineto_output: bool = False,
                 trace_path: str | None = None, flush_l2: bool = True,
                 with_multiple_kernels: bool = False, **_unused):
    """Seconds of device time per call of fn, from the profiler (CUDA), L2 flushed before each;
    with `with_multiple_kernels`, per kernel fn launches, as DeepGEMM's (whose callers multiply
    by the launch count they expect: a k-grouped call launches one GEMM per group here too).

    fp8gemm's kernels are not named as DeepGEMM's, so the time is that of every kernel fn
    launches (the flush excluded); `kernel_names` is accepted for compatibility, and a tuple
    of names gets a tuple of that one time. On a machine without CUDA it is wall time per call.
    """
    if not torch.cuda.is_available():
        fn()
        t0 = time.perf_counter()
        for _ in range(num_tests):
            fn()
        t = (time.perf_counter() - t0) / num_tests
        return tuple(t for _ in kernel_names) if isinstance(kernel_names, tuple) else t
    from torch.profiler import ProfilerActivity, profile

    flush = torch.empty(256 << 20, dtype=torch.int8, device="cuda") if flush_l2 else None
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num_tests):
            if flush is not None:
                flush.zero_()
            fn()
        torch.cuda.synchronize()
    if trace_path is not None:
        prof.export_chrome_trace(trace_path)
    total_us, launches = 0.0, 0
    for evt in prof.key_averages():
        if evt.device_type is not None and "cuda" in str(evt.device_type).lower():
            name = evt.key.lower()
            if flush is not None and ("fill" in name or "memset" in name):
                continue  # the L2 flush
            total_us += evt.self_device_time_total
            launches += evt.count
    per = max(launches, 1) if with_multiple_kernels else num_tests
    t = total_us / per / 1e6
    return tuple(t for _ in kernel_names) if isinstance(kernel_names, tuple) else t


def install() -> None:
    """Make `import deep_gemm` (and `deep_gemm.jit_kernels.utils` and `deep_gemm.utils.layout`,
    where code imports the layout helpers from) resolve to this module, for code that cannot
    change its imports."""
    import sys

    me = sys.modules[__name__]
    # DeepGEMM is a package: code that prints or walks `deep_gemm.__path__` (its test file does)
    # finds this module's folder.
    if not hasattr(me, "__path__"):
        me.__path__ = [os.path.dirname(os.path.abspath(__file__))]
    for name in ("deep_gemm", "deep_gemm.jit_kernels", "deep_gemm.jit_kernels.utils",
                 "deep_gemm.utils", "deep_gemm.utils.layout"):
        sys.modules[name] = me
