"""TMA descriptors (`cuTensorMapEncodeTiled`), cached while pointer, shape and strides hold.

Descriptions are generic: a tensor of `rank` dims (innermost first, as the driver wants them),
a box, a swizzle mode. Encoding costs a few microseconds of host time; a hit in
`TensorMapCache` costs one dict lookup.
"""

from __future__ import annotations

import ctypes
import enum
from collections import OrderedDict

import torch

from . import driver

__all__ = ["Swizzle", "TensorMap", "encode_tiled", "TensorMapCache", "tma_dtype"]


class Swizzle(enum.IntEnum):
    NONE = 0
    B32 = 1
    B64 = 2
    B128 = 3


# CUtensorMapDataType values (cuda.h). FP8 travels as UINT8: TMA only moves bytes.
_DTYPES = {
    torch.uint8: 0, torch.int8: 0, torch.float8_e4m3fn: 0, torch.float8_e5m2: 0,
    torch.float16: 6, torch.float32: 7, torch.bfloat16: 9,
}
_L2_PROMOTION_256B = 3


def tma_dtype(dtype: torch.dtype) -> int:
    if dtype not in _DTYPES:
        raise ValueError(f"no TMA data type for {dtype}")
    return _DTYPES[dtype]


class TensorMap:
    """One encoded CUtensorMap: 128 bytes at a 64-byte aligned address (the driver's rule)."""

    __slots__ = ("_buf", "address", "key")

    def __init__(self, key: tuple) -> None:
        self._buf = ctypes.create_string_buffer(128 + 64)
        base = ctypes.addressof(self._buf)
        self.address = (base + 63) // 64 * 64
        self.key = key


def encode_tiled(dtype: torch.dtype, address: int, dims: tuple[int, ...],
                 strides_bytes: tuple[int, ...], box: tuple[int, ...],
                 swizzle: Swizzle = Swizzle.NONE) -> TensorMap:
    """Encode a tiled tensor map. dims/box are innermost first; strides_bytes are the rank - 1
    strides of dims[1:] (the innermost dim is contiguous). Checks TMA's rules first so that a
    violation says which one instead of CUDA_ERROR_INVALID_VALUE."""
    rank = len(dims)
    if not (1 <= rank <= 5) or len(box) != rank or len(strides_bytes) != rank - 1:
        raise ValueError(f"rank {rank}: dims {dims}, box {box}, strides {strides_bytes} disagree")
    if address % 16:
        raise ValueError(f"TMA needs a 16-byte aligned base address, got {address:#x}")
    if any(not 1 <= d <= 2 ** 32 for d in dims):
        raise ValueError(f"TMA dims are 1..2^32 elements, got {dims}")
    if any(s % 16 or not 0 < s < 2 ** 40 for s in strides_bytes):
        raise ValueError(f"TMA needs strides that are multiples of 16 bytes in (0, 2^40), "
                         f"got {strides_bytes}")
    if any(not 1 <= b <= 256 for b in box):
        raise ValueError(f"TMA boxes are 1..256 elements a side, got {box}")
    elem = torch.empty((), dtype=dtype).element_size()
    if (box[0] * elem) % 16:
        raise ValueError(f"TMA needs an inner box of a multiple of 16 bytes, got {box[0] * elem}")
    if swizzle != Swizzle.NONE and box[0] * elem > 16 << int(swizzle):
        raise ValueError(f"inner box of {box[0] * elem} bytes exceeds the {16 << int(swizzle)}-byte swizzle")
    key = (dtype, address, dims, strides_bytes, box, int(swizzle))
    tmap = TensorMap(key)
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    c_dims = (u64 * rank)(*dims)
    c_strides = (u64 * max(rank - 1, 1))(*strides_bytes) if rank > 1 else (u64 * 1)(0)
    c_box = (u32 * rank)(*box)
    c_elem_strides = (u32 * rank)(*([1] * rank))
    rc = driver.lib().cuTensorMapEncodeTiled(
        tmap.address, tma_dtype(dtype), rank, address, ctypes.addressof(c_dims),
        ctypes.addressof(c_strides), ctypes.addressof(c_box), ctypes.addressof(c_elem_strides),
        0, int(swizzle), _L2_PROMOTION_256B, 0)
    if rc != 0:
        raise driver.DriverError(f"cuTensorMapEncodeTiled({key}) failed: {driver.error_name(rc)}")
    return tmap


class TensorMapCache:
    """Bounded LRU of encoded tensor maps keyed by everything the encoding reads."""

    def __init__(self, capacity: int = 256) -> None:
        self.capacity = capacity
        self._maps: OrderedDict[tuple, TensorMap] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, dtype: torch.dtype, address: int, dims: tuple[int, ...],
            strides_bytes: tuple[int, ...], box: tuple[int, ...],
            swizzle: Swizzle = Swizzle.NONE) -> TensorMap:
        key = (dtype, address, dims, strides_bytes, box, int(swizzle))
        tmap = self._maps.get(key)
        if tmap is not None:
            self.hits += 1
            try:
                self._maps.move_to_end(key)
            except KeyError:  # another thread evicted it meanwhile; the map itself is still good
                pass
            return tmap
        self.misses += 1
        tmap = encode_tiled(dtype, address, dims, strides_bytes, box, swizzle)
        self._maps[key] = tmap
        if len(self._maps) > self.capacity:
            self._maps.popitem(last=False)
        return tmap
