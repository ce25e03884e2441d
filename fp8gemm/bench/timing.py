"""Timing and statistics: how every figure of the benchmark is measured.

Device time: the median of >= 30 runs timed with CUDA events, the L2 flushed before each run by a
256 MB memset, and the GPU kept busy (`torch.cuda._sleep`) from before the start event is recorded
until the call under test has been enqueued (twice its measured host time, at least 50 us, and
at least an implementation's own minimum where its host cost varies, as DeepGEMM's does), so the
host's launch cost is not in the number. The
implementations of one case are timed run by run in turn, so that the chip's drift in clock and
temperature over the measurement falls on all of them alike (timed one after the other, the same
kernel measured 0.96x and 1.01x cuBLAS on 4096x4096x7168 in two runs).
Eager time: 50 back-to-back calls with no flush, host wall clock per call including the final
synchronisation: what an eager caller sees.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

__all__ = ["median", "geomean", "tflops", "gbs", "EagerTime", "eager_time_us", "DeviceTimer",
           "MIN_DEVICE_RUNS", "EAGER_CALLS", "FLUSH_BYTES", "MIN_BUSY_US"]

MIN_DEVICE_RUNS = 30
EAGER_CALLS = 50
FLUSH_BYTES = 256 << 20  # NOTE: 4x the H200's 60 MB L2, so nothing of the last run stays.
MIN_BUSY_US = 50.0  # the shortest sleep before a start event


def median(xs: Sequence[float]) -> float:
    if not xs:
        raise ValueError("median of an empty sequence")
    return float(statistics.median(xs))


def geomean(xs: Sequence[float]) -> float | None:
    """Geometric mean of positive values; None when there are none (nothing to summarise)."""
    xs = [float(x) for x in xs if x is not None]
    if not xs:
        return None
    if any(x <= 0 or not math.isfinite(x) for x in xs):
        raise ValueError(f"geomean needs positive finite values, got {xs}")
    return math.exp(sum(math.log(x) for x in xs) / len(xs))


def tflops(flops: int, us: float) -> float:
    return flops / (us * 1e-6) / 1e12


def gbs(nbytes: int, us: float) -> float:
    return nbytes / (us * 1e-6) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass(frozen=True)
class EagerTime:
    wall_us: float  # per call, back to back, including the final synchronisation
    host_us: float  # per call, the host's time to enqueue (before the synchronisation)


def eager_time_us(fn: Callable[[], object], device: torch.device, calls: int = EAGER_CALLS,
                  warmup: int = 3) -> EagerTime:
    """Time `calls` back-to-back calls of fn with no L2 flush."""
    for _ in range(warmup):
        fn()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    _sync(device)
    t2 = time.perf_counter()
    return EagerTime(wall_us=(t2 - t0) * 1e6 / calls, host_us=(t1 - t0) * 1e6 / calls)


class DeviceTimer:
    """Cold-L2 device time of a call, with the host's launch cost hidden behind a sleep kernel.

    One timer per device: it owns the flush buffer and knows how many `_sleep` cycles make a
    microsecond on this GPU (measured once, so no clock rate is assumed).
    """

    def __init__(self, device: torch.device, flush_bytes: int = FLUSH_BYTES):
        if device.type != "cuda":
            raise ValueError(f"DeviceTimer needs a CUDA device, got {device}")
        self.device = device
        self.flush_buf = torch.empty(flush_bytes, dtype=torch.int8, device=device)
        self.cycles_per_us = self._calibrate_sleep()

    def _calibrate_sleep(self) -> float:
        cycles = 2_000_000
        torch.cuda._sleep(cycles)  # first call loads the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        _sync(self.device)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) * 1e3)

    def sleep_cycles(self, host_us: float, min_us: float = MIN_BUSY_US) -> int:
        """Enough GPU work to outlast enqueuing the call: twice its host time, at least
        `min_us` (never under MIN_BUSY_US)."""
        return int(max(MIN_BUSY_US, min_us, 2.0 * host_us + 20.0) * self.cycles_per_us)

    def time_us(self, fn: Callable[[], object], host_us: float,
                runs: int = MIN_DEVICE_RUNS, min_busy_us: float = MIN_BUSY_US) -> list[float]:
        """Per-run device times in microseconds (take the median)."""
        return self.time_interleaved_us([(fn, host_us, min_busy_us)], runs)[0]

    def time_interleaved_us(self, calls: Sequence[tuple[Callable[[], object], float, float]],
                            runs: int = MIN_DEVICE_RUNS) -> list[list[float]]:
        """Per-run device times of each (fn, host_us, min_busy_us), the calls taking turns run
        by run."""
        if runs < 1:
            raise ValueError(f"runs must be positive, got {runs}")
        sleeps = [self.sleep_cycles(host_us, min_us) for _, host_us, min_us in calls]
        events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                   for _ in range(runs)] for _ in calls]
        _sync(self.device)
        for r in range(runs):
            for (fn, _, _), sleep, evs in zip(calls, sleeps, events):
                s, e = evs[r]
                self.flush_buf.zero_()
                torch.cuda._sleep(sleep)
                s.record()
                fn()
                e.record()
        _sync(self.device)
        return [[s.elapsed_time(e) * 1e3 for s, e in evs] for evs in events]
