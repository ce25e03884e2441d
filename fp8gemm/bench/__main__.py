"""python -m fp8gemm.bench: fp8gemm's backends against cuBLAS, bf16 and DeepGEMM on a CUDA GPU.

Every available fp8gemm backend (fp8gemm-cuda, fp8gemm-triton) and the peers (cublas-block,
cublas-tensor, cublas-rowwise-grouped, cublas-block-loop, torch-bf16, and deepgemm when
`import deep_gemm` works: put DeepGEMM's package directory on PYTHONPATH) are timed on each shape
of the chosen suites; implementations that cannot run are skipped with the reason shown. Suites:
deepseek-dense, deepseek-grouped, irregular, m-sweep (M = 1 ... 256 against the memory floor),
moe-skewed (skewed expert loads), backward (wgrad, dgrad, k-grouped wgrad) and moe-layer (a
DeepSeek-V3 expert layer, prefill and decode). Prints one line per measurement, then markdown
tables (detailed, then the summary with ratios over the baseline peer and geometric means) last;
with both --markdown and --plot the markdown links the plot.

  python -m fp8gemm.bench --suite deepseek-dense --json out.json --markdown out.md --plot out.png
  python -m fp8gemm.bench --suite m-sweep --quick         # fewer M, 30 timed runs
  python -m fp8gemm.bench --dry-run                       # list the shapes, no GPU needed
  python -m fp8gemm.bench --from-json a.json --markdown a.md --plot a.png   # no GPU needed
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .impls import ALL_IMPLS, DEFAULT_IMPLS, applies
from .report import load_json, make_doc, make_meta, markdown, plot, read_clocks, write_json
from .suites import all_suite_names, suite_cases
from .timing import MIN_DEVICE_RUNS

__all__ = ["main", "parse_args"]

_RUNS = 100


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fp8gemm.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="all", choices=("all",) + all_suite_names(),
                   help="which shapes (default: all)")
    p.add_argument("--impl", action="append", default=None, metavar="NAMES",
                   help="comma-separated implementations to run, may repeat (default: "
                   f"{','.join(DEFAULT_IMPLS)}; also: fp8gemm-reference, small shapes only)")
    p.add_argument("--json", metavar="PATH", help="write the results (the form of report.py)")
    p.add_argument("--markdown", metavar="PATH", help="write the markdown tables")
    p.add_argument("--plot", metavar="PATH", help="write a PNG plot (needs matplotlib)")
    p.add_argument("--quick", action="store_true",
                   help=f"{MIN_DEVICE_RUNS} timed runs instead of {_RUNS}; fewer irregular "
                   "shapes, m-sweep M values and backward N x K")
    p.add_argument("--runs", type=int, default=None,
                   help=f"timed runs per measurement (median; at least {MIN_DEVICE_RUNS})")
    p.add_argument("--seed", type=int, default=0, help="random input seed")
    p.add_argument("--dry-run", action="store_true", help="list the cases and exit (no GPU)")
    p.add_argument("--from-json", nargs="+", metavar="PATH",
                   help="no measurement: make --markdown / --plot from result files; with "
                   "--json, merge them into one file first (meta of the first)")
    p.add_argument("--notes", metavar="PATH", action="append", default=None,
                   help="measuring: also write the notes (how peers were called, what was "
                   "skipped and why) to PATH; with --from-json: read notes from PATH (may repeat)")
    args = p.parse_args(argv)
    names = []
    for item in args.impl or [",".join(DEFAULT_IMPLS)]:
        names += [x.strip() for x in item.split(",") if x.strip()]
    bad = [x for x in names if x not in ALL_IMPLS]
    if bad:
        p.error(f"--impl must name some of {', '.join(ALL_IMPLS)}; got {', '.join(bad)}")
    args.impls = list(dict.fromkeys(names))
    if args.runs is None:
        args.runs = MIN_DEVICE_RUNS if args.quick else _RUNS
    if args.runs < MIN_DEVICE_RUNS:
        p.error(f"--runs must be at least {MIN_DEVICE_RUNS} (fewer make the median noisy), "
                f"got {args.runs}")
    return args


def _dry_run(args) -> int:
    cases = suite_cases(args.suite, args.quick)
    print(f"{len(cases)} cases, implementations: {', '.join(args.impls)}")
    for c in cases:
        impls = [i for i in args.impls if applies(i, c.op)]
        print(f"  {c.suite:<17} {c.op:<10} {c.label:<22} {c.flops / 1e9:9.2f} GFLOP "
              f"{c.min_bytes / 1e6:9.2f} MB  {', '.join(impls)}")
    return 0


def _from_json(args) -> int:
    docs = [(Path(path).name, load_json(path)) for path in args.from_json]
    if args.json:
        merged = make_doc(docs[0][1]["meta"], [r for _, d in docs for r in d["rows"]])
        write_json(args.json, merged)
        docs = [(f"{merged['meta']['gpu']}, {merged['meta']['date']}", merged)]
    notes = []
    for path in args.notes or []:
        try:
            with open(path) as f:
                notes += [line.rstrip("\n") for line in f if line.strip()]
            notes = list(dict.fromkeys(notes))
        except OSError as e:
            notes.append(f"notes file {path} unreadable: {e}")
    image = _plot(docs[-1][1], args)
    text = markdown(docs, title="fp8gemm benchmarks", notes=notes, image=image)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    else:
        print(text)
    return 0


def _plot(doc: dict, args) -> str | None:
    """Write --plot; the plot's path relative to --markdown's folder when both are written."""
    if not args.plot:
        return None
    why = plot(doc, args.plot)
    if why:
        print(why)
        return None
    if not args.markdown:
        return None
    return os.path.relpath(args.plot, os.path.dirname(os.path.abspath(args.markdown)))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        return _dry_run(args)
    if args.from_json:
        return _from_json(args)

    import torch

    if not torch.cuda.is_available():
        print("python -m fp8gemm.bench needs a CUDA GPU (torch.cuda.is_available() is False "
              "here). Use --dry-run to list the shapes, or --from-json to make tables from "
              "result files.", file=sys.stderr)
        return 2
    from .impls import WRONG_DIFF, cublas_block_probe
    from .runner import run_cases

    device = torch.device("cuda", torch.cuda.current_device())
    meta = make_meta()
    print(f"fp8gemm.bench on {meta['gpu']} ({meta['clocks']}), torch {meta['torch']}, "
          f"triton {meta['triton']}, CUDA {meta['cuda']}, commit {meta['commit']}", flush=True)
    notes = []
    block_way = None
    if "cublas-block" in args.impls and torch.cuda.get_device_capability() == (9, 0):
        block_way, probe = cublas_block_probe(device)
        print("cublas-block: ways of calling cuBLAS 1x128/128x128 on small shapes:")
        for shape, way, what in probe:
            print(f"  {shape:<14} {way:<42} {what}")
        print(f"  -> using: {block_way or 'the first way that runs (none was right everywhere)'}")
        wrong = [f"{w} at {s} ({r})" for s, w, r in probe
                 if r.startswith("diff") and float(r.split()[1]) >= WRONG_DIFF]
        notes.append(f"cublas-block called as: {block_way or 'the first way that runs'}"
                     + (f"; WRONG in the probe: {'; '.join(wrong)}" if wrong else ""))
    cases = suite_cases(args.suite, args.quick)
    print(f"{len(cases)} cases x {', '.join(args.impls)}; {args.runs} timed runs each", flush=True)

    def save(res) -> None:
        if args.json:
            write_json(args.json, make_doc(meta, res.rows))

    res = run_cases(cases, args.impls, device, args.runs, block_way=block_way, on_row=save,
                    seed=args.seed, log=lambda s: print(s, flush=True))
    # NOTE: clocks idle low before a run; the reading just after it is the one under load.
    meta["clocks"] = f"{meta['clocks']} at start; {read_clocks()} at end"
    save(res)
    notes += res.notes
    notes += [f"skipped {impl} at {case}: {why}" for case, impl, why in res.skips]
    if res.aborted:
        notes.append(f"ABORTED: {res.aborted}")
    doc = make_doc(meta, res.rows)
    notes = _dedup(notes)
    for path in args.notes or []:
        with open(path, "w") as f:
            f.write("".join(n + "\n" for n in notes))
    image = _plot(doc, args)
    text = markdown([(f"{meta['gpu']}, {meta['date']}", doc)], notes=notes, image=image)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print("\n" + text, flush=True)
    return 1 if res.aborted or not res.rows else 0


def _dedup(notes: list[str]) -> list[str]:
    """Skips repeat per shape: keep the first of each (impl, reason) and count the others."""
    seen: dict[str, int] = {}
    order = []
    for n in notes:
        skipped = n.startswith("skipped")
        key = n.split(" at ", 1)[0] + " :: " + n.split(": ", 1)[-1] if skipped else n
        if key not in seen:
            seen[key] = 0
            order.append((key, n))
        seen[key] += 1
    return [n + (f" (and {seen[k] - 1} more shapes)" if seen[k] > 1 else "") for k, n in order]


if __name__ == "__main__":
    sys.exit(main())
