"""nn modules over the fp8gemm ops: Fp8Linear and Fp8MoE, for inference and training.

Weights are stored quantised per 128x128 block (DeepSeek-V3 recipe); activations are quantised
per 1x128 token group on every call. With `trainable=True` a module keeps a bf16 (or float32)
master weight as its nn.Parameter, quantises it again whenever it changed, and differentiates
through FP8 GEMMs (see `_Fp8LinearFunction`). The modules call the public ops (the warm eager fast path;
the `torch.ops.fp8gemm` custom ops while torch.compile traces) and capture in CUDA graphs (the
masked MoE path needs no host synchronisation). `convert` swaps a model's nn.Linear layers.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from . import quant
from . import torch_ops  # noqa: F401  (registers torch.ops.fp8gemm)
from .ops import (fp8_gemm_nt, m_grouped_fp8_gemm_nt_contiguous, m_grouped_fp8_gemm_nt_masked,
                  m_grouped_fp8_gemm_nt_offsets)
from .layout import get_col_major_tma_aligned_tensor
from .problem import FP8_DTYPES, SCALE_BLOCK, ceil_div
from .moe import (moe_combine_contiguous, moe_combine_masked, moe_dispatch_contiguous,
                  moe_dispatch_masked)

__all__ = ["Fp8Linear", "Fp8MoE", "convert", "ConvertReport", "DEFAULT_EXCLUDE"]


def _check_features(what: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what}: {name} must be a non-negative int, got {value!r}")


_MASTER_DTYPES = (torch.bfloat16, torch.float32)


def _check_training_options(what: str, trainable, master_dtype, grad_format) -> None:
    if not isinstance(trainable, bool):
        raise TypeError(f"{what}: trainable must be a bool, got {trainable!r}")
    if master_dtype not in _MASTER_DTYPES:
        raise TypeError(f"{what}: master_dtype must be torch.bfloat16 or torch.float32, got "
                        f"{master_dtype}")
    if grad_format not in quant.FORMATS:
        raise ValueError(f"{what}: grad_format must be 'e4m3' or 'e5m2', got {grad_format!r}")


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# --- pre-quantised weights ------------------------------------------------------------------------
# A checkpoint quantised per 128x128 block (DeepSeek-V3, and the fine-grained FP8 checkpoints that
# follow it) stores each weight in fp8 beside its block scales, under the name `<weight>_scale_inv`
# (a dequantisation multiplier despite the name: real value = weight * scale, the meaning of this
# library's `<weight>_scale`). The modules take such weights as they are, with no second rounding.

def _fp8_non_finite(q: torch.Tensor) -> int:
    """NaN (and e5m2 Inf) codes in an fp8 tensor, counted on its bits (fp8 has no isfinite)."""
    bits = q.view(torch.uint8) & 0x7F
    bad = bits == 0x7F if q.dtype == torch.float8_e4m3fn else bits >= 0x7C
    return int(bad.sum())


def _checked_fp8_weight(what: str, name: str, q: torch.Tensor, scale, shape: tuple,
                        fmt: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """A pre-quantised weight `q` (fp8; in format `fmt` unless None) of `shape` and its 128x128
    block scales, checked; the scales as float32."""
    if fmt is not None and q.dtype != quant.fp8_dtype(fmt)[0]:
        raise TypeError(f"{what}: {name} is {q.dtype} but the module stores "
                        f"{quant.fp8_dtype(fmt)[0]} (fmt={fmt!r}); build it with the "
                        f"checkpoint's format, or dequantise the weight first "
                        f"(fp8gemm.dequantize_per_block)")
    if tuple(q.shape) != tuple(shape):
        raise ValueError(f"{what}: {name} must be {list(shape)}, got {list(q.shape)}")
    want = (*shape[:-2], ceil_div(shape[-2], SCALE_BLOCK), ceil_div(shape[-1], SCALE_BLOCK))
    if scale is None:
        raise ValueError(f"{what}: {name} is fp8 ({q.dtype}) and needs its 128x128 block scales "
                         f"{list(want)} ({name}_scale, or {name}_scale_inv as DeepSeek-V3 "
                         f"checkpoints name them)")
    if not isinstance(scale, torch.Tensor) or not scale.is_floating_point() \
            or scale.dtype in FP8_DTYPES:
        raise TypeError(f"{what}: {name}_scale must be a float32 tensor, got "
                        f"{getattr(scale, 'dtype', type(scale).__name__)}")
    lead = tuple(shape[:-2])
    if tuple(scale.shape) in {lead, lead + (1,), lead + (1, 1)} | ({(1,)} if not lead else set()):
        # one scale per tensor (per expert): every block takes it, exactly
        scale = scale.reshape(*lead, 1, 1).expand(want)
    if tuple(scale.shape) != want:
        raise ValueError(f"{what}: {name}_scale must be {list(want)} (one per 128x128 block of "
                         f"{name} {list(shape)}) or one per tensor, got {list(scale.shape)}")
    scale = scale.float().contiguous()
    if q.is_meta or scale.is_meta:
        return q, scale  # (no values to check: a skeleton's state dict)
    if not bool(torch.isfinite(scale).all()):
        raise ValueError(f"{what}: {name}_scale must be finite, got "
                         f"{int((~torch.isfinite(scale)).sum())} NaN or Inf value(s)")
    bad = _fp8_non_finite(q)
    if bad:
        raise ValueError(f"{what}: {name} must be finite, got {bad} NaN or Inf code(s)")
    return q, scale


def _stored_form(module, what: str, name: str, w, scale):
    """What `module` keeps of weight `name` (of its parameter's or buffer's shape) given `w`
    (and, for an fp8 `w`, its block scales `scale`): (weight, scale) for an inference module,
    which stores fp8 per 128x128 block (a floating-point `w` quantised here, an fp8 one as it
    is); (weight, None) for a trainable one, whose master weight takes a floating-point `w` as
    it is and an fp8 one dequantised."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point():
        raise TypeError(f"{what}: {name} must be a floating-point tensor, got "
                        f"{getattr(w, 'dtype', type(w).__name__)}")
    shape = tuple(getattr(module, name).shape)
    if w.dtype in FP8_DTYPES:
        q, s = _checked_fp8_weight(what, name, w, scale, shape,
                                   None if module.trainable else module.fmt)
        if module.trainable:
            return quant.dequantize_per_block(q, s, getattr(module, name).dtype), None
        return q, s
    if scale is not None:
        raise ValueError(f"{what}: {name}_scale goes with an fp8 {name}; a {w.dtype} {name} is "
                         f"quantised here")
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"{what}: {name} must be {list(shape)}, got {list(w.shape)}")
    if module.trainable:
        return w, None
    if not w.is_meta and not bool(torch.isfinite(w).all()):
        raise ValueError(f"{what}: {name} must be finite to quantise to fp8, got "
                         f"{int((~torch.isfinite(w)).sum())} NaN or Inf value(s)")
    return quant.quantize_per_block(w, module.fmt, pow2_scales=module.pow2_scales)


