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


def test_all_suite_and_unknown_suite():
    assert len(suites.suite_cases("all")) == 18 + 10 + 24
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
        doc["rows"][0]["impl"] = "deepgemm"
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
    with pytest.raises(SystemExit):
        parse_args(["--impl", "deepgemm"])
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
        for fn, host_us in calls:
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

    g1 = (dequantize(data.a[16:], data.sa[16:], Recipe.GROUP, torch.float64)
          @ dequantize(data.b[1], data.sb[1], Recipe.BLOCK, torch.float64).T)
    assert torch.allclose(ref[16:], g1)
    assert data.m_indices.tolist() == [0] * 16 + [1] * 16
    assert math.isfinite(float(ref.abs().sum())) and ref.abs().sum() > 0


def test_wrong_results_are_marked():
    rows = [_row(impl="cublas-block", us=25.0, diff=2e-2), _row(impl="fp8gemm-triton", us=20.0),
            _row(impl="cublas-tensor", us=12.0, diff=1.4e-3), _row(impl="torch-bf16", diff=None)]
    assert [report.is_wrong(r) for r in rows] == [True, False, False, True]
    text = report.summary_markdown(report.make_doc(META, rows))
    assert "25.0 (1.00×) WRONG" in text and "20.0 (1.25×) |" in text
