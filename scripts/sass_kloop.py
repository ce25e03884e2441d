#!/usr/bin/env python3
"""What a kernel's mainloop issues a k-block: the innermost SASS loop that holds wgmma (QGMMA),
its instructions counted by opcode and over the k-blocks it runs. Runs on the CPU.

    python scripts/sass_kloop.py KERNEL.cubin|KERNEL.sass [...] [--waves 2]
    python scripts/sass_kloop.py --1d2d contiguous 7168x2048 128x192 [--headers DIR]
    python scripts/sass_kloop.py --1d1d wgrad 2048 128x152 [--headers DIR]

A k-block of one 64-row wave is BLOCK_K / 32 = 4 QGMMA; `--waves` gives the waves a k-block runs
(2 for the 256-row tiles of the 1D2D and 1D1D kernels) when the loop is one of those. The loop
is the shortest one (a backward branch and its target, in code order) that holds at least one
k-block's QGMMA (`--kblocks N`: N k-blocks', to pick a loop unrolled over the stages of a turn
of the ring beside loops of one k-block); a loop the compiler unrolled over several k-blocks
counts as that many. Compare kernels compiled for the same tile (ours against a peer's, one
variant against another): the counts beside the QGMMA and the promotion's FFMA / FMUL are the
ring's and the barrier's bookkeeping.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import sass_waits as sw  # noqa: E402

QGMMA_PER_WAVE = 4  # BLOCK_K 128 over wgmma's K of 32 (FP8)
_BRANCH = re.compile(r"\bBRA\s+(0x[0-9a-f]+)")


def opcode(text: str) -> str:
    """'@!P1 FFMA.FTZ R1, ...' -> 'FFMA' (the predicate and the modifiers dropped)."""
    return re.sub(r"^@!?U?P[T0-9]+\s+", "", text).split()[0].split(".")[0]


def k_loop(instrs: list[sw.Instr], waves: int = 1, min_kblocks: int = 1) -> dict | None:
    """The shortest loop holding min_kblocks k-blocks' QGMMA or more: its address range,
    instructions, k-blocks and opcode counts; None when there is none."""
    per_kblock = QGMMA_PER_WAVE * waves
    mma_addrs = [i.addr for i in instrs if opcode(i.text) == "QGMMA"]
    best = None
    for ins in instrs:
        m = _BRANCH.search(ins.text)
        if not m or int(m.group(1), 16) >= ins.addr:
            continue
        lo, hi = int(m.group(1), 16), ins.addr
        n_mma = sum(lo <= a <= hi for a in mma_addrs)
        if n_mma >= per_kblock * min_kblocks and (best is None or hi - lo < best[1] - best[0]):
            best = (lo, hi, n_mma)
    if best is None:
        return None
    lo, hi, n_mma = best
    body = [i for i in instrs if lo <= i.addr <= hi]
    return {"start": lo, "end": hi, "instructions": len(body), "kblocks": n_mma / per_kblock,
            "opcodes": Counter(opcode(i.text) for i in body)}


def report(name: str, sass: str, waves: int, min_kblocks: int = 1) -> dict | None:
    loop = k_loop(sw.parse(sass), waves, min_kblocks)
    if loop is None:
        print(f"== {name}: no loop holds {QGMMA_PER_WAVE * waves * min_kblocks} QGMMA")
        return None
    kb = loop["kblocks"]
    ops = loop["opcodes"]
    math = sum(ops[o] for o in ("QGMMA", "FFMA", "FMUL"))
    print(f"== {name}: loop {loop['start']:#x}-{loop['end']:#x}, {loop['instructions']} "
          f"instructions over {kb:g} k-blocks: {loop['instructions'] / kb:.1f} a k-block "
          f"({(loop['instructions'] - math) / kb:.1f} beside QGMMA, FFMA and FMUL)")
    print("   " + ", ".join(f"{o} {c / kb:g}" for o, c in ops.most_common()))
    return loop


def main(argv: list[str] | None = None) -> int:
    ap = sw.kernel_parser(__doc__)
    ap.add_argument("--waves", type=int, default=None,
                    help="64-row waves a k-block runs (default 1; --1d2d, --1d1d: BLOCK_M / 128, "
                         "at least 1)")
    ap.add_argument("--kblocks", type=int, default=1,
                    help="the shortest loop of at least this many k-blocks (an unrolled turn of "
                         "the ring beside shorter loops of one k-block)")
    args = ap.parse_args(argv)
    for name, sass, block_m in sw.kernels(ap, args):
        report(name, sass, args.waves or (max(1, block_m // 128) if block_m else 1), args.kblocks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
