"""nn modules over the fp8gemm ops (inference): Fp8Linear and Fp8MoE.

Weights are stored quantised per 128x128 block (DeepSeek-V3 recipe); activations are quantised
per 1x128 token group on every call. The modules call the public ops (the warm eager fast path;
the `torch.ops.fp8gemm` custom ops while torch.compile traces) and capture in CUDA graphs (the
masked MoE path needs no host synchronisation). `convert` swaps a model's nn.Linear layers.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from . import quant
from . import torch_ops  # noqa: F401  (registers torch.ops.fp8gemm)
from .ops import fp8_gemm_nt
from .problem import SCALE_BLOCK, ceil_div
from .moe import (moe_combine_contiguous, moe_combine_masked, moe_dispatch_contiguous,
                  moe_dispatch_masked)

__all__ = ["Fp8Linear", "Fp8MoE", "convert", "ConvertReport", "DEFAULT_EXCLUDE"]

_ops = torch.ops.fp8gemm


def _check_features(what: str, name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{what}: {name} must be a non-negative int, got {value!r}")


class Fp8Linear(nn.Module):
    """y = x @ W^T + bias with W in fp8 (128x128 block scales) and x quantised per 1x128 group.

    x [..., in_features] (bf16/fp16/fp32) -> y [..., out_features] in `out_dtype` (bf16). The
    bias is kept in float32 and added to the float32 accumulator (the GEMM's `c` input), so the
    output is rounded once. `name` (set by `convert` to the layer's path in its model) appears in
    every error the layer raises.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 fmt: str = "e4m3", out_dtype: torch.dtype = torch.bfloat16, device=None,
                 name: str | None = None):
        super().__init__()
        self.name = name
        _check_features(self._what(in_features, out_features), "in_features", in_features)
        _check_features(self._what(in_features, out_features), "out_features", out_features)
        if out_dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"{self._what(in_features, out_features)}: out_dtype must be "
                            f"torch.bfloat16 or torch.float32, got {out_dtype}")
        self.in_features, self.out_features, self.fmt, self.out_dtype = (
            in_features, out_features, fmt, out_dtype)
        dtype, _ = quant.fp8_dtype(fmt)
        nb, kb = ceil_div(out_features, SCALE_BLOCK), ceil_div(in_features, SCALE_BLOCK)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones(nb, kb, dtype=torch.float32,
                                                        device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=torch.float32, device=device),
                                  requires_grad=False) if bias else None)

    def _what(self, in_features=None, out_features=None) -> str:
        if self.name is not None:
            return f"Fp8Linear {self.name!r}"
        i = self.in_features if in_features is None else in_features
        o = self.out_features if out_features is None else out_features
        return f"Fp8Linear(in_features={i}, out_features={o})"

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str = "e4m3",
                    out_dtype: torch.dtype = torch.bfloat16, *,
                    name: str | None = None) -> "Fp8Linear":
        """Quantise an nn.Linear's weight per 128x128 block (once, here)."""
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"from_linear takes an nn.Linear{f' ({name!r})' if name else ''}, "
                            f"got {type(linear).__name__}")
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt=fmt,
                out_dtype=out_dtype, device=linear.weight.device, name=name)
        m.load_weight(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return m

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        """Quantise `weight` [out_features, in_features] into this layer; copy `bias`."""
        if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
            raise TypeError(f"{self._what()}: weight must be a floating-point tensor, got "
                            f"{getattr(weight, 'dtype', type(weight).__name__)}")
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"{self._what()}: weight must be [{self.out_features}, "
                             f"{self.in_features}], got {list(weight.shape)}")
        if not bool(torch.isfinite(weight).all()):
            bad = int((~torch.isfinite(weight)).sum())
            raise ValueError(f"{self._what()}: weight must be finite to quantise to fp8, got "
                             f"{bad} NaN or Inf value(s)")
        q, s = quant.quantize_per_block(weight, self.fmt)
        self.weight.copy_(q)
        self.weight_scale.copy_(s)
        if bias is not None:
            if self.bias is None:
                raise ValueError(f"{self._what()}: bias given but the layer has bias=False")
            if tuple(bias.shape) != (self.out_features,):
                raise ValueError(f"{self._what()}: bias must be [{self.out_features}], got "
                                 f"{list(bias.shape)}")
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(f"{self._what()}: x must be [..., {self.in_features}], got "
                             f"{list(getattr(x, 'shape', []))}")
        lead = x.shape[:-1]
        x2 = x.reshape(lead.numel(), self.in_features)  # (-1 is ambiguous when in_features = 0)
        a, sa = quant.quantize_per_token(x2, self.fmt)
        c = None
        if self.bias is not None:  # added in float32, before the one rounding to out_dtype
            c = self.bias.expand(x2.shape[0], self.out_features)
        y = fp8_gemm_nt((a, sa), (self.weight, self.weight_scale), c=c, out_dtype=self.out_dtype)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fmt={self.fmt}")


@dataclass
class ConvertReport:
    """What `convert` did: the layers it converted, and each one it left, with the reason."""

    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        lines = [f"converted {len(self.converted)} nn.Linear layer(s) to Fp8Linear, "
                 f"left {len(self.skipped)}"]
        lines += [f"  fp8   {name}" for name in self.converted]
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


