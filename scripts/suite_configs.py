#!/usr/bin/env python3
"""The CUDA backend's choice (family and config) for every case of the bench suites, on a
device's facts, without a GPU: which results a heuristic or cost-model change touches.

    python scripts/suite_configs.py                      # every suite, H200 facts
    python scripts/suite_configs.py deepseek-dense m-sweep > after.txt   # then diff against before

One line per case: `suite/op shape: family config`, or the reason the CUDA backend does not take
it (those cases run on another backend). moe_layer cases (a pipeline of GEMMs) are left out.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fp8gemm.backends.cuda import family_for, supports  # noqa: E402
from fp8gemm.backends.family import DeviceFacts  # noqa: E402
from fp8gemm.bench.impls import case_problem  # noqa: E402
from fp8gemm.bench.suites import all_suite_names, suite_cases  # noqa: E402

H200 = DeviceFacts("NVIDIA H200", (9, 0), num_sms=132, smem_per_block=232448)


def case_lines(suite: str, facts: DeviceFacts = H200) -> list[str]:
    lines = []
    for c in suite_cases(suite):
        if c.op == "moe_layer":
            continue
        shape = (f"{c.m}x{c.n}x{c.k}" + (f" g{c.groups}" if c.groups > 1 else "")
                 + (" skewed" if c.sizes else ""))
        problem = case_problem(c)
        why = supports(problem)
        if why is not None:
            lines.append(f"{suite}/{c.op} {shape}: not the CUDA backend's ({why})")
            continue
        fam = family_for(problem, facts)
        lines.append(f"{suite}/{c.op} {shape}: {fam.name} {fam.select_config(problem, facts)}")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("suites", nargs="*", help=f"default: all of {', '.join(all_suite_names())}")
    ap.add_argument("--sms", type=int, default=H200.num_sms, help="SM count of the facts")
    args = ap.parse_args(argv)
    facts = DeviceFacts(H200.name, H200.capability, args.sms, H200.smem_per_block)
    for suite in args.suites or all_suite_names():
        for line in case_lines(suite, facts):
            print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
