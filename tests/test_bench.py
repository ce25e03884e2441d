"""The benchmark's CPU-checkable parts: suites, statistics, the result-file form, markdown, the CLI.

The timing itself needs a GPU (tests/test_bench_gpu.py); here a stand-in timer drives the runner
on the CPU with the reference backend and torch's bf16 matmul.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8gemm.bench import impls, report, suites, timing
from fp8gemm.bench.__main__ import main as bench_main
from fp8gemm.bench.__main__ import parse_args
from fp8gemm.bench.runner import run_cases
from fp8gemm.bench.suites import Case
from helpers import BENCH_PEER_TOL, TOL

ROOT = Path(__file__).resolve().parents[1]
META = {k: f"<{k}>" for k in report.META_KEYS}

# The benchmark suite of the contract in docs/design.md, in its order: (M, N, K).
SUITE_DENSE = [
    (64, 2112, 7168), (64, 24576, 1536), (64, 32768, 512), (64, 7168, 16384), (64, 4096, 7168),
    (64, 7168, 2048), (128, 2112, 7168), (128, 24576, 1536), (128, 32768, 512),
    (128, 7168, 16384), (128, 4096, 7168), (128, 7168, 2048), (4096, 2112, 7168),
    (4096, 24576, 1536), (4096, 32768, 512), (4096, 7168, 16384), (4096, 4096, 7168),
    (4096, 7168, 2048),
]
# (G, M per group, N, K)
SUITE_CONTIGUOUS = [(4, 8192, 4096, 7168), (4, 8192, 7168, 2048), (8, 4096, 4096, 7168),
                     (8, 4096, 7168, 2048)]
SUITE_MASKED = [(1, 1024, 4096, 7168), (1, 1024, 7168, 2048), (2, 512, 4096, 7168),
                 (2, 512, 7168, 2048), (4, 256, 4096, 7168), (4, 256, 7168, 2048)]


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def _row(suite="deepseek-dense", op="dense", m=64, n=2112, k=7168, g=1, impl="cublas-block",
         us=25.0, diff=1e-6):
    case = Case(suite, op, m, n, k, g)
    return report.make_row(suite, op, case.shape, impl, us, us + 20,
                           timing.tflops(case.flops, us), timing.gbs(case.min_bytes, us), diff)


# ---------------------------------------------------------------------------------------------
# Suites


def test_dense_suite_is_the_18_design_shapes():
    cases = suites.suite_cases("deepseek-dense")
    assert [(c.m, c.n, c.k) for c in cases] == SUITE_DENSE
    assert all(c.op == "dense" and c.groups == 1 for c in cases)


def test_grouped_suite_is_4_contiguous_and_6_masked():
    cases = suites.suite_cases("deepseek-grouped")
    cont = [(c.groups, c.m, c.n, c.k) for c in cases if c.op == "contiguous"]
    masked = [(c.groups, c.m, c.n, c.k) for c in cases if c.op == "masked"]
    assert cont == SUITE_CONTIGUOUS
    assert masked == SUITE_MASKED
    assert len(cases) == 10


def test_irregular_suite_has_awkward_shapes():
    cases = suites.suite_cases("irregular")
    assert {c.m for c in cases} == {1, 37, 130, 1000}
    assert {c.n for c in cases} == {200, 576, 2112}
    assert {c.k for c in cases} == {320, 7168}
    assert len(cases) == 24
    quick = suites.suite_cases("irregular", quick=True)
    assert 0 < len(quick) < len(cases) and set(quick) <= set(cases)


def test_decode_suite_is_few_masked_experts():
    """One, two and four local experts of 32 and 128 rows on both expert shapes: every case
    masked, full groups, priced against the memory floor (at most 128 rows a group)."""
    cases = suites.suite_cases("moe-decode")
    assert {(c.groups, c.m) for c in cases} == {(g, m) for g in (1, 2, 4) for m in (32, 128)}
    assert {(c.n, c.k) for c in cases} == {(4096, 7168), (7168, 2048)} and len(cases) == 12
    assert all(c.op == "masked" and not c.sizes and c.mmax == c.m for c in cases)
    row = report.make_row("moe-decode", "masked", cases[0].shape, "fp8gemm-cuda", 20.0, 25.0,
                          1.0, 1.0, 0.0)
    assert report.floor_us(row) == pytest.approx(cases[0].floor_us)


def test_all_suite_and_unknown_suite():
    assert len(suites.suite_cases("all")) == 18 + 10 + 24 + 90 + 18 + 28 + 2 + 12
    assert suites.suite_cases("deepseek-dense", quick=True) == suites.suite_cases("deepseek-dense")
    with pytest.raises(ValueError, match="suite must be one of"):
        suites.suite_cases("nope")


def test_flops_and_fewest_bytes():
    c = Case("deepseek-dense", "dense", 64, 2112, 7168)
    assert c.flops == 2 * 64 * 2112 * 7168
    kb = 7168 // 128
    assert c.min_bytes == 64 * 7168 + 64 * kb * 4 + 2112 * 7168 + 17 * kb * 4 + 64 * 2112 * 2
    g = Case("deepseek-grouped", "masked", 256, 4096, 7168, 4)
    assert g.flops == 2 * 4 * 256 * 4096 * 7168
    assert g.min_bytes == (4 * 256 * 7168 + 4 * 256 * kb * 4 + 4 * (4096 * 7168 + 32 * kb * 4)
                           + 4 * 256 * 4096 * 2)
    assert g.shape == {"m": 256, "n": 4096, "k": 7168, "groups": 4}
    assert g.label == "4x256, 4096x7168" and c.label == "64x2112x7168"


# ---------------------------------------------------------------------------------------------
# Statistics and timing


def test_median_geomean_rates():
    assert timing.median([3.0, 1.0, 2.0]) == 2.0
    assert timing.median([4.0, 1.0, 2.0, 3.0]) == 2.5
    with pytest.raises(ValueError):
        timing.median([])
    assert timing.geomean([1.0, 4.0]) == pytest.approx(2.0)
    assert timing.geomean([2.0, 2.0, 2.0]) == pytest.approx(2.0)
    assert timing.geomean([]) is None
    with pytest.raises(ValueError):
        timing.geomean([1.0, 0.0])
    assert timing.tflops(2 * 10**12, 1e6) == pytest.approx(2.0)  # 2 TFLOP in 1 s
    assert timing.gbs(10**9, 1e6) == pytest.approx(1.0)


def test_eager_time_counts_calls_and_is_per_call():
    calls = []
    t = timing.eager_time_us(lambda: calls.append(1), torch.device("cpu"), calls=50, warmup=3)
    assert len(calls) == 53
    assert 0 < t.host_us <= t.wall_us < 1e5


def test_device_timer_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        timing.DeviceTimer(torch.device("cpu"))
    assert timing.MIN_DEVICE_RUNS >= 30 and timing.EAGER_CALLS == 50
    assert timing.FLUSH_BYTES == 256 << 20


# ---------------------------------------------------------------------------------------------
# The result-file form


def test_json_form_round_trip(tmp_path):
    doc = report.make_doc(META, [_row(), _row(impl="fp8gemm-triton", us=20.0)])
    path = tmp_path / "r" / "run.json"
    report.write_json(path, doc)
    raw = json.loads(path.read_text())
    assert set(raw) == {"meta", "rows"}
    assert list(raw["meta"]) == list(report.META_KEYS)
    assert set(raw["meta"]) == {"gpu", "clocks", "torch", "triton", "cuda", "commit", "date"}
    for r in raw["rows"]:
        assert set(r) == {"suite", "op", "shape", "impl", "us", "eager_us", "tflops", "gbs",
                          "diff"}
        assert set(r["shape"]) == {"m", "n", "k", "groups"}
    assert report.load_json(path) == raw
    assert not list(path.parent.glob(".*tmp"))  # written atomically, no leftovers


@pytest.mark.parametrize("breakage", ["extra_row_key", "missing_meta", "bad_impl", "zero_us",
                                      "shape_str", "extra_top"])
def test_validate_rejects_other_forms(breakage):
    doc = report.make_doc(META, [_row()])
    if breakage == "extra_row_key":
        doc["rows"][0]["note"] = "x"
    elif breakage == "missing_meta":
        del doc["meta"]["clocks"]
    elif breakage == "bad_impl":
        doc["rows"][0]["impl"] = "deep-gemm"
    elif breakage == "zero_us":
        doc["rows"][0]["us"] = 0
    elif breakage == "shape_str":
        doc["rows"][0]["shape"]["m"] = "64"
    else:
        doc["skipped"] = []
    with pytest.raises(ValueError):
        report.validate_doc(doc)


def test_make_row_rounds_and_maps_nan_to_null():
    r = report.make_row("irregular", "dense", {"m": 1, "n": 2, "k": 3, "groups": 1},
                        "torch-bf16", 12.345678, 40.0, 1.0, 2.0, float("nan"))
    assert r["us"] == 12.346 and r["diff"] is None
    report.validate_doc(report.make_doc(META, [r]))
    json.dumps(r, allow_nan=False)


def test_make_meta_has_the_keys(monkeypatch):
    monkeypatch.setenv("FP8GEMM_COMMIT", "abc123")
    meta = report.make_meta()
    assert set(meta) == set(report.META_KEYS)
    assert meta["commit"] == "abc123" and meta["torch"] == torch.__version__
    assert meta["date"].endswith("Z")


# ---------------------------------------------------------------------------------------------
# Ratios, geometric means, markdown


def _synthetic_rows():
    rows = []
    for m, base, ours in ((64, 25.0, 12.5), (128, 26.0, 13.0), (4096, 120.0, 100.0)):
        rows.append(_row(m=m, impl="cublas-block", us=base))
        rows.append(_row(m=m, impl="fp8gemm-triton", us=ours))
    rows.append(_row(m=4096, impl="cublas-tensor", us=60.0))  # ratio 2
    rows.append(_row("deepseek-grouped", "masked", 256, 4096, 7168, 4, "torch-bf16", 90.0))
    rows.append(_row("deepseek-grouped", "masked", 256, 4096, 7168, 4, "fp8gemm-triton", 45.0))
    rows.append(_row("deepseek-grouped", "contiguous", 8192, 4096, 7168, 4, "fp8gemm-triton",
                     1500.0))  # no baseline: no ratio
    return rows


def test_ratios_are_baseline_over_impl_within_a_run():
    rows = _synthetic_rows()
    rat = report.ratios(rows)
    assert rat[1] == pytest.approx(2.0) and rat[0] == pytest.approx(1.0)
    assert rat[5] == pytest.approx(1.2)
    assert rat[8] == pytest.approx(2.0)  # masked: over torch-bf16
    assert len(rows) - 1 not in rat  # contiguous without cublas-rowwise-grouped


def test_geomeans_per_suite_and_m_range():
    gm = {(g["suite"], g["op"], g["impl"], g["range"]): g
          for g in report.geomeans(_synthetic_rows())}
    tri = gm[("deepseek-dense", "dense", "fp8gemm-triton", "all")]
    assert tri["geomean"] == pytest.approx((2.0 * 2.0 * 1.2) ** (1 / 3)) and tri["count"] == 3
    small = gm[("deepseek-dense", "dense", "fp8gemm-triton", "M<=128")]
    large = gm[("deepseek-dense", "dense", "fp8gemm-triton", "M>128")]
    assert small["geomean"] == pytest.approx(2.0) and large["geomean"] == pytest.approx(1.2)
    assert gm[("deepseek-dense", "dense", "cublas-block", "all")]["geomean"] == pytest.approx(1.0)
    assert ("deepseek-grouped", "contiguous", "fp8gemm-triton", "all") not in gm


def test_markdown_has_tables_ratios_geomeans_and_notes():
    doc = report.make_doc(META, _synthetic_rows())
    text = report.markdown([("run-1", doc)], title="T", notes=["cublas-block called as: X"])
    assert text.startswith("# T")
    assert "| 64x2112x7168 | fp8gemm-triton | 12.5 |" in text  # detailed table
    assert "12.5 (2.00×)" in text  # wide table: µs with the ratio
    assert "4x256, 4096x7168" in text
    assert "| deepseek-dense | dense | fp8gemm-triton | 1.687 (3) | 2.000 (2) | 1.200 (1) |" in text
    assert "cublas-block called as: X" in text
    assert "<gpu>" in text and "<commit>" in text
    # the summary comes last: the geometric means close the text
    assert text.rstrip().splitlines()[-1].startswith("| deepseek-grouped | masked")


def test_plot_writes_png_or_says_why(tmp_path):
    doc = report.make_doc(META, _synthetic_rows())
    why = report.plot(doc, tmp_path / "p.png")
    if why is None:
        assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "matplotlib" in why


def test_make_benchmarks_md_script(tmp_path):
    res = tmp_path / "results"
    report.write_json(res / "h200.json", report.make_doc(META, _synthetic_rows()))
    out = tmp_path / "BENCHMARKS.md"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_benchmarks_md.py"),
                        "--results", str(res), "--out", str(out)],
                       capture_output=True, text=True, env=_env(), timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    text = out.read_text()
    assert "## h200.json" in text and "12.5 (2.00×)" in text and "Geometric mean" in text


def test_make_benchmarks_md_adds_a_run_per_suite(tmp_path):
    """--add splits a run into the GPU's per-suite result files (DATE-GPU-COMMIT-SUITE.json; the
    skewed backward rows with the backward ones, deepseek-grouped as `grouped`) and deletes that
    GPU's older file and plot of each suite, no other GPU's and no other suite's."""
    res = tmp_path / "results"
    res.mkdir()
    # (a whole hash, as `git rev-parse HEAD` gives it, names the file by its first 7 digits)
    meta = dict(META, gpu="NVIDIA H200", commit="abc1234" + "5" * 33, date="2026-12-06T01:02:03Z")
    old = [res / "2026-12-01-h200-0000000-grouped.json",
           res / "2026-12-01-h200-0000000-backward.json"]
    kept = [res / "2026-12-01-h100-0000000-grouped.json",
            res / "2026-12-01-h200-0000000-m-sweep.json"]
    for path in old + kept:
        report.write_json(path, report.make_doc(meta, _synthetic_rows()[:2]))
        path.with_suffix(".png").write_bytes(b"png")
    rows = _synthetic_rows()
    backward = [_row("backward", "wgrad", 2112, 7168, 4096),
                _row("backward-skewed", "k_grouped_wgrad", 4096, 7168, 4096, 8)]
    run = tmp_path / "bench.json"
    report.write_json(run, report.make_doc(meta, rows + backward))
    out = tmp_path / "BENCHMARKS.md"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_benchmarks_md.py"),
                        "--results", str(res), "--out", str(out), "--history",
                        str(tmp_path / "history.json"), "--add", str(run), "--record"],
                       capture_output=True, text=True, env=_env(), timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in res.glob("*.json"))
    assert names == sorted(["2026-12-01-h100-0000000-grouped.json",
                            "2026-12-01-h200-0000000-m-sweep.json",
                            "2026-12-06-h200-abc1234-backward.json",
                            "2026-12-06-h200-abc1234-deepseek-dense.json",
                            "2026-12-06-h200-abc1234-grouped.json"])
    assert not any(p.with_suffix(".png").exists() for p in old)
    assert all(p.with_suffix(".png").exists() for p in kept)
    split = {n: report.load_json(res / n)["rows"] for n in names if "abc1234" in n}
    assert split["2026-12-06-h200-abc1234-backward.json"] == backward
    assert split["2026-12-06-h200-abc1234-grouped.json"] == rows[7:]
    assert split["2026-12-06-h200-abc1234-deepseek-dense.json"] == rows[:7]
    assert "2026-12-06-h200-abc1234-grouped.json" in out.read_text()


