#!/usr/bin/env python3
"""Where the 1D2D kernel's k-loop time goes, from clock64 stamps of a traced build (Hopper GPU).

    python scripts/timeline_1d2d.py SHAPE OP [VARIANT]
    python scripts/timeline_1d2d.py s16x2048x4096x7168 contiguous \\
        block_n=160+num_multicast=2+multicast_on_a=0+num_stages=4

SHAPE, OP and VARIANT as scripts/ncu_call.py takes them (VARIANT in scripts/cuda_tiles.py's
syntax, default the heuristic's config; `deepgemm`: DeepGEMM's kernel on its own config, from a
copy of the peer whose kernel source is patched with the same stamps, for measurement only). The kernel headers are copied to a temporary folder with
FP8GEMM_TRACE defined (sm90_fp8_gemm_1d2d.cuh: thread 0 of each warpgroup of the first 8 CTAs
stamps its events, the untraced build compiles them to nothing), the config runs once to warm up
and once traced, and the stamps are read back from the kernel's `fp8gemm_trace` global.

Only the one-accumulator k-loop and its epilogue are stamped (not two accumulators, split-K or a
warpgroup's idle half): time those configs' loops some other way. A stamp costs its thread a
clock read and a global store, four a k-block: compare traced builds with each other, not with
the untraced kernel's time.

Printed per traced CTA, over the window in which every role was still stamping: the share of
the cycles with no wgmma in flight in any math warpgroup, and what the warpgroups were doing then
(waiting for a stage, issuing, promoting, in the epilogue); the mean cycles of a k-block's
wgmma, promotion and stage wait per warpgroup; and the producer's share of the window spent
waiting for a free stage. Then each k-block followed through the stage ring (stage_chain), and
the epilogue's mean cycles per warpgroup, whole and by phase (its first barrier, the writes to
shared memory, its second barrier, the stores' issue).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import shutil
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

# The tags of sm90_fp8_gemm_1d2d.cuh's TraceTag, and the trace buffer's shape.
SLOT_FREE, SENT, LANDED, ISSUED, DONE, PROMOTED, EPILOGUE, EPILOGUE_END = range(1, 9)
EPI_SYNCED, EPI_WRITTEN, EPI_STORING = range(9, 12)  # the epilogue's phases
# A tile's start (not in DeepGEMM's traced kernel): past the barrier after its B scales went to
# shared memory, then past the walk to the next tile (and its B scales' loads issued).
TILE_SYNCED, TILE_READY = 12, 13
TRACE_CTAS, TRACE_ROLES, TRACE_EVENTS = 8, 3, 8192
# Where no wgmma is in flight, what the math warpgroups are doing, most telling first: one
# waiting for its stage explains the idle tensor cores before one promoting does.
IDLE_CAUSES = ("stage wait", "epilogue", "tile start", "promotion", "issue", "other")
# The epilogue's phases: waiting at its first barrier (for the other warpgroup, and for the
# previous tile's store to have read shared memory), writing the sums to shared memory, waiting
# at its second barrier, issuing the stores.
EPILOGUE_PHASES = ("epi_wait", "epi_write", "epi_sync", "epi_store")
_STATE_OF = {"wait": "stage wait", "epilogue": "epilogue", "promote": "promotion",
             "issue": "issue", "tile_sync": "tile start", "tile_walk": "tile start",
             **{phase: "epilogue" for phase in EPILOGUE_PHASES}}
# A math warpgroup's state between two consecutive stamps (tag before, tag after).
_STATE_BETWEEN = {(PROMOTED, LANDED): "wait", (EPILOGUE_END, LANDED): "wait",
                  (EPILOGUE_END, TILE_SYNCED): "tile_sync", (TILE_SYNCED, TILE_READY): "tile_walk",
                  (TILE_READY, LANDED): "wait",
                  (LANDED, ISSUED): "issue", (ISSUED, DONE): "mma", (DONE, PROMOTED): "promote",
                  (EPILOGUE, EPILOGUE_END): "epilogue",
                  (EPILOGUE, EPI_SYNCED): "epi_wait", (EPI_SYNCED, EPI_WRITTEN): "epi_write",
                  (EPI_WRITTEN, EPI_STORING): "epi_sync", (EPI_STORING, EPILOGUE_END): "epi_store"}


def decode(words) -> list[tuple[int, int]]:
    """[(tag, clock)] of one role's stamps (stops at the first unwritten word)."""
    out = []
    for w in words:
        w = int(w)
        if w == 0:
            break
        out.append((w >> 56, w & ((1 << 56) - 1)))
    return out


