"""Quantisation to FP8: per-token 1x128, per-block 128x128, per-tensor, per-channel, delayed.

Rule for every recipe: scale = amax / fmt_max over the group (amax floored at AMAX_FLOOR so an
all-zero group gets a finite scale), optionally rounded up to a power of two; q = x / scale,
clamped to +-fmt_max, rounded to nearest in the fp8 format. Real value = q * scale.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from .layout import get_col_major_tma_aligned_tensor
from .ops._common import check_index
from .problem import FP8_DTYPES, SCALE_BLOCK, ceil_div

__all__ = ["FORMATS", "AMAX_FLOOR", "fp8_dtype", "quantize_per_token", "quantize_per_block",
           "dequantize_per_block", "quantize_per_tensor", "quantize_per_channel",
           "silu_mul_quantize_per_token", "quantize_per_token_transposed",
           "quantize_per_block_transposed", "DelayedScaling", "calc_diff"]

FORMATS = {"e4m3": (torch.float8_e4m3fn, 448.0), "e5m2": (torch.float8_e5m2, 57344.0)}
AMAX_FLOOR = 1e-4
_GROUP = SCALE_BLOCK


def fp8_dtype(fmt: str) -> tuple[torch.dtype, float]:
    """(torch dtype, largest finite value) of "e4m3" or "e5m2"."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be 'e4m3' or 'e5m2', got {fmt!r}")
    return FORMATS[fmt]


def _check_input(x, min_dim: int = 1) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype in FP8_DTYPES:
        raise TypeError(f"x must be float32, float16 or bfloat16, got {x.dtype}")
    if x.dim() < min_dim:
        raise ValueError(f"x must have at least {min_dim} dims, got shape {list(x.shape)}")


def _scale_from_amax(amax: torch.Tensor, fmax: float, pow2: bool) -> torch.Tensor:
    scale = amax.float().clamp_min(AMAX_FLOOR) / fmax
    if pow2:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return scale


def _amax(x: torch.Tensor) -> torch.Tensor:
    """amax of the whole tensor; 0 for an empty one (torch's amax refuses empty input)."""
    return x.abs().amax() if x.numel() else torch.zeros((), dtype=x.dtype, device=x.device)


def _cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, fmax: float) -> torch.Tensor:
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype)


