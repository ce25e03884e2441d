#!/usr/bin/env python3
"""Make BENCHMARKS.md from benchmarks/results/*.json (the current run per GPU) and
benchmarks/history.json (one line per past run). Runs no GPU code.

  python scripts/make_benchmarks_md.py [--results DIR] [--history PATH] [--out BENCHMARKS.md]
  python scripts/make_benchmarks_md.py --record    # first add the current runs to the history
  python scripts/make_benchmarks_md.py --add OUT/bench.json --record   # a new run, then record

A GPU keeps one result file per suite (the skewed backward cases share the backward file, the
grouped suite's file is called `grouped`), named DATE-GPU-COMMIT-SUITE.json beside its PNG.
--add RUN.json (a run of `python -m fp8gemm.bench` or scripts/gpu_check.sh's merged bench.json)
writes the run's rows of each suite as such a file and its plot, and deletes that GPU's older
pair for the suite; --record then adds the new runs' geometric means to the history. The page
shows every current run, recorded or not.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fp8gemm.bench.report import (history_entry, load_history, load_json, make_doc,  # noqa: E402
                                  page_markdown, plot, write_history, write_json)

# Suites whose rows go to another suite's result file.
FILE_OF_SUITE = {"deepseek-grouped": "grouped", "backward-skewed": "backward"}
_RESULT_NAME = re.compile(r"^(\d{4}-\d{2}-\d{2})-([a-z0-9]+)-([0-9a-z]+)-(.+)\.json$")


def gpu_tag(name: str) -> str:
    """'NVIDIA H200' -> 'h200': the model number, else the whole name in lower case."""
    m = re.search(r"\b([A-Z]\d{2,4})\b", name)
    return m.group(1).lower() if m else re.sub(r"[^a-z0-9]+", "", name.lower()) or "gpu"


def short_commit(commit) -> str:
    """A commit as a file name carries it: a git hash's first 7 digits (any suffix kept, e.g.
    '-dirty'), anything else as it is."""
    return re.sub(r"^([0-9a-f]{7})[0-9a-f]+", r"\1", str(commit))


def add_run(run: Path, results: Path) -> list[Path]:
    """Write `run`'s rows of each suite as its GPU's result file for that suite (with the plot),
    delete the GPU's older files of the same suites; returns the files written."""
    doc = load_json(run)
    meta = doc["meta"]
    tag, date, commit = gpu_tag(str(meta["gpu"])), str(meta["date"])[:10], short_commit(meta["commit"])
    by_file: dict[str, list[dict]] = {}
    for r in doc["rows"]:
        by_file.setdefault(FILE_OF_SUITE.get(r["suite"], r["suite"]), []).append(r)
    results.mkdir(parents=True, exist_ok=True)
    written = []
    for suite, rows in by_file.items():
        path = results / f"{date}-{tag}-{commit}-{suite}.json"
        for old in results.glob("*.json"):
            m = _RESULT_NAME.match(old.name)
            if old != path and m and m.group(2) == tag and m.group(4) == suite:
                old.unlink()
                old.with_suffix(".png").unlink(missing_ok=True)
        part = make_doc(meta, rows)
        write_json(path, part)
        why = plot(part, path.with_suffix(".png"))
        print(f"wrote {path.name} ({len(rows)} rows){'; ' + why if why else ''}")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default=str(ROOT / "benchmarks" / "results"),
                   help="folder of the current result files (default: benchmarks/results)")
    p.add_argument("--history", default=str(ROOT / "benchmarks" / "history.json"),
                   help="the history file (default: benchmarks/history.json)")
    p.add_argument("--out", default=str(ROOT / "BENCHMARKS.md"), help="markdown file to write")
    p.add_argument("--record", action="store_true",
                   help="add the current runs that the history lacks to it, then write the page")
    p.add_argument("--add", metavar="RUN", action="append", default=[],
                   help="a run's result file to split into the GPU's per-suite result files "
                        "(replacing their older ones) before the page is made")
    args = p.parse_args(argv)
    for run in args.add:
        add_run(Path(run), Path(args.results))
    paths = sorted(Path(args.results).glob("*.json"))
    if not paths:
        print(f"no result files in {args.results}", file=sys.stderr)
        return 1
    out = Path(args.out)
    docs = [(path, load_json(path)) for path in paths]
    history = load_history(args.history)
    if args.record:
        known = {e["file"] for e in history}
        history += [history_entry(path.name, doc) for path, doc in docs if path.name not in known]
        write_history(args.history, history)

    def link(path: Path) -> str:
        return Path(os.path.relpath(path, out.resolve().parent)).as_posix()

    current = [(link(path), doc, link(path.with_suffix(".png")) if path.with_suffix(".png").exists()
                else None) for path, doc in sorted(docs, key=lambda d: (str(d[1]["meta"]["gpu"]),
                                                                        d[0].name))]
    header = ("<!-- generated by scripts/make_benchmarks_md.py from benchmarks/results/*.json and "
              "benchmarks/history.json; do not edit -->\n")
    out.write_text(header + page_markdown(current, history))
    print(f"wrote {args.out} from {len(docs)} result file(s) and {len(history)} recorded run(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