def test_from_json_merges_and_writes_markdown(tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    rows = _synthetic_rows()
    report.write_json(a, report.make_doc(META, rows[:7]))
    report.write_json(b, report.make_doc(META, rows[7:]))
    notes = tmp_path / "n.txt"
    notes.write_text("skipped fp8gemm-cuda at x: cannot import\n")
    md, merged = tmp_path / "m.md", tmp_path / "m.json"
    assert bench_main(["--from-json", str(a), str(b), "--json", str(merged), "--markdown",
                       str(md), "--notes", str(notes)]) == 0
    assert report.load_json(merged)["rows"] == rows
    assert "cannot import" in md.read_text() and "12.5 (2.00×)" in md.read_text()


# ---------------------------------------------------------------------------------------------
# The CLI


def test_help_works():
    r = subprocess.run([sys.executable, "-m", "fp8gemm.bench", "--help"], capture_output=True,
                       text=True, env=_env(), timeout=120, cwd=ROOT, check=False)
    assert r.returncode == 0 and "--suite" in r.stdout and "--dry-run" in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without a GPU")
def test_without_gpu_says_so_without_traceback():
    r = subprocess.run([sys.executable, "-m", "fp8gemm.bench", "--suite", "deepseek-dense"],
                       capture_output=True, text=True, env=_env(), timeout=120, cwd=ROOT,
                       check=False)
    assert r.returncode == 2
    assert "needs a CUDA GPU" in r.stderr and "Traceback" not in r.stderr + r.stdout


def test_dry_run_lists_cases(capsys):
    assert bench_main(["--dry-run", "--suite", "deepseek-grouped"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("10 cases")
    assert "masked     4x256, 4096x7168" in out and "cublas-rowwise-grouped" in out


def test_parse_args_impls_and_runs():
    a = parse_args(["--impl", "cublas-block,torch-bf16", "--impl", "fp8gemm-reference"])
    assert a.impls == ["cublas-block", "torch-bf16", "fp8gemm-reference"]
    assert parse_args([]).runs == 100 and parse_args(["--quick"]).runs == 30
    assert parse_args([]).impls == list(impls.DEFAULT_IMPLS)
    assert parse_args(["--impl", "deepgemm"]).impls == ["deepgemm"]
    with pytest.raises(SystemExit):
        parse_args(["--impl", "deep-gemm"])
    with pytest.raises(SystemExit):
        parse_args(["--runs", "10"])


# ---------------------------------------------------------------------------------------------
# Inputs, peers' layouts and the runner on the CPU


def test_bench_quantisers_match_the_library():
    import fp8gemm

    x = torch.randn(37, 320, dtype=torch.bfloat16)
    w = torch.randn(200, 320, dtype=torch.bfloat16)
    q, s = impls._quant_groups(x)
    q_ref, s_ref = fp8gemm.quantize_per_token(x, col_major_scales=False)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)
    q, s = impls._quant_blocks(w)
    q_ref, s_ref = fp8gemm.quantize_per_block(w)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(s, s_ref)


def test_block_scale_layouts_for_cublas():
    sb = torch.arange(2 * 3, dtype=torch.float32).reshape(2, 3)  # nb = 2, kb = 3
    plain = impls._block_scale_b(sb, "plain")
    assert plain.shape == (3, 2) and plain.stride() == (1, 3) and torch.equal(plain, sb.t())
    padded = impls._block_scale_b(sb, "padded")
    assert padded.shape == (4, 2) and padded.stride() == (1, 4)
    assert torch.equal(padded[:3], sb.t()) and not padded[3].any()
    view = impls._block_scale_b(sb, "padded-view")
    assert view.shape == (3, 2) and view.stride() == (1, 4) and torch.equal(view, sb.t())
    sa = impls._block_scale_a(torch.randn(8, 3))
    assert sa.stride() == (1, 8)
    q = torch.randn(3, 16).to(torch.float8_e4m3fn)
    p = impls._pad_rows(q, 4)
    assert p.shape == (4, 16) and p.dtype == q.dtype
    assert torch.equal(p[:3].view(torch.uint8), q.view(torch.uint8)) and not p[3].float().any()


class _StandInTimer:
    """The runner's timer on the CPU: 'device time' = the host time per call."""

    def time_interleaved_us(self, calls, runs=30):
        out = []
        for fn, host_us, _ in calls:
            fn()
            out.append([host_us] * runs)
        return out


def test_runner_on_cpu_with_reference_and_bf16():
    cases = [Case("irregular", "dense", 37, 200, 320),
             Case("deepseek-grouped", "contiguous", 64, 256, 384, 2),
             Case("deepseek-grouped", "masked", 32, 256, 384, 3)]
    saved = []
    res = run_cases(cases, ["fp8gemm-reference", "cublas-block", "torch-bf16"],
                    torch.device("cpu"), 30, timer=_StandInTimer(), log=lambda s: None,
                    on_row=lambda r: saved.append(len(r.rows)))
    assert res.aborted is None
    got = {(r["op"], r["impl"]): r for r in res.rows}
    assert set(got) == {(op, impl) for op in ("dense", "contiguous", "masked")
                        for impl in ("fp8gemm-reference", "torch-bf16")}
    for (op, impl), r in got.items():
        limit = TOL[torch.bfloat16] if impl.startswith("fp8gemm") else BENCH_PEER_TOL[impl]
        assert r["diff"] is not None and r["diff"] < limit, (op, impl, r["diff"])
        assert r["us"] > 0 and r["tflops"] > 0 and r["gbs"] > 0
    assert got[("masked", "torch-bf16")]["shape"] == {"m": 32, "n": 256, "k": 384, "groups": 3}
    assert saved == list(range(1, len(res.rows) + 1))
    assert [s[1] for s in res.skips] == ["cublas-block"]  # dense only, and sm_90 only
    report.validate_doc(report.make_doc(META, res.rows))


def test_reference_output_is_float64_of_dequantised_inputs():
    data = impls.make_data(Case("t", "contiguous", 16, 24, 160, 2), torch.device("cpu"))
    ref = impls.reference_output(data)
    assert ref.dtype == torch.float64 and ref.shape == (32, 24)
    from fp8gemm.backends.reference import dequantize
    from fp8gemm.problem import Recipe

    g1 = (dequantize(data.a_rows[16:], data.sa_rows[16:], Recipe.GROUP, torch.float64)
          @ dequantize(data.b[1], data.sb[1], Recipe.BLOCK, torch.float64).T)
    assert torch.allclose(ref[16:], g1)
    # each group padded to 128 rows, padding rows -1
    assert data.m_indices.tolist() == [0] * 16 + [-1] * 112 + [1] * 16 + [-1] * 112
    assert data.rows.tolist() == list(range(16)) + list(range(128, 144))
    assert math.isfinite(float(ref.abs().sum())) and ref.abs().sum() > 0


def test_wrong_results_are_marked():
    rows = [_row(impl="cublas-block", us=25.0, diff=2e-2), _row(impl="fp8gemm-triton", us=20.0),
            _row(impl="cublas-tensor", us=12.0, diff=1.4e-3), _row(impl="torch-bf16", diff=None)]
    assert [report.is_wrong(r) for r in rows] == [True, False, False, True]
    text = report.summary_markdown(report.make_doc(META, rows))
    assert "25.0 (1.00×) WRONG" in text and "20.0 (1.25×) |" in text


# ---------------------------------------------------------------------------------------------
# The suites for the kernel issues: skewed experts, the M sweep, backward, the MoE layer


def test_skewed_sizes_are_deterministic_skewed_and_sum_right():
    for g in (8, 16, 32):
        sizes = suites.skewed_sizes(32768, g)
        assert len(sizes) == g and sum(sizes) == 32768
        assert sizes == suites.skewed_sizes(32768, g)  # same seed, same sizes
        assert max(sizes) > 2.5 * 32768 / g > 2.5 * min(sizes)  # skewed, not near-equal
    assert suites.skewed_sizes(1024, 8) != suites.skewed_sizes(1024, 8, seed=7)
    ks = suites.skewed_sizes(32768, 8, unit=128)
    assert sum(ks) == 32768 and all(k % 128 == 0 for k in ks)
    with pytest.raises(ValueError, match="multiple of unit"):
        suites.skewed_sizes(1000, 4, unit=128)


def test_skewed_suite_is_deterministic_with_matching_rows():
    cases = suites.suite_cases("moe-skewed")
    again = suites.suite_cases("moe-skewed")
    assert cases == again
    by = {(c.op, c.groups, c.n, c.k): c for c in cases}
    for g in (8, 16, 32):
        for n, k in ((4096, 7168), (7168, 2048)):
            cont, offs, masked = (by[(op, g, n, k)] for op in ("contiguous", "offsets", "masked"))
            assert cont.sizes == offs.sizes and sum(cont.sizes) == 32768  # the grouped suite's
            assert cont.m * g == 32768 and cont.flops == offs.flops
            assert sum(masked.sizes) == 1024 and masked.m == 1024 // g  # expected_m = mean
            assert len(set(masked.sizes)) > 1 and masked.mmax % 128 == 0
            assert masked.mmax >= max(masked.sizes)
    assert {c.op for c in cases} == {"contiguous", "offsets", "masked"}  # (kg: in backward)
    with pytest.raises(ValueError, match="sizes must be"):
        Case("t", "contiguous", 10, 16, 16, 2, (5, 6))


def test_m_sweep_and_backward_and_layer_suites():
    sweep = suites.suite_cases("m-sweep")
    nk = {(c.n, c.k) for c in sweep}
    dense_nk = [(c.n, c.k) for c in suites.suite_cases("deepseek-dense")][:6]
    assert nk == set(dense_nk) and len(dense_nk) == 6
    assert sorted({c.m for c in sweep}) == [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192,
                                             224, 256]
    assert all(c.op == "dense" for c in sweep) and len(sweep) == 15 * 6
    quick = suites.suite_cases("m-sweep", quick=True)
    assert 0 < len(quick) < len(sweep) and set(quick) <= set(sweep)
    assert {(c.n, c.k) for c in quick} == set(dense_nk)  # fewer M, every N x K
    back = suites.suite_cases("backward")
    wgrad = [(c.m, c.n, c.k) for c in back if c.op == "wgrad"]
    assert wgrad == [(n, k, t) for t in (4096, 1000) for n, k in dense_nk]
    dgrad = [(c.m, c.n, c.k) for c in back if c.op == "dgrad"]
    assert dgrad == [(t, k, n) for t in (4096, 1000) for n, k in dense_nk]
    kg = [c for c in back if c.op == "k_grouped_wgrad"]
    assert [(c.suite, c.m, c.n, c.k, c.groups) for c in kg] == [
        ("backward", 4096, 7168, 4096, 8), ("backward", 7168, 2048, 4096, 8),
        ("backward-skewed", 4096, 7168, 4096, 8), ("backward-skewed", 7168, 2048, 4096, 8)]
    assert kg[0].group_sizes == kg[1].group_sizes == (4096,) * 8
    skewed = kg[2].group_sizes
    assert kg[3].group_sizes == skewed and sum(skewed) == 8 * 4096
    assert skewed.count(0) == 2 and max(skewed) > 2 * 4096 and all(k % 128 == 0 for k in skewed)
    assert "2 with none" in kg[2].label
    quick_back = suites.suite_cases("backward", quick=True)
    assert set(quick_back) <= set(back) and len(quick_back) < len(back)
    assert {c.op for c in quick_back} == {"wgrad", "dgrad", "k_grouped_wgrad"}
    assert [c for c in quick_back if c.op == "k_grouped_wgrad"] == kg  # every k-grouped case
    assert {c.k for c in quick_back if c.op == "wgrad"} == {4096, 1000}
    layer = suites.suite_cases("moe-layer")
    assert [(c.m, c.n, c.k, c.groups) for c in layer] == [(4096, 7168, 2048, 32),
                                                          (128, 7168, 2048, 32)]


def test_counts_of_the_new_ops():
    w = Case("t", "wgrad", 2112, 7168, 1000)
    kb = 8  # ceil(1000 / 128)
    assert w.flops == 2 * 2112 * 7168 * 1000 and w.label == "2112x7168x1000"
    assert w.min_bytes == (2112 + 7168) * (1000 + 4 * kb) + 4 * 2112 * 7168
    kg = Case("t", "k_grouped_wgrad", 256, 512, 192, 2, (128, 256))
    assert kg.flops == 2 * 256 * 512 * 384
    assert kg.min_bytes == (256 + 512) * (384 + 4 * 3) + 2 * 4 * 256 * 512
    layer = suites.suite_cases("moe-layer")[0]
    assert layer.flops == 2 * 4096 * 3 * 7168 * 2048  # tokens * 8 of 256 experts * 32 local
    assert layer.min_bytes > 32 * 3 * 7168 * 2048  # every expert's fp8 weights
    d = Case("t", "dgrad", 1000, 7168, 2112)  # dX [1000, 7168] = dY [1000, 2112] . W
    kb = 17  # ceil(2112 / 128)
    assert d.flops == 2 * 1000 * 7168 * 2112 and d.label == "1000x7168x2112"
    assert d.min_bytes == (1000 * 2112 + 1000 * kb * 4 + 7168 * 2112 + 56 * kb * 4
                           + 1000 * 7168 * 2)
    r = report.make_row("m-sweep", "dense", {"m": 256, "n": 2112, "k": 7168, "groups": 1},
                        "deepgemm", 20.0, 30.0, 1.0, 1.0, 1e-6)
    case = Case("m-sweep", "dense", 256, 2112, 7168)
    assert suites.FLOOR_BYTES_PER_US == 4.25e6 and suites.FLOOR_FIXED_US == 4.0
    assert case.floor_us == pytest.approx(case.min_bytes / 4.25e6 + 4.0)
    assert report.floor_us(r) == pytest.approx(case.floor_us)  # at every M of the sweep
    assert report.floor_us(dict(r, suite="deepseek-dense")) is None  # M > 128 elsewhere
    small = dict(r, suite="deepseek-dense", shape=dict(r["shape"], m=64))
    assert report.floor_us(small) == pytest.approx(Case("t", "dense", 64, 2112, 7168).floor_us)


def test_contiguous_and_offsets_data_share_rows():
    sizes = (5, 130, 0, 65)
    cont = impls.make_data(Case("t", "contiguous", 50, 24, 160, 4, sizes), torch.device("cpu"))
    offs = impls.make_data(Case("t", "offsets", 50, 24, 160, 4, sizes), torch.device("cpu"))
    assert offs.a.shape == (200, 160) and offs.offsets.tolist() == [0, 5, 135, 135, 200]
    assert cont.a.shape == (128 + 256 + 0 + 128, 160)
    u8 = torch.uint8
    assert torch.equal(cont.a[cont.rows].view(u8), offs.a.view(u8))  # the same data rows
    assert torch.equal(cont.sa[cont.rows], offs.sa)
    pad = torch.ones(cont.a.shape[0], dtype=torch.bool)
    pad[cont.rows] = False
    assert (cont.m_indices[pad] == -1).all() and not cont.a[pad].view(u8).any()
    assert cont.m_indices[cont.rows].tolist() == [0] * 5 + [1] * 130 + [3] * 65
    assert torch.equal(impls.reference_output(cont), impls.reference_output(offs))
    masked = impls.make_data(Case("t", "masked", 5, 24, 160, 3, (1, 9, 5)), torch.device("cpu"))
    assert masked.a.shape == (3, 128, 160) and masked.masked_m.tolist() == [1, 9, 5]
    assert impls.reference_output(masked).shape == (15, 24)
    out = torch.arange(3 * 128 * 2, dtype=torch.float32).reshape(3, 128, 2)
    assert masked.data_rows(out).tolist() == (out[0, :1].tolist() + out[1, :9].tolist()
                                              + out[2, :5].tolist())
    assert masked.no_data_rows(out).tolist() == (out[0, 1:].tolist() + out[1, 9:].tolist()
                                                 + out[2, 5:].tolist())
    cont_out = torch.arange(cont.a.shape[0] * 2, dtype=torch.float32).reshape(-1, 2)
    assert torch.equal(cont.no_data_rows(cont_out), cont_out[pad])
    assert offs.no_data_rows(torch.zeros(200, 24)).shape == (0, 24)


def test_deepgemm_skips_cleanly_when_absent(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", None)  # import deep_gemm raises ImportError
    cpu = torch.device("cpu")
    for case in (Case("t", "dense", 64, 256, 256), Case("t", "wgrad", 128, 256, 256),
                 Case("t", "masked", 64, 256, 256, 2)):
        with pytest.raises(impls.Skip, match="cannot import deep_gemm.*PYTHONPATH"):
            impls.make_impl("deepgemm", impls.make_data(case, cpu))
    assert not impls.applies("deepgemm", "offsets")
    assert "deepgemm" in impls.DEFAULT_IMPLS and "cublas-block-loop" in impls.DEFAULT_IMPLS


def test_deepgemm_calls_match_its_api():
    """The calls made are functions of DeepGEMM's package, with the argument order used (runs
    where `import deep_gemm` works: its directory on PYTHONPATH)."""
    import ast
    import inspect

    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"deep_gemm is not importable here ({type(e).__name__})")
    src = (ROOT / "fp8gemm" / "bench" / "impls.py").read_text()
    used = {n.attr for n in ast.walk(ast.parse(src))
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "dg"}
    assert used == {"gemm_fp8_fp8_bf16_nt", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous",
                    "m_grouped_gemm_fp8_fp8_bf16_nt_masked", "wgrad_gemm_fp8_fp8_fp32_nt",
                    "k_grouped_wgrad_gemm_fp8_fp8_fp32_nt", "get_col_major_tma_aligned_tensor"}
    params = {name: list(inspect.signature(getattr(deep_gemm, name)).parameters)
              for name in used}
    assert params["m_grouped_gemm_fp8_fp8_bf16_nt_masked"][-2:] == ["masked_m", "expected_m"]
    assert params["m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"][-1] == "m_indices"
    assert len(params["k_grouped_wgrad_gemm_fp8_fp8_fp32_nt"]) == 4


class _BusyRecorder(_StandInTimer):
    def __init__(self):
        self.calls = []

    def time_interleaved_us(self, calls, runs=30):
        self.calls += list(calls)
        return super().time_interleaved_us(calls, runs)


def test_runner_new_ops_on_cpu():
    cpu = torch.device("cpu")
    sizes = suites.skewed_sizes(300, 3)
    cases = [Case("moe-skewed", "contiguous", 100, 128, 256, 3, sizes),
             Case("moe-skewed", "offsets", 100, 128, 256, 3, sizes),
             Case("moe-skewed", "masked", 20, 128, 256, 3, suites.skewed_sizes(60, 3)),
             Case("deepseek-backward", "wgrad", 128, 256, 1000),
             Case("moe-skewed", "k_grouped_wgrad", 64, 128, 256, 2, (128, 384))]
    timer = _BusyRecorder()
    res = run_cases(cases, ["fp8gemm-reference", "torch-bf16", "cublas-block",
                            "cublas-block-loop", "deepgemm"], cpu, 30, timer=timer,
                    log=lambda s: None)
    assert res.aborted is None
    got = {(r["op"], r["impl"]): r for r in res.rows}
    assert set(got) == {("contiguous", "fp8gemm-reference"), ("contiguous", "torch-bf16"),
                        ("offsets", "fp8gemm-reference"), ("offsets", "torch-bf16"),
                        ("masked", "fp8gemm-reference"), ("masked", "torch-bf16"),
                        ("wgrad", "fp8gemm-reference"), ("k_grouped_wgrad", "fp8gemm-reference")}
    for (op, impl), r in got.items():
        assert r["diff"] is not None and r["diff"] < (1e-5 if impl.startswith("fp8gemm") else 1e-4)
    assert got[("masked", "torch-bf16")]["shape"] == {"m": 20, "n": 128, "k": 256, "groups": 3}
    assert got[("k_grouped_wgrad", "fp8gemm-reference")]["shape"]["k"] == 256
    skipped = {(case.split("/")[1].split()[0], impl): why for case, impl, why in res.skips}
    assert "K % 16" in skipped[("wgrad", "cublas-block")]
    assert "sm_90" in skipped[("k_grouped_wgrad", "cublas-block-loop")]
    assert all("cannot import deep_gemm" in why for (_, impl), why in skipped.items()
               if impl == "deepgemm") or "deep_gemm" in sys.modules
    assert any("k_grouped_fp8_gemm_nt_contiguous, out += A_g . B_g^T" in n for n in res.notes)
    doc = report.make_doc(META, res.rows)
    report.validate_doc(doc)
    text = report.markdown([("cpu", doc)])
    assert "moe-skewed / offsets" in text and "128x256x1000" in text
    assert all(busy >= 0 for _, _, busy in timer.calls)


def test_moe_layer_impls_on_cpu():
    """A small layer (hidden 256, width 128, 2 local experts of 16): fp8gemm's Fp8MoE and the
    bf16 layer against the float64 layer on the dequantised weights, prefill and decode."""
    cpu = torch.device("cpu")
    for tokens in (16, 200):  # decode (masked layout) and prefill (contiguous)
        case = Case("moe-layer", "moe_layer", tokens, 256, 128, 2)
        data = impls.make_data(case, cpu)
        ref = impls.reference_output(data)
        assert ref.shape == (tokens, 256) and ref.abs().sum() > 0
        from fp8gemm.quant import calc_diff

        for name, limit in (("fp8gemm-reference", 5e-3), ("torch-bf16", 1e-4)):
            made = impls.make_impl(name, data)
            diff = calc_diff(made.output(), ref)
            assert diff < limit, (name, tokens, diff)
            assert "GEMMs" in made.parts
            for part in made.parts.values():
                part()
        made.fn()
        assert calc_diff(made.output(), ref) < 1e-4  # a second call gives the same layer
    r = report.make_row("moe-layer", "moe_layer", case.shape, "fp8gemm-cuda", 900.0, 950.0,
                        1.0, 1.0, 2e-3)
    assert not report.is_wrong(r)  # the layer's fp8 activations are within the loose limit


def test_impl_outputs_hold_only_data_rows_for_deepgemm_like_layouts():
    """Padding rows written with garbage (as DeepGEMM may) never reach the diff."""
    cpu = torch.device("cpu")
    data = impls.make_data(Case("t", "contiguous", 50, 24, 160, 2, (30, 70)), cpu)
    ref = impls.reference_output(data)
    out = torch.full((data.a.shape[0], 24), float("nan"))
    out[data.rows] = ref.float()
    assert torch.equal(data.data_rows(out), ref.float())


# ---------------------------------------------------------------------------------------------
# The M sweep against the memory floor, the backward ops, end to end on the CPU


def test_skewed_sizes_with_empty_groups():
    sizes = suites.skewed_sizes(32768, 8, unit=128, empty=2)
    assert sizes == suites.skewed_sizes(32768, 8, unit=128, empty=2)
    assert len(sizes) == 8 and sum(sizes) == 32768 and sizes.count(0) == 2
    assert all(k % 128 == 0 for k in sizes)
    assert suites.skewed_sizes(600, 5, empty=4).count(0) == 4  # one group takes every row
    assert suites.skewed_sizes(1024, 8) == suites.skewed_sizes(1024, 8, empty=0)
    for bad in (-1, 8):
        with pytest.raises(ValueError, match="empty must be"):
            suites.skewed_sizes(1024, 8, empty=bad)


def test_dgrad_data_is_the_transposed_weight_quantised():
    """B of dgrad is W^T [K_in, N_out] in 128x128 blocks: the same bits as quantising W^T
    itself; the reference is dY . W on the dequantised inputs."""
    case = Case("t", "dgrad", 40, 200, 320)  # dX [40, 200] = dY [40, 320] . W [320, 200]
    data = impls.make_data(case, torch.device("cpu"))
    assert data.a.shape == (40, 320) and data.b.shape == (200, 320)
    assert data.x.shape == (40, 320) and data.w.shape == (200, 320)  # dY and W^T
    q, s = impls._quant_blocks(data.w)
    assert torch.equal(q.view(torch.uint8), data.b.view(torch.uint8)) and torch.equal(s, data.sb)
    ref = impls.reference_output(data)
    from fp8gemm.backends.reference import dequantize
    from fp8gemm.problem import Recipe

    want = (dequantize(data.a, data.sa, Recipe.GROUP, torch.float64)
            @ dequantize(data.b, data.sb, Recipe.BLOCK, torch.float64).T)
    assert ref.shape == (40, 200) and torch.allclose(ref, want)


def test_cublas_loop_leaves_empty_experts_at_zero(monkeypatch):
    """The per-expert cuBLAS loop calls cuBLAS only for experts with tokens (it takes no
    K = 0); a float matmul stands in for cuBLAS and the sm_90 check here."""
    calls = []

    def mm_way(way):
        def prepare(a, sa, b, sb):
            return a, sa, b, sb

        def mm(a, sa, b, sb):
            calls.append(a.shape[1])
            da, db = impls._dequant(a, sa, b, sb, torch.float32, impls.Recipe.GROUP)
            return da @ db.T
        return prepare, mm

    monkeypatch.setattr(impls, "_cublas_sm90", lambda data, what: None)
    monkeypatch.setattr(impls, "_wgrad_way", lambda device: "stand-in")
    monkeypatch.setattr(impls, "_wgrad_mm", mm_way)
    case = Case("backward-skewed", "k_grouped_wgrad", 64, 128, 256, 4, (0, 384, 0, 640))
    data = impls.make_data(case, torch.device("cpu"))
    made = impls.make_impl("cublas-block-loop", data)
    assert calls == [384, 640] and "the 2 without are zeros" in made.note
    out = made.output()
    assert out.shape == (4, 64, 128) and not out[0].any() and not out[2].any()
    from fp8gemm.quant import calc_diff

    assert calc_diff(out, impls.reference_output(data)) < 1e-6


def _sweep_doc():
    """m-sweep rows of two N x K at three M, three impls (no baseline for one N x K)."""
    rows = []
    for n, k in ((256, 512), (384, 256)):
        for m in (1, 64, 192):
            case = Case("m-sweep", "dense", m, n, k)
            for impl, times in (("fp8gemm-cuda", 1.5), ("cublas-block", 2.0), ("deepgemm", 3.0)):
                if impl == "cublas-block" and n == 384:
                    continue
                us = case.floor_us * times * (2 if m == 192 else 1)
                rows.append(report.make_row("m-sweep", "dense", case.shape, impl, us, us + 5,
                                            timing.tflops(case.flops, us),
                                            timing.gbs(case.min_bytes, us), 1e-6))
    rows.append(_row(m=4096, impl="cublas-block", us=120.0))
    rows.append(_row(m=4096, impl="fp8gemm-cuda", us=100.0))
    return report.make_doc(META, rows)


def test_sweep_markdown_has_the_floor_and_time_over_floor():
    doc = _sweep_doc()
    text = report.markdown([("run", doc)])
    floor = Case("m-sweep", "dense", 64, 256, 512).floor_us
    head = ("| M×N×K | floor µs | fp8gemm-cuda µs / floor | cublas-block µs / floor "
            "| deepgemm µs / floor |")
    assert head in text
    assert f"| 64x256x512 | {floor:.1f} | 1.50 | 2.00 | 3.00 |" in text
    floor = Case("m-sweep", "dense", 192, 256, 512).floor_us
    assert f"| 192x256x512 | {floor:.1f} | 3.00 |" in text
    assert "| 1x384x256 | 4.0 | 1.50 | — | 3.00 |" in text  # no cublas-block there
    # the summary: per N x K the geomean over M <= 128, then over every M
    summary = report.summary_markdown(doc)
    g = 2 ** (1 / 3)  # (1, 1, 2) ** (1/3): M = 192 takes twice as long
    assert (f"| 256x512 | 1.50 / {1.5 * g:.2f} | 2.00 / {2 * g:.2f} | 3.00 / {3 * g:.2f} |"
            in summary)
    assert (f"| all N×K | 1.50 / {1.5 * g:.2f} | 2.00 / {2 * g:.2f} | 3.00 / {3 * g:.2f} |"
            in summary)
    assert "µs / floor" not in report.summary_markdown(report.make_doc(META, _synthetic_rows()))
    assert "4.25 TB/s + 4 µs" in report.method_text()


def test_plot_panels_sweep_lines_and_other_bars(tmp_path):
    doc = _sweep_doc()
    bars, lines = report.plot_panels(doc["rows"])
    assert [(s, o) for s, o, _ in bars] == [("deepseek-dense", "dense")]
    assert [(s, o, nk) for s, o, nk, _ in lines] == [("m-sweep", "dense", (256, 512)),
                                                     ("m-sweep", "dense", (384, 256))]
    assert all(len(idx) == 3 * 3 for *_, nk, idx in lines if nk == (256, 512))
    sweep_only = report.make_doc(META, [r for r in doc["rows"] if r["suite"] == "m-sweep"])
    assert report.plot_panels(sweep_only["rows"])[0] == []  # no baseline needed for lines
    why = report.plot(sweep_only, tmp_path / "s.png")
    if why is None:
        assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"
    else:
        assert "matplotlib" in why
    assert "no plot" in report.plot(report.make_doc(META, []), tmp_path / "e.png")


def test_plot_is_written_when_matplotlib_is_there(tmp_path):
    pytest.importorskip("matplotlib")
    assert report.plot(_sweep_doc(), tmp_path / "p.png") is None
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_and_backward_on_cpu_json_markdown_and_plot(tmp_path, capsys):
    """Tiny m-sweep and backward cases through the runner on the CPU (reference backend,
    torch's bf16 matmul), then the result file through --from-json to markdown and a plot."""
    cpu = torch.device("cpu")
    cases = [Case("m-sweep", "dense", m, 256, 384) for m in (1, 24, 192)]
    cases += [Case("backward", "wgrad", 128, 256, 1000), Case("backward", "dgrad", 200, 256, 384),
              Case("backward", "k_grouped_wgrad", 64, 128, 256, 2),
              Case("backward-skewed", "k_grouped_wgrad", 64, 128, 256, 4, (0, 384, 0, 640))]
    res = run_cases(cases, ["fp8gemm-reference", "torch-bf16", "cublas-block",
                            "cublas-block-loop", "deepgemm"], cpu, 30, timer=_StandInTimer(),
                    log=lambda s: None)
    assert res.aborted is None
    got = {(r["suite"], r["op"], r["shape"]["m"], r["impl"]): r for r in res.rows}
    want = {("m-sweep", "dense", m, i) for m in (1, 24, 192)
            for i in ("fp8gemm-reference", "torch-bf16")}
    want |= {("backward", "wgrad", 128, "fp8gemm-reference"),
             ("backward", "dgrad", 200, "fp8gemm-reference"),
             ("backward", "dgrad", 200, "torch-bf16"),
             ("backward", "k_grouped_wgrad", 64, "fp8gemm-reference"),
             ("backward-skewed", "k_grouped_wgrad", 64, "fp8gemm-reference")}
    assert set(got) == want
    for key, r in got.items():
        limit = TOL[torch.bfloat16] if key[3].startswith("fp8gemm") else BENCH_PEER_TOL[key[3]]
        assert r["diff"] is not None and r["diff"] < limit, (key, r["diff"])
    skipped = {(case.split("/")[1].split()[0], impl): why for case, impl, why in res.skips}
    assert "K % 16" in skipped[("wgrad", "cublas-block")]  # cuBLAS refuses K = 1000
    assert "sm_90" in skipped[("dgrad", "cublas-block")]
    path = tmp_path / "cpu.json"
    report.write_json(path, report.make_doc(META, res.rows))
    md, png = tmp_path / "out" / "cpu.md", tmp_path / "plots" / "cpu.png"
    md.parent.mkdir()
    assert bench_main(["--from-json", str(path), "--markdown", str(md), "--plot", str(png)]) == 0
    text = md.read_text()
    assert "m-sweep / dense: µs / floor" in text and "24x256x384" in text
    assert "backward / dgrad" in text and "200x256x384" in text
    assert "backward-skewed / k_grouped_wgrad" in text
    assert "geometric mean of µs / floor" in text
    if png.exists():  # matplotlib there: the plot is written and the markdown links it
        assert png.read_bytes()[:4] == b"\x89PNG" and "](../plots/cpu.png)" in text
    else:
        assert "matplotlib" in capsys.readouterr().out and "![" not in text


def test_dry_run_of_the_quick_sweep_and_backward(capsys):
    assert bench_main(["--dry-run", "--suite", "m-sweep", "--quick"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{len(suites.suite_cases('m-sweep', True))} cases")
    assert "192x7168x2048" in out and "24x7168x2048" not in out
    assert bench_main(["--dry-run", "--suite", "backward"]) == 0
    out = capsys.readouterr().out
    assert "dgrad      1000x7168x2112" in out and "cublas-block-loop" in out
    assert "8xmean 4096 tokens (2 with none), 4096x7168" in out


def test_benchmarks_page_shows_backward_and_the_sweep_floor():
    rows = _sweep_doc()["rows"]
    rows += [_row("backward", "dgrad", 4096, 7168, 2112, impl="cublas-block", us=80.0),
             _row("backward", "dgrad", 4096, 7168, 2112, impl="fp8gemm-cuda", us=64.0)]
    text = report.page_markdown([("results/h.json", report.make_doc(META, rows), None)], [])
    assert "backward / dgrad: device µs" in text and "64.0 (1.25×)" in text
    assert "m-sweep / dense: geometric mean of µs / floor" in text
    assert "m-sweep / dense: device µs" not in text  # its 90 shapes stay in the result file


def test_problems_asked_of_the_backends():
    """What `supports` is asked: wgrad a dense 1x128 x 1x128 GEMM with fp32 out and c, the
    k-grouped wgrad the k-grouped kind over every expert's tokens, dgrad the forward GEMM."""
    from fp8gemm.problem import GemmKind, Recipe

    w = impls.case_problem(Case("t", "wgrad", 256, 384, 1000))
    assert (w.kind, w.m, w.n, w.k, w.b_recipe, w.out_dtype, w.has_c) == (
        GemmKind.DENSE, 256, 384, 1000, Recipe.GROUP, torch.float32, True)
    kg = impls.case_problem(Case("t", "k_grouped_wgrad", 64, 128, 256, 3, (0, 512, 256)))
    assert (kg.kind, kg.m, kg.n, kg.k, kg.groups) == (GemmKind.K_GROUPED, 64, 128, 768, 3)
    d = impls.case_problem(Case("t", "dgrad", 1000, 384, 512))
    assert (d.kind, d.m, d.n, d.k, d.b_recipe, d.out_dtype) == (
        GemmKind.DENSE, 1000, 384, 512, Recipe.BLOCK, torch.bfloat16)


def test_case_problem_rows_are_the_data_rows():
    """The grouped problem's M is the rows make_data lays A out in: contiguous groups padded to
    128 rows, offsets back to back, masked the [G, mmax] capacity."""
    cpu = torch.device("cpu")
    sizes = (5, 300, 0, 131)
    for op in ("contiguous", "offsets", "masked"):
        case = Case("t", op, sum(sizes) // 4, 256, 384, 4, sizes)
        data = impls.make_data(case, cpu)
        rows = data.a.shape[1] if op == "masked" else data.a.shape[0]
        assert impls.case_problem(case).m == rows, op


def test_geomeans_leave_wrong_results_out_and_count_them():
    """A wrong result's speed-up is not averaged in (DeepGEMM's masked GEMM at Mmax = 32 with
    several experts writes the next expert's rows): its shape is left out and counted."""
    rows = _synthetic_rows()
    rows[1]["diff"] = 0.13  # fp8gemm-triton at M = 64: wrong, ratio 2
    gm = {(g["suite"], g["op"], g["impl"], g["range"]): g for g in report.geomeans(rows)}
    tri = gm[("deepseek-dense", "dense", "fp8gemm-triton", "all")]
    assert tri["geomean"] == pytest.approx((2.0 * 1.2) ** 0.5)
    assert (tri["count"], tri["wrong"]) == (2, 1)
    small = gm[("deepseek-dense", "dense", "fp8gemm-triton", "M<=128")]
    assert (small["count"], small["wrong"]) == (1, 1) and small["geomean"] == pytest.approx(2.0)
    assert gm[("deepseek-dense", "dense", "cublas-block", "all")]["wrong"] == 0
    md = report.summary_markdown(report.make_doc(META, rows))
    assert "(2; 1 WRONG left out)" in md
    # every result of an impl wrong: no geometric mean for it
    rows[3]["diff"], rows[5]["diff"] = None, float("nan")  # (make_row stores NaN as None)
    assert all(g["impl"] != "fp8gemm-triton" or g["suite"] != "deepseek-dense"
               for g in report.geomeans(rows))