# NOTE: groups are formed without padding: amax over a view of the whole groups plus one over
# the short last group, and the scales gathered back to the elements by group index (no padded
# copy of x). Inductor (CPU, torch 2.13) miscompiles group quantisation when a size is not a
# multiple of 128 (NaN and wrong fp8 values: padding -> unflatten -> amax -> divide -> flatten
# -> slice, scales broadcast with expand and cut to size, and 128x128 blocks with N < 128 all
# do it), so under torch.compile the public quantisers run as custom ops and inductor never
# compiles this code.
def _group_amax(xa: torch.Tensor, dim: int) -> torch.Tensor:
    """amax of xa (already non-negative) over groups of 128 along dim, the last group short
    when the size is not a multiple of 128: size ceil(size/128) along dim."""
    dim = dim % xa.dim()
    size = xa.shape[dim]
    whole, tail = size // _GROUP * _GROUP, size % _GROUP
    parts = []
    if whole:
        groups = xa.narrow(dim, 0, whole).unflatten(dim, (whole // _GROUP, _GROUP))
        parts.append(groups.amax(dim=dim + 1))
    if tail:
        parts.append(xa.narrow(dim, whole, tail).amax(dim=dim, keepdim=True))
    if not parts:  # size 0: no groups
        return xa.narrow(dim, 0, 0)
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _expand_groups(s: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """s with each entry along dim repeated for the elements of its 128-group, `size` long."""
    group_of = torch.arange(size, device=s.device) // _GROUP
    return s.index_select(dim % s.dim(), group_of)


def _triton_quant(x: torch.Tensor):
    """The Triton quantisation kernels for a CUDA tensor (one pass over x), else None: the torch
    code below, which is also their specification."""
    if not x.is_cuda or x.numel() == 0 or x.dtype == torch.float64:
        return None  # (the kernels read bf16, fp16 and fp32)
    return _triton_kernels(x.device.index if x.device.index is not None
                           else torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _triton_kernels(device_index: int):
    """Triton's quantisation module where it runs on this GPU, else None (cached: this runs on
    every activation quantisation)."""
    from .backends import triton_runs_on

    if not triton_runs_on(device_index):
        return None
    from .backends.triton import quant as kernels

    return kernels


# NOTE: the per-token quantisers (with SiLU*mul too) as a CUDA kernel of the JIT
# (backends/cuda/quant.py), for host time. On the H200 its GPU tests pass
# (tests/test_cuda_quant.py), and scripts/quant_bandwidth.py timed both in one run over five
# DeepSeek-V3 shapes: 25-47 us of host time per call against Triton's 40-77, but 66-67 % of a
# bf16 copy's bandwidth (silu_mul 53-58 %) against Triton's 82-90 % (67-81 %), with either work
# order of the scale stores. Where the GPU is the bound (CUDA graphs, large batches) that loses
# more than the host time saves, so the Triton kernels run.
CUDA_QUANT = False
# NOTE: inputs of at most this many elements take the CUDA kernel with CUDA_QUANT off: at decode
# sizes either kernel runs in a few microseconds of device time and the host's launch cost is the
# difference. scripts/quant_bandwidth.py on the H200, per_token (silu_mul) against Triton: 32x7168
# 5.9 (7.5) against 5.5 (7.1) us of device time, 128x4096 6.2 (7.7) against 5.9 (7.4), 128x7168
# 6.7 (7.9) against 6.2 (7.6), with 42-46 us of host time per call against 63-70; at 2112x7168
# the device time is 22.0 against 17.8 us, more than the host time saved where the GPU is busy.
CUDA_QUANT_MAX_ELEMENTS = 1 << 20
_printed: set[str] = set()


@functools.lru_cache(maxsize=None)
def _sm90(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) == (9, 0)


def _cuda_rows(x: torch.Tensor, k: int, silu: bool, masked: bool = False):
    """The CUDA per-token kernels' module when CUDA_QUANT is on (or x has at most
    CUDA_QUANT_MAX_ELEMENTS elements, or masked: only the rows of tokens are read), x is on a
    Hopper GPU and the kernel takes it, else None (the Triton kernel runs). FP8GEMM_PRINT_CONFIGS
    shows which."""
    if not (CUDA_QUANT or masked) and not 0 < x.numel() <= CUDA_QUANT_MAX_ELEMENTS:
        return None
    from ._settings import settings

    try:
        from .backends.cuda import quant as rows
    except ImportError as e:  # no cuda-bindings: the CUDA backend is not installed
        why = f"the CUDA backend does not import ({e})"
    else:
        index = x.device.index if x.device.index is not None else torch.cuda.current_device()
        why = "needs sm_90" if not _sm90(index) else rows.refusal(x, k, silu)
        if why is None:
            return rows
    line = (f"[fp8gemm] {'silu_mul_' if silu else ''}quantize_per_token runs on Triton: the CUDA "
            f"kernel {why}")
    if settings.print_configs and line not in _printed:  # (once per reason)
        _printed.add(line)
        print(line, flush=True)
    return None


def _check_masked_m(x: torch.Tensor, masked_m) -> None:
    if x.dim() != 3:
        raise ValueError(f"x must be [G, Mmax, 2I] with masked_m, got shape {list(x.shape)}")
    check_index("masked_m", masked_m, (x.shape[0],), x.device, like="x")


def _compiling() -> bool:
    """Whether torch.compile (or export) is tracing this call: the public quantisers then run as
    the `torch.ops.fp8gemm` custom ops (see torch_ops), one opaque node each."""
    return torch.compiler.is_compiling()


def quantize_per_token(x: torch.Tensor, fmt: str = "e4m3", *, pow2_scales: bool = False,
                       col_major_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Activations, one scale per 1x128 group along K.

    x [..., M, K] float -> (q [..., M, K] fp8, s [..., M, ceil(K/128)] float32). With
    col_major_scales (default) s is column-major with M padded to 16 bytes: the layout the
    CUDA kernels read, so passing it costs no conversion.
    """
    _check_input(x, 2)
    fp8_dtype(fmt)
    if _compiling():
        return torch.ops.fp8gemm.quantize_per_token(x, fmt, pow2_scales, col_major_scales)
    kernels = _triton_quant(x)
    if kernels is not None:
        rows = _cuda_rows(x, x.shape[-1], False)
        if rows is not None:
            return rows.quantize_rows(x, fmt, pow2_scales, col_major_scales, False)
        return kernels.quantize_per_token(x, fmt, pow2_scales=pow2_scales,
                                          col_major_scales=col_major_scales)
    return per_token_torch(x, fmt, pow2_scales, col_major_scales)


def silu_mul_quantize_per_token(x: torch.Tensor, fmt: str = "e4m3", *, pow2_scales: bool = False,
                                col_major_scales: bool = True,
                                masked_m: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The middle of a SwiGLU expert in one pass: x [..., T, 2I] -> silu(x[..., :I]) * x[..., I:]
    quantised per 1x128 group, as `quantize_per_token` returns it ([..., T, I] fp8 + scales).

    masked_m: for x [G, Mmax, 2I] in the masked layout (decode MoE), int32 [G] on x's device,
    read on the device (clamped to [0, Mmax]): the rows at or past masked_m[g] of expert g hold
    no token and are not read, whatever they hold (an output buffer nothing zeroed); their
    scales are an all-zero group's and their fp8 values unspecified."""
    _check_input(x, 2)
    if x.shape[-1] % 2:
        raise ValueError(f"x must be [..., T, 2I] with an even last dim, got {list(x.shape)}")
    fp8_dtype(fmt)
    if masked_m is not None:
        _check_masked_m(x, masked_m)
        masked_m = masked_m.contiguous()  # (the kernels read it as G int32 in a row)
    if _compiling():
        return torch.ops.fp8gemm.silu_mul_quantize_per_token(x, fmt, pow2_scales,
                                                             col_major_scales, masked_m)
    kernels = _triton_quant(x)
    if kernels is not None:
        rows = _cuda_rows(x, x.shape[-1] // 2, True, masked=masked_m is not None)
        if rows is not None:
            return rows.quantize_rows(x, fmt, pow2_scales, col_major_scales, True, masked_m)
        return kernels.silu_mul_quantize_per_token(x, fmt, pow2_scales=pow2_scales,
                                                   col_major_scales=col_major_scales,
                                                   masked_m=masked_m)
    return silu_mul_per_token_torch(x, fmt, pow2_scales, col_major_scales, masked_m)


def quantize_per_block(w: torch.Tensor, fmt: str = "e4m3", *,
                       pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Weights, one scale per 128x128 block.

    w [..., N, K] float -> (q [..., N, K] fp8, s [..., ceil(N/128), ceil(K/128)] float32).
    """
    _check_input(w, 2)
    fp8_dtype(fmt)
    if _compiling():
        return torch.ops.fp8gemm.quantize_per_block(w, fmt, pow2_scales)
    kernels = _triton_quant(w)
    if kernels is not None:
        return kernels.quantize_per_block(w, fmt, pow2_scales=pow2_scales)
    return per_block_torch(w, fmt, pow2_scales)


def dequantize_per_block(q: torch.Tensor, scale: torch.Tensor,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The real values of a weight quantised per 128x128 block: q [..., N, K] (e4m3 or e5m2)
    times its block's scale, scale [..., ceil(N/128), ceil(K/128)] (any float dtype), returned
    in `dtype` (the product taken in float32, or float64 for float64). The inverse of
    `quantize_per_block` up to fp8 rounding, and how a pre-quantised checkpoint (DeepSeek-V3's
    `weight` and `weight_scale_inv`) becomes a bf16 weight again."""
    if not isinstance(q, torch.Tensor) or q.dtype not in FP8_DTYPES:
        raise TypeError(f"q must be a float8_e4m3fn or float8_e5m2 tensor, got "
                        f"{getattr(q, 'dtype', type(q).__name__)}")
    if q.dim() < 2:
        raise ValueError(f"q must have at least 2 dims [..., N, K], got shape {list(q.shape)}")
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() \
            or scale.dtype in FP8_DTYPES:
        raise TypeError(f"scale must be a float32, float16 or bfloat16 tensor, got "
                        f"{getattr(scale, 'dtype', type(scale).__name__)}")
    n, k = q.shape[-2:]
    want = (*q.shape[:-2], ceil_div(n, _GROUP), ceil_div(k, _GROUP))
    if tuple(scale.shape) != want:
        raise ValueError(f"scale must be {list(want)} for q of shape {list(q.shape)} (one per "
                         f"128x128 block), got {list(scale.shape)}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point or dtype in FP8_DTYPES:
        raise TypeError(f"dtype must be a float32, float16 or bfloat16 dtype, got {dtype}")
    work = torch.promote_types(dtype, torch.float32)
    full = _expand_groups(_expand_groups(scale.to(q.device, work), -2, n), -1, k)
    return (q.to(work) * full).to(dtype)


# NOTE: the transposing quantisers are the quantisers above on a transposed view, bit for bit. On
# a GPU each is one Triton kernel of its own that reads x along its rows and transposes the
# quantised tiles in shared memory (a read through the transposed view reaches fewer bytes per
# DRAM line); elsewhere, and while torch.compile traces, the quantisers above take the view.

def quantize_per_token_transposed(x: torch.Tensor, fmt: str = "e4m3", *,
                                  pow2_scales: bool = False,
                                  col_major_scales: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed operand of a weight gradient, quantised along the token axis.

    x [..., T, C] float -> (q [..., C, T] fp8 row-major, s [..., C, ceil(T/128)] float32): x^T
    quantised per 1x128 group along T, exactly `quantize_per_token(x.transpose(-1, -2))`. For
    dW = dY^T . X both dY [T, N] and X [T, K] go through here: A = dY^T [N, T] with 1x128 A
    scales, B = X^T [K, T] with the 1x128-group B scales [K, ceil(T/128)] of `fp8_gemm_nt`.
    Scales column-major (M padded to 16 bytes) unless col_major_scales=False.
    """
    _check_input(x, 2)
    fp8_dtype(fmt)
    kernels = None if _compiling() else _triton_quant(x)
    if kernels is not None:
        return kernels.quantize_per_token_transposed(x, fmt, pow2_scales=pow2_scales,
                                                     col_major_scales=col_major_scales)
    return quantize_per_token(x.transpose(-1, -2), fmt, pow2_scales=pow2_scales,
                              col_major_scales=col_major_scales)


def quantize_per_block_transposed(w: torch.Tensor, fmt: str = "e4m3", *,
                                  pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The transposed weight of an input gradient, quantised per 128x128 block.

    w [..., N, K] float -> (q [..., K, N] fp8 row-major, s [..., ceil(K/128), ceil(N/128)]
    float32), exactly `quantize_per_block(w.transpose(-1, -2))`: the B operand of
    dX = dY . W run as the NT GEMM dY . (W^T)^T. A block of W^T holds the values of one block
    of W, so q and s are the transposes of `quantize_per_block(w)`'s, bit for bit.
    """
    _check_input(w, 2)
    fp8_dtype(fmt)
    kernels = None if _compiling() else _triton_quant(w)
    if kernels is not None:
        return kernels.quantize_per_block_transposed(w, fmt, pow2_scales=pow2_scales)
    return quantize_per_block(w.transpose(-1, -2), fmt, pow2_scales=pow2_scales)


# The torch twins of the three quantisers above: their specification, what runs where the
# Triton kernels do not, and (on fake tensors) the custom ops' shapes and strides.

def per_token_torch(x: torch.Tensor, fmt: str, pow2_scales: bool, col_major_scales: bool):
    dtype, fmax = fp8_dtype(fmt)
    xf = x.float()
    scale = _scale_from_amax(_group_amax(xf.abs(), -1), fmax, pow2_scales)  # [..., M, kb]
    q = _cast(xf, _expand_groups(scale, -1, x.shape[-1]), dtype, fmax).contiguous()
    return q, get_col_major_tma_aligned_tensor(scale) if col_major_scales else scale


def silu_mul_per_token_torch(x: torch.Tensor, fmt: str, pow2_scales: bool,
                             col_major_scales: bool, masked_m: torch.Tensor | None = None):
    gate, up = x.float().chunk(2, dim=-1)
    mid = F.silu(gate) * up
    if masked_m is not None:  # (the rows of no token quantised as zeros, whatever x holds there)
        rows = torch.arange(x.shape[-2], device=x.device)
        mid = mid.where((rows < masked_m[:, None])[..., None], 0.0)
    return per_token_torch(mid, fmt, pow2_scales, col_major_scales)


def per_block_torch(w: torch.Tensor, fmt: str, pow2_scales: bool):
    dtype, fmax = fp8_dtype(fmt)
    n, k = w.shape[-2:]
    wf = w.float()
    amax = _group_amax(_group_amax(wf.abs(), -1), -2)  # [..., nb, kb]
    scale = _scale_from_amax(amax, fmax, pow2_scales)
    full = _expand_groups(_expand_groups(scale, -2, n), -1, k)
    return _cast(wf, full, dtype, fmax).contiguous(), scale.contiguous()


def quantize_per_tensor(x: torch.Tensor, fmt: str = "e4m3", *,
                        pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale for the whole tensor: x -> (q fp8 like x, s [1] float32)."""
    _check_input(x)
    dtype, fmax = fp8_dtype(fmt)
    scale = _scale_from_amax(_amax(x).reshape(1), fmax, pow2_scales)
    return _cast(x, scale, dtype, fmax), scale


def quantize_per_channel(x: torch.Tensor, fmt: str = "e4m3", *,
                         pow2_scales: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One scale per row (per output channel of a weight [N, K], per token of an activation):
    x [..., R, K] -> (q fp8 like x, s [..., R] float32)."""
    _check_input(x, 2)
    dtype, fmax = fp8_dtype(fmt)
    amax = x.abs().amax(dim=-1) if x.shape[-1] else x.new_zeros(x.shape[:-1])
    scale = _scale_from_amax(amax, fmax, pow2_scales)
    return _cast(x, scale.unsqueeze(-1), dtype, fmax), scale


class DelayedScaling:
    """Per-tensor scaling from an amax history (the delayed-scaling recipe of FP8 training).

    Each call quantises x with scale = max(history) / fmt_max (the current amax while the
    history is still empty), then records x's amax in the history. All on the device, with no
    host synchronisation, so it can run inside a CUDA graph.

        ds = DelayedScaling(history_len=16)
        q, s = ds.quantize(x)        # s: [1] float32, the scale used for this call
    """

    def __init__(self, history_len: int = 16, fmt: str = "e4m3", *, margin: int = 0,
                 pow2_scales: bool = False, device: torch.device | str | None = None):
        if not isinstance(history_len, int) or history_len < 1:
            raise ValueError(f"history_len must be a positive int, got {history_len!r}")
        if not isinstance(margin, int) or margin < 0:
            raise ValueError(f"margin must be a non-negative int, got {margin!r}")
        self.dtype, self.fmax = fp8_dtype(fmt)
        self.fmt, self.margin, self.pow2_scales = fmt, margin, pow2_scales
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)

    def scale(self, current_amax: torch.Tensor) -> torch.Tensor:
        """The scale the next quantisation uses ([1] float32), given x's current amax."""
        hist = self.amax_history.max()
        amax = torch.where(hist > 0, hist, current_amax.float()).reshape(1)
        return _scale_from_amax(amax * 2.0 ** self.margin, self.fmax, self.pow2_scales)

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        _check_input(x)
        if x.device != self.amax_history.device:
            self.amax_history = self.amax_history.to(x.device)
        amax = _amax(x).float()
        scale = self.scale(amax)
        q = _cast(x, scale, self.dtype, self.fmax)
        self.amax_history.copy_(torch.roll(self.amax_history, 1))
        self.amax_history[0] = amax
        return q, scale


def calc_diff(x: torch.Tensor, y: torch.Tensor) -> float:
    """1 - 2 sum(xy) / sum(x^2 + y^2) in float64: 0 for equal tensors, scale-free."""
    if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor) or x.shape != y.shape:
        raise ValueError(f"x and y must be tensors of one shape, got "
                         f"{list(getattr(x, 'shape', []))} and {list(getattr(y, 'shape', []))}")
    x, y = x.detach().double(), y.detach().double()
    denom = (x * x + y * y).sum()
    if float(denom) == 0.0:
        return 0.0
    return float(1 - 2 * (x * y).sum() / denom)
