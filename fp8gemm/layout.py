"""Layout helpers: TMA alignment, column-major scales, contiguous-layout alignment, SM count."""

from __future__ import annotations

import functools

import torch

from .problem import SCALE_BLOCK

__all__ = ["TMA_ALIGN_BYTES", "CONTIGUOUS_M_ALIGNMENT", "get_tma_aligned_size",
           "get_col_major_tma_aligned_tensor", "is_col_major_tma_aligned",
           "get_m_alignment_for_contiguous_layout", "set_num_sms", "get_num_sms", "num_sms_override",
           "k_group_columns", "k_groups_on_blocks", "empty_token_scales"]

# NOTE: TMA needs global base addresses and strides that are multiples of 16 bytes.
TMA_ALIGN_BYTES = 16
# Rows per M tile of the grouped kernels: each group of the contiguous layout starts on one.
CONTIGUOUS_M_ALIGNMENT = 128


def get_tma_aligned_size(x: int, element_size: int) -> int:
    """x rounded up so that x elements of `element_size` bytes span a multiple of 16 bytes."""
    if element_size <= 0 or TMA_ALIGN_BYTES % element_size:
        raise ValueError(f"element_size must divide 16, got {element_size}")
    step = TMA_ALIGN_BYTES // element_size
    return (x + step - 1) // step * step


def is_col_major_tma_aligned(s: torch.Tensor) -> bool:
    """True when s [..., M, kb] is column-major with M padded to 16 bytes (kernel layout)."""
    if s.dim() < 2:
        return False
    if s.numel() == 0:  # nothing to lay out
        return True
    m, kb = s.shape[-2], s.shape[-1]
    mp = get_tma_aligned_size(m, s.element_size())
    if s.stride(-2) != 1 and m > 1:
        return False
    if kb > 1 and s.stride(-1) != mp:
        return False
    return s.dim() == 2 or kb * mp == s.stride(-3) or s.shape[-3] == 1


def empty_token_scales(lead: tuple[int, ...], m: int, kb: int, col_major: bool,
                       device: torch.device) -> torch.Tensor:
    """An uninitialised float32 [*lead, M, kb] for per-token scales: column-major with each
    column padded to 16 bytes (the layout is_col_major_tma_aligned accepts) when col_major, else
    row-major. One allocation with its strides (this runs on every quantisation)."""
    if not col_major:
        return torch.empty((*lead, m, kb), dtype=torch.float32, device=device)
    mp = get_tma_aligned_size(m, 4)
    strides, step = [], kb * mp
    for d in reversed(lead):
        strides.append(step)
        step *= d
    # NOTE: the padded rows are allocated too (a reader may address whole 16-byte columns,
    # e.g. a TMA box over mp rows), and cut off by a view only when there are any.
    s = torch.empty_strided((*lead, mp, kb), (*reversed(strides), 1, mp), dtype=torch.float32,
                            device=device)
    return s if mp == m else s[..., :m, :]


def get_col_major_tma_aligned_tensor(s: torch.Tensor) -> torch.Tensor:
    """The values of s [..., M, kb] in the layout fast kernels read: column-major, each column
    padded to 16 bytes. Returns s itself when it already has that layout."""
    if not isinstance(s, torch.Tensor) or s.dim() < 2:
        raise ValueError(f"s must be a tensor [..., M, kb], got "
                         f"{getattr(s, 'shape', type(s).__name__)}")
    if is_col_major_tma_aligned(s):
        return s
    *lead, m, kb = s.shape
    mp = get_tma_aligned_size(m, s.element_size())
    buf = torch.empty(*lead, kb, mp, dtype=s.dtype, device=s.device)
    out = buf[..., :m].transpose(-1, -2)
    out.copy_(s)
    return out


def get_m_alignment_for_contiguous_layout() -> int:
    """Rows each group is padded to in the contiguous grouped layout (one M tile)."""
    return CONTIGUOUS_M_ALIGNMENT