def math_intervals(events: list[tuple[int, int]]) -> list[tuple[int, int, str]]:
    """(start, end, state) of a math warpgroup: 'wait' (from its last promotion or epilogue to
    the next stage landing), 'issue' (landed to issued), 'mma' (issued to complete), 'promote',
    'epilogue'."""
    out = []
    last = None  # the stamp that ended the previous state, and its tag
    for tag, t in events:
        if last is not None:
            prev_tag, t0 = last
            state = _STATE_BETWEEN.get((prev_tag, tag))
            if state is not None and t > t0:
                out.append((t0, t, state))
        last = (tag, t)
    return out


def producer_wait(events: list[tuple[int, int]], t0: int, t1: int) -> float:
    """Share of [t0, t1) the producer spent between a k-block's loads and the next free stage."""
    waited, sent = 0, None
    for tag, t in events:
        if tag == SENT:
            sent = t
        elif tag == SLOT_FREE and sent is not None:
            a, b = max(sent, t0), min(t, t1)
            waited += max(0, b - a)
            sent = None
    return waited / max(1, t1 - t0)


def split_roles(roles: dict[int, list[tuple[int, int]]]) -> tuple[list[int], list[int]]:
    """(producer roles, math warpgroup roles) of one CTA's stamps: the producer is the role
    that stamps SLOT_FREE, whichever warpgroup it is."""
    producer = [r for r, ev in roles.items() if any(tag == SLOT_FREE for tag, _ in ev)]
    return producer, [r for r, ev in roles.items() if ev and r not in producer]


def summarise(roles: dict[int, list[tuple[int, int]]], num_stages: int | None = None) -> dict:
    """Summary of one CTA's stamps (role -> [(tag, clock)], split_roles); with num_stages, also
    its stage_chain."""
    producer, maths = split_roles(roles)
    if not maths:
        return {}
    # the window every role was stamping in
    t0 = max(ev[0][1] for r, ev in roles.items() if ev)
    t1 = min(ev[-1][1] for r, ev in roles.items() if ev)
    ivs = {r: [iv for iv in math_intervals(roles[r]) if iv[1] > t0 and iv[0] < t1] for r in maths}
    # sweep the boundaries: in each piece, which state is each warpgroup in
    cuts = sorted({t0, t1} | {max(t0, min(t1, x)) for r in maths for iv in ivs[r] for x in iv[:2]})
    idle = defaultdict(int)
    pos = {r: 0 for r in maths}
    for a, b in zip(cuts, cuts[1:]):
        states = []
        for r in maths:
            lst = ivs[r]
            while pos[r] < len(lst) and lst[pos[r]][1] <= a:
                pos[r] += 1
            i = pos[r]
            states.append(lst[i][2] if i < len(lst) and lst[i][0] <= a < lst[i][1] else None)
        if "mma" in states:
            continue
        causes = {_STATE_OF[s] for s in states if s in _STATE_OF}
        cause = next((c for c in IDLE_CAUSES if c in causes), "other")
        idle[cause] += b - a
    span = max(1, t1 - t0)
    per_wg = {}
    for r in maths:
        by = defaultdict(list)
        for a, b, s in ivs[r]:
            by[s].append(b - a)
        # (the whole epilogue, from its start to its stores' issue, whether or not it has phases)
        by.pop("epilogue", None)
        by["epilogue"] = epilogue_spans(roles[r])
        per_wg[r] = {s: sum(v) / len(v) for s, v in by.items() if v}
    return {"window": span, "idle": sum(idle.values()) / span,
            "idle_by": {c: idle[c] / span for c in IDLE_CAUSES},
            "per_wg": per_wg,
            "producer_wait": producer_wait(roles[producer[0]], t0, t1) if producer else None,
            "chain": (stage_chain(roles[producer[0]], [roles[r] for r in maths], num_stages)
                      if producer and num_stages else None)}


