"""nn modules over the fp8gemm ops (inference): Fp8Linear and Fp8MoE.

Weights are stored quantised per 128x128 block (DeepSeek-V3 recipe); activations are quantised
per 1x128 token group on every call. Both go through the `torch.ops.fp8gemm` custom ops, so the
modules trace under `torch.compile` and capture in CUDA graphs (the masked MoE path needs no host
synchronisation).
"""

from __future__ import annotations

import torch
from torch import nn

from . import quant
from . import torch_ops  # noqa: F401  (registers torch.ops.fp8gemm)
from .moe import (moe_combine_contiguous, moe_combine_masked, moe_dispatch_contiguous,
                  moe_dispatch_masked)

__all__ = ["Fp8Linear", "Fp8MoE"]

_ops = torch.ops.fp8gemm


class Fp8Linear(nn.Module):
    """y = x @ W^T + bias with W in fp8 (128x128 block scales) and x quantised per 1x128 group.

    x [..., in_features] (bf16/fp16/fp32) -> y [..., out_features] in `out_dtype` (bf16).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *,
                 fmt: str = "e4m3", out_dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.in_features, self.out_features, self.fmt, self.out_dtype = (
            in_features, out_features, fmt, out_dtype)
        dtype, _ = quant.fp8_dtype(fmt)
        nb, kb = -(-out_features // 128), -(-in_features // 128)
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype,
                                                   device=device))
        self.register_buffer("weight_scale", torch.ones(nb, kb, dtype=torch.float32,
                                                        device=device))
        self.bias = (nn.Parameter(torch.zeros(out_features, dtype=out_dtype, device=device),
                                  requires_grad=False) if bias else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, fmt: str = "e4m3",
                    out_dtype: torch.dtype = torch.bfloat16) -> "Fp8Linear":
        """Quantise an nn.Linear's weight per 128x128 block."""
        m = cls(linear.in_features, linear.out_features, linear.bias is not None, fmt=fmt,
                out_dtype=out_dtype, device=linear.weight.device)
        m.load_weight(linear.weight.detach(), None if linear.bias is None else linear.bias.detach())
        return m

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight must be [{self.out_features}, {self.in_features}], "
                             f"got {list(weight.shape)}")
        q, s = quant.quantize_per_block(weight, self.fmt)
        self.weight.copy_(q)
        self.weight_scale.copy_(s)
        if bias is not None:
            if self.bias is None:
                raise ValueError("bias given but the module was built with bias=False")
            self.bias.copy_(bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"x must be [..., {self.in_features}], got {list(x.shape)}")
        lead = x.shape[:-1]
        a, sa = _ops.quantize_per_token(x.reshape(-1, self.in_features), self.fmt)
        y = _ops.fp8_gemm_nt(a, sa, self.weight, self.weight_scale, None, self.out_dtype)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, fmt={self.fmt}")


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
        "auto": masked while a CUDA graph is being captured, else contiguous.
        """
        if x.dim() != 2 or x.shape[1] != self.hidden:
            raise ValueError(f"x must be [T, {self.hidden}], got {list(x.shape)}")
        if layout == "auto":
            capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
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
