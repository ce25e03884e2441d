"""Input checks, scale-recipe resolution and the warm-call fast path's pieces, shared by the op
families.

Every check raises TypeError/ValueError naming the argument, what was given and what is needed.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .._settings import settings
from ..problem import FP8_DTYPES, OUT_DTYPES, SCALE_BLOCK, Recipe, ceil_div

_BLOCK = SCALE_BLOCK

# NOTE: the guard torch.compile checks the tensors of its graphs' inputs with: one C++ call
# compares the metadata of every tensor (~0.4 us for five, where reading it in Python costs
# ~2 us). Private API, hence the Python fallback in metadata_guard.
try:
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards
except ImportError:
    _TensorGuards = None

from torch._subclasses.fake_tensor import FakeTensor as _FakeTensor  # noqa: E402


def is_fake(t: torch.Tensor) -> bool:
    """Whether t is a fake tensor of torch.compile's tracing (metadata, no memory)."""
    return isinstance(t, _FakeTensor)


def shape_str(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def split_operand(name: str, operand) -> tuple[torch.Tensor, torch.Tensor]:
    """`operand` must be a (tensor, scale) pair."""
    if not isinstance(operand, (tuple, list)) or len(operand) != 2:
        raise TypeError(f"{name} must be a (tensor, scale) pair, got {type(operand).__name__}")
    t, s = operand
    if not isinstance(t, torch.Tensor) or not isinstance(s, torch.Tensor):
        raise TypeError(f"{name} must be a pair of tensors, got "
                        f"({type(t).__name__}, {type(s).__name__})")
    return t, s


def check_fp8(name: str, t: torch.Tensor, ndim: int, what: str) -> None:
    if t.dtype not in FP8_DTYPES:
        raise TypeError(f"{name} must be float8_e4m3fn or float8_e5m2, got {t.dtype}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {what}, got shape {shape_str(t.shape)}")


def check_device(name: str, t: torch.Tensor, device: torch.device, like: str = "a") -> None:
    if t.device != device:
        raise ValueError(f"{name} must be on {device} like {like}, got {t.device}")


def check_out_dtype(out_dtype: torch.dtype, name: str = "out_dtype") -> None:
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"{name} must be torch.bfloat16 or torch.float32, got {out_dtype}")


def resolve_out_dtype(out, out_dtype: torch.dtype | None) -> torch.dtype:
    """The output dtype: `out_dtype`, else out's dtype, else bfloat16; both must agree."""
    if out_dtype is None:
        out_dtype = out.dtype if isinstance(out, torch.Tensor) else torch.bfloat16
        check_out_dtype(out_dtype, "out")  # the dtype came from the caller's out
    check_out_dtype(out_dtype)
    if isinstance(out, torch.Tensor) and out.dtype != out_dtype:
        raise TypeError(f"out must have out_dtype {out_dtype}, got {out.dtype}")
    return out_dtype


def check_values_now(t: torch.Tensor) -> bool:
    """Value checks read memory: always on the CPU, on a GPU only when FP8GEMM_CHECK_VALUES=1
    (they synchronise the stream), never while a CUDA graph is being captured, and never while
    torch.compile traces (fake tensors have no values; a compiled graph's custom ops check
    CPU values when they run)."""
    if t.device.type == "meta" or torch.compiler.is_compiling() or is_fake(t):
        return False  # no values to read
    if t.device.type == "cpu":
        return True
    # NOTE: is_current_stream_capturing raises on a CPU-only torch build; ask only for CUDA.
    return settings.check_values and not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def check_scale_values(name: str, s: torch.Tensor) -> None:
    if s.numel() and check_values_now(s) and not bool(torch.isfinite(s).all()):
        raise ValueError(f"{name} scales must be finite, got a NaN or Inf")


