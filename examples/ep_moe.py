"""An expert-parallel FP8 MoE layer: every rank holds G / W experts and its own tokens.

    torchrun --nproc_per_node 2 examples/ep_moe.py              # CPUs: gloo, reference GEMMs
    torchrun --nproc_per_node 8 examples/ep_moe.py --experts 256 --hidden 7168 \\
        --intermediate 2048 --topk 8 --prefill-tokens 4096 --decode-tokens 128   # 8 GPUs: NCCL

Each rank routes its tokens (softmax top-k of a shared gate), runs one prefill step (the
contiguous layout; ranks hold different numbers of tokens) and one decode step (the masked
layout, fixed capacity; captured and replayed as a CUDA graph on a GPU), checks both against
the one-process Fp8MoE holding every expert, and rank 0 prints what each rank saw and the time
of each stage (dispatch: quantise + all-to-all; compute: the local experts' grouped GEMMs;
combine: all-to-all back + weighted sum). On GPUs `--bench` adds the median device time of
each stage (cold L2, as `python -m fp8gemm.bench` times), of the decode graph, and of the same
expert GEMMs run alone on the rows the rank received.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist

import fp8gemm
from fp8gemm.distributed import Fp8EPMoE
from fp8gemm.nn import Fp8MoE


def route(x: torch.Tensor, gate: torch.Tensor, topk: int):
    """Softmax over the experts' logits, the top-k of them, weights renormalised to sum 1."""
    probs = torch.softmax(x.float() @ gate.T, dim=-1)
    weights, ids = probs.topk(topk, dim=-1)
    return ids.to(torch.int32), weights / weights.sum(-1, keepdim=True)


def timed_step(ep: Fp8EPMoE, x, ids, wts, sync, **kw):
    """One step through the three stages -> (output, seconds per stage)."""
    t0 = time.perf_counter()
    step = ep.dispatch(x, ids, wts, **kw)
    sync()
    t1 = time.perf_counter()
    y = ep.compute(step)
    sync()
    t2 = time.perf_counter()
    out = ep.combine(step, y)
    sync()
    times = {"dispatch": t1 - t0, "compute": t2 - t1, "combine": time.perf_counter() - t2}
    return out, step, times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--experts", type=int, default=None, help="default: 4 per rank")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--prefill-tokens", type=int, default=96, help="on rank 0; rank r has r*7 more")
    p.add_argument("--decode-tokens", type=int, default=16, help="on every rank")
    p.add_argument("--capacity", type=int, default=None, help="decode rows per destination rank")
    p.add_argument("--bench", action="store_true",
                   help="GPUs: device time of each stage (median, cold L2), of the decode graph, "
                        "and of the same expert GEMMs run alone on the received rows")
    args = p.parse_args()

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = args.experts or 4 * world
    h, i, k = args.hidden, args.intermediate, args.topk
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    # the same weights and gate on every rank, drawn on the device in bf16 (DeepSeek-V3's 256
    # experts are 22 GB in bf16: too many to draw on the host once per rank)
    gen = torch.Generator(device=device).manual_seed(0)
    w13 = torch.randn(g, 2 * i, h, generator=gen, device=device, dtype=torch.bfloat16) / 16
    w2 = torch.randn(g, h, i, generator=gen, device=device, dtype=torch.bfloat16) / 16
    gate = torch.randn(g, h, generator=gen, device=device)
    ep = Fp8EPMoE(g, h, i, device=device)
    ep.load_weights(w13, w2)
    full = Fp8MoE(g, h, i, device=device)  # the one-process layer, for the check
    full.load_weights(w13, w2)
    del w13, w2

    torch.manual_seed(1 + rank)  # each rank its own tokens
    lines = []
    x = torch.randn(args.prefill_tokens + 7 * rank, h, device=device, dtype=torch.bfloat16)
    ids, wts = route(x, gate, k)
    y, step, times = timed_step(ep, x, ids, wts, sync, layout="contiguous")
    diff = fp8gemm.calc_diff(y, full(x, ids, wts, layout="contiguous"))
    lines.append(f"prefill: {x.shape[0]} tokens, sent {step.splits[0]} rows, received "
                 f"{step.splits[1]}; calc_diff vs one process {diff:.1e}; " + _ms(times))

    x = torch.randn(args.decode_tokens, h, device=device, dtype=torch.bfloat16)
    ids, wts = route(x, gate, k)
    y, step, times = timed_step(ep, x, ids, wts, sync, layout="masked", capacity=args.capacity)
    dropped = step.dropped.tolist()
    diff = fp8gemm.calc_diff(y, full(x, ids, wts, layout="contiguous"))
    lines.append(f"decode:  {x.shape[0]} tokens, rows per local expert "
                 f"{step.tokens_per_expert.tolist()}, dropped {dropped[0]} sent + {dropped[1]} "
                 f"received; calc_diff vs one process {diff:.1e}; " + _ms(times))
    graph = None
    if cuda:  # the whole decode step as one CUDA graph (fixed buffers, no host sync)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            ep(x, ids, wts, layout="masked", capacity=args.capacity)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ep(x, ids, wts, layout="masked", capacity=args.capacity)
        graph.replay()
        sync()
        lines.append(f"decode graph replay equals eager: {torch.equal(out, y)}")
    if args.bench and cuda:
        prefill = (torch.randn(args.prefill_tokens, h, device=device, dtype=torch.bfloat16),)
        prefill += route(prefill[0], gate, k)
        lines += bench(ep, full, prefill, (x, ids, wts), args.capacity, graph)

    report = [None] * world
    dist.all_gather_object(report, lines)
    if rank == 0:
        print(f"{world} ranks ({dist.get_backend()}), {g} experts ({g // world} per rank), "
              f"hidden {h}, intermediate {i}, top-{k}")
        for r, rank_lines in enumerate(report):
            for line in rank_lines:
                print(f"[rank {r}] {line}")
    dist.destroy_process_group()


