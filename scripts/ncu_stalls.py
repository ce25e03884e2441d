#!/usr/bin/env python3
"""Where a kernel's warps stall, from Nsight Compute's per-instruction source page (the CSV that
`SOURCE=1 bash scripts/ncu_dense.sh` writes, plain or gzipped). Runs on the CPU.

    python scripts/ncu_stalls.py ncu_contiguous_..._fp8gemm-cuda_sass.csv[.gz] [...]
    python scripts/ncu_stalls.py OURS.csv PEER.csv --per 2606912x192,3080896x160

Per kernel: the stall samples by reason over the whole kernel, then by execution class, the
instructions executed the same number of times (a loop's body: a k-loop runs every instruction
once per k-block of each math warp, the producer's loop once per k-block, a tile's prologue and
epilogue once per tile), largest first, and the instructions with the most samples. Samples are
proportional to the time warps spend at an instruction, so two kernels compare class by class
once each is divided by the work it ran: `--per UNITS[,UNITS...]` (one per file; a product such
as `2606912x192`: warp-k-blocks times columns) prints the k-loop's samples per million units,
where the k-loop is the classes of the `--loop` most-executed instruction counts holding QGMMA.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import io
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

_STALL = "stall_"


@dataclass
class Instr:
    address: str
    source: str
    executed: float
    samples: float
    stalls: Counter = field(default_factory=Counter)  # reason -> samples


@dataclass
class Kernel:
    name: str
    instrs: list[Instr]


def _number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return 0.0


def read(path: Path) -> list[Kernel]:
    """The kernels of one source-page CSV: each a `"Kernel Name"` line, then its table."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        lines = f.read().splitlines()
    kernels, i = [], 0
    while i < len(lines):
        if not lines[i].startswith('"Kernel Name"'):
            i += 1
            continue
        name = next(csv.reader([lines[i]]))[1]
        j = i + 1
        while j < len(lines) and not lines[j].startswith('"Kernel Name"'):
            j += 1
        rows = csv.DictReader(io.StringIO("\n".join(lines[i + 1:j])))
        instrs = []
        for r in rows:
            stalls = Counter({k[len(_STALL):]: _number(v) for k, v in r.items()
                              if k and k.startswith(_STALL) and "(Not Issued)" not in k})
            instrs.append(Instr(r["Address"], r["Source"].strip(),
                                _number(r["Instructions Executed"]),
                                _number(r["Warp Stall Sampling (All Samples)"]), +stalls))
        kernels.append(Kernel(name, instrs))
        i = j
    return kernels


def classes(instrs: list[Instr]) -> dict[float, list[Instr]]:
    """Instructions grouped by how many times each was executed."""
    out: dict[float, list[Instr]] = {}
    for ins in instrs:
        out.setdefault(ins.executed, []).append(ins)
    return out


def k_loop(instrs: list[Instr], loop: int = 4) -> list[Instr]:
    """The instructions of the classes among the `loop` most-executed ones that hold a QGMMA
    (an unrolled k-loop runs as several classes: its copies, and the barrier tests executed as
    often as the k-blocks that wait)."""
    by_count = classes(instrs)
    top = sorted((c for c in by_count if c > 0), reverse=True)[:loop]
    mma = [c for c in top if any("QGMMA" in i.source for i in by_count[c])]
    if not mma:
        return []
    # the classes between the least-executed QGMMA class and the most-executed one: the k-loop's
    # barrier tests run fewer times than its body (a stage already landed skips the retry)
    low = min(mma)
    return [i for c in top if c >= low * 0.8 for i in by_count[c]]


def sums(instrs: list[Instr]) -> tuple[float, Counter]:
    total, reasons = 0.0, Counter()
    for ins in instrs:
        total += ins.samples
        reasons.update(ins.stalls)
    return total, reasons


def units(spec: str) -> float:
    """'2606912x192' -> 500527104.0"""
    return math.prod(float(x) for x in spec.split("x"))


def report(kernel: Kernel, top: int, per: float | None, loop: int) -> str:
    out = [f"== {kernel.name[:150]}"]
    total, reasons = sums(kernel.instrs)
    executed = sum(i.executed for i in kernel.instrs)
    out.append(f"samples {total:.0f}, warp instructions {executed:.0f}")
    if total:
        out.append("  " + ", ".join(f"{k} {v / total:.1%}" for k, v in reasons.most_common() if v))
    out.append("by execution count (samples, instructions, top reasons):")
    groups = sorted(((count, len(ins), *sums(ins))
                     for count, ins in classes(kernel.instrs).items()), key=lambda g: -g[2])
    for count, n, s, r in groups[:top]:
        why = ", ".join(f"{k} {v:.0f}" for k, v in r.most_common(4))
        out.append(f"  x{count:>10.0f}  {s:8.0f}  {n:5d}  {why}")
    loop_instrs = k_loop(kernel.instrs, loop)
    if per and loop_instrs:
        s, r = sums(loop_instrs)
        out.append(f"k-loop per million units: {s / per * 1e6:.1f}  "
                   + ", ".join(f"{k} {v / per * 1e6:.1f}" for k, v in r.most_common(9)))
    out.append("most sampled instructions:")
    for ins in sorted(kernel.instrs, key=lambda i: -i.samples)[:top]:
        why = ", ".join(f"{k} {v:.0f}" for k, v in ins.stalls.most_common(3))
        out.append(f"  x{ins.executed:>10.0f}  {ins.samples:7.0f}  {ins.source[:58]:58s}  {why}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", type=Path, help="ncu source-page CSVs (.csv or .csv.gz)")
    ap.add_argument("--top", type=int, default=12, help="classes and instructions to list")
    ap.add_argument("--per", default="",
                    help="comma-separated work units, one per file, e.g. 2606912x192")
    ap.add_argument("--loop", type=int, default=4,
                    help="most-executed classes searched for the k-loop (default 4)")
    args = ap.parse_args(argv)
    pers = [units(p) for p in args.per.split(",")] if args.per else []
    if pers and len(pers) != len(args.csv):
        ap.error(f"--per takes one value per file: {len(pers)} for {len(args.csv)} files")
    for n, path in enumerate(args.csv):
        kernels = read(path)
        if not kernels:
            print(f"{path}: no kernel's source page (a CSV of `ncu --page source --csv`?)")
            continue
        for kernel in kernels:
            print(report(kernel, args.top, pers[n] if pers else None, args.loop))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
