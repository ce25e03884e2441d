#!/usr/bin/env python3
"""Time configs of a CUDA kernel family against its heuristic's choice and cuBLAS (Hopper GPU).

    python scripts/cuda_tiles.py --shapes 4096x4096x7168 --variants base,block_m=256+block_n=128
    python scripts/cuda_tiles.py --shapes 64x2112x7168,128x7168x2048 --sweep --json sweep.json
    python scripts/cuda_tiles.py --family sm90_m_grouped_fp8_gemm_1d2d --kind masked \
        --shapes 4x256x4096x7168 --variants base,block_m=256+block_n=128
    python scripts/cuda_tiles.py --family sm90_fp8_gemm_1d1d --kind wgrad \
        --shapes 2112x7168x4096,7168x2048x1000 --variants base,block_n=128+two_accum=1
    python scripts/cuda_tiles.py --family sm90_k_grouped_fp8_gemm_1d1d --kind k_grouped_wgrad \
        --shapes 8x4096x7168x4096,s8x7168x2048x4096 --variants base,block_n=128

A variant is `base` (the family's `select_config`) or '+'-joined FIELD=VALUE changes to it
(`num_multicast=2+multicast_on_a=0`, `block_n=144`; booleans as 0/1). Fields not given keep the
heuristic's value, except those that follow from a changed field, unless they are given too: a
changed block_m or block_n re-derives num_stages (the most that fit the device's shared memory,
up to the most the family's candidates use; even for the small-M family) and two_accum (off,
also for a changed splits); a changed ctas_per_sm (the 1D2D families: 2 for two 64-row CTAs an
SM) re-derives num_stages in its share of shared memory; a changed block_m, block_n,
num_multicast, splits (the 1D2D family's split-K) or ctas_per_sm re-derives grid (a CTA per
tile, or per tile and split, up to the SM count times ctas_per_sm, a multiple of the cluster;
small-M: a changed block_m or num_splits, one CTA per tile and split).
--sweep adds every config of `candidate_configs`. --also FAMILY,... times each other family's
own choice beside them, as a variant named after the family (a family against the one it
takes problems from, or one of `backends.cuda.TRIAL_FAMILIES` against the one it would:
`--family sm90_m_grouped_fp8_gemm_1d2d_small_m --kind masked --also sm90_m_grouped_fp8_gemm_1d2d`;
there a changed block_m also re-derives num_slots, the token tiles per group in the grid).

Each config runs through the family's public `run`, is checked against the float64 product of the
dequantised inputs (calc_diff < 1e-5, output poisoned first, and the rows of no group, contiguous
padding and masked rows past masked_m, still poisoned after), then all of a shape's configs and
cuBLAS block-wise are timed together as the benchmark times (fp8gemm.bench.timing: cold L2,
launch cost hidden, the calls taking turns run by run, median). Prints µs, TFLOPS, the speed-up
over cuBLAS block-wise of the same run and the rate of L2 reads the tiles make (each tile's rows
of A and B over all of K, over its time: `l2_read_bytes`; weight gradients: also the rate of
their fp32 output traffic, out written and c read); a config the family refuses is
reported, not timed. Grouped kinds (--kind contiguous, offsets, masked; shapes GxMxNxK, M rows
per group, the bench's layouts; sGxMxNxK: the G groups' G * M rows in the moe-skewed suite's
skewed sizes) have no cuBLAS peer here: the speed-up is over the first variant. DeepGEMM (the
bench's `deepgemm`, where `import deep_gemm` works) is timed beside them wherever it takes the
kind. --kind wgrad is the weight gradient of the bench's backward suite (both operands in 1x128
groups, accumulated into fp32 out in place), timed against cuBLAS block-wise 1x128 x 1x128 (which
writes out); where cuBLAS cannot run a shape (K % 16), the speed-up is over the first variant
too; --kind wgrad_no_c writes the same product to out (no c), as cuBLAS does, and wgrad_c adds
a c of its own (zeros), read and added by the epilogue rather than reduced into out. --kind
k_grouped_wgrad (--family sm90_k_grouped_fp8_gemm_1d1d; shapes GxMxNxK, K the tokens of each of
the G experts, sGxMxNxK the backward-skewed suite's token counts of mean K) is the MoE weight
gradient of the bench, timed against the per-expert cuBLAS loop (cublas-block-loop).

--headers NAME=DIR (comma-separated, repeatable names not allowed) also times every variant
built from another copy of the kernels' headers, as `VARIANT@NAME`, in the same run: the
previous kernel against the one being changed, with the same data and peers. DIR is a checkout
(or `git archive REV fp8gemm/backends/cuda/include | tar -x -C DIR`: carry it to the GPU
machine) or its include folder; the Python side is this tree's, so the headers must take the
template arguments it passes. With --headers every kernel launches without programmatic
dependent launch (FP8GEMM_PDL=0): older headers' kernels may lack the wait it needs.

    python scripts/cuda_tiles.py --shapes 4096x7168x2048 --headers old=.work/old
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8gemm import calc_diff  # noqa: E402
from fp8gemm.backends.cuda import FAMILIES, TRIAL_FAMILIES  # noqa: E402
from fp8gemm.backends.cuda import (sm90_fp8_gemm_1d1d, sm90_fp8_gemm_1d2d,  # noqa: E402
                                   sm90_fp8_gemm_small_m)
from fp8gemm.backends.family import DeviceFacts  # noqa: E402
from fp8gemm.bench.impls import (Skip, case_problem, cublas_block_probe,  # noqa: E402
                                 k_grouped_operands, make_data, make_impl, reference_output)
from fp8gemm.bench.suites import Case, backward_skewed_sizes, skewed_sizes  # noqa: E402
from fp8gemm.bench.timing import (DeviceTimer, MIN_BUSY_US, MIN_DEVICE_RUNS, eager_time_us,  # noqa: E402
                                  geomean, median)
from fp8gemm.problem import GemmKind, GemmProblem, Recipe, ceil_div  # noqa: E402

M4096 = "4096x2112x7168,4096x24576x1536,4096x32768x512,4096x7168x16384,4096x4096x7168,4096x7168x2048"
TILE_FIELDS = ("block_m", "block_n")  # num_stages and two_accum follow from these
GRID_FIELDS = ("block_m", "block_n", "num_multicast", "splits", "ctas_per_sm")  # and grid these
MAX_DIFF = 1e-5  # the library's bound for bf16 output (fp32 output lands closer)


def dense_problem(m: int, n: int, k: int) -> GemmProblem:
    """A dense e4m3 problem, A in 1x128 groups, B in 128x128 blocks, bf16 out."""
    e4m3 = torch.float8_e4m3fn
    return GemmProblem(GemmKind.DENSE, m, n, k, 1, e4m3, e4m3, Recipe.GROUP, Recipe.BLOCK,
                       torch.bfloat16)


def wgrad_problem(m: int, n: int, k: int, has_c: bool = True) -> GemmProblem:
    """A dense e4m3 weight gradient as the bench's backward suite runs it: A and B in 1x128
    groups, fp32 out, c added (the suite's c is out itself); `has_c` False: out written."""
    e4m3 = torch.float8_e4m3fn
    return GemmProblem(GemmKind.DENSE, m, n, k, 1, e4m3, e4m3, Recipe.GROUP, Recipe.GROUP,
                       torch.float32, has_c=has_c)


# The modules whose plans compile kernels, and those that name the include folder (the small-M
# family compiles from the 1D2D module's).
_PLAN_MODULES = (sm90_fp8_gemm_1d2d, sm90_fp8_gemm_1d1d, sm90_fp8_gemm_small_m)
_INCLUDE_MODULES = (sm90_fp8_gemm_1d2d, sm90_fp8_gemm_1d1d)


def parse_headers(spec: str) -> dict[str, Path]:
    """'old=DIR,b=DIR2' -> {'old': DIR/.../include, ...}: each DIR a checkout or an include
    folder (one that holds fp8gemm/sm90_utils.cuh)."""
    out: dict[str, Path] = {}
    for part in filter(None, spec.split(",")):
        name, eq, path = part.partition("=")
        if not eq or not name or name in out or "@" in name:
            raise ValueError(f"--headers takes NAME=DIR parts with distinct names, got {part!r}")
        root = Path(path).resolve()
        inc = root / "fp8gemm" / "backends" / "cuda" / "include"
        inc = inc if inc.is_dir() else root
        if not (inc / "fp8gemm" / "sm90_utils.cuh").is_file():
            raise ValueError(f"--headers {name}: no fp8gemm/sm90_utils.cuh under {root}")
        out[name] = inc
    return out


@contextlib.contextmanager
def kernel_headers(include: Path, caches: dict):
    """Plans built inside compile from `include` and live in caches of their own (`caches`,
    one dict per module), so that they never meet the plans of this tree's headers."""
    includes = [m.INCLUDE_DIR for m in _INCLUDE_MODULES]
    plans = [m._plans for m in _PLAN_MODULES]
    for m in _INCLUDE_MODULES:
        m.INCLUDE_DIR = include
    for m in _PLAN_MODULES:
        m._plans = caches.setdefault(m.__name__, {})
    try:
        yield
    finally:
        for m, inc in zip(_INCLUDE_MODULES, includes):
            m.INCLUDE_DIR = inc
        for m, cache in zip(_PLAN_MODULES, plans):
            m._plans = cache


def parse_variant(spec: str, cfg_type: type) -> dict:
    """'block_m=256+two_accum=1' -> {'block_m': 256, 'two_accum': True}; 'base' -> {}."""
    if spec == "base":
        return {}
    types = {f.name: f.type for f in dataclasses.fields(cfg_type)}
    changes = {}
    for part in spec.split("+"):
        name, eq, value = part.partition("=")
        if not eq or name not in types:
            raise ValueError(f"variant part must be FIELD=VALUE with FIELD one of "
                             f"{', '.join(types)}, got {part!r}")
        is_bool = types[name] in (bool, "bool")
        if is_bool and value not in ("0", "1"):
            raise ValueError(f"{name} takes 0 or 1, got {value!r}")
        changes[name] = value == "1" if is_bool else int(value)
    return changes


def grouped_problem(kind: GemmKind, data, groups: int, m: int, n: int, k: int) -> GemmProblem:
    """The problem the grouped op builds for the bench's data of `kind` (masked: M = Mmax, the
    expected rows `m`; contiguous and offsets: M = the rows of A)."""
    e4m3 = torch.float8_e4m3fn
    rows = data.a.shape[1] if kind is GemmKind.MASKED else data.a.shape[0]
    return GemmProblem(kind, rows, n, k, groups, e4m3, e4m3, Recipe.GROUP, Recipe.BLOCK,
                       torch.bfloat16, expected_m=m if kind is GemmKind.MASKED else 0)


def tile_rows(problem: GemmProblem) -> int:
    """Rows the tiles of one group cover: masked, the expected rows; else M."""
    return (sm90_fp8_gemm_small_m.expected_rows(problem) if problem.kind is GemmKind.MASKED
            else problem.m)


def tile_count(problem: GemmProblem, cfg) -> int:
    m_tiles = ceil_div(tile_rows(problem), cfg.block_m)
    groups = problem.groups if problem.kind in (GemmKind.MASKED, GemmKind.K_GROUPED) else 1
    return groups * m_tiles * ceil_div(problem.n, cfg.block_n)


def l2_read_bytes(problem: GemmProblem, cfg) -> int | None:
    """Bytes of A and B that `cfg`'s tiles read from L2 (fp8; scales and C left out): each tile
    its rows of A and of B over all of K, a 2-CTA cluster's shared operand once for the pair.
    Over the run time, the L2 read rate the config needs (docs/cuda.md, "Where the time goes").
    None for the k-grouped weight gradient (K differs per expert)."""
    if problem.kind is GemmKind.K_GROUPED:
        return None
    a, b = min(cfg.block_m, tile_rows(problem)), min(cfg.block_n, problem.n)
    if getattr(cfg, "num_multicast", 1) > 1:
        a, b = (a / 2, b) if cfg.multicast_on_a else (a, b / 2)
    return round(tile_count(problem, cfg) * (a + b) * problem.k)


def config_smem(cfg, problem: GemmProblem) -> int:
    """Shared memory of a config of any family: the 1D2D families' smem(k, kind), the small-M
    family's smem(k), the 1D1D families' smem property (independent of K)."""
    smem = cfg.smem
    if not callable(smem):
        return smem
    return smem(problem.k, problem.kind) if len(inspect.signature(smem).parameters) > 1 \
        else smem(problem.k)


def derive(base, changes: dict, problem: GemmProblem, facts: DeviceFacts, max_stages: int):
    """`base` with `changes`, and the fields that follow from a changed tile re-derived (see the
    module docstring). Returns None when no stage count fits shared memory."""
    cfg = dataclasses.replace(base, **changes)
    tile_changed = any(f in changes for f in TILE_FIELDS)
    if (tile_changed or "splits" in changes) and "two_accum" not in changes \
            and hasattr(cfg, "two_accum"):
        cfg = dataclasses.replace(cfg, two_accum=False)  # (split-K runs one accumulator)
    split = hasattr(cfg, "num_splits")  # the small-M family: one CTA per (tile, split), even rings
    if split and problem.kind is GemmKind.MASKED and tile_changed and "num_slots" not in changes:
        cfg = dataclasses.replace(
            cfg, num_slots=ceil_div(sm90_fp8_gemm_small_m.expected_rows(problem), cfg.block_m))
    if "grid" not in changes and (split and ("num_splits" in changes or tile_changed)
                                  or any(f in changes for f in GRID_FIELDS)):
        if split:
            cfg = dataclasses.replace(cfg, grid=tile_count(problem, cfg) * cfg.num_splits)
        else:
            grid = min(facts.num_sms * getattr(cfg, "ctas_per_sm", 1),
                       tile_count(problem, cfg) * getattr(cfg, "splits", 1))
            mc = getattr(cfg, "num_multicast", 1)
            cfg = dataclasses.replace(cfg, grid=max(grid - grid % mc, mc))
    if (tile_changed or "ctas_per_sm" in changes) and "num_stages" not in changes:
        limit = cfg.smem_limit(facts) if hasattr(cfg, "smem_limit") else facts.smem_per_block
        fits = [s for s in range(max_stages, 0, -1)
                if not (split and s % 2)
                and config_smem(dataclasses.replace(cfg, num_stages=s), problem) <= limit]
        if not fits:
            return None
        cfg = dataclasses.replace(cfg, num_stages=fits[0])
    return cfg


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="sm90_fp8_gemm_1d2d",
                    help=f"one of {', '.join(f.name for f in FAMILIES + TRIAL_FAMILIES)}")
    ap.add_argument("--kind", default="dense", choices=[k.value for k in GemmKind
                                                         if k is not GemmKind.K_GROUPED]
                    + ["wgrad", "wgrad_no_c", "wgrad_c", "k_grouped_wgrad"])
    ap.add_argument("--shapes", default=M4096,
                    help="comma-separated MxNxK (grouped: GxMxNxK, sGxMxNxK skewed)")
    ap.add_argument("--variants", default="base", help="comma-separated variants (see above)")
    ap.add_argument("--sweep", action="store_true", help="also every candidate config")
    ap.add_argument("--runs", type=int, default=MIN_DEVICE_RUNS)
    ap.add_argument("--json", default="", help="write every row here")
    ap.add_argument("--headers", default="",
                    help="NAME=DIR,...: also every variant built from DIR's kernel headers")
    ap.add_argument("--also", default="",
                    help="FAMILY,...: also time each family's own choice, as a variant")
    args = ap.parse_args(argv)
    try:
        headers = parse_headers(args.headers)
    except ValueError as e:
        ap.error(str(e))
    header_caches: dict[str, dict] = {name: {} for name in headers}
    if headers:
        os.environ["FP8GEMM_PDL"] = "0"  # (read when the plans build their launch configs)
    families = {f.name: f for f in FAMILIES + TRIAL_FAMILIES}
    fam = families.get(args.family)
    also = [families.get(x) for x in filter(None, args.also.split(","))]
    if fam is None or None in also:
        ap.error(f"--family and --also take names of {', '.join(families)}")
    specs = args.variants.split(",")
    changes = {spec: parse_variant(spec, fam.Config) for spec in specs}
    dev = torch.device("cuda", torch.cuda.current_device())
    facts = DeviceFacts.of(dev)
    timer = DeviceTimer(dev)
    k_grouped = args.kind == "k_grouped_wgrad"
    wgrad = args.kind.startswith("wgrad") or k_grouped  # fp32 out of A . B^T
    in_place = args.kind in ("wgrad", "k_grouped_wgrad")  # out += A . B^T (c = out)
    separate_c = args.kind == "wgrad_c"  # out = c + A . B^T, c zeros of its own
    has_c = in_place or separate_c
    op = "wgrad" if wgrad and not k_grouped else args.kind  # the bench's data
    kind = (GemmKind.K_GROUPED if k_grouped else GemmKind.DENSE if wgrad
            else GemmKind(args.kind))
    dense = kind is GemmKind.DENSE
    out_dtype = torch.float32 if wgrad else torch.bfloat16
    block_way = cublas_block_probe(dev)[0] if dense else None  # the bench's way of calling it
    rows = []
    for shape in args.shapes.split(","):
        skewed = not dense and shape.startswith("s")
        dims = [int(v) for v in shape.removeprefix("s").split("x")]
        if len(dims) != (3 if dense else 4):
            ap.error(f"--shapes: {shape!r} is not {'MxNxK' if dense else '[s]GxMxNxK'}")
        g, (m, n, k) = (1, dims) if dense else (dims[0], dims[1:])
        sizes = () if not skewed else (backward_skewed_sizes(g, k) if k_grouped
                                       else skewed_sizes(g * m, g))
        data = make_data(Case("tiles", op, m, n, k, groups=g, sizes=sizes), dev)
        if k_grouped:
            problem = case_problem(data.case)
            *operands, index = k_grouped_operands(data)  # index: ks
        else:
            problem = (grouped_problem(kind, data, g, m, n, k) if not dense
                       else wgrad_problem(m, n, k, has_c) if wgrad
                       else dense_problem(m, n, k))
            operands = (data.a, data.sa, data.b, data.sb)
            index = {GemmKind.DENSE: None, GemmKind.CONTIGUOUS: data.m_indices,
                     GemmKind.OFFSETS: data.offsets, GemmKind.MASKED: data.masked_m}[kind]
        out_shape = (g, m, n) if k_grouped else data.a.shape[:-1] + (n,)
        why = fam.supports(problem)
        try:
            base = fam.select_config(problem, facts) if why is None else None
        except ValueError as e:  # (a trial family with no config for the problem: small-M)
            why = str(e)
        if why is not None:
            print(f"{shape}: {fam.name} does not run it: {why}", flush=True)
            continue
        ref = reference_output(data)
        candidates = fam.candidate_configs(problem, facts)
        max_stages = max(c.num_stages for c in candidates + [base])
        configs = {}  # name -> config, each config once
        for spec in specs:
            cfg = derive(base, changes[spec], problem, facts, max_stages)
            if cfg is None:
                print(f"{shape} {spec}: no stage count fits {facts.smem_per_block} bytes", flush=True)
            elif cfg not in configs.values():
                configs[spec] = cfg
        if args.sweep:
            for i, cfg in enumerate(candidates):
                if cfg not in configs.values():
                    configs[f"candidate{i}"] = cfg
        runner = dict.fromkeys(configs, fam)  # variant -> the family that runs it
        for other in also:
            why = other.supports(problem)
            if why is None:
                try:
                    configs[other.name] = other.select_config(problem, facts)
                    runner[other.name] = other
                except ValueError as e:
                    why = str(e)
            if why is not None:
                print(f"{shape}: {other.name} does not run it: {why}", flush=True)
        calls = {}
        # every variant with this tree's headers, then with each of --headers'
        for h in headers:
            for x, c in list(configs.items()):
                if "@" not in x:
                    configs[f"{x}@{h}"], runner[f"{x}@{h}"] = c, runner[x]
        for name, cfg in configs.items():
            # (in place: out += A . B^T, so out starts at zero; otherwise poisoned)
            out = torch.full(out_shape, 0.0 if in_place else float("nan"), dtype=out_dtype,
                             device=dev)
            c = out if in_place else torch.zeros_like(out) if separate_c else None
            h = name.partition("@")[2]

            def fn(cfg=cfg, out=out, c=c, h=h, f=runner[name]):
                with (kernel_headers(headers[h], header_caches[h]) if h
                      else contextlib.nullcontext()):
                    f.run(cfg, problem, *operands, out, c, index)

            try:
                fn()
                torch.cuda.synchronize()
            except (ValueError, RuntimeError) as e:
                print(f"{shape} {name}: refused: {e}  ({cfg})", flush=True)
                continue
            diff = calc_diff(data.data_rows(out), ref)
            if not diff < MAX_DIFF:
                print(f"{shape} {name}: WRONG, diff {diff:.2e}  ({cfg})", flush=True)
                continue
            if not in_place and not data.no_data_rows(out).isnan().all():
                print(f"{shape} {name}: WRONG, rows of no group written  ({cfg})", flush=True)
                continue
            calls[name] = fn
        cublas = "cublas-block-loop" if k_grouped else "cublas-block"
        if dense or k_grouped:
            try:
                calls[cublas] = make_impl(cublas, data, block_way).fn
            except Skip as e:
                print(f"{shape} {cublas}: not timed: {e}", flush=True)
        if not calls:
            continue
        peer = cublas if cublas in calls else next(iter(calls))
        busy = dict.fromkeys(calls, MIN_BUSY_US)
        try:
            dg = make_impl("deepgemm", data)
            calls["deepgemm"], busy["deepgemm"] = dg.fn, dg.busy_us
        except Skip as e:
            print(f"{shape} deepgemm: not timed: {e}", flush=True)
        names = list(calls)
        times = timer.time_interleaved_us(
            [(calls[x], eager_time_us(calls[x], dev).host_us, busy[x]) for x in names],
            args.runs)
        us = {x: median(t) for x, t in zip(names, times)}
        # data rows only (no padding, no rows past masked_m); k-grouped: every expert's tokens
        flops = 2 * m * n * sum(data.case.group_sizes) if k_grouped else 2 * ref.shape[0] * n * k
        # fp32 output traffic of the weight gradients: out written, and c read where there is one
        out_bytes = (2 if has_c else 1) * 4 * ref.numel() if wgrad else None
        for x in names:
            speedup = us[peer] / us[x]
            cfg = configs.get(x)
            l2 = None if cfg is None else l2_read_bytes(problem, cfg)
            l2_tbs = None if l2 is None else l2 / us[x] / 1e6
            print(f"{shape:>18} {x:>24} {us[x]:9.1f} us {flops / us[x] / 1e6:6.0f} "
                  f"TFLOPS {speedup:5.2f}x  "
                  + (f"L2 {l2_tbs:5.2f} TB/s  " if l2_tbs is not None else "")
                  + (f"out {out_bytes / us[x] / 1e6:5.2f} TB/s  " if out_bytes else "")
                  + f"{cfg if cfg is not None else ''}", flush=True)
            rows.append({"shape": shape, "variant": x, "us": us[x], "peer": peer,
                         "speedup": speedup, "l2_read_tbs": l2_tbs,
                         "config": None if cfg is None else dataclasses.asdict(cfg)})
        del data, ref
        torch.cuda.empty_cache()
    over = ("cuBLAS block-wise" if dense else "the cuBLAS loop" if k_grouped
            else "the first variant")
    print(f"geometric mean of the speed-up over {over}, over the shapes each ran:")
    for x in dict.fromkeys(r["variant"] for r in rows):
        xs = [r["speedup"] for r in rows if r["variant"] == x]
        print(f"  {x:>24} {geomean(xs):.3f} ({len(xs)} shapes)")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
