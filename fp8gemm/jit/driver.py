"""The CUDA driver, two ways.

Cold path (load a cubin, set attributes): `cuda.bindings.driver`, with its checked wrappers.
Hot path (launch, encode a tensor map): direct `ctypes` calls into libcuda with integer
arguments. NOTE: every launch pays Python-side argument marshalling; calling the C symbol with
plain ints and prebuilt structs keeps it to one ctypes call, where the generic `cuda.bindings`
wrappers build Python objects for every field on every call. Measured on the H200 machine: 5-6.5 us
per launch, most of it inside the driver (plain cuLaunchKernel through ctypes: 6.3-9.5 us).
"""

from __future__ import annotations

import ctypes
import functools

__all__ = ["DriverError", "bind_hot_path", "check", "lib", "error_name", "CUlaunchAttribute",
           "CUlaunchConfig", "CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION",
           "CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION"]

# cuda.h's CUlaunchAttributeID values
CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION = 4
CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class DriverError(RuntimeError):
    pass


class _ClusterDim(ctypes.Structure):
    _fields_ = [("x", ctypes.c_uint), ("y", ctypes.c_uint), ("z", ctypes.c_uint)]


class _AttrValue(ctypes.Union):
    _fields_ = [("pad", ctypes.c_char * 64), ("clusterDim", _ClusterDim),
                ("programmaticStreamSerializationAllowed", ctypes.c_int)]


class CUlaunchAttribute(ctypes.Structure):
    # cuda.h: { CUlaunchAttributeID id; char pad[8 - sizeof(id)]; CUlaunchAttributeValue value; }
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", _AttrValue)]


class CUlaunchConfig(ctypes.Structure):
    _fields_ = [("gridDimX", ctypes.c_uint), ("gridDimY", ctypes.c_uint), ("gridDimZ", ctypes.c_uint),
                ("blockDimX", ctypes.c_uint), ("blockDimY", ctypes.c_uint), ("blockDimZ", ctypes.c_uint),
                ("sharedMemBytes", ctypes.c_uint), ("hStream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(CUlaunchAttribute)), ("numAttrs", ctypes.c_uint)]


if ctypes.sizeof(CUlaunchAttribute) != 72 or ctypes.sizeof(CUlaunchConfig) != 56:
    raise ImportError("ctypes layout of CUlaunchAttribute/CUlaunchConfig disagrees with cuda.h")


def bind_hot_path(dst, cdll: ctypes.CDLL) -> None:
    """Set dst.cuLaunchKernelEx and dst.cuTensorMapEncodeTiled to cdll's, with integer-only
    prototypes (tests bind no-op stand-ins the same way)."""
    dst.cuLaunchKernelEx = cdll.cuLaunchKernelEx
    dst.cuLaunchKernelEx.restype = ctypes.c_int
    dst.cuLaunchKernelEx.argtypes = [ctypes.c_void_p] * 4
    dst.cuTensorMapEncodeTiled = cdll.cuTensorMapEncodeTiled
    dst.cuTensorMapEncodeTiled.restype = ctypes.c_int
    dst.cuTensorMapEncodeTiled.argtypes = [
        ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_void_p, ctypes.c_void_p,
        ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_int]


class _Lib:
    """libcuda symbols used on the hot path, with integer-only prototypes."""

    def __init__(self) -> None:
        cuda = ctypes.CDLL("libcuda.so.1")
        bind_hot_path(self, cuda)
        self.cuGetErrorName = cuda.cuGetErrorName
        self.cuGetErrorName.restype = ctypes.c_int
        self.cuGetErrorName.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]


@functools.lru_cache(maxsize=1)
def lib() -> _Lib:
    try:
        return _Lib()
    except OSError as e:
        raise DriverError(f"cannot load the CUDA driver (libcuda.so.1): {e}") from e


def error_name(code: int) -> str:
    name = ctypes.c_char_p()
    if lib().cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return name.value.decode()
    return f"CUresult {code}"


def check(result, what: str):
    """Unwrap a `cuda.bindings` result tuple (err, *values), raising DriverError on failure."""
    from cuda.bindings import driver

    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise DriverError(f"{what} failed: {err.name if hasattr(err, 'name') else err}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)