class Fp8MoE(nn.Module):
    """A SwiGLU mixture of experts with fp8 expert weights, routed by the caller:

        y[t] = sum_k topk_weights[t, k] * W2[e] . (silu(W1[e] x) * W3[e] x),  e = topk_ids[t, k]

    w13 [G, 2*I, H] (W1 rows then W3 rows) and w2 [G, H, I], each quantised per 128x128 block.
    Runs the contiguous grouped GEMM (compact) or, while a CUDA graph is captured, the masked
    one (no host synchronisation); `forward(layout=...)` picks explicitly.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int, *, fmt: str = "e4m3",
                 device=None):
        super().__init__()
        self.num_experts, self.hidden, self.intermediate, self.fmt = (
            num_experts, hidden, intermediate, fmt)
        dtype, _ = quant.fp8_dtype(fmt)
        g, h, i = num_experts, hidden, intermediate
        self.register_buffer("w13", torch.zeros(g, 2 * i, h, dtype=dtype, device=device))
        self.register_buffer("w13_scale", torch.ones(g, -(-2 * i // 128), -(-h // 128),
                                                     device=device))
        self.register_buffer("w2", torch.zeros(g, h, i, dtype=dtype, device=device))
        self.register_buffer("w2_scale", torch.ones(g, -(-h // 128), -(-i // 128), device=device))

    @torch.no_grad()
    def load_weights(self, w13: torch.Tensor, w2: torch.Tensor) -> None:
        g, h, i = self.num_experts, self.hidden, self.intermediate
        if tuple(w13.shape) != (g, 2 * i, h):
            raise ValueError(f"w13 must be [{g}, {2 * i}, {h}], got {list(w13.shape)}")
        if tuple(w2.shape) != (g, h, i):
            raise ValueError(f"w2 must be [{g}, {h}, {i}], got {list(w2.shape)}")
        for name, w in (("w13", w13), ("w2", w2)):
            q, s = quant.quantize_per_block(w, self.fmt)
            getattr(self, name).copy_(q)
            getattr(self, f"{name}_scale").copy_(s)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                layout: str = "auto", max_m: int | None = None,
                expected_m: int | None = None) -> torch.Tensor:
        """x [T, H], topk_ids [T, topk] (ids outside [0, G) dropped), topk_weights [T, topk]
        -> [T, H] in x's dtype.

        layout: "masked" ([G, max_m, H] per-expert buffers, no host synchronisation: CUDA-graph
        safe; max_m defaults to T, and slots past it are dropped), "contiguous" (rows grouped by
        expert, padded to the kernels' M tile: compact, one host synchronisation to size it), or
        "auto": masked while a CUDA graph is being captured or torch.compile traces, else
        contiguous.
        """
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, {self.hidden}], got {list(x.shape)}")
        if layout == "auto":  # the contiguous layout sizes its buffers on the host
            capturing = torch.compiler.is_compiling() or (
                x.is_cuda and torch.cuda.is_current_stream_capturing())
            layout = "masked" if capturing else "contiguous"
        if layout == "masked":
            return self._forward_masked(x, topk_ids, topk_weights, max_m, expected_m)
        if layout == "contiguous":
            return self._forward_contiguous(x, topk_ids, topk_weights)
        raise ValueError(f"layout must be 'auto', 'masked' or 'contiguous', got {layout!r}")

    def _forward_masked(self, x, topk_ids, topk_weights, max_m, expected_m):
        lay = moe_dispatch_masked(x, topk_ids, self.num_experts, max_m)
        em = expected_m if expected_m is not None else max(
            1, x.shape[0] * topk_ids.shape[1] // self.num_experts)
        a, sa = _ops.quantize_per_token(lay.x, self.fmt)
        h13 = _ops.m_grouped_fp8_gemm_nt_masked(a, sa, self.w13, self.w13_scale, lay.masked_m,
                                                em, torch.bfloat16)
        a2, sa2 = _ops.silu_mul_quantize_per_token(h13, self.fmt)
        y = _ops.m_grouped_fp8_gemm_nt_masked(a2, sa2, self.w2, self.w2_scale, lay.masked_m, em,
                                              torch.bfloat16)
        return moe_combine_masked(y, lay, topk_weights).to(x.dtype)

    def _forward_contiguous(self, x, topk_ids, topk_weights):
        lay = moe_dispatch_contiguous(x, topk_ids, self.num_experts)
        a, sa = _ops.quantize_per_token(lay.x, self.fmt)
        h13 = _ops.m_grouped_fp8_gemm_nt_contiguous(a, sa, self.w13, self.w13_scale, lay.m_indices,
                                                    torch.bfloat16)
        a2, sa2 = _ops.silu_mul_quantize_per_token(h13, self.fmt)
        y = _ops.m_grouped_fp8_gemm_nt_contiguous(a2, sa2, self.w2, self.w2_scale, lay.m_indices,
                                                  torch.bfloat16)
        return moe_combine_contiguous(y, lay, topk_weights).to(x.dtype)