def _load_checkpoint_weight(module, what: str, state_dict: dict, prefix: str, name: str) -> None:
    """Put weight `name` of a state dict into the form `module` keeps (`_stored_form`), in
    place, before nn.Module loads it, which would cast across fp8 and float with no scale.
    Block scales named `<name>_scale_inv` (DeepSeek-V3's name) are taken as `<name>_scale`."""
    key, skey, ikey = prefix + name, prefix + name + "_scale", prefix + name + "_scale_inv"
    if ikey in state_dict:
        if skey in state_dict:
            raise ValueError(f"{what}: the state dict has both {skey} and {ikey}; give one")
        state_dict[skey] = state_dict.pop(ikey)
    if key not in state_dict:
        return
    w, s = _stored_form(module, what, name, state_dict[key], state_dict.pop(skey, None))
    state_dict[key] = w
    if s is not None:
        state_dict[skey] = s


class _Fp8Cache:
    """The fp8 copy of a master weight, quantised again when the weight changed: its version
    counter moved (every in-place update does that, an optimizer step included; writes through
    `weight.data` do not, call `refresh()` after them) or its storage, dtype or device did.
    While torch.compile traces, the copy is quantised in the graph on every call instead (the
    compiled step then reads the weight it is given)."""

    def __init__(self, fmt: str, pow2_scales: bool):
        self.fmt, self.pow2_scales = fmt, pow2_scales
        self.key = self.value = None

    def get(self, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if torch.compiler.is_compiling():
            return quant.quantize_per_block(w.detach(), self.fmt, pow2_scales=self.pow2_scales)
        key = (w._version, w.data_ptr(), w.dtype, w.device)
        if key != self.key:
            with torch.no_grad():
                self.value = quant.quantize_per_block(w.detach(), self.fmt,
                                                      pow2_scales=self.pow2_scales)
            self.key = key
        return self.value

    def refresh(self) -> None:
        self.key = self.value = None


def _grad_out_dtype(dtype: torch.dtype) -> torch.dtype:
    """GEMM output dtype of a gradient that ends in `dtype`: float32 for float32, else bf16
    (the dtype the fastest kernels write)."""
    return torch.float32 if dtype == torch.float32 else torch.bfloat16


class _Fp8LinearFunction(torch.autograd.Function):
    """y = x . W^T + bias through FP8 GEMMs, forward and backward.

    forward:  y  = q(x) . q(W)^T + bias         x per 1x128 group along K, W per 128x128 block
    backward: dX = q(dY) . q(W^T)^T             dY per 1x128 group along N (grad_fmt), W^T per
                                                128x128 block, quantised again from the master
              dW = q(dY^T) . q(X^T)^T           both per 1x128 group along the token axis (the
                                                1x128-group B recipe), float32 output
              db = sum of dY over tokens        float32
    FP8 wgmma reads both operands K-major, so the transposes happen in the quantisers. Saved for
    backward: X^T in fp8 with its scales (when W needs a gradient) and the master weight.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, w_q, w_s, fmt: str, grad_fmt: str, pow2: bool,
                out_dtype: torch.dtype):
        a, sa = quant.quantize_per_token(x, fmt, pow2_scales=pow2)
        c = None if bias is None else bias.float().expand(x.shape[0], w_q.shape[0])
        y = fp8_gemm_nt((a, sa), (w_q, w_s), c=c, out_dtype=out_dtype)
        xt = st = None
        if ctx.needs_input_grad[1]:
            xt, st = quant.quantize_per_token_transposed(x, fmt, pow2_scales=pow2)
        ctx.save_for_backward(xt, st, weight)
        ctx.fmt, ctx.grad_fmt, ctx.pow2, ctx.x_dtype = fmt, grad_fmt, pow2, x.dtype
        ctx.has_bias = bias is not None
        return y

    @staticmethod
    def backward(ctx, dy):
        xt, st, weight = ctx.saved_tensors
        dx = dw = db = None
        if ctx.needs_input_grad[0]:
            g, sg = quant.quantize_per_token(dy, ctx.grad_fmt, pow2_scales=ctx.pow2)
            wt, swt = quant.quantize_per_block_transposed(weight.detach(), ctx.fmt,
                                                          pow2_scales=ctx.pow2)
            dx = fp8_gemm_nt((g, sg), (wt, swt),
                             out_dtype=_grad_out_dtype(ctx.x_dtype)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            gt, sgt = quant.quantize_per_token_transposed(dy, ctx.grad_fmt, pow2_scales=ctx.pow2)
            dw = fp8_gemm_nt((gt, sgt), (xt, st), out_dtype=torch.float32).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = dy.float().sum(0)
        return dx, dw, db, None, None, None, None, None, None


class Fp8Linear(nn.Module):
    """y = x @ W^T + bias with W in fp8 (128x128 block scales) and x quantised per 1x128 group.

    x [..., in_features] (bf16/fp16/fp32) -> y [..., out_features] in `out_dtype` (bf16). The
    bias is kept in float32 and added to the float32 accumulator (the GEMM's `c` input), so the
    output is rounded once. `name` (set by `convert` to the layer's path in its model) appears in
    every error the layer raises.

    Inference (default): `weight` is an fp8 buffer [out_features, in_features] with
    `weight_scale` [ceil(out/128), ceil(in/128)], quantised once by `load_weight`.

    Training (`trainable=True`): `weight` is an nn.Parameter in `master_dtype` (bf16 or
    float32, initialised as nn.Linear's), `bias` a float32 nn.Parameter; the fp8 copy the
    forward reads is quantised again whenever the weight changed (`refresh_weight()` after
    writes through `weight.data`). Gradients flow through FP8 GEMMs: dY is quantised in
    `grad_format` ("e4m3", or "e5m2" for its wider range), W^T per 128x128 block and dY^T, X^T
    per 1x128 group along the tokens; `pow2_scales` rounds every scale up to a power of two.
    Without a gradient to compute (torch.no_grad, eval) it runs the inference path on the
    cached copy.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 fmt: str = "e4m3", out_dtype: torch.dtype = torch.bfloat16, device=None,
                 name: str | None = None, trainable: bool = False,
                 master_dtype: torch.dtype = torch.bfloat16, grad_format: str = "e4m3",
                 pow2_scales: bool = False):
        super().__init__()
        self.name = name
        what = self._what(in_features, out_features)
        _check_features(what, "in_features", in_features)
        _check_features(what, "out_features", out_features)
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"{what}: out_dtype must be torch.bfloat16 or torch.float32, got "
                            f"{out_dtype}")
        _check_training_options(what, trainable, master_dtype, grad_format)
        self.in_features, self.out_features, self.fmt, self.out_dtype = (
            in_features, out_features, fmt, out_dtype)
        self.trainable, self.grad_format, self.pow2_scales = trainable, grad_format, pow2_scales
        dtype, _ = quant.fp8_dtype(fmt)
        if trainable:
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=master_dtype,
                                                   device=device))
            self.bias = (nn.Parameter(torch.empty(out_features, dtype=torch.float32,
                                                  device=device)) if bias else None)
            self._fp8 = _Fp8Cache(fmt, pow2_scales)
            self.reset_parameters()
            return
        nb, kb = ceil_div(out_features, SCALE_BLOCK), ceil_div(in_features, SCALE_BLOCK)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones(nb, kb, dtype=torch.float32,
                                                        device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=torch.float32, device=device),
                                  requires_grad=False) if bias else None)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """nn.Linear's initialisation of a trainable layer's master weight and bias."""
        if not self.trainable:
            raise ValueError(f"{self._what()}: reset_parameters needs trainable=True (an "
                             f"inference layer's weight comes from load_weight)")
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(self.in_features) if self.in_features else 0.0
            nn.init.uniform_(self.bias, -bound, bound)

    def refresh_weight(self) -> None:
        """Quantise a trainable layer's master weight again on the next call (needed only after
        writes that bypass its version counter, such as through `weight.data`)."""
        if self.trainable:
            self._fp8.refresh()

    def _what(self, in_features=None, out_features=None) -> str:
        if self.name is not None:
            return f"Fp8Linear {self.name!r}"
        i = self.in_features if in_features is None else in_features
        o = self.out_features if out_features is None else out_features
        return f"Fp8Linear(in_features={i}, out_features={o})"

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str = "e4m3",
                    out_dtype: torch.dtype = torch.bfloat16, *,
                    name: str | None = None, **training) -> "Fp8Linear":
        """Quantise an nn.Linear's weight per 128x128 block (once, here); with
        `trainable=True` (and the other training options of `Fp8Linear`) copy it into the
        master weight instead. A linear layer that holds a pre-quantised fp8 weight (such as
        transformers' fine-grained FP8 layers: `weight` fp8 and `weight_scale_inv`, `block_size`
        (128, 128)) is taken as it is, see `load_weight`; its activations are then quantised
        per 1x128 group on every call, whatever scheme the layer used."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear{f' ({name!r})' if name else ''}, "
                            f"got {type(linear).__name__}")
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt=fmt,
                out_dtype=out_dtype, device=linear.weight.device, name=name, **training)
        weight, scale = linear.weight.detach(), None
        if weight.dtype in FP8_DTYPES:
            scale = getattr(linear, "weight_scale_inv", None)
            if scale is None:
                scale = getattr(linear, "weight_scale", None)
            block = getattr(linear, "block_size", None)
            if block is not None and tuple(block) != (SCALE_BLOCK, SCALE_BLOCK):
                raise ValueError(f"{m._what()}: the layer's fp8 weight is scaled per "
                                 f"{list(block)} block; Fp8Linear takes 128x128 blocks "
                                 f"(dequantise it first: fp8gemm.dequantize_per_block)")
            scale = None if scale is None else scale.detach()
        m.load_weight(weight, None if linear.bias is None else linear.bias.detach(),
                      weight_scale=scale)
        return m

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                    weight_scale: torch.Tensor | None = None) -> None:
        """Put `weight` [out_features, in_features] into this layer and copy `bias`.

        A floating-point weight is quantised per 128x128 block (a trainable layer copies it
        into its master weight). An fp8 weight is pre-quantised (a DeepSeek-V3-style
        checkpoint's `weight` with `weight_scale_inv`): `weight_scale` [ceil(out/128),
        ceil(in/128)] holds its block scales (real value = weight * scale; one scale for the
        whole tensor is taken by every block), and the pair is stored as it is, in the layer's
        `fmt` (a trainable layer dequantises it into its master weight)."""
        w, s = _stored_form(self, self._what(), "weight", weight, weight_scale)
        self.weight.copy_(w)
        if s is not None:
            self.weight_scale.copy_(s)
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"{self._what()}: bias given but the layer has bias=False")
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"{self._what()}: bias must be [{self.out_features}], got "
                                 f"{list(bias.shape)}")
            self.bias.copy_(bias)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _load_checkpoint_weight(self, self._what(), state_dict, prefix, "weight")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"{self._what()}: x must be [..., {self.in_features}], got "
                             f"{list(getattr(x, 'shape', []))}")
        lead = x.shape[:-1]
        x2 = x.reshape(lead.numel(), self.in_features)  # (-1 is ambiguous when in_features = 0)
        if self.trainable:
            y = self._forward_trainable(x2)
        else:
            a, sa = quant.quantize_per_token(x2, self.fmt, pow2_scales=self.pow2_scales)
            c = None
            if self.bias is not None:  # added in float32, before the one rounding to out_dtype
                c = self.bias.expand(x2.shape[0], self.out_features)
            y = fp8_gemm_nt((a, sa), (self.weight, self.weight_scale), c=c,
                            out_dtype=self.out_dtype)
        return y.reshape(*lead, self.out_features)

    def _forward_trainable(self, x2: torch.Tensor) -> torch.Tensor:
        w_q, w_s = self._fp8.get(self.weight)
        bias = self.bias
        if _needs_grad(x2, self.weight, bias):
            return _Fp8LinearFunction.apply(x2, self.weight, bias, w_q, w_s, self.fmt,
                                            self.grad_format, self.pow2_scales, self.out_dtype)
        a, sa = quant.quantize_per_token(x2, self.fmt, pow2_scales=self.pow2_scales)
        c = None if bias is None else bias.detach().expand(x2.shape[0], self.out_features)
        return fp8_gemm_nt((a, sa), (w_q, w_s), c=c, out_dtype=self.out_dtype)

    def extra_repr(self) -> str:
        text = (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fmt={self.fmt}")
        if self.trainable:
            text += (f", trainable, master_dtype={self.weight.dtype}, "
                     f"grad_format={self.grad_format}")
        return text + (", pow2_scales" if self.pow2_scales else "")


@dataclass
class ConvertReport:
    """What `convert` did: the layers it converted, and each one it left, with the reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    # the converted layers that already held fp8 weights, taken with their scales as stored
    prequantised: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} nn.Linear layer(s) to Fp8Linear, "
                 f"left {len(self.skipped)}"]
        lines += [f"  fp8   {name}" + (" (pre-quantised, kept as stored)"
                                       if name in self.prequantised else "")
                  for name in self.converted]
        lines += [f"  kept  {name}: {why}" for name, why in self.skipped.items()]
        return "\n".join(lines)