def epilogue_spans(events: list[tuple[int, int]]) -> list[int]:
    """Cycles of each of a math warpgroup's epilogues, from its start to its stores' issue."""
    spans, start = [], None
    for tag, t in events:
        if tag == EPILOGUE:
            start = t
        elif tag == EPILOGUE_END and start is not None:
            spans.append(t - start)
            start = None
    return spans


def kblocks(events: list[tuple[int, int]]) -> list[dict]:
    """A math warpgroup's k-blocks in order: when it began waiting for the stage (its previous
    promotion, or the end of the tile start after an epilogue; None for its first), when the
    stage landed, its wgmma completed, whether it is a tile's first (the wait began after an
    epilogue) and, for a tile's first, the cycles from the epilogue's end to that wait (the tile
    start: 0 where the kernel does not stamp it)."""
    out, wait_from, landed, first, start = [], None, None, False, 0
    for tag, t in events:
        if tag == LANDED:
            landed = t
        elif tag == DONE and landed is not None:
            out.append({"wait_from": wait_from, "landed": landed, "done": t, "first": first,
                        "start": start})
            landed = None
        elif tag in (PROMOTED, EPILOGUE_END):
            wait_from, first, start = t, tag == EPILOGUE_END, 0
        elif tag == TILE_READY and wait_from is not None:
            start, wait_from = t - wait_from, t
    return out