def bench(ep: Fp8EPMoE, full: Fp8MoE, prefill, decode, capacity, graph) -> list[str]:
    """Median device time (us) of each stage at prefill and decode, of the decode graph's
    replay, of the local expert GEMMs alone on the rows this rank received (scales in the
    quantiser's column-major layout, as the one-GPU layer has them: the reference of
    `compute`), and of the one-GPU Fp8MoE holding every expert on this rank's tokens. Every
    rank times the same calls in the same order, so the collectives pair up."""
    from fp8gemm.bench.timing import DeviceTimer, eager_time_us, median
    from fp8gemm.layout import get_col_major_tma_aligned_tensor

    device = prefill[0].device
    timer = DeviceTimer(device)
    lines = []
    for name, (x, ids, wts), kw in (("prefill", prefill, {"layout": "contiguous"}),
                                    ("decode", decode, {"layout": "masked",
                                                        "capacity": capacity})):
        step = ep.dispatch(x, ids, wts, **kw)
        y = ep.compute(step)
        a, sa = step.a, get_col_major_tma_aligned_tensor(step.sa)
        if step.layout == "contiguous":
            def alone():
                return ep.experts.experts_grouped(a, sa, step.experts.m_indices)
        else:
            def alone():
                return ep.experts.experts_masked(a, sa, step.tokens_per_expert, step.expected_m)
        calls = {"dispatch": lambda: ep.dispatch(x, ids, wts, **kw),
                 "compute": lambda: ep.compute(step),
                 "combine": lambda: ep.combine(step, y),
                 "experts alone": alone,
                 "one-GPU layer": lambda: full(x, ids, wts, layout=kw["layout"])}
        if name == "decode" and graph is not None:
            calls["graph step"] = graph.replay
        hosts = [eager_time_us(fn, device, calls=5).host_us for fn in calls.values()]
        runs = timer.time_interleaved_us([(fn, hu, 0.0) for fn, hu in zip(calls.values(), hosts)])
        us = {n: median(r) for n, r in zip(calls, runs)}
        lines.append(f"{name} device us: " + ", ".join(f"{n} {v:.1f}" for n, v in us.items())
                     + f"; compute / experts alone {us['compute'] / us['experts alone']:.3f}")
    return lines


def _ms(times: dict) -> str:
    return ", ".join(f"{name} {1e3 * s:.1f} ms" for name, s in times.items())


if __name__ == "__main__":
    main()