class _SmCount:
    """The one piece of mutable state: an optional cap on the SMs kernels may use."""

    override: int | None = None


def set_num_sms(num_sms: int | None) -> None:
    """Limit the SMs persistent kernels use (e.g. to leave room for communication kernels);
    None restores the device's count."""
    if num_sms is not None:
        if not isinstance(num_sms, int) or isinstance(num_sms, bool) or num_sms < 1:
            raise ValueError(f"num_sms must be a positive int or None, got {num_sms!r}")
        if torch.cuda.is_available():
            total = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
            if num_sms > total:
                raise ValueError(f"num_sms must be at most the device's {total} SMs, got {num_sms}")
    _SmCount.override = num_sms


def get_num_sms(device: torch.device | int | None = None) -> int:
    """SMs kernels use: the `set_num_sms` value, else the device's multiprocessor count."""
    if _SmCount.override is not None:
        return _SmCount.override
    if not torch.cuda.is_available():
        raise RuntimeError("get_num_sms: no CUDA device here; call set_num_sms(n) to set a count")
    if device is None:
        device = torch.cuda.current_device()
    return _device_sms(torch.device("cuda", device).index if isinstance(device, int)
                       else torch.device(device).index or 0)


def num_sms_override() -> int | None:
    """The `set_num_sms` value (None: every SM); cheap, for plans built under one to compare."""
    return _SmCount.override


@functools.lru_cache(maxsize=None)
def _device_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


# --- k-grouped operands -------------------------------------------------------------------------
# A k-grouped operand [rows, sum K] holds its groups one after another along K; its scales give
# each group ceil(K_g / 128) columns of their own. When every K_g is a multiple of 128 (exactly
# when sum K = 128 x the scale columns) group g starts at column 128 x its first scale column;
# otherwise the compiled kernels, which need 16-byte aligned group starts (TMA boxes, wgmma
# descriptors, vector loads), take a copy with every group moved to such a column.


def k_group_columns(ks: torch.Tensor, sum_k: int, num_blocks: int) -> torch.Tensor:
    """Where each of the sum_k columns of a k-grouped operand goes when every group starts on a
    128-column block: column j of group g (K_g = ks[g], clamped to [0, sum K] in order) to
    128 * kb_g + (j - off_g), kb_g = sum over h < g of ceil(K_h / 128); columns of no group, or
    past num_blocks blocks (ks and the scales disagree), to column 128 * num_blocks (a spare
    one). Device ops only: no synchronisation, safe to capture in a CUDA graph."""
    k = ks.to(torch.int64).clamp(min=0)
    ends = torch.cumsum(k, 0).clamp(max=sum_k)
    starts = ends - torch.diff(ends, prepend=ends.new_zeros(1))
    blocks = (ends - starts + SCALE_BLOCK - 1) // SCALE_BLOCK
    kb0 = torch.cumsum(blocks, 0) - blocks
    j = torch.arange(sum_k, device=ks.device)
    g = torch.searchsorted(ends, j, right=True)
    gc = g.clamp(max=ks.shape[0] - 1)
    dst = kb0[gc] * SCALE_BLOCK + (j - starts[gc])
    spare = SCALE_BLOCK * num_blocks
    return torch.where((g < ks.shape[0]) & (dst < spare), dst, spare)


def k_groups_on_blocks(t: torch.Tensor, columns: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """[rows, 128 * num_blocks] view of t's columns moved to `columns` (k_group_columns), zeros
    elsewhere: every group starts on a block and its last block is zero past its K. The buffer
    has 16 spare columns (the target of stray columns; rows stay 16-byte multiples)."""
    buf = torch.zeros(t.shape[0], SCALE_BLOCK * num_blocks + TMA_ALIGN_BYTES, dtype=torch.uint8,
                      device=t.device)
    buf.index_copy_(1, columns, t.view(torch.uint8))
    return buf[:, :SCALE_BLOCK * num_blocks].view(t.dtype)
