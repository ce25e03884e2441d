"""scripts/timeline_1d2d.py on the CPU: its reading of the stamps, and the traced build (the 1D2D
kernel with FP8GEMM_TRACE) compiling clean beside an untraced build that has no trace at all."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as g2
from fp8gemm.problem import GemmKind
from helpers import compiler_or_skip, load_script

ct = load_script("scripts/cuda_tiles.py")
tl = load_script("scripts/timeline_1d2d.py")


def _kblocks(t, mma, promote, wait, n, first_land=None):
    """Stamps of n k-blocks of one warpgroup from clock t: each waits `wait`, then its wgmma
    take `mma` and the promotion `promote` (issue takes 1 cycle)."""
    ev = []
    for i in range(n):
        if i > 0 or first_land is None:
            t += wait
        else:
            t = first_land
        ev.append((tl.LANDED, t))
        ev.append((tl.ISSUED, t + 1))
        ev.append((tl.DONE, t + 1 + mma))
        t += 1 + mma + promote
        ev.append((tl.PROMOTED, t))
    return ev


def test_alternating_warpgroups_keep_a_wgmma_in_flight():
    # warpgroup 1 issues while warpgroup 0 promotes, and the other way round: never idle
    wg0 = _kblocks(0, mma=300, promote=200, wait=0, n=20)
    wg1 = _kblocks(0, mma=300, promote=200, wait=0, n=20, first_land=250)
    s = tl.summarise({0: wg0, 1: wg1})
    assert s["idle"] < 0.01
    assert s["per_wg"][0]["mma"] == 300 and s["per_wg"][0]["promote"] == 200
    assert s["producer_wait"] is None


def test_idle_time_goes_to_the_stage_wait_before_the_promotion():
    # both warpgroups in step: while both promote nothing runs (promotion), and each k-block
    # first waits 100 cycles for its stage (stage wait)
    wg0 = _kblocks(0, mma=300, promote=200, wait=100, n=10)
    wg1 = _kblocks(0, mma=300, promote=200, wait=100, n=10)
    s = tl.summarise({0: wg0, 1: wg1})
    by = s["idle_by"]
    assert by["promotion"] > 0.3 and by["stage wait"] > 0.1
    assert abs(s["idle"] - sum(by.values())) < 1e-9
    # per k-block: 600 cycles; 300 of wgmma in flight, the rest idle
    assert abs(s["idle"] - 0.5) < 0.05


def test_producer_wait_and_decode():
    words = [(tl.SLOT_FREE << 56) | 10, (tl.SENT << 56) | 20, (tl.SLOT_FREE << 56) | 70,
             (tl.SENT << 56) | 80, 0, (tl.SENT << 56) | 999]
    ev = tl.decode(words)
    assert ev == [(tl.SLOT_FREE, 10), (tl.SENT, 20), (tl.SLOT_FREE, 70), (tl.SENT, 80)]
    assert tl.producer_wait(ev, 10, 80) == pytest.approx(50 / 70)


def _ring(n, num_stages, flight, refill, mma=300, promote=200, lag=0, tile=0, epilogue=0,
          first_flight=None, tile_start=0):
    """Stamps of a producer and two warpgroups running n k-blocks through a ring: a k-block's
    loads land `flight` cycles after they are sent, a stage is found free `refill` cycles after
    the later warpgroup's wgmma on it completed; warpgroup 1 starts `lag` cycles late. With
    `tile`, every tile of that many k-blocks ends in an epilogue of `epilogue` cycles, and a
    tile's first k-block is in flight `first_flight` cycles; with `tile_start`, the next tile
    starts (its barrier, its walk) that many cycles after the epilogue."""
    prod, wgs = [], [[], []]
    free, sent, done = [], [], [[], []]
    promoted = [None, None]
    for j in range(n):
        free.append(0 if j < num_stages else max(d[j - num_stages] for d in done) + refill)
        sent.append(free[-1] + 5)
        prod += [(tl.SLOT_FREE, free[-1]), (tl.SENT, sent[-1])]
        first = tile and j % tile == 0 and j > 0
        for w in range(2):
            start = promoted[w] if promoted[w] is not None else lag * w
            landed = max(start, sent[-1] + (first_flight if first else flight))
            done[w].append(landed + 1 + mma)
            promoted[w] = done[w][-1] + promote
            wgs[w] += [(tl.LANDED, landed), (tl.ISSUED, landed + 1), (tl.DONE, done[w][-1]),
                       (tl.PROMOTED, promoted[w])]
            if tile and (j + 1) % tile == 0:
                wgs[w] += [(tl.EPILOGUE, promoted[w]), (tl.EPILOGUE_END, promoted[w] + epilogue)]
                promoted[w] += epilogue
                if tile_start:
                    wgs[w] += [(tl.TILE_SYNCED, promoted[w] + tile_start // 2),
                               (tl.TILE_READY, promoted[w] + tile_start)]
                    promoted[w] += tile_start
    return prod, wgs


def test_stage_chain_reads_the_flight_and_the_refill():
    # two stages, a long flight: every wait is spent with the loads in flight, sent as soon as
    # the stage was found free, 40 cycles after the last wgmma on it
    prod, wgs = _ring(50, num_stages=2, flight=900, refill=40)
    c = tl.stage_chain(prod, wgs, num_stages=2)
    assert c["kblocks"] == 50 and c["refill"] == 40 and c["issue"] == 5
    assert c["late"] == 0.0 and c["flight"] == 900
    # four stages hide that flight: no k-block waits
    prod, wgs = _ring(50, num_stages=4, flight=900, refill=40)
    c = tl.stage_chain(prod, wgs, num_stages=4)
    assert c["flight"] is None and c["late"] == 0.0
    # a refill slower than the ring can hide: the loads go out after the warpgroups wait
    prod, wgs = _ring(50, num_stages=2, flight=100, refill=2000)
    c = tl.stage_chain(prod, wgs, num_stages=2)
    assert c["refill"] == 2000 and c["late"] > 0.5
    s = tl.summarise({0: wgs[0], 1: wgs[1], 2: prod}, num_stages=2)
    assert s["chain"] == c and s["producer_wait"] > 0


def test_stage_chain_tells_a_tiles_first_k_block_from_the_others():
    # four stages hide a 900-cycle flight in a tile, but a tile's first k-block, sent before the
    # previous tile's last three and in flight 4000 cycles, outlasts that tile's 1000-cycle
    # epilogue
    prod, wgs = _ring(64, num_stages=4, flight=900, refill=40, tile=16, epilogue=1000,
                      first_flight=4000)
    c = tl.stage_chain(prod, wgs, num_stages=4)
    assert c["wait"] == 0 and c["first_wait"] > 1000
    # sent before the epilogue began, so waited with its loads in flight: the whole flight shows
    assert c["first_flight"] == 4000 and c["flight"] is None
    # a warpgroup that idles on a tile (no stamps for its second tile: 16 k-blocks of 4 stamps
    # and the epilogue's 2) leaves the other to be followed
    per_tile = 16 * 4 + 2
    idle = wgs[1][:per_tile] + wgs[1][2 * per_tile:]
    c2 = tl.stage_chain(prod, [wgs[0], idle], num_stages=4)
    assert c2["kblocks"] == 64 and c2["refill"] == 40 and c2["first_flight"] == 4000
    assert c["first_start"] == 0  # (no tile-start stamps)


def test_a_tiles_start_is_told_from_its_first_wait():
    # 600 cycles from the epilogue's end to the next tile's first wait (its barrier and walk):
    # the first k-block then waits what is left of its 4000-cycle flight, 600 cycles less
    args = dict(num_stages=4, flight=900, refill=40, tile=16, epilogue=1000, first_flight=4000)
    c0 = tl.stage_chain(*_ring(64, **args), num_stages=4)
    prod, wgs = _ring(64, **args, tile_start=600)
    c = tl.stage_chain(prod, wgs, num_stages=4)
    assert c["first_start"] == 600 and c["first_wait"] == c0["first_wait"] - 600
    assert c["first_flight"] == 4000 and c["wait"] == 0
    s = tl.summarise({0: wgs[0], 1: wgs[1], 2: prod}, num_stages=4)
    assert s["idle_by"]["tile start"] == pytest.approx(3 * 600 / s["window"], rel=0.01)


def test_traced_build_compiles_clean_and_the_default_has_no_trace(tmp_path, monkeypatch):
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    cfg = g2.Sm90Config(128, 160, 4, 2, False, 16, 132)
    plain = g2.compile_kernel(GemmKind.CONTIGUOUS, 4096, 7168, cfg)[1]
    with tl.traced_headers() as include, ct.kernel_headers(include, {}):
        traced = g2.compile_kernel(GemmKind.CONTIGUOUS, 4096, 7168, cfg)[1]
    assert b"fp8gemm_trace" in traced.cubin
    assert b"fp8gemm_trace" not in plain.cubin
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", traced.log)]
    assert not any(spills), traced.log


def test_traced_headers_copy_the_given_include_folder(tmp_path):
    # --headers: another copy of the headers is traced, not this tree's
    import shutil
    inc = tmp_path / "include"
    shutil.copytree(g2.INCLUDE_DIR, inc)
    kernel = inc / "fp8gemm" / "sm90_fp8_gemm_1d2d.cuh"
    kernel.write_text("// another copy\n" + kernel.read_text())
    with tl.traced_headers(inc) as traced:
        text = (traced / "fp8gemm" / "sm90_fp8_gemm_1d2d.cuh").read_text()
    assert text.startswith("#define FP8GEMM_TRACE 1\n// another copy\n")
    with tl.traced_headers() as traced:
        assert "// another copy" not in (traced / "fp8gemm" / "sm90_fp8_gemm_1d2d.cuh").read_text()


def test_ring_depth_is_read_from_the_stamps():
    for stages in (2, 4, 5):
        prod, wgs = _ring(30, num_stages=stages, flight=900, refill=40)
        assert tl.infer_num_stages(prod, wgs) == stages
    assert tl.infer_num_stages([(tl.SLOT_FREE, 0)], [[]]) == 0


def _deepgemm_include() -> Path:
    """DeepGEMM's include folder, from .peers or ../shared/peers (skip without either)."""
    root = Path(__file__).resolve().parents[1]
    for peers in (root / ".peers", root.parent / "shared" / "peers"):
        include = peers / "deepgemm" / "deep_gemm" / "include"
        if (include / "deep_gemm" / "fp8_gemm.cuh").is_file():
            return include
    pytest.skip("no DeepGEMM checkout in .peers or ../shared/peers")