def resolve_a_scale(name: str, s: torch.Tensor, lead: tuple[int, ...], rows: int, k: int,
                    device: torch.device) -> tuple[Recipe, torch.Tensor]:
    """A's scale -> (recipe, normalised scale). `lead` is () for 2-D A, (G,) for masked A.

    [] or [1]: per-tensor; lead+[rows] or lead+[rows, 1]: per-row; lead+[rows, ceil(K/128)]: 1x128.
    """
    kb = ceil_div(k, _BLOCK)
    _check_scale_tensor(name, s, device)
    shape = tuple(s.shape)
    if s.numel() == 1 and len(shape) <= 1:
        recipe, norm = Recipe.TENSOR, s.reshape(1)
    elif shape in (lead + (rows,), lead + (rows, 1)):
        recipe, norm = Recipe.ROW, s.reshape(lead + (rows,))
    elif shape == lead + (rows, kb):
        recipe, norm = Recipe.GROUP, s
    else:
        r = shape_str(lead + (rows,))
        raise ValueError(
            f"{name} scales must be [] or [1] (per-tensor), {r} (per-row) or "
            f"{shape_str(lead + (rows, kb))} (1x128 groups, ceil(K/128) = {kb}), "
            f"got {shape_str(shape)}")
    check_scale_values(name, s)
    return recipe, norm


def resolve_b_scale(name: str, s: torch.Tensor, lead: tuple[int, ...], n: int, k: int,
                    device: torch.device) -> tuple[Recipe, torch.Tensor]:
    """B's scale -> (recipe, normalised scale). `lead` is () for dense, (G,) for grouped B.

    Per-tensor: [] or [1] (dense), [G] or [G, 1] (grouped; [] or [1] broadcast to all groups);
    per-column: lead+[N] or lead+[N, 1]; 128x128 blocks: lead+[ceil(N/128), ceil(K/128)];
    1x128 groups: lead+[N, ceil(K/128)].
    """
    kb, nb = ceil_div(k, _BLOCK), ceil_div(n, _BLOCK)
    _check_scale_tensor(name, s, device)
    shape = tuple(s.shape)
    if s.numel() == 1 and len(shape) <= 1:
        recipe, norm = Recipe.TENSOR, s.reshape(1).expand(lead + (1,)).reshape(lead or (1,))
    elif lead and shape in (lead, lead + (1,)):
        recipe, norm = Recipe.TENSOR, s.reshape(lead)
    elif shape in (lead + (n,), lead + (n, 1)):
        recipe, norm = Recipe.ROW, s.reshape(lead + (n,))
    elif shape == lead + (nb, kb):
        recipe, norm = Recipe.BLOCK, s
    elif shape == lead + (n, kb):
        recipe, norm = Recipe.GROUP, s
    else:
        t = "[] or [1]" if not lead else f"{shape_str(lead)} or [] (per-tensor)"
        raise ValueError(
            f"{name} scales must be {t}, {shape_str(lead + (n,))} (per-column), "
            f"{shape_str(lead + (nb, kb))} (128x128 blocks) or {shape_str(lead + (n, kb))} "
            f"(1x128 groups; ceil(N/128) = {nb}, ceil(K/128) = {kb}), got {shape_str(shape)}")
    check_scale_values(name, s)
    return recipe, norm


def _check_scale_tensor(name: str, s: torch.Tensor, device: torch.device) -> None:
    if s.dtype != torch.float32:
        raise TypeError(f"{name} scales must be torch.float32, got {s.dtype}")
    check_device(f"{name} scales", s, device)


def check_index(name: str, t: torch.Tensor, shape: tuple[int, ...], device: torch.device,
                like: str = "a") -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.int32 tensor, got {type(t).__name__}")
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be torch.int32, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape_str(shape)}, got {shape_str(t.shape)}")
    check_device(name, t, device, like)