# Layers commonly left in higher precision: the output head (its logits are what the loss and
# sampling read) and classifier/pooler heads.
DEFAULT_EXCLUDE = ("lm_head", "*.lm_head", "head", "*.head", "classifier", "*.classifier")


def convert(model: nn.Module, include=None, exclude=DEFAULT_EXCLUDE, min_features: int = 128, *,
            fmt: str = "e4m3", out_dtype: torch.dtype = torch.bfloat16) -> ConvertReport:
    """Swap the nn.Linear layers of `model` for Fp8Linear, in place, quantising each weight once.

    A layer (named by its path in `model.named_modules()`, e.g. "encoder.layer.0.attention.q")
    is converted when it matches a pattern of `include` (fnmatch patterns; None: every layer),
    matches none of `exclude` (default: output and classifier heads, `DEFAULT_EXCLUDE`), and
    has in_features and out_features both at least `min_features` (smaller layers gain little
    from fp8 and lose the most accuracy: one 128-wide scale group spans the whole row). Pass
    the first projection's name in `exclude` to keep it too. A layer shared by several paths is
    converted once. Returns a `ConvertReport`; a layer whose weight cannot be quantised (NaN,
    Inf) raises ValueError naming it.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if isinstance(model, nn.Linear):
        raise TypeError("convert swaps the layers inside a model; for one nn.Linear use "
                        "Fp8Linear.from_linear")
    include, exclude = _patterns("include", include), _patterns("exclude", exclude) or ()
    _check_features("convert", "min_features", min_features)
    report, done = ConvertReport(), {}
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent._modules.items()):  # aliases too
            if not isinstance(child, nn.Linear):
                continue
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if id(child) in done:
                if done[id(child)] is not None:
                    setattr(parent, child_name, done[id(child)])
                continue
            why = _why_kept(name, child, include, exclude, min_features)
            if why is not None:
                report.skipped[name] = why
                done[id(child)] = None
                continue
            fp8 = Fp8Linear.from_linear(child, fmt, out_dtype, name=name)
            setattr(parent, child_name, fp8)
            done[id(child)] = fp8
            report.converted.append(name)
            if child.weight.dtype in FP8_DTYPES:
                report.prequantised.append(name)
    return report


def _patterns(arg: str, value) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = (value,)
    value = tuple(value)
    if not all(isinstance(p, str) for p in value):
        raise TypeError(f"{arg} must be a pattern string or a sequence of them, got {value!r}")
    return value


def _why_kept(name, layer, include, exclude, min_features) -> str | None:
    if include is not None and not any(fnmatch.fnmatchcase(name, p) for p in include):
        return "not matched by include"
    hit = next((p for p in exclude if fnmatch.fnmatchcase(name, p)), None)
    if hit is not None:
        return f"matched exclude pattern {hit!r}"
    small = min(layer.in_features, layer.out_features)
    if small < min_features:
        return (f"[{layer.out_features}, {layer.in_features}] has a side under "
                f"min_features={min_features}")
    return None


def _silu_mul_backward(h13: torch.Tensor, dz: torch.Tensor):
    """(dH13, z) for z = silu(gate) * up, [gate | up] = h13, in float32."""
    gate, up = h13.float().chunk(2, dim=-1)
    sig = torch.sigmoid(gate)
    silu = gate * sig
    dz = dz.float()
    dgate = dz * up * (sig * (1 + gate * (1 - sig)))
    return torch.cat([dgate, dz * silu], dim=-1), silu * up


def _expert_wgrad(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor, grad_fmt: str,
                  fmt: str, pow2: bool) -> torch.Tensor:
    """dW[g] = dY_g^T . X_g for the rows offsets[g]:offsets[g+1] of dy [R, N] and x [R, K]:
    float32 [G, N, K], in one masked grouped GEMM whose GEMM-K is the token axis.

    Each expert's rows are gathered into [G, Tmax, .] (zero rows past its count, which add
    nothing and leave every 1x128 amax as it was), quantised along the tokens with the
    transposing quantiser, and multiplied as A_g = dY_g^T [N, Tmax], B_g = X_g^T [K, Tmax]
    (1x128-group B scales). Tmax is read on the host (one synchronisation, as the contiguous
    layout's own sizing)."""
    g = offsets.numel() - 1
    rows, n, k = dy.shape[0], dy.shape[1], x.shape[1]
    starts = offsets[:-1].long()
    counts = offsets[1:].long() - starts
    tmax = int(counts.max()) if g else 0
    if tmax == 0:
        return torch.zeros(g, n, k, dtype=torch.float32, device=dy.device)
    t = torch.arange(tmax, device=dy.device)
    index = torch.where(t < counts[:, None], starts[:, None] + t, rows)  # row `rows`: zeros

    def gather(v):
        return torch.cat([v, v.new_zeros(1, v.shape[1])])[index]  # [G, Tmax, C]

    a, sa = quant.quantize_per_token_transposed(gather(dy), grad_fmt, pow2_scales=pow2)
    b, sb = quant.quantize_per_token_transposed(gather(x), fmt, pow2_scales=pow2)
    masked_m = torch.full((g,), n, dtype=torch.int32, device=dy.device)
    return m_grouped_fp8_gemm_nt_masked((a, sa), (b, sb), None, masked_m, n,
                                        out_dtype=torch.float32)


def _grouped(a, sa, b, sb, rows_index, layout: str, out_dtype=torch.bfloat16, out=None):
    """The contiguous (rows_index = m_indices) or offsets (rows_index = offsets) grouped GEMM
    (into zeros, or into `out`, whose rows of no group it leaves as they are)."""
    if layout == "contiguous":
        return m_grouped_fp8_gemm_nt_contiguous((a, sa), (b, sb), out, rows_index,
                                                out_dtype=out_dtype)
    return m_grouped_fp8_gemm_nt_offsets((a, sa), (b, sb), out, rows_index, out_dtype=out_dtype)


class _Fp8ExpertsFunction(torch.autograd.Function):
    """The expert part of Fp8MoE on rows already grouped by expert (contiguous or offsets
    layout): y = W2_g . (silu(W1_g x) * W3_g x) through FP8 GEMMs, forward and backward.

    forward:  h13 = q(x) . q(W13_g)^T,  z = silu(gate) * up,  y = q(z) . q(W2_g)^T
    backward: dz  = q(dY) . q(W2_g^T)^T       (grouped, the layout of the forward)
              dh13 from dz through SiLU * mul, in float32
              dx  = q(dh13) . q(W13_g^T)^T    (grouped)
              dW2_g = q(dY_g^T) . q(Z_g^T)^T, dW13_g = q(dh13_g^T) . q(X_g^T)^T (`_expert_wgrad`)
    Gradients are quantised in grad_fmt, per 1x128 group (along the features for dgrad, along
    the tokens for wgrad); weights per 128x128 block, W^T quantised again from the master.
    Saved: x and h13 in their own dtype (the wgrad needs them along the token axis) and the
    master weights. Padding rows stay zero throughout (the grouped GEMMs leave them zero).
    """

    @staticmethod
    def forward(ctx, x, w13, w2, w13_q, w13_s, w2_q, w2_s, rows_index, offsets, layout: str,
                fmt: str, grad_fmt: str, pow2: bool):
        a, sa = quant.quantize_per_token(x, fmt, pow2_scales=pow2)
        h13 = _grouped(a, sa, w13_q, w13_s, rows_index, layout)
        a2, sa2 = quant.silu_mul_quantize_per_token(h13, fmt, pow2_scales=pow2)
        y = _grouped(a2, sa2, w2_q, w2_s, rows_index, layout)
        ctx.save_for_backward(x, h13, w13, w2, rows_index, offsets)
        ctx.layout, ctx.fmt, ctx.grad_fmt, ctx.pow2 = layout, fmt, grad_fmt, pow2
        return y

    @staticmethod
    def backward(ctx, dy):
        x, h13, w13, w2, rows_index, offsets = ctx.saved_tensors
        fmt, gfmt, pow2 = ctx.fmt, ctx.grad_fmt, ctx.pow2
        g, sg = quant.quantize_per_token(dy, gfmt, pow2_scales=pow2)
        w2t, s2t = quant.quantize_per_block_transposed(w2.detach(), fmt, pow2_scales=pow2)
        dz = _grouped(g, sg, w2t, s2t, rows_index, ctx.layout)
        dh13, z = _silu_mul_backward(h13, dz)
        dx = dw13 = dw2 = None
        if ctx.needs_input_grad[0]:
            gh, sgh = quant.quantize_per_token(dh13, gfmt, pow2_scales=pow2)
            w13t, s13t = quant.quantize_per_block_transposed(w13.detach(), fmt, pow2_scales=pow2)
            dx = _grouped(gh, sgh, w13t, s13t, rows_index, ctx.layout,
                          _grad_out_dtype(x.dtype)).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw13 = _expert_wgrad(dh13, x, offsets, gfmt, fmt, pow2).to(w13.dtype)
        if ctx.needs_input_grad[2]:
            dw2 = _expert_wgrad(dy, z, offsets, gfmt, fmt, pow2).to(w2.dtype)
        return (dx, dw13, dw2) + (None,) * 10


class Fp8MoE(nn.Module):
    """A SwiGLU mixture of experts with fp8 expert weights, routed by the caller:

        y[t] = sum_k topk_weights[t, k] * W2[e] . (silu(W1[e] x) * W3[e] x),  e = topk_ids[t, k]

    w13 [G, 2*I, H] (W1 rows then W3 rows) and w2 [G, H, I], each quantised per 128x128 block.
    Runs the contiguous grouped GEMM (compact) or, while a CUDA graph is captured, the masked
    one (no host synchronisation); `forward(layout=...)` picks explicitly.

    Training (`trainable=True`): w13 and w2 are nn.Parameters in `master_dtype`, their fp8
    copies quantised again whenever they changed; with a gradient to compute, forward runs the
    contiguous (or offsets) layout through `_Fp8ExpertsFunction`, and gradients reach x, the
    weights and topk_weights (through the combine). `grad_format` and `pow2_scales` as for
    Fp8Linear.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, fmt: str = "e4m3",
                 device=None, trainable: bool = False, master_dtype: torch.dtype = torch.bfloat16,
                 grad_format: str = "e4m3", pow2_scales: bool = False):
        super().__init__()
        _check_training_options("Fp8MoE", trainable, master_dtype, grad_format)
        self.num_experts, self.hidden, self.intermediate, self.fmt = (
            num_experts, hidden, intermediate, fmt)
        self.trainable, self.grad_format, self.pow2_scales = trainable, grad_format, pow2_scales
        dtype, _ = quant.fp8_dtype(fmt)
        g, h, i = num_experts, hidden, intermediate
        if trainable:
            self.w13 = nn.Parameter(torch.empty(g, 2 * i, h, dtype=master_dtype, device=device))
            self.w2 = nn.Parameter(torch.empty(g, h, i, dtype=master_dtype, device=device))
            self._fp8 = {"w13": _Fp8Cache(fmt, pow2_scales), "w2": _Fp8Cache(fmt, pow2_scales)}
            with torch.no_grad():  # nn.Linear's bound, 1/sqrt(fan_in), for each expert
                for w in (self.w13, self.w2):
                    bound = 1 / math.sqrt(w.shape[-1]) if w.shape[-1] else 0.0
                    w.uniform_(-bound, bound)
            return
        self.register_buffer("w13", torch.zeros(g, 2 * i, h, dtype=dtype, device=device))
        self.register_buffer("w13_scale", torch.ones(g, -(-2 * i // 128), -(-h // 128),
                                                     device=device))
        self.register_buffer("w2", torch.zeros(g, h, i, dtype=dtype, device=device))
        self.register_buffer("w2_scale", torch.ones(g, -(-h // 128), -(-i // 128), device=device))

    @torch.no_grad()
    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor, *,
                     w13_scale: torch.Tensor | None = None,
                     w2_scale: torch.Tensor | None = None) -> None:
        """Put w13 [G, 2I, H] and w2 [G, H, I] into the module: floating-point weights are
        quantised per 128x128 block (a trainable module copies them into its master weights);
        fp8 ones are pre-quantised and come with their block scales `w13_scale` [G,
        ceil(2I/128), ceil(H/128)] and `w2_scale` [G, ceil(H/128), ceil(I/128)] (or one per
        expert, [G]), stored as they are (a trainable module dequantises them). A checkpoint's
        per-expert W1 and W3 (with their scales) stack along the rows into w13 when
        I % 128 == 0; otherwise a 128-row block of w13 would straddle the two, so dequantise
        them first (fp8gemm.dequantize_per_block)."""
        for name, w, scale in (("w13", w13, w13_scale), ("w2", w2, w2_scale)):
            w, s = _stored_form(self, "Fp8MoE", name, w, scale)
            getattr(self, name).copy_(w)
            if s is not None:
                getattr(self, f"{name}_scale").copy_(s)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        _load_checkpoint_weight(self, "Fp8MoE", state_dict, prefix, "w13")
        _load_checkpoint_weight(self, "Fp8MoE", state_dict, prefix, "w2")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def refresh_weights(self) -> None:
        """Quantise a trainable module's master weights again on the next call (needed only
        after writes that bypass their version counters, such as through `.data`)."""
        if self.trainable:
            for cache in self._fp8.values():
                cache.refresh()

    def _fp8_weights(self):
        if not self.trainable:
            return self.w13, self.w13_scale, self.w2, self.w2_scale
        return (*self._fp8["w13"].get(self.w13), *self._fp8["w2"].get(self.w2))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                layout: str = "auto", max_m: int | None = None,
                expected_m: int | None = None) -> torch.Tensor:
        """x [T, H], topk_ids [T, topk] (ids outside [0, G) dropped), topk_weights [T, topk]
        -> [T, H] in x's dtype.

        layout: "masked" ([G, max_m, H] per-expert buffers, no host synchronisation: CUDA-graph
        safe; max_m defaults to T, and slots past it are dropped), "contiguous" (rows grouped by
        expert, padded to the kernels' M tile: compact, one host synchronisation to size it),
        "offsets" (the same without padding), or "auto": masked while a CUDA graph is being
        captured or torch.compile traces, else contiguous. A trainable module computing a
        gradient runs "contiguous" for "auto" and refuses "masked".
        """
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, {self.hidden}], got {list(x.shape)}")
        training = self.trainable and _needs_grad(x, self.w13, self.w2, topk_weights)
        if layout == "auto":  # the contiguous layout sizes its buffers on the host
            capturing = not training and (torch.compiler.is_compiling() or (
                x.is_cuda and torch.cuda.is_current_stream_capturing()))
            layout = "masked" if capturing else "contiguous"
        if layout not in ("masked", "contiguous", "offsets"):
            raise ValueError(f"layout must be 'auto', 'masked', 'contiguous' or 'offsets', got "
                             f"{layout!r}")
        weights = self._fp8_weights()
        if training:
            if layout == "masked":
                raise ValueError("Fp8MoE: training (a gradient to compute) runs the "
                                 "'contiguous' or 'offsets' layout, got layout='masked'")
            return self._forward_training(x, topk_ids, topk_weights, layout, weights)
        if layout == "masked":
            return self._forward_masked(x, topk_ids, topk_weights, max_m, expected_m, weights)
        return self._forward_grouped(x, topk_ids, topk_weights, layout, weights)

    def _forward_masked(self, x, topk_ids, topk_weights, max_m, expected_m, weights):
        # NOTE: the T tokens are quantised, not the G x Mmax rows of the layout (at decode four
        # times as many, mostly empty); the dispatch moves fp8 rows, and their scales follow.
        # Nothing reads the layout's rows past masked_m, so the dispatch leaves them unwritten.
        a, sa = quant.quantize_per_token(x, self.fmt, pow2_scales=self.pow2_scales)
        lay = moe_dispatch_masked(a, topk_ids, self.num_experts, max_m, zero_rest=False)
        sa = get_col_major_tma_aligned_tensor(
            sa.index_select(0, lay.token_of_row.flatten()).view(*lay.x.shape[:2], -1))
        em = expected_m if expected_m is not None else max(
            1, x.shape[0] * topk_ids.shape[1] // self.num_experts)
        y = self.experts_masked(lay.x, sa, lay.masked_m, em, weights)
        return moe_combine_masked(y, lay, topk_weights).to(x.dtype)

    def experts_masked(self, a, sa, masked_m, expected_m: int, weights=None) -> torch.Tensor:
        """The experts on rows already quantised in the masked layout: a fp8 [G, Mmax, H] with
        1x128 scales sa [G, Mmax, ceil(H/128)], masked_m int32 [G] on the device -> bf16
        [G, Mmax, H] (rows past masked_m[g] unspecified). No host synchronisation."""
        w13, s13, w2, s2 = self._fp8_weights() if weights is None else weights
        # NOTE: neither h13 nor y is zeroed: the quantiser reads only h13's rows below
        # masked_m, and the combine only y's rows of tokens. At decode most of each expert's
        # Mmax rows hold none, and a fill would cost as much as writing both whole (32 x 128
        # rows: 33.5 MB for h13 at I = 2048, 59 MB for y at H = 7168).
        g, mmax = a.shape[:2]
        h13 = torch.empty((g, mmax, w13.shape[1]), dtype=torch.bfloat16, device=a.device)
        m_grouped_fp8_gemm_nt_masked((a, sa), (w13, s13), h13, masked_m, expected_m)
        a2, sa2 = quant.silu_mul_quantize_per_token(h13, self.fmt, pow2_scales=self.pow2_scales,
                                                    masked_m=masked_m)
        y = torch.empty((g, mmax, w2.shape[1]), dtype=torch.bfloat16, device=a.device)
        return m_grouped_fp8_gemm_nt_masked((a2, sa2), (w2, s2), y, masked_m, expected_m)

    def _dispatch(self, x, topk_ids, layout):
        lay = moe_dispatch_contiguous(x, topk_ids, self.num_experts,
                                      None if layout == "contiguous" else 1)
        return lay, (lay.m_indices if layout == "contiguous" else lay.offsets)

    def _forward_grouped(self, x, topk_ids, topk_weights, layout, weights):
        # NOTE: the T tokens are quantised before the dispatch, whose host synchronisation then
        # waits for that kernel instead of the host launching it while the GPU idles after the
        # synchronisation; the dispatch moves fp8 rows, and their scales follow them.
        a, sa = quant.quantize_per_token(x, self.fmt, pow2_scales=self.pow2_scales)
        lay, rows_index = self._dispatch(a, topk_ids, layout)
        sa = get_col_major_tma_aligned_tensor(sa.index_select(0, lay.token_of_row))
        y = self.experts_grouped(lay.x, sa, rows_index, layout, weights)
        return moe_combine_contiguous(y, lay, topk_weights).to(x.dtype)

    def experts_grouped(self, a, sa, rows_index, layout: str = "contiguous",
                        weights=None) -> torch.Tensor:
        """The experts on rows already quantised and grouped by expert: a fp8 [R, H] with 1x128
        scales sa [R, ceil(H/128)]; rows_index is m_indices int32 [R] (-1 padding) for layout
        "contiguous", offsets int32 [G + 1] for "offsets" -> bf16 [R, H] (padding rows
        unspecified: the combine never reads them)."""
        if layout not in ("contiguous", "offsets"):
            raise ValueError(f"layout must be 'contiguous' or 'offsets', got {layout!r}")
        w13, s13, w2, s2 = self._fp8_weights() if weights is None else weights
        # (h13 zero in the padding rows, which the quantiser reads; y not zeroed: the combine reads
        # only the rows of tokens)
        h13 = _grouped(a, sa, w13, s13, rows_index, layout)
        a2, sa2 = quant.silu_mul_quantize_per_token(h13, self.fmt, pow2_scales=self.pow2_scales)
        y = torch.empty((a.shape[0], w2.shape[1]), dtype=torch.bfloat16, device=a.device)
        return _grouped(a2, sa2, w2, s2, rows_index, layout, out=y)

    def _forward_training(self, x, topk_ids, topk_weights, layout, weights):
        lay, rows_index = self._dispatch(x, topk_ids, layout)  # (differentiable in x)
        y = _Fp8ExpertsFunction.apply(lay.x, self.w13, self.w2, *weights, rows_index,
                                      lay.offsets, layout, self.fmt, self.grad_format,
                                      self.pow2_scales)
        return moe_combine_contiguous(y, lay, topk_weights).to(x.dtype)
