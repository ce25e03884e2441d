#!/usr/bin/env python3
"""The Triton MoE kernels against the torch code they replace (fp8gemm.moe.TRITON_COMBINE,
TRITON_DISPATCH), in one run on a Hopper GPU:

    python scripts/moe_triton_ab.py [--switch combine|dispatch] [--tokens ...] [--runs 30]
                                    [--json PATH]

For each token count of the bench's moe-layer suite (one rank's 32 experts of DeepSeek-V3) it
builds the bench's data, checks that both sides give the same layer output (calc_diff below
MAX_DIFF), then times, taking turns run by run as the bench does (fp8gemm.bench.timing: cold L2,
launch cost hidden, median):
  combine (default tokens 4096,128):
    combine-torch / combine-triton   moe_combine_contiguous alone on the layer's expert rows;
    layer-torch / layer-triton       Fp8MoE, contiguous layout, eager.
  dispatch (default tokens 128,512):
    dispatch-torch / dispatch-triton moe_dispatch_masked alone on the layer's fp8 rows;
    layer-torch / layer-triton       Fp8MoE, masked layout (decode), eager.
Prints µs and the Triton side's speed-up over the torch side of the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fp8gemm  # noqa: E402
import fp8gemm.moe as moe_module  # noqa: E402
from fp8gemm.bench.impls import make_data  # noqa: E402
from fp8gemm.bench.suites import MOE_LAYER, Case  # noqa: E402
from fp8gemm.bench.timing import DeviceTimer, MIN_BUSY_US, eager_time_us, median  # noqa: E402

MAX_DIFF = 1e-5


def with_switch(switch: str, triton: bool, fn):
    """fn run with fp8gemm.moe.TRITON_<SWITCH> set to `triton`, restored afterwards."""
    name = f"TRITON_{switch.upper()}"

    def run():
        saved = getattr(moe_module, name)
        setattr(moe_module, name, triton)
        try:
            return fn()
        finally:
            setattr(moe_module, name, saved)
    return run


def calls_for(md, switch: str):
    """{name: callable} of the four timed calls on one case's data."""
    g = md.module.num_experts
    if switch == "combine":
        def layer():
            return md.module(md.x, md.topk_ids, md.topk_weights, layout="contiguous")

        lay = fp8gemm.moe_dispatch_contiguous(md.x, md.topk_ids, g)
        y = torch.randn(lay.x.shape[0], md.x.shape[1], device=md.x.device, dtype=torch.bfloat16)

        def part():
            return fp8gemm.moe_combine_contiguous(y, lay, md.topk_weights)
    else:
        def layer():
            return md.module(md.x, md.topk_ids, md.topk_weights, layout="masked",
                             expected_m=md.expected_m)

        a = fp8gemm.quantize_per_token(md.x)[0]

        def part():
            lay = fp8gemm.moe_dispatch_masked(a, md.topk_ids, g, zero_rest=False)
            live = torch.arange(lay.x.shape[1], device=a.device)[None, :] < lay.masked_m[:, None]
            # (the rows past masked_m hold whatever the allocation held: compared as zeros)
            return torch.where(live[..., None], lay.x.float(), 0.0)
    return {f"{switch}-torch": with_switch(switch, False, part),
            f"{switch}-triton": with_switch(switch, True, part),
            "layer-torch": with_switch(switch, False, layer),
            "layer-triton": with_switch(switch, True, layer)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--switch", choices=("combine", "dispatch"), default="combine")
    ap.add_argument("--tokens", help="comma-separated token counts (default: the switch's)")
    ap.add_argument("--runs", type=int, default=30, help="timed runs per call")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    timer = DeviceTimer(dev)
    s, rows = MOE_LAYER, []
    with torch.no_grad():
        tokens = args.tokens or ("4096,128" if args.switch == "combine" else "128,512")
        for t in (int(v) for v in tokens.split(",")):
            md = make_data(Case("moe-layer", "moe_layer", t, s.hidden, s.width, s.local_experts),
                           dev).moe
            calls = calls_for(md, args.switch)
            for part in (args.switch, "layer"):
                a, b = calls[f"{part}-torch"](), calls[f"{part}-triton"]()
                diff = fp8gemm.calc_diff(a, b)
                if not diff < MAX_DIFF:
                    print(f"{t} tokens {part}: the two sides differ, calc_diff {diff:.2e}")
                    return 1
            names = list(calls)
            times = timer.time_interleaved_us(
                [(calls[x], eager_time_us(calls[x], dev).host_us, MIN_BUSY_US) for x in names],
                args.runs)
            us = {x: median(v) for x, v in zip(names, times)}
            for part in (args.switch, "layer"):
                torch_us, triton_us = us[f"{part}-torch"], us[f"{part}-triton"]
                print(f"{t:>6} tokens {part:>8}: torch {torch_us:9.1f} us  triton {triton_us:9.1f} "
                      f"us  {torch_us / triton_us:5.2f}x", flush=True)
                rows.append({"switch": args.switch, "tokens": t, "part": part,
                             "torch_us": torch_us, "triton_us": triton_us})
            del md, calls
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