def _deepgemm_kernel_source() -> str:
    return (_deepgemm_include() / "deep_gemm" / "fp8_gemm.cuh").read_text()


def test_deepgemm_source_takes_every_stamp_once():
    text = _deepgemm_kernel_source()
    traced = tl.deepgemm_traced_source(text, 0x7F0000000000)
    # the macro, the counter and one stamp per tag, each after its anchor
    assert traced.count("#define FP8GEMM_DG_STAMP") == 1
    assert traced.count("uint32_t trace_count = 0;") == 1
    for tag in range(tl.SLOT_FREE, tl.EPI_STORING + 1):
        assert traced.count(f"FP8GEMM_DG_STAMP({tag});") == 1, tag
    order = [traced.index(f"FP8GEMM_DG_STAMP({t});") for t in
             (tl.SLOT_FREE, tl.SENT, tl.LANDED, tl.ISSUED, tl.DONE, tl.PROMOTED, tl.EPILOGUE,
              tl.EPI_SYNCED, tl.EPI_WRITTEN, tl.EPI_STORING, tl.EPILOGUE_END)]
    assert order == sorted(order)
    assert "0x7f0000000000ull" in traced
    # nothing else of the kernel changed
    stripped = "\n".join(line for line in traced.splitlines()
                         if "FP8GEMM_DG_STAMP" not in line and "trace_count = 0" not in line)
    assert stripped == "\n".join(text.splitlines())


