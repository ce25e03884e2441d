#!/usr/bin/env python3
"""Time the public quantisers against a bf16 copy of the same tensor (Hopper GPU).

    python scripts/quant_bandwidth.py                      # the DeepSeek-V3 shapes, e4m3
    python scripts/quant_bandwidth.py --fmt e4m3,e5m2 --shapes 4096x7168 --json quant.json

For each shape [R, C] (bf16 input) every quantiser runs as a user calls it:
  per_token             quantize_per_token(x)                 x [R, C] -> q [R, C]
  per_token_transposed  quantize_per_token_transposed(x)      x [R, C] -> q [C, R] (wgrad operand)
  per_block             quantize_per_block(x)                 x [R, C] -> q [R, C], 128x128 scales
  per_block_transposed  quantize_per_block_transposed(x)      x [R, C] -> q [C, R] (dgrad weight)
  silu_mul              silu_mul_quantize_per_token(x)        x [R, C] -> q [R, C/2]
  per_token_cuda, silu_mul_cuda   the two above with fp8gemm.quant.CUDA_QUANT on (the CUDA
                        kernel of backends/cuda/quant.py where it takes x, else the same Triton)
and `copy` is `dst.copy_(x)` into a bf16 tensor of x's shape, the bandwidth the others are
measured against. GB/s counts each byte once: bf16 in, fp8 out, float32 scales (copy: bf16 in
and out). The % column is a quantiser's GB/s over copy's in the same run; timing as the
benchmark's (fp8gemm.bench.timing: cold L2, launch cost hidden, the calls taking turns run by
run, median); host is the eager host time of a call (back-to-back calls, no
synchronisation). Every output is checked against the torch twin the CPU runs: the same scales to
float32 rounding (SCALE_RTOL: silu's exp on the GPU is not torch's to the last bit), and the
same fp8 bytes but for at most STEP_FRACTION of them one fp8 step away (values within a float32
rounding of a midpoint between two fp8 values go either way).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8gemm import quant  # noqa: E402
from fp8gemm.bench.timing import DeviceTimer, MIN_BUSY_US, MIN_DEVICE_RUNS, eager_time_us, median  # noqa: E402

# Activations of 4096 tokens at the DeepSeek-V3 widths, and two of its weights.
SHAPES = "4096x7168,4096x2048,4096x16384,7168x2048,2112x7168,128x7168,128x4096,32x7168"
OPS = ("per_token", "per_token_transposed", "per_block", "per_block_transposed", "silu_mul",
       "per_token_cuda", "silu_mul_cuda")
SCALE_BLOCK = 128
STEP_FRACTION = 5e-3
SCALE_RTOL = 1e-6  # as tests/test_quant.py holds the GPU quantisers to the CPU spec


def ceil_div(x: int, y: int) -> int:
    return (x + y - 1) // y


def with_cuda_quant(fn):
    """fn run with fp8gemm.quant.CUDA_QUANT on, restored afterwards."""
    def run(x):
        saved, quant.CUDA_QUANT = quant.CUDA_QUANT, True
        try:
            return fn(x)
        finally:
            quant.CUDA_QUANT = saved
    return run


def quantiser(op: str, fmt: str):
    """(the public call, its torch twin): both x -> (q, s)."""
    if op.endswith("_cuda"):
        fn, twin = quantiser(op[:-len("_cuda")], fmt)
        return with_cuda_quant(fn), twin
    if op == "per_token":
        return (lambda x: quant.quantize_per_token(x, fmt),
                lambda x: quant.per_token_torch(x, fmt, False, True))
    if op == "per_token_transposed":
        return (lambda x: quant.quantize_per_token_transposed(x, fmt),
                lambda x: quant.per_token_torch(x.transpose(-1, -2), fmt, False, True))
    if op == "per_block":
        return (lambda x: quant.quantize_per_block(x, fmt),
                lambda x: quant.per_block_torch(x, fmt, False))
    if op == "per_block_transposed":
        return (lambda x: quant.quantize_per_block_transposed(x, fmt),
                lambda x: quant.per_block_torch(x.transpose(-1, -2), fmt, False))
    if op == "silu_mul":
        return (lambda x: quant.silu_mul_quantize_per_token(x, fmt),
                lambda x: quant.silu_mul_per_token_torch(x, fmt, False, True))
    raise ValueError(f"op must be one of {', '.join(OPS)}, got {op!r}")


def agrees(q, s, tq, ts) -> bool:
    """The check of the module docstring (fp8 codes are sign-magnitude: one step is a code one
    apart with the same sign bit)."""
    if s.shape != ts.shape or not torch.allclose(s, ts, rtol=SCALE_RTOL, atol=0):
        return False
    a, b = q.view(torch.uint8).int(), tq.view(torch.uint8).int()
    off = a != b
    one_step = ((a - b).abs() == 1) & ((a ^ b) & 0x80 == 0)
    return bool((one_step | ~off).all()) and off.float().mean().item() <= STEP_FRACTION


def moved_bytes(op: str, r: int, c: int) -> int:
    """Bytes a quantiser of x [r, c] must move: x once (bf16), q once (fp8), its scales once."""
    op = op[:-len("_cuda")] if op.endswith("_cuda") else op
    if op == "silu_mul":
        return 2 * r * c + r * (c // 2) + 4 * r * ceil_div(c // 2, SCALE_BLOCK)
    if op in ("per_token", "per_token_transposed"):
        groups = r * ceil_div(c, SCALE_BLOCK) if op == "per_token" else c * ceil_div(r, SCALE_BLOCK)
    else:
        groups = ceil_div(r, SCALE_BLOCK) * ceil_div(c, SCALE_BLOCK)
    return 3 * r * c + 4 * groups


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="comma-separated RxC of the bf16 input")
    ap.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, of {', '.join(OPS)}")
    ap.add_argument("--fmt", default="e4m3", help="comma-separated fp8 formats (e4m3, e5m2)")
    ap.add_argument("--runs", type=int, default=MIN_DEVICE_RUNS)
    ap.add_argument("--json", default="", help="write every row here")
    args = ap.parse_args(argv)
    ops = args.ops.split(",")
    for op in ops:
        if op not in OPS:
            ap.error(f"--ops: {op!r} is not one of {', '.join(OPS)}")
    if not torch.cuda.is_available():
        print("quant_bandwidth: needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    timer = DeviceTimer(dev)
    rows = []
    for shape in args.shapes.split(","):
        r, c = (int(v) for v in shape.split("x"))
        x = torch.randn(r, c, device=dev, dtype=torch.bfloat16)
        dst = torch.empty_like(x)
        calls = {"copy": lambda x=x, dst=dst: dst.copy_(x)}
        nbytes = {"copy": 4 * r * c}
        for fmt in args.fmt.split(","):
            for op in ops:
                if op.startswith("silu_mul") and c % 2:
                    continue
                fn, twin = quantiser(op, fmt)
                q, s = fn(x)
                tq, ts = twin(x)
                torch.cuda.synchronize()
                name = f"{op}/{fmt}"
                if not agrees(q, s, tq, ts):
                    print(f"{shape} {name}: WRONG, differs from the torch twin", flush=True)
                    continue
                calls[name] = lambda fn=fn, x=x: fn(x)
                nbytes[name] = moved_bytes(op, r, c)
        names = list(calls)
        host = {n: eager_time_us(calls[n], dev).host_us for n in names}
        times = timer.time_interleaved_us([(calls[n], host[n], MIN_BUSY_US) for n in names],
                                          args.runs)
        us = {n: median(t) for n, t in zip(names, times)}
        copy_gbs = nbytes["copy"] / us["copy"] / 1e3
        for n in names:
            gbs = nbytes[n] / us[n] / 1e3
            print(f"{shape:>11} {n:>28} {us[n]:9.1f} us {gbs:7.0f} GB/s {100 * gbs / copy_gbs:5.0f} %"
                  f" of copy  host {host[n]:6.1f} us", flush=True)
            rows.append({"shape": [r, c], "impl": n, "us": round(us[n], 3),
                         "gbs": round(gbs, 1), "of_copy": round(gbs / copy_gbs, 4),
                         "host_us": round(host[n], 1)})
    if args.json:
        meta = {"gpu": torch.cuda.get_device_name(dev), "torch": torch.__version__}
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
