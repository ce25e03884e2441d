#!/usr/bin/env python3
"""Where a kernel waits for its global loads: each load in the SASS and the first instruction
after it (in code order) that waits on the load's scoreboard. Runs on the CPU.

    python scripts/sass_waits.py KERNEL.cubin|KERNEL.sass [...] [--within 16] [--all]
    python scripts/sass_waits.py --1d2d contiguous 7168x2048 128x192 [--headers DIR]
    python scripts/sass_waits.py --1d1d wgrad 2048 128x152 [--headers DIR]

A load consumed a few instructions later stalls its warp for the whole round trip (L2 under a
GEMM's traffic: several hundred cycles); a load whose value is first read a tile later costs
nothing. `--within N` lists the loads waited on within N instructions (default 16), `--all`
every load. `--1d2d KIND NxK BMxBN` compiles that config of the 1D2D family first (the most
stages that fit an H100/H200, no multicast; `--headers` another copy of the kernel headers, as
scripts/cuda_tiles.py takes them); `--1d1d KIND N BMxBN` a config of the 1D1D family (KIND
wgrad) or the k-grouped one (k_grouped), N columns, the most stages that fit. A cubin of any
kernel: FP8GEMM_DUMP_SASS=1 writes the SASS of each kernel compiled beside its cubin in the
cache (FP8GEMM_CACHE_DIR).

The control bits come from each instruction's second 64-bit word, as cuobjdump prints it: from
bit 41, the stall count (4 bits), the yield flag (1), the scoreboard the instruction sets when
its result is written (3; 7 = none), the one it sets when its operands are read (3), and the
mask of scoreboards it waits on (6). Code order is not execution order: a wait in a branch not
taken, or a loop's back edge, is not followed.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_LINE = re.compile(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;?\s*/\* 0x([0-9a-f]{16}) \*/\s*$")
_HI = re.compile(r"^\s+/\* 0x([0-9a-f]{16}) \*/\s*$")
# Global loads whose result lands in a register (a scoreboard guards it until then).
_GLOBAL_LOAD = re.compile(r"\b(LDG|ATOMG|ATOM)\b")
NO_SCOREBOARD = 7
SMEM_PER_BLOCK = 232448  # an H100's or H200's shared memory a block: the stages that fit


@dataclass(frozen=True)
class Instr:
    addr: int
    text: str
    stall: int
    write_sb: int  # set when the result is written (NO_SCOREBOARD: none)
    read_sb: int   # set when the operands are read
    wait_mask: int  # bit i: waits for scoreboard i

    def waits_on(self, sb: int) -> bool:
        return sb != NO_SCOREBOARD and bool(self.wait_mask >> sb & 1)


def parse(sass: str) -> list[Instr]:
    """The instructions of cuobjdump -sass text, with their control bits."""
    out = []
    lines = sass.splitlines()
    for i, line in enumerate(lines[:-1]):
        m = _LINE.match(line)
        hi = _HI.match(lines[i + 1]) if m else None
        if not hi:
            continue
        ctrl = int(hi.group(1), 16) >> 41
        out.append(Instr(int(m.group(1), 16), m.group(2).strip(), ctrl & 0xF, ctrl >> 5 & 7,
                         ctrl >> 8 & 7, ctrl >> 11 & 0x3F))
    return out


def load_waits(instrs: list[Instr]) -> list[dict]:
    """Each global load with a result scoreboard, and the first later instruction in code order
    that waits on that scoreboard (distance in instructions; None: none before the end)."""
    out = []
    for i, ins in enumerate(instrs):
        if not _GLOBAL_LOAD.search(ins.text) or ins.write_sb == NO_SCOREBOARD:
            continue
        j = next((j for j in range(i + 1, len(instrs)) if instrs[j].waits_on(ins.write_sb)), None)
        out.append({"load": ins, "waiter": None if j is None else instrs[j],
                    "distance": None if j is None else j - i})
    return out


def sass_of(path: Path) -> str:
    """SASS text of a .sass file, or of a cubin through cuobjdump."""
    return path.read_text() if path.suffix != ".cubin" else _sass_of_cubin(path.read_bytes())


def _sass_of_cubin(cubin: bytes) -> str:
    from fp8gemm.jit import disassemble

    out = disassemble(cubin)
    if out is None:
        raise SystemExit("no cuobjdump (CUDA toolkit or Triton's wheel)")
    out.check_returncode()
    return out.stdout


def compile_1d2d(kind: str, nk: str, block: str, headers: Path | None) -> str:
    """SASS of a config of the 1D2D family compiled here (no GPU)."""
    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as g
    from fp8gemm.problem import GemmKind

    n, k = map(int, nk.lower().split("x"))
    bm, bn = map(int, block.lower().split("x"))
    gk = GemmKind(kind)
    stages = g.max_stages(bm, bn, k, SMEM_PER_BLOCK, gk)
    cfg = g.Sm90Config(bm, bn, stages, 1, False, g.BAND_SIZE, 132)
    compiled = g.compile_kernel(gk, n, k, cfg, include_dir=headers)[1]
    return _sass_of_cubin(compiled.cubin)


def compile_1d1d(kind: str, n: str, block: str, headers: Path | None) -> str:
    """SASS of a config of the 1D1D family (kind wgrad) or the k-grouped one (k_grouped), N
    columns, compiled here (no GPU)."""
    from fp8gemm.backends.cuda import sm90_fp8_gemm_1d1d as d1

    if kind not in ("wgrad", "k_grouped"):
        raise ValueError(f"--1d1d KIND must be wgrad or k_grouped, got {kind!r}")
    bm, bn = map(int, block.lower().split("x"))
    cfg = d1.Sm90Config1d1d(bm, bn, d1.max_stages(bm, bn, SMEM_PER_BLOCK), d1.BAND_SIZE, 132)
    compiled = d1.compile_kernel(int(n), cfg, kind == "k_grouped",
                                 include_dir=headers)[1]
    return _sass_of_cubin(compiled.cubin)


def report(name: str, sass: str, within: int | None) -> int:
    """Print the loads of one kernel (those waited on within `within` instructions; None:
    all); returns how many were printed."""
    waits = load_waits(parse(sass))
    shown = [w for w in waits if within is None or (w["distance"] is not None
                                                    and w["distance"] <= within)]
    print(f"== {name}: {len(waits)} global loads, {len(shown)} shown")
    for w in shown:
        ld, wt = w["load"], w["waiter"]
        after = "never (in code order)" if wt is None else \
            f"+{w['distance']:<4} {wt.addr:#07x}  {wt.text[:60]}"
        print(f"  {ld.addr:#07x}  SB{ld.write_sb}  {ld.text[:52]:52}  waited {after}")
    return len(shown)


def kernel_parser(doc: str) -> argparse.ArgumentParser:
    """The arguments that name the kernels to read: files, or a 1D2D or 1D1D config to
    compile."""
    ap = argparse.ArgumentParser(description=doc,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", type=Path, help=".cubin or .sass files")
    ap.add_argument("--1d2d", dest="one_d2d", nargs=3, metavar=("KIND", "NxK", "BMxBN"),
                    help="compile this 1D2D config first (KIND: dense, contiguous, offsets, "
                         "masked)")
    ap.add_argument("--1d1d", dest="one_d1d", nargs=3, metavar=("KIND", "N", "BMxBN"),
                    help="compile this 1D1D config first (KIND: wgrad, k_grouped; the most stages "
                         "that fit)")
    ap.add_argument("--headers", type=Path,
                    help="with --1d2d / --1d1d: another copy of the headers")
    return ap


def kernels(ap: argparse.ArgumentParser, args) -> list[tuple[str, str, int | None]]:
    """(name, SASS, BLOCK_M of a --1d2d / --1d1d config, else None) of each kernel
    kernel_parser named."""
    if not args.files and not args.one_d2d and not args.one_d1d:
        ap.error("give a .cubin / .sass file, --1d2d or --1d1d")
    out = [(str(path), sass_of(path), None) for path in args.files]
    for spec, compile_ in ((args.one_d2d, compile_1d2d), (args.one_d1d, compile_1d1d)):
        if spec:
            block_m = int(spec[2].lower().split("x")[0])
            try:
                out.append((" ".join(spec), compile_(*spec, args.headers), block_m))
            except ValueError as e:
                ap.error(str(e))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = kernel_parser(__doc__)
    ap.add_argument("--within", type=int, default=16)
    ap.add_argument("--all", action="store_true", help="every load, however far its wait")
    args = ap.parse_args(argv)
    for name, sass, _ in kernels(ap, args):
        report(name, sass, None if args.all else args.within)
    return 0


if __name__ == "__main__":
    sys.exit(main())
