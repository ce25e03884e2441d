"""Measure every case with every implementation that can run it."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ..quant import calc_diff
from .impls import Skip, applies, make_data, make_impl, reference_output
from .report import floor_us, make_row
from .suites import Case
from .timing import DeviceTimer, eager_time_us, gbs, median, tflops

__all__ = ["RunResult", "run_cases"]


@dataclass
class RunResult:
    rows: list[dict] = field(default_factory=list)
    skips: list[tuple[str, str, str]] = field(default_factory=list)  # (case, impl, why)
    notes: list[str] = field(default_factory=list)
    aborted: str | None = None  # why the run stopped early (a broken CUDA context)


def _reference(data) -> torch.Tensor:
    try:
        return reference_output(data, torch.float64)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return reference_output(data, torch.float32)


def _skip(res, case, impl: str, shown: str, reason: str, device, log) -> bool:
    """Record an impl that did not run on a case; True when the CUDA context is broken and the
    suite must stop (every later launch would fail too)."""
    res.skips.append((str(case), impl, reason))
    log(f"  {case} {impl:<24} {shown}")
    broken = _context_broken(device)
    if broken:
        res.aborted = f"{case} {impl}: CUDA context broken ({broken})"
        log(f"ABORT: {res.aborted}")
    return bool(broken)


def _context_broken(device: torch.device) -> str | None:
    """A kernel fault (illegal address, trap) poisons the CUDA context for the whole process."""
    if device.type != "cuda":
        return None
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    return None


def _time_parts(made, us: float, timer, runs: int, device) -> str:
    """The device time of each of an impl's parts alone, and its share of the whole call."""
    try:
        calls = [(fn, eager_time_us(fn, device).host_us, made.busy_us)
                 for fn in made.parts.values()]
        times = [median(t) for t in timer.time_interleaved_us(calls, runs)]
    except Exception as e:  # noqa: BLE001 - the parts are extra: never lose the row for them
        return f"parts not timed ({type(e).__name__}: {e})"
    shares = [f"{name} {t:.1f} us ({100 * t / us:.0f} %)" for name, t in zip(made.parts, times)]
    rest = us - sum(times)
    return (f"{us:.1f} us per call: " + ", ".join(shares)
            + f", everything else (routing, layout, combine) {rest:.1f} us")


def run_cases(cases: list[Case], impls: list[str], device: torch.device, runs: int,
              block_way: str | None = None, log: Callable[[str], None] = print,
              on_row: Callable[[RunResult], None] | None = None, seed: int = 0,
              timer: DeviceTimer | None = None) -> RunResult:
    """Time each (case, impl). `on_row` is called after every measured row (to save partial
    results); a broken CUDA context ends the run with `aborted` set. `timer` defaults to a
    `DeviceTimer` on `device` (tests pass a stand-in to run on the CPU)."""
    res = RunResult()
    timer = timer or DeviceTimer(device)
    notes_seen: set[str] = set()
    for case in cases:
        todo = [i for i in impls if applies(i, case.op)]
        if not todo:
            continue
        data = make_data(case, device, seed)
        ref = _reference(data)
        # Every impl is checked and its eager time taken first; then all are timed together,
        # run by run in turn (DeviceTimer.time_interleaved_us).
        ready = []  # (impl, made, diff, eager)
        for impl in todo:
            try:
                made = make_impl(impl, data, block_way)
            except Skip as e:
                if _skip(res, case, impl, f"skipped: {e}", str(e), device, log):
                    return res
                continue
            if made.note and f"{impl}: {made.note}" not in notes_seen:
                notes_seen.add(f"{impl}: {made.note}")
                res.notes.append(f"{impl} ({case}): {made.note}")
            try:
                out = made.output()
                diff = calc_diff(out, ref) if not bool(torch.isnan(out).any()) else float("nan")
                ready.append((impl, made, diff, eager_time_us(made.fn, device)))
            except Exception as e:  # noqa: BLE001 - a failing impl must not end the benchmark
                why = f"failed: {type(e).__name__}: {e}"
                if _skip(res, case, impl, why, why, device, log):
                    return res
        try:
            times = timer.time_interleaved_us(
                [(m.fn, eager.host_us, m.busy_us) for _, m, _, eager in ready], runs)
        except Exception as e:  # noqa: BLE001
            why = f"failed while timed: {type(e).__name__}: {e}"
            for impl, *_ in ready:
                if _skip(res, case, impl, why, why, device, log):
                    return res
            ready, times = [], []
        for (impl, made, diff, eager), runs_us in zip(ready, times):
            us = median(runs_us)
            row = make_row(case.suite, case.op, case.shape, impl, us, eager.wall_us,
                           tflops(case.flops, us), gbs(case.min_bytes, us), diff)
            res.rows.append(row)
            floor = floor_us(row)
            log(f"  {case} {impl:<24} {us:9.1f} us  eager {eager.wall_us:8.1f} us "
                f"(host {eager.host_us:6.1f})  {row['tflops']:7.1f} TFLOPS  "
                f"{row['gbs']:7.0f} GB/s  diff {diff:.1e}"
                + (f"  {us / floor:5.2f}x floor" if floor else ""))
            if made.parts:
                note = _time_parts(made, us, timer, runs, device)
                res.notes.append(f"{impl} at {case}: {note}")
                log(f"    {note}")
            if on_row is not None:
                on_row(res)
        del data, ref, ready  # (moe_layer's CUDA graphs hold their memory until here)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return res