def test_deepgemm_source_without_an_anchor_is_refused():
    with pytest.raises(SystemExit, match="anchors"):
        tl.deepgemm_traced_source("#pragma once\nint main() {}\n", 0)


def test_deepgemm_traced_kernel_compiles(tmp_path):
    # the stamps sit where the counter is in scope: DeepGEMM's contiguous 128x160 pairs compile
    import shutil
    import subprocess
    text = _deepgemm_kernel_source()
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("no nvcc")
    src = _deepgemm_include()
    inc = tmp_path / "include"
    shutil.copytree(src, inc)
    (inc / "deep_gemm" / "fp8_gemm.cuh").write_text(tl.deepgemm_traced_source(text, 0x7F0000000000))
    cu = tmp_path / "k.cu"
    cu.write_text("#include <cuda.h>\n#include <cuda_bf16.h>\n#include <cuda_fp8.h>\n"
                  "#include <deep_gemm/fp8_gemm.cuh>\nusing namespace deep_gemm;\n"
                  "void* kernel_address() { return reinterpret_cast<void*>(&fp8_gemm_kernel<4096, "
                  "7168, 128, 160, 128, 0, 64, 16, 4, 128, 128, 2, false, "
                  "GemmType::GroupedContiguous>); }\n")
    run = subprocess.run([nvcc, "-std=c++20", "-arch=sm_90a", "-cubin", "-I", str(inc),
                          "--diag-suppress=39,161,174,177,186,940", "-o", str(tmp_path / "k.cubin"),
                          str(cu)], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert (tmp_path / "k.cubin").stat().st_size > 0


def test_epilogue_phases_are_idle_epilogue_time_and_averaged_whole():
    # both warpgroups' k-blocks, then an epilogue: warpgroup 0's in four phases of 100, 200,
    # 300 and 400 cycles, warpgroup 1's stamped whole; the 1000 cycles count as epilogue
    wg0 = _kblocks(0, mma=300, promote=200, wait=0, n=4)
    t = wg0[-1][1]
    wg0 += [(tl.EPILOGUE, t), (tl.EPI_SYNCED, t + 100), (tl.EPI_WRITTEN, t + 300),
            (tl.EPI_STORING, t + 600), (tl.EPILOGUE_END, t + 1000), (tl.LANDED, t + 1000)]
    wg1 = _kblocks(0, mma=300, promote=200, wait=0, n=4)
    wg1 += [(tl.EPILOGUE, t), (tl.EPILOGUE_END, t + 1000), (tl.LANDED, t + 1000)]
    s = tl.summarise({0: wg0, 1: wg1})
    w = s["per_wg"][0]
    assert w["epilogue"] == 1000
    assert [w[p] for p in tl.EPILOGUE_PHASES] == [100, 200, 300, 400]
    assert s["idle_by"]["epilogue"] * s["window"] == pytest.approx(1000)
    assert s["per_wg"][1]["epilogue"] == 1000 and "epi_wait" not in s["per_wg"][1]
    assert tl.epilogue_spans(wg0) == [1000] and tl.epilogue_spans(wg1[:-3]) == []