def stage_chain(producer: list[tuple[int, int]], maths: list[list[tuple[int, int]]],
                num_stages: int, min_wait: int = 32) -> dict:
    """Why the math warpgroups waited for their stages, following each k-block through the ring
    (the producer and every warpgroup stamp the same k-blocks in the same order: dense tiles, or
    grouped tiles whose rows fill both warpgroups).

    late: share of the waited cycles (waits over min_wait) before the k-block's loads were sent,
      the rest spent with them in flight; flight: median cycles from sending a waited k-block's
      loads (sent before the wait began) to its landing; refill: median cycles from the later
      warpgroup's wgmma completion on a stage to the producer finding it free again, k-block
      j + num_stages (its release; in a cluster also the peer CTA's); issue: median cycles from
      the producer finding a stage free to its loads issued; first_start: median cycles from an
      epilogue's end to the next tile's first wait (its B scales to shared memory, the walk to
      the tile after it); first_wait, wait: median cycles a tile's first k-block and the others
      waited for their stage (every wait); first_flight: the median flight of the waited first
      k-blocks.
    A warpgroup that idles on some k-blocks (a 128-row tile's half without rows of the group)
    stamps fewer of them: only the warpgroups that stamped the most are followed."""
    sent = [t for tag, t in producer if tag == SENT]
    free = [t for tag, t in producer if tag == SLOT_FREE]
    wgs = [kblocks(ev) for ev in maths]
    most = max(len(k) for k in wgs)
    wgs = [k for k in wgs if len(k) == most]
    n = min(len(sent), most)
    late = in_flight = 0
    flights, first_flights, refills = [], [], []
    waits = {True: [], False: []}
    starts = []
    for j in range(n):
        for k in wgs:
            kb = k[j]
            if kb["wait_from"] is None:
                continue
            waits[kb["first"]].append(kb["landed"] - kb["wait_from"])
            if kb["first"]:
                starts.append(kb["start"])
            if kb["landed"] - kb["wait_from"] < min_wait:
                continue
            late += max(0, min(sent[j], kb["landed"]) - kb["wait_from"])
            in_flight += kb["landed"] - max(sent[j], kb["wait_from"])
            if sent[j] <= kb["wait_from"]:
                (first_flights if kb["first"] else flights).append(kb["landed"] - sent[j])
        if j + num_stages < len(free):
            refills.append(free[j + num_stages] - max(k[j]["done"] for k in wgs))

    def median(v):
        return sorted(v)[len(v) // 2] if v else None

    return {"late": late / max(1, late + in_flight), "flight": median(flights),
            "issue": median([s - f for s, f in zip(sent, free)]), "refill": median(refills),
            "first_start": median(starts), "first_wait": median(waits[True]),
            "wait": median(waits[False]),
            "first_flight": median(first_flights), "kblocks": n}


@contextlib.contextmanager
def traced_headers(include: Path | None = None):
    """A copy of the kernel headers (this tree's, or those under `include`) whose 1D2D kernel
    stamps (FP8GEMM_TRACE defined)."""
    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "include"
        shutil.copytree(include or sm90_fp8_gemm_1d2d.INCLUDE_DIR, dst)
        header = dst / "fp8gemm" / "sm90_fp8_gemm_1d2d.cuh"
        header.write_text("#define FP8GEMM_TRACE 1\n" + header.read_text())
        yield dst


# DeepGEMM's sm90 kernel (deep_gemm/include/deep_gemm/fp8_gemm.cuh of the peer in .peers), traced
# in a patched copy for measurement: (pattern, stamp) pairs, the stamp inserted after the first
# match of each pattern (SLOT_FREE after the producer's wait for a free stage, SENT after its
# expected-bytes arrival, which follows its loads; the math warpgroups' LANDED, ISSUED, DONE and
# PROMOTED around their k-block; EPILOGUE before the wait for the previous store, EPI_SYNCED after
# the barrier that follows it, EPI_WRITTEN after the shared-memory writes' fence, EPI_STORING
# after the next barrier, EPILOGUE_END after the stores' issue). The stages that a K not a
# multiple of the ring's K leaves empty in the last turn (waited for and released, nothing
# loaded) are not stamped, by its producer or its math warpgroups alike.
_DG_STAMPS = (
    (r"empty_barriers\[s\]->wait\(\(scheduler\.current_iter \* kNumIterations \+ k_iter \+ 1\) & 1\);\n",
     SLOT_FREE),
    (r"full_barrier\.arrive_and_expect_tx\([^\n]*\n", SENT),
    (r"full_barriers\[s\]->wait\(\(scheduler\.current_iter \* kNumIterations \+ k_iter\) & 1\);\n",
     LANDED),
    (r"warpgroup_commit_batch\(\);\n", ISSUED),
    (r"warpgroup_wait<0>\(\);\n", DONE),
    (r"shifted_accum\[i \* 4 \+ 3\] \+= [^\n]*\n[ \t]*\}\n", PROMOTED),
    # the epilogue's phases: its first barrier, its shared-memory writes fenced, its second
    (r"// Wait last TMA store to be finished\n(?:[^\n]*\n){0,3}?"
     r"[ \t]*cutlass::arch::NamedBarrier\(kNumMathThreads\)\.sync\(\);\n", EPI_SYNCED),
    (r"cute::tma_store_fence\(\);\n", EPI_WRITTEN),
    (r"cute::tma_store_fence\(\);\n(?:FP8GEMM_DG_STAMP\(\d+\);\n)?"
     r"[ \t]*cutlass::arch::NamedBarrier\(kNumMathThreads\)\.sync\(\);\n", EPI_STORING),
)


def deepgemm_traced_source(text: str, buffer_address: int) -> str:
    """DeepGEMM's fp8_gemm.cuh with the stamps of this script's tags written by thread 0 of each
    warpgroup of the first TRACE_CTAS CTAs into the TRACE_CTAS x TRACE_ROLES x TRACE_EVENTS
    words at `buffer_address` (a device buffer the caller owns)."""
    stamp = (f"#define FP8GEMM_DG_STAMP(tag) do {{ if (blockIdx.x < {TRACE_CTAS} && "
             f"threadIdx.x % 128 == 0 && trace_count < {TRACE_EVENTS}) {{ "
             f"const unsigned long long t_ = clock64(); "
             f"reinterpret_cast<unsigned long long*>({buffer_address:#x}ull)"
             f"[(blockIdx.x * {TRACE_ROLES} + threadIdx.x / 128) * {TRACE_EVENTS} + trace_count++] "
             f"= ((unsigned long long)(tag) << 56) | (t_ & ((1ull << 56) - 1)); }} }} while (0)\n")

    def after(pattern: str, insert: str, text: str) -> str:
        match = re.search(pattern, text)
        if match is None:
            raise SystemExit(f"DeepGEMM's kernel source has no match for {pattern!r}: "
                             f"its stamps need new anchors")
        return text[:match.end()] + insert + text[match.end():]

    text = after(r"#pragma once\n", stamp, text)
    # (one counter a thread, declared before the kernel splits into producer and math)
    text = after(r"auto scheduler = Scheduler<[^\n]*\n", "    uint32_t trace_count = 0;\n", text)
    for pattern, tag in _DG_STAMPS:
        text = after(pattern, f"FP8GEMM_DG_STAMP({tag});\n", text)
    epilogue = text.find("// Wait last TMA store to be finished\n")
    if epilogue < 0:
        raise SystemExit("DeepGEMM's kernel source has no epilogue anchor: its stamps need new "
                         "anchors")
    line = text.rindex("\n", 0, epilogue) + 1
    text = text[:line] + f"FP8GEMM_DG_STAMP({EPILOGUE});\n" + text[line:]
    # the epilogue ends at the math branch's last __syncwarp
    end = text.rindex("__syncwarp();\n") + len("__syncwarp();\n")
    return text[:end] + f"FP8GEMM_DG_STAMP({EPILOGUE_END});\n" + text[end:]


def infer_num_stages(producer: list[tuple[int, int]], maths: list[list[tuple[int, int]]]) -> int:
    """The ring's depth, from the stamps alone: the stages the producer found free before any
    math warpgroup had completed a wgmma (all of them, at the start)."""
    first_done = min((t for ev in maths for tag, t in ev if tag == DONE), default=None)
    if first_done is None:
        return 0
    return sum(1 for tag, t in producer if tag == SLOT_FREE and t < first_done)


def read_stamps(words) -> list[list[list[tuple[int, int]]]]:
    """[CTA][role] of [(tag, clock)] from the trace buffer's words."""
    words = words.view(TRACE_CTAS, TRACE_ROLES, TRACE_EVENTS).tolist()
    return [[decode(words[cta][r]) for r in range(TRACE_ROLES)] for cta in range(TRACE_CTAS)]


def trace_ours(args, data, g: int, m: int, n: int, k: int):
    """(config, num_stages, stamps: read_stamps) of our 1D2D kernel's config args.variant."""
    import torch
    from cuda.bindings import driver as cu

    import cuda_tiles as ct
    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d
    from fp8gemm.jit import driver
    from ncu_call import variant_call

    caches: dict = {}
    headers = ct.parse_headers(f"x={args.headers}")["x"] if args.headers else None
    with traced_headers(headers) as include, ct.kernel_headers(include, caches):
        call = variant_call(args.variant, args.op, data, g, m, n, k)[0]
        call()
        torch.cuda.synchronize()
        plans = list(caches.get(sm90_fp8_gemm_1d2d.__name__, {}).values())
        if len(plans) != 1:
            raise SystemExit(f"expected one 1D2D plan, found {len(plans)} (another family ran?)")
        dptr, nbytes = driver.check(cu.cuLibraryGetGlobal(plans[0].kernel._library,
                                                          b"fp8gemm_trace"),
                                    "cuLibraryGetGlobal(fp8gemm_trace)")
        driver.check(cu.cuMemsetD8(dptr, 0, nbytes), "cuMemsetD8")
        call()
        torch.cuda.synchronize()
    host = torch.empty(nbytes // 8, dtype=torch.int64)
    driver.check(cu.cuMemcpyDtoH(host.data_ptr(), dptr, nbytes), "cuMemcpyDtoH")
    cfg = plans[0].cfg
    return str(cfg), cfg.num_stages, read_stamps(host)


def trace_deepgemm(data):
    """(config, num_stages, stamps) of DeepGEMM's own call, its kernel stamped in a patched copy
    of the peer (DEEPGEMM_DIR, default .peers/deepgemm) compiled in a cache of its own."""
    import os

    import torch

    from fp8gemm.bench.impls import make_impl

    src = Path(os.environ.get("DEEPGEMM_DIR", ROOT / ".peers" / "deepgemm"))
    if not (src / "deep_gemm").is_dir():
        raise SystemExit(f"no DeepGEMM checkout at {src} (DEEPGEMM_DIR)")
    if "deep_gemm" in sys.modules:
        raise SystemExit("deep_gemm is already imported: the traced copy must be the first")
    words = torch.zeros(TRACE_CTAS * TRACE_ROLES * TRACE_EVENTS, dtype=torch.int64,
                        device="cuda")
    with tempfile.TemporaryDirectory() as tmp:
        dst = Path(tmp) / "deepgemm"
        shutil.copytree(src, dst)
        header = dst / "deep_gemm" / "include" / "deep_gemm" / "fp8_gemm.cuh"
        header.write_text(deepgemm_traced_source(header.read_text(), words.data_ptr()))
        sys.path.insert(0, str(dst))
        os.environ["DG_JIT_CACHE_DIR"] = str(Path(tmp) / "cache")
        impl = make_impl("deepgemm", data)
        impl.fn()
        torch.cuda.synchronize()
        words.zero_()
        impl.fn()
        torch.cuda.synchronize()
    stamps = read_stamps(words.cpu())
    stages = 0
    for st in stamps:
        producer, maths = split_roles(dict(enumerate(st)))
        if producer:
            stages = max(stages, infer_num_stages(st[producer[0]], [st[r] for r in maths]))
    return "DeepGEMM's own config", stages, stamps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape")
    ap.add_argument("op", choices=["dense", "dgrad", "contiguous", "offsets", "masked"])
    ap.add_argument("variant", nargs="?", default="base",
                    help="our config (scripts/cuda_tiles.py's syntax), or `deepgemm`: "
                    "DeepGEMM's kernel on its own config, traced with the same stamps")
    ap.add_argument("--headers", type=Path,
                    help="trace the kernels of another copy of the headers (an include folder, "
                    "as scripts/cuda_tiles.py --headers takes them)")
    ap.add_argument("--dump", help="also write the stamps as JSON here ([CTA][role] of "
                    "[tag, clock] pairs, with the config)")
    args = ap.parse_args()

    from ncu_call import shape_data

    data, g, m, n, k = shape_data(args.shape, args.op, "timeline")
    if args.variant == "deepgemm":
        config, num_stages, stamps = trace_deepgemm(data)
    else:
        config, num_stages, stamps = trace_ours(args, data, g, m, n, k)
    print(f"{config}: {num_stages} stages")
    if args.dump:
        Path(args.dump).write_text(json.dumps({
            "shape": args.shape, "op": args.op, "variant": args.variant, "config": config,
            "num_stages": num_stages, "stamps": stamps}))
    print(f"{'CTA':>3} {'window':>10} {'no wgmma':>8}  "
          + "  ".join(f"{c:>10}" for c in IDLE_CAUSES) + "  producer waits  per warpgroup "
          "(mean cycles: issue / mma / promote / wait)")
    chains, epilogues = [], []
    for cta in range(TRACE_CTAS):
        s = summarise(dict(enumerate(stamps[cta])), num_stages)
        if not s:
            continue
        wgs = "  ".join(f"wg{r}: " + " / ".join(f"{w.get(x, 0):.0f}" for x in
                                                ("issue", "mma", "promote", "wait"))
                        for r, w in s["per_wg"].items())
        pw = "-" if s["producer_wait"] is None else f"{s['producer_wait']:.1%}"
        print(f"{cta:>3} {s['window']:>10} {s['idle']:>8.1%}  "
              + "  ".join(f"{s['idle_by'][c]:>10.1%}" for c in IDLE_CAUSES)
              + f"  {pw:>14}  {wgs}")
        if s["chain"]:
            chains.append((cta, s["chain"]))
        epilogues.append((cta, s["per_wg"]))
    print("stage waits: share before the loads were sent; median cycles in flight (sent before "
          "the wait), from a free stage to its loads sent, and from the last wgmma on a stage "
          "to its refill; median cycles from an epilogue's end to the next tile's first wait; "
          "median wait of a tile's first k-block and of the others, and the first k-block's "
          "flight")
    for cta, c in chains:
        print(f"{cta:>3} {c['kblocks']:>6} k-blocks  late {c['late']:>6.1%}"
              + "".join(f"  {key} {'-' if c[key] is None else c[key]:>6}"
                        for key in ("flight", "issue", "refill", "first_start", "first_wait",
                                    "wait", "first_flight")))
    print("epilogue, mean cycles per warpgroup: whole (first barrier / shared-memory writes / "
          "second barrier / stores issued)")
    for cta, per_wg in epilogues:
        print(f"{cta:>3}  " + "  ".join(
            f"wg{r}: {w.get('epilogue', 0):.0f} ("
            + " / ".join(f"{w.get(phase, 0):.0f}" for phase in EPILOGUE_PHASES) + ")"
            for r, w in per_wg.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