def prepare_out(out: torch.Tensor | None, shape: tuple[int, ...], out_dtype: torch.dtype,
                device: torch.device, zero: bool = False) -> torch.Tensor:
    """Check a caller's `out`, or allocate one (zeros when some rows may stay unwritten)."""
    if out is None:
        check_out_dtype(out_dtype)
        alloc = torch.zeros if zero else torch.empty
        return alloc(shape, dtype=out_dtype, device=device)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a tensor, got {type(out).__name__}")
    if out.dtype not in OUT_DTYPES:
        raise TypeError(f"out must be torch.bfloat16 or torch.float32, got {out.dtype}")
    if tuple(out.shape) != shape:
        raise ValueError(f"out must have shape {shape_str(shape)}, got {shape_str(out.shape)}")
    check_device("out", out, device)
    return out


# --- the warm-call fast path ----------------------------------------------------------------------
# NOTE: a warm eager call must cost a few microseconds of host time. Validation depends only on
# tensor metadata once value checks are off (GPU default), so each op remembers the outcome of its
# full path (the problem, the backend and how it runs) per metadata signature: found by a cheap key
# (element counts, the other arguments, hot_env()), then confirmed by a metadata guard over every
# tensor. Reading shapes, strides, dtypes and devices of five tensors in Python costs ~2 us; the
# guard compares them in one C++ call, and element counts are ints (no torch.Size to build and
# hash) that tell apart the shapes of a model's layers.
MAX_PLANS = 4096  # per op family's table; cleared when full
MAX_PER_KEY = 8  # signatures under one key (other shapes of equal size, strides, dtypes)


def values_unchecked(t: torch.Tensor) -> bool:
    """Whether calls on t's device skip value checks by default (so metadata decides everything):
    CUDA, where reading values would synchronise. CPU inputs always have their values checked."""
    return t.is_cuda


def metadata_decides(t: torch.Tensor) -> bool:
    """Whether a call on t's device may be remembered: its values go unchecked now."""
    return values_unchecked(t) and not settings.check_values


def remember(plans: dict, key: tuple, plan: tuple) -> None:
    """Add `plan` (its guard first) to the signatures under `key`, the oldest dropped past
    MAX_PER_KEY."""
    if len(plans) >= MAX_PLANS:
        plans.clear()
    # NOTE: a new tuple, not an append: a thread scanning the old one never sees it change.
    plans[key] = plans.get(key, ())[1 - MAX_PER_KEY:] + (plan,)


def scale_view(s: torch.Tensor,
               norm: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """How resolve_a_scale/resolve_b_scale turned scale `s` into `norm`, as a function for later
    scales with s's metadata; None when norm is s itself."""
    if norm is s:
        return None
    shape = tuple(norm.shape)
    if norm.numel() != s.numel():  # one per-tensor scale broadcast to every group
        return lambda x: x.reshape(1).expand(shape)
    return lambda x: x.reshape(shape)


def _metadata(t: torch.Tensor) -> tuple:
    return (type(t), t.shape, t.stride(), t.dtype, t.device)


def metadata_guard(tensors: tuple) -> Callable[..., bool]:
    """check(*ts) -> whether tensors ts have the metadata `tensors` have now: types, shapes,
    strides, dtypes, devices (torch's guard also compares requires_grad and dispatch keys, and
    fails a tensor passed twice, so it may say no where the Python check says yes: a miss, never
    a wrong hit)."""
    if _TensorGuards is not None:
        try:
            return _TensorGuards(*tensors, dynamic_dims_sizes=None, dynamic_dims_strides=None).check
        except TypeError:  # another signature in this torch: the Python check below
            pass
    expected = tuple(map(_metadata, tensors))
    return lambda *ts: tuple(map(_metadata, ts)) == expected


def contiguous_operand(t: torch.Tensor) -> torch.Tensor:
    """Backends read K-major contiguous operands; a strided view is copied once here."""
    return t if t.is_contiguous() else t.contiguous()


def run_into(out: torch.Tensor, fn) -> torch.Tensor:
    """Call `fn(dst)` with a contiguous destination; copy back when `out` is a strided view."""
    if out.is_contiguous():
        fn(out)
    else:
        tmp = out.contiguous()  # carries rows a grouped op leaves untouched
        fn(tmp)
        out.copy_(tmp)
    return out
