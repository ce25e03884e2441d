"""Result files and what is made from them: the JSON form below, markdown tables with ratios and
geometric means, time over the memory floor (m-sweep), a PNG plot, the compact history of past
runs and the BENCHMARKS.md page.

    {"meta": {"gpu", "clocks", "torch", "triton", "cuda", "commit", "date"},
     "rows": [{"suite", "op", "shape": {"m", "n", "k", "groups"}, "impl",
               "us", "eager_us", "tflops", "gbs", "diff"}]}

`m` is M per group for grouped ops; `diff` is null when the output held NaN. Ratios are taken
inside one file only: every figure is a ratio against a peer measured in the same run.

The history (benchmarks/history.json) keeps one entry per past run: its date, commit, GPU, file
name and geometric means, so a result file can leave the tree once a newer run replaces it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import subprocess
from collections import defaultdict
from pathlib import Path

from .suites import (BASELINE, DENSE_LIKE_OPS, FLOOR_BYTES_PER_US, FLOOR_FIXED_US, MOE_LAYER,
                     Case)
from .timing import MIN_DEVICE_RUNS, geomean

__all__ = ["META_KEYS", "ROW_KEYS", "SHAPE_KEYS", "IMPL_ORDER", "read_clocks", "make_meta",
           "is_wrong", "make_row", "make_doc", "validate_doc", "write_json", "load_json", "ratios",
           "geomeans", "floor_us", "FLOOR_SUITES", "method_text", "markdown", "summary_markdown",
           "HISTORY_KEYS", "history_entry", "load_history", "write_history", "history_markdown",
           "page_markdown", "plot", "plot_panels"]

META_KEYS = ("gpu", "clocks", "torch", "triton", "cuda", "commit", "date")
ROW_KEYS = ("suite", "op", "shape", "impl", "us", "eager_us", "tflops", "gbs", "diff")
SHAPE_KEYS = ("m", "n", "k", "groups")
IMPL_ORDER = ("fp8gemm-cuda", "fp8gemm-triton", "fp8gemm-reference", "cublas-block",
              "cublas-tensor", "cublas-rowwise-grouped", "cublas-block-loop", "torch-bf16",
              "deepgemm")
_SUITE_ORDER = ("deepseek-dense", "deepseek-grouped", "irregular", "m-sweep", "moe-skewed",
                "backward", "backward-skewed", "moe-layer")
_OP_ORDER = ("dense", "contiguous", "offsets", "masked", "wgrad", "dgrad", "k_grouped_wgrad",
             "moe_layer")
# M buckets of the per-range geometric means: decode-sized and prefill-sized.
_SMALL_M = 128


# ---------------------------------------------------------------------------------------------
# The JSON form.


def _run(cmd: list[str]) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def _commit() -> str:
    env = os.environ.get("FP8GEMM_COMMIT", "").strip()
    if env:
        return env
    root = Path(__file__).resolve().parents[2]
    head = _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    if head is None:
        return "unknown"
    dirty = _run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"])
    return head + ("-dirty" if dirty else "")


def read_clocks() -> str:
    """SM, memory and max SM clocks from nvidia-smi (first GPU), e.g. "1980 MHz, 3201 MHz,
    1980 MHz", or "unknown"."""
    clocks = _run(["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,clocks.max.sm",
                   "--format=csv,noheader"])
    return clocks.splitlines()[0] if clocks else "unknown"


def make_meta() -> dict:
    """GPU, clocks (nvidia-smi: SM, memory, max SM), versions, commit and UTC date of this run."""
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
    return {
        "gpu": gpu,
        "clocks": f"sm, mem, max sm: {read_clocks()}",
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda,
        "commit": _commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def _num(x: float | None, digits: int) -> float | None:
    """Rounded to `digits` significant digits; None for a missing or non-finite value."""
    if x is None or not math.isfinite(x):
        return None
    return float(f"{x:.{digits}g}")


def make_row(suite: str, op: str, shape: dict, impl: str, us: float, eager_us: float,
             tflops: float, gbs: float, diff: float | None) -> dict:
    return {"suite": suite, "op": op, "shape": {k: int(shape[k]) for k in SHAPE_KEYS},
            "impl": impl, "us": _num(us, 5), "eager_us": _num(eager_us, 5),
            "tflops": _num(tflops, 4), "gbs": _num(gbs, 4), "diff": _num(diff, 3)}


def make_doc(meta: dict, rows: list[dict]) -> dict:
    return {"meta": {k: meta.get(k) for k in META_KEYS}, "rows": list(rows)}


def validate_doc(doc: object) -> dict:
    """`doc` if it has the form above; else ValueError saying what is wrong."""
    if not isinstance(doc, dict) or set(doc) != {"meta", "rows"}:
        raise ValueError(f"a result file must be {{'meta', 'rows'}}, got "
                         f"{sorted(doc) if isinstance(doc, dict) else type(doc).__name__}")
    meta, rows = doc["meta"], doc["rows"]
    if not isinstance(meta, dict) or set(meta) != set(META_KEYS):
        raise ValueError(f"meta must have exactly the keys {META_KEYS}, got "
                         f"{sorted(meta) if isinstance(meta, dict) else meta!r}")
    if not isinstance(rows, list):
        raise ValueError(f"rows must be a list, got {type(rows).__name__}")
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or set(r) != set(ROW_KEYS):
            raise ValueError(f"rows[{i}] must have exactly the keys {ROW_KEYS}, got "
                             f"{sorted(r) if isinstance(r, dict) else r!r}")
        if not isinstance(r["shape"], dict) or set(r["shape"]) != set(SHAPE_KEYS) or not all(
                isinstance(v, int) and v >= 0 for v in r["shape"].values()):
            raise ValueError(f"rows[{i}].shape must be {{m, n, k, groups}} of ints, "
                             f"got {r['shape']!r}")
        if r["impl"] not in IMPL_ORDER:
            raise ValueError(f"rows[{i}].impl must be one of {IMPL_ORDER}, got {r['impl']!r}")
        for key in ("suite", "op"):
            if not isinstance(r[key], str) or not r[key]:
                raise ValueError(f"rows[{i}].{key} must be a non-empty string, got {r[key]!r}")
        for key in ("us", "eager_us", "tflops", "gbs"):
            v = r[key]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0:
                raise ValueError(f"rows[{i}].{key} must be a positive number, got {v!r}")
        if r["diff"] is not None and not isinstance(r["diff"], (int, float)):
            raise ValueError(f"rows[{i}].diff must be a number or null (NaN), got {r['diff']!r}")
    return doc


def write_json(path: str | os.PathLike, doc: dict) -> None:
    """Write atomically, so a run that dies leaves the last complete file."""
    validate_doc(doc)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def load_json(path: str | os.PathLike) -> dict:
    with open(path) as f:
        doc = json.load(f)
    try:
        return validate_doc(doc)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None


# ---------------------------------------------------------------------------------------------
# Ratios and geometric means.


def _shape_key(r: dict) -> tuple:
    s = r["shape"]
    return (s["m"], s["n"], s["k"], s["groups"])


def ratios(rows: list[dict]) -> dict[int, float]:
    """{row index: speed-up over the op's baseline peer (baseline us / row us)} for rows whose
    shape has a baseline measurement in the same rows."""
    base = {(r["suite"], r["op"], _shape_key(r)): r["us"] for r in rows
            if r["impl"] == BASELINE.get(r["op"])}
    out = {}
    for i, r in enumerate(rows):
        b = base.get((r["suite"], r["op"], _shape_key(r)))
        if b is not None:
            out[i] = b / r["us"]
    return out


def _bucket(r: dict) -> str:
    return f"M<={_SMALL_M}" if r["shape"]["m"] <= _SMALL_M else f"M>{_SMALL_M}"


def geomeans(rows: list[dict]) -> list[dict]:
    """Geometric mean of the speed-up over the baseline, for each (suite, op, impl): over all
    shapes ("all") and over each M range. A wrong result's speed is no speed: its shapes are
    left out and counted. [{suite, op, impl, range, geomean, count, wrong}], for the groups with
    at least one right result."""
    rat = ratios(rows)
    groups: dict[tuple, list[float]] = defaultdict(list)
    wrong: dict[tuple, int] = defaultdict(int)
    for i, r in enumerate(rows):
        if i in rat:
            bad = is_wrong(r)
            for rng in ("all", _bucket(r)):
                key = (r["suite"], r["op"], r["impl"], rng)
                if bad:
                    wrong[key] += 1
                else:
                    groups[key].append(rat[i])
    out = []
    for (suite, op, impl, rng), xs in groups.items():
        out.append({"suite": suite, "op": op, "impl": impl, "range": rng,
                    "geomean": geomean(xs), "count": len(xs),
                    "wrong": wrong[(suite, op, impl, rng)]})
    return sorted(out, key=lambda g: (_order(g["suite"], _SUITE_ORDER), _order(g["op"], _OP_ORDER),
                                      _order(g["impl"], IMPL_ORDER),
                                      ("all", f"M<={_SMALL_M}", f"M>{_SMALL_M}").index(g["range"])))


def _order(x: str, seq: tuple) -> int:
    return seq.index(x) if x in seq else len(seq)


# ---------------------------------------------------------------------------------------------
# Markdown.


def _fmt(v: float | None, spec: str) -> str:
    return "nan" if v is None else format(v, spec)


def _label(op: str, shape: tuple) -> str:
    m, n, k, g = shape
    return f"{m}x{n}x{k}" if op in DENSE_LIKE_OPS + ("wgrad",) else f"{g}x{m}, {n}x{k}"


def _table(header: list[str], body: list[list[str]], align: list[str] | None = None) -> str:
    align = align or ["---"] + ["---:"] * (len(header) - 1)
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in body]
    return "\n".join(lines)


def _sections(rows: list[dict]) -> list[tuple[str, str, list[int]]]:
    """[(suite, op, row indices)] in suite/op order."""
    idx: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(rows):
        idx[(r["suite"], r["op"])].append(i)
    keys = sorted(idx, key=lambda k: (_order(k[0], _SUITE_ORDER), _order(k[1], _OP_ORDER)))
    return [(s, o, idx[(s, o)]) for s, o in keys]


# diff above which a result is marked wrong: impls computing exactly the 1x128/128x128 recipe
# land near 1e-6 (bf16 output rounding); per-tensor / per-row quantisation adds about 1.5e-3.
_EXACT_IMPLS = ("fp8gemm-cuda", "fp8gemm-triton", "fp8gemm-reference", "cublas-block",
                "cublas-block-loop", "deepgemm")
_WRONG_EXACT, _WRONG_OTHER = 1e-4, 2e-2


def is_wrong(r: dict) -> bool:
    """The row's output is NaN or too far from the float64 reference to be right."""
    if r["diff"] is None:
        return True
    # NOTE: moe_layer's reference leaves its activations unquantised: fp8 layers carry that error.
    exact = r["impl"] in _EXACT_IMPLS and r["op"] != "moe_layer"
    return not r["diff"] <= (_WRONG_EXACT if exact else _WRONG_OTHER)  # (NaN: wrong)


def _shapes(rows: list[dict], indices: list[int]) -> list[tuple]:
    """Shapes in the order they were measured (the suite's order)."""
    return list(dict.fromkeys(_shape_key(rows[i]) for i in indices))


def _impls(rows: list[dict], indices: list[int]) -> list[str]:
    present = {rows[i]["impl"] for i in indices}
    return sorted(present, key=lambda x: _order(x, IMPL_ORDER))


def _meta_table(meta: dict) -> str:
    return _table(["", ""], [[k, str(meta.get(k))] for k in META_KEYS], ["---", "---"])


def _detailed(rows: list[dict], suite: str, op: str, indices: list[int], rat: dict) -> str:
    base = BASELINE.get(op, "?")
    body = []
    order = {s: j for j, s in enumerate(_shapes(rows, indices))}
    for i in sorted(indices, key=lambda i: (order[_shape_key(rows[i])],
                                            _order(rows[i]["impl"], IMPL_ORDER))):
        r = rows[i]
        floor = floor_us(r)
        body.append([_label(op, _shape_key(r)), r["impl"], _fmt(r["us"], ".1f"),
                     _fmt(r["eager_us"], ".1f"), _fmt(r["tflops"], ".0f"), _fmt(r["gbs"], ".0f"),
                     _fmt(r["diff"], ".1e") + (" WRONG" if is_wrong(r) else ""),
                     "—" if i not in rat else f"{rat[i]:.2f}",
                     "—" if floor is None else f"{r['us'] / floor:.2f}"])
    return (f"#### {suite} / {op}: every measurement\n\n"
            + _table(["shape", "impl", "µs", "eager µs", "TFLOPS", "GB/s", "diff",
                      f"× {base}", "µs / floor"], body, ["---", "---"] + ["---:"] * 7))


# Suites whose every shape is judged against the memory floor (their own tables and plot).
FLOOR_SUITES = ("m-sweep",)


def floor_us(r: dict) -> float | None:
    """The memory floor of a row's problem (`Case.floor_us`), for M per group <= 128 (larger M
    is compute-bound and the floor says nothing) and at every M of FLOOR_SUITES, which study
    the approach to it; else None."""
    s = r["shape"]
    if s["m"] > _SMALL_M and r["suite"] not in FLOOR_SUITES:
        return None
    return Case(r["suite"], r["op"], s["m"], s["n"], s["k"], s["groups"]).floor_us


def _by_nk(rows: list[dict], indices: list[int]) -> dict[tuple[int, int], list[int]]:
    """{(N, K): row indices}, N x K in the order measured."""
    out: dict[tuple[int, int], list[int]] = {}
    for i in indices:
        out.setdefault((rows[i]["shape"]["n"], rows[i]["shape"]["k"]), []).append(i)
    return out


def _floor_detail(rows: list[dict], suite: str, op: str, indices: list[int]) -> str:
    """Shapes down: the floor, then each impl's µs / floor."""
    impls = _impls(rows, indices)
    cell = {(_shape_key(rows[i]), rows[i]["impl"]): i for i in indices}
    first = {}
    for i in indices:
        first.setdefault(_shape_key(rows[i]), i)
    body = []
    for s in _shapes(rows, indices):
        floor = floor_us(rows[first[s]])
        line = [_label(op, s), f"{floor:.1f}"]
        for impl in impls:
            i = cell.get((s, impl))
            line.append("—" if i is None else f"{rows[i]['us'] / floor:.2f}"
                        + (" WRONG" if is_wrong(rows[i]) else ""))
        body.append(line)
    return (f"#### {suite} / {op}: µs / floor (floor = bytes / "
            f"{FLOOR_BYTES_PER_US / 1e6:g} TB/s + {FLOOR_FIXED_US:g} µs)\n\n"
            + _table(["M×N×K", "floor µs"] + [f"{x} µs / floor" for x in impls], body))


def _floor_geomeans(rows: list[dict], suite: str, op: str, indices: list[int]) -> str:
    """N x K down, impls across: the geometric mean of µs / floor over M <= 128 and over every
    M (lower is better; 1 is the floor), wrong results left out."""
    impls = _impls(rows, indices)

    def cell(idx: list[int], impl: str) -> str:
        xs = {rng: [rows[i]["us"] / floor_us(rows[i]) for i in idx if rows[i]["impl"] == impl
                    and not is_wrong(rows[i])
                    and (rng == "all" or rows[i]["shape"]["m"] <= _SMALL_M)]
              for rng in ("small", "all")}
        if not xs["all"]:
            return "—"
        small = geomean(xs["small"])
        return ("—" if small is None else f"{small:.2f}") + f" / {geomean(xs['all']):.2f}"

    groups = _by_nk(rows, indices)
    body = [[f"{n}x{k}"] + [cell(idx, x) for x in impls] for (n, k), idx in groups.items()]
    body.append(["all N×K"] + [cell(indices, x) for x in impls])
    return (f"#### {suite} / {op}: geometric mean of µs / floor, M<={_SMALL_M} / every M "
            "(1 is the floor, lower is better)\n\n" + _table(["N×K"] + impls, body))


def _wide(rows: list[dict], suite: str, op: str, indices: list[int], rat: dict) -> str:
    """Shapes down, impls across: device µs and the speed-up over the baseline."""
    impls = _impls(rows, indices)
    cell: dict[tuple, int] = {(_shape_key(rows[i]), rows[i]["impl"]): i for i in indices}
    shapes = _shapes(rows, indices)
    body = []
    for s in shapes:
        line = [_label(op, s)]
        for impl in impls:
            i = cell.get((s, impl))
            if i is None:
                line.append("—")
            else:
                ratio = f" ({rat[i]:.2f}×)" if i in rat else ""
                wrong = " WRONG" if is_wrong(rows[i]) else ""
                line.append(f"{rows[i]['us']:.1f}{ratio}{wrong}")
        body.append(line)
    head = "M×N×K" if op in DENSE_LIKE_OPS + ("wgrad",) else "G×M, N×K"
    return (f"#### {suite} / {op}: device µs (× {BASELINE.get(op, '?')})\n\n"
            + _table([head] + impls, body))


def _geomean_table(rows: list[dict]) -> str:
    """One line per (suite, op, impl): the geomean over all shapes and over each M range."""
    gm = geomeans(rows)
    if not gm:
        return "(no baseline measured: no ratios)"
    ranges = ("all", f"M<={_SMALL_M}", f"M>{_SMALL_M}")
    table: dict[tuple, dict] = {}
    for g in gm:
        table.setdefault((g["suite"], g["op"], g["impl"]), {})[g["range"]] = g
    body = []
    for (suite, op, impl), by in table.items():
        cells = [f"{by[r]['geomean']:.3f} ({by[r]['count']}"
                 + (f"; {by[r]['wrong']} WRONG left out)" if by[r]["wrong"] else ")")
                 if r in by else "—" for r in ranges]
        body.append([suite, op, impl] + cells)
    return _table(["suite", "op", "impl"] + [f"{r} (shapes)" for r in ranges], body,
                  ["---"] * 3 + ["---:"] * 3)


def summary_markdown(doc: dict) -> str:
    """The short form: one wide table per suite and op, then the geometric means."""
    rows = doc["rows"]
    rat = ratios(rows)
    parts = []
    for s, o, idx in _sections(rows):
        parts.append(_wide(rows, s, o, idx, rat))
        if s in FLOOR_SUITES:
            parts.append(_floor_geomeans(rows, s, o, idx))
    parts.append("#### Geometric mean of the speed-up over the baseline peer\n\n"
                 + _geomean_table(rows))
    return "\n\n".join(parts) + "\n"


def method_text() -> str:
    """How every figure of the tables was measured and what the columns mean."""
    return (
        f"Device µs: median of >= {MIN_DEVICE_RUNS} runs, CUDA events, L2 flushed (256 MB memset) "
        "before each run, launch cost hidden behind a sleep kernel, the impls of a shape taking "
        "turns run by run. Eager µs: 50 back-to-back calls, wall clock per call. TFLOPS and GB/s "
        "use the problem's FLOPs and fewest bytes (fp8 A and B, fp32 scales, bf16 out or fp32 for "
        "the weight gradients, each once) "
        "for every impl. diff: 1 - 2Σxy/Σ(x²+y²) against a float64 product of the dequantised "
        "inputs (cublas-tensor and cublas-rowwise-grouped quantise per tensor / per row, so their "
        "diff includes that quantisation error; torch-bf16 includes bf16 rounding). "
        f"moe_layer: one rank's share of a DeepSeek-V3 expert layer (hidden {MOE_LAYER.hidden}, "
        f"expert width {MOE_LAYER.width}, top-{MOE_LAYER.topk} of {MOE_LAYER.experts} experts "
        f"over {MOE_LAYER.ranks} ranks: {MOE_LAYER.local_experts} local experts), random "
        "routing, time per layer; its notes split it into GEMMs, quantisation and the rest. "
        "µs / floor "
        f"(M <= {_SMALL_M}, and every M of {', '.join(FLOOR_SUITES)}): time over the memory "
        f"floor, bytes / {FLOOR_BYTES_PER_US / 1e6:g} TB/s + {FLOOR_FIXED_US:g} µs (the H200's "
        "measured copy bandwidth and an almost-empty kernel timed this way). WRONG: NaN, or "
        f"diff above {_WRONG_EXACT:g} "
        f"({', '.join(_EXACT_IMPLS)}) or {_WRONG_OTHER:g} (the others); the geometric means "
        "leave WRONG results out and say how many. × = speed-up over the "
        "baseline peer of the same run: "
        + ", ".join(f"{op}: {impl}" for op, impl in BASELINE.items())
        + ". Shapes are M×N×K of D [M, N] = A [M, K] . B [N, K]^T: for a layer with weight "
        "[N_out, K_in] at T tokens, wgrad (dW = dY^T . X, fp32 out, 1x128 scales on both) is "
        "N_out×K_in×T and dgrad (dX = dY . W on the transposed weight) T×K_in×N_out. Grouped "
        "shapes are G×M per group (moe-skewed: G×mean); deepseek-grouped masked groups are full "
        "(masked_m = Mmax), moe-skewed draws masked_m per expert; k_grouped_wgrad is G×M, N×K "
        "with K the tokens of each expert (backward-skewed: their mean; some experts get none).")


def markdown(docs: list[tuple[str, dict]], title: str | None = None,
             notes: list[str] | None = None, image: str | None = None) -> str:
    """Every result file in full: its meta, detailed tables, then the summary (wide tables and
    geometric means) last. `docs` is [(name, doc)]; `image` a link to the plot of the last."""
    out = [f"# {title}\n"] if title else []
    out.append(method_text() + "\n")
    if image:
        out.append(f"![speed-up over the baseline peer, and µs / floor against M]({image})\n")
    for name, doc in docs:
        rows = doc["rows"]
        rat = ratios(rows)
        out.append(f"## {name}\n\n" + _meta_table(doc["meta"]) + "\n")
        for s, o, idx in _sections(rows):
            out.append(_detailed(rows, s, o, idx, rat) + "\n")
            if s in FLOOR_SUITES:
                out.append(_floor_detail(rows, s, o, idx) + "\n")
        if notes:
            out.append("#### Notes\n\n" + "\n".join(f"- {n}" for n in notes) + "\n")
        out.append(f"### Summary: {name}\n\n" + summary_markdown(doc))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# The history of runs and the BENCHMARKS.md page.

HISTORY_KEYS = ("date", "commit", "gpu", "file", "geomeans")
# Geometric means the page's history table shows: every fp8gemm impl over all shapes, and the
# DeepSeek dense suite per M range (decode and prefill sizes behave differently).
_HISTORY_RANGED_SUITES = ("deepseek-dense",)
# Suites whose per-shape table the page shows (the others are in the result file's markdown).
_PAGE_SUITES = ("deepseek-dense", "deepseek-grouped", "backward", "backward-skewed")


def history_entry(name: str, doc: dict) -> dict:
    """One run in the history: when, which commit, which GPU, the file it came from and its
    geometric means, keyed "suite/op/impl/range" (a range only when it holds fewer shapes than
    "all"; not the baselines, which are 1 by definition)."""
    gm = geomeans(doc["rows"])
    total = {(g["suite"], g["op"], g["impl"]): g["count"] for g in gm if g["range"] == "all"}
    means = {f"{g['suite']}/{g['op']}/{g['impl']}/{g['range']}": round(g["geomean"], 4)
             for g in gm if g["impl"] != BASELINE.get(g["op"])
             and (g["range"] == "all" or g["count"] < total[(g["suite"], g["op"], g["impl"])])}
    meta = doc["meta"]
    return {"date": meta["date"], "commit": meta["commit"], "gpu": meta["gpu"], "file": name,
            "geomeans": means}


def load_history(path: str | os.PathLike) -> list[dict]:
    """The entries of a history file; [] when there is none."""
    path = Path(path)
    if not path.exists():
        return []
    doc = json.loads(path.read_text())
    runs = doc.get("runs") if isinstance(doc, dict) else None
    if not isinstance(runs, list) or any(
            not isinstance(e, dict) or set(e) != set(HISTORY_KEYS) for e in runs):
        keys = ", ".join(HISTORY_KEYS)
        raise ValueError(f"{path}: a history file must be {{'runs': [{{{keys}}}]}}")
    return runs


def write_history(path: str | os.PathLike, entries: list[dict]) -> None:
    """Oldest run first, one run per line; written atomically."""
    entries = sorted(entries, key=lambda e: (str(e["date"]), e["file"]))
    lines = [json.dumps({k: e[k] for k in HISTORY_KEYS}, ensure_ascii=False) for e in entries]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text('{"runs": [\n' + ",\n".join(lines) + "\n]}\n")
    os.replace(tmp, path)


def _history_columns(entries: list[dict]) -> list[tuple[str, str, str, str]]:
    keys = {tuple(k.split("/")) for e in entries for k in e["geomeans"]}
    cols = [k for k in keys if k[2].startswith("fp8gemm-")
            and (k[3] == "all" or k[0] in _HISTORY_RANGED_SUITES)]
    ranges = ("all", f"M<={_SMALL_M}", f"M>{_SMALL_M}")
    return sorted(cols, key=lambda k: (_order(k[0], _SUITE_ORDER), _order(k[1], _OP_ORDER),
                                       _order(k[2], IMPL_ORDER), _order(k[3], ranges)))


def history_markdown(entries: list[dict]) -> str:
    """Newest run first: date, commit, GPU and the geometric mean of each fp8gemm impl's
    speed-up over its baseline peer."""
    cols = _history_columns(entries)
    head = ["date", "commit", "gpu"]
    for suite, op, impl, rng in cols:
        where = suite if op == "dense" else op
        head.append(f"{where} {impl.removeprefix('fp8gemm-')}"
                    + ("" if rng == "all" else f" {rng}"))
    body = []
    for e in sorted(entries, key=lambda e: (str(e["date"]), e["file"]), reverse=True):
        line = [str(e["date"]).replace("T", " ")[:16], str(e["commit"])[:7], str(e["gpu"])]
        for col in cols:
            v = e["geomeans"].get("/".join(col))
            line.append("—" if v is None else f"{v:.3f}")
        body.append(line)
    return _table(head, body, ["---"] * 3 + ["---:"] * len(cols))


def page_markdown(current: list[tuple[str, dict, str | None]], history: list[dict],
                  title: str = "fp8gemm benchmarks") -> str:
    """BENCHMARKS.md. `current` is [(link to the result file, its doc, link to its plot or
    None)], one per GPU; `history` the recorded runs (runs of `current` not recorded yet are
    added). For each current run: its meta, plot, geometric means, the per-shape tables of
    _PAGE_SUITES and the µs / floor means of FLOOR_SUITES; then the history table."""
    out = [f"# {title}\n", method_text() + "\n"]
    for link, doc, png in current:
        name = Path(link).name
        rows = doc["rows"]
        rat = ratios(rows)
        out.append(f"## {name}\n\nThe current run on {doc['meta']['gpu']}. Every measurement, "
                   f"with eager µs, diff and µs / floor, is in [{name}]({link}); "
                   f"`python -m fp8gemm.bench --from-json {link} --markdown FILE` tables them."
                   "\n\n" + _meta_table(doc["meta"]) + "\n")
        if png:
            out.append(f"![speed-up over the baseline peer]({png})\n")
        out.append("#### Geometric mean of the speed-up over the baseline peer\n\n"
                   + _geomean_table(rows) + "\n")
        for s, o, idx in _sections(rows):
            if s in _PAGE_SUITES:
                out.append(_wide(rows, s, o, idx, rat) + "\n")
            if s in FLOOR_SUITES:
                out.append(_floor_geomeans(rows, s, o, idx) + "\n")
    recorded = {e["file"] for e in history}
    entries = list(history) + [history_entry(Path(link).name, doc) for link, doc, _ in current
                               if Path(link).name not in recorded]
    out.append("## History\n\nGeometric mean of each fp8gemm backend's speed-up over the "
               "baseline peer of its own run, one line per run.\n\n"
               + history_markdown(entries) + "\n")
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# Plot.


def plot(doc: dict, path: str | os.PathLike) -> str | None:
    """A PNG: the speed-up over the baseline, one bar panel per suite and op; for FLOOR_SUITES,
    µs / floor against M instead, one panel per N x K with a line per impl. Returns None when
    written, else why not (matplotlib missing, nothing to plot)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        return f"no plot: matplotlib is not importable ({e})"
    rows = doc["rows"]
    rat = ratios(rows)
    bars, lines = plot_panels(rows)
    if not bars and not lines:
        return "no plot: no shape has its baseline measured, and none is of a floor suite"
    cols = 3
    line_rows = -(-len(lines) // cols)
    height = 3.6 * len(bars) + 3.2 * line_rows
    fig = plt.figure(figsize=(14, height))
    grid = fig.add_gridspec(len(bars) + line_rows, cols)
    for r, (suite, op, idx) in enumerate(bars):
        _bar_panel(fig.add_subplot(grid[r, :]), rows, rat, suite, op, idx)
    for j, (suite, op, (n, k), idx) in enumerate(lines):
        ax = fig.add_subplot(grid[len(bars) + j // cols, j % cols])
        _floor_panel(ax, rows, suite, op, n, k, idx, legend=j == 0)
    meta = doc["meta"]
    fig.suptitle(f"fp8gemm on {meta.get('gpu')}, torch {meta.get('torch')}, "
                 f"commit {str(meta.get('commit'))[:12]}, {meta.get('date')}", fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.3 / height))  # (room for the suptitle)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def plot_panels(rows: list[dict]) -> tuple[list[tuple], list[tuple]]:
    """What `plot` draws: ([(suite, op, row indices with a ratio)] as bar panels,
    [(suite, op, (N, K), row indices)] as µs / floor panels, FLOOR_SUITES only)."""
    rat = ratios(rows)
    bars = [(s, o, [i for i in idx if i in rat]) for s, o, idx in _sections(rows)
            if s not in FLOOR_SUITES]
    lines = [(s, o, nk, idx) for s, o, sec in _sections(rows) if s in FLOOR_SUITES
             for nk, idx in _by_nk(rows, sec).items()]
    return [x for x in bars if x[2]], lines


def _bar_panel(ax, rows: list[dict], rat: dict, suite: str, op: str, idx: list[int]) -> None:
    impls = _impls(rows, idx)
    shapes = _shapes(rows, idx)
    width = 0.8 / max(1, len(impls))
    for j, impl in enumerate(impls):
        xs, ys = [], []
        for x, s in enumerate(shapes):
            for i in idx:
                if rows[i]["impl"] == impl and _shape_key(rows[i]) == s:
                    xs.append(x + (j - (len(impls) - 1) / 2) * width)
                    ys.append(rat[i])
        ax.bar(xs, ys, width, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(shapes)))
    ax.set_xticklabels([_label(op, s) for s in shapes], rotation=30, ha="right", fontsize=7)
    ax.set_ylabel(f"× {BASELINE.get(op)}")
    ax.set_title(f"{suite} / {op}: speed-up over {BASELINE.get(op)} (higher is better)")
    ax.legend(fontsize=7, ncol=len(impls))


def _floor_panel(ax, rows: list[dict], suite: str, op: str, n: int, k: int, idx: list[int],
                 legend: bool) -> None:
    for impl in _impls(rows, idx):
        pts = sorted((rows[i]["shape"]["m"], rows[i]["us"] / floor_us(rows[i])) for i in idx
                     if rows[i]["impl"] == impl)
        ax.plot([m for m, _ in pts], [y for _, y in pts], marker="o", markersize=3,
                linewidth=1, label=impl)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log", base=2)
    ms = sorted({rows[i]["shape"]["m"] for i in idx})
    ax.set_xticks(ms, [str(m) if m & (m - 1) == 0 else "" for m in ms])  # label powers of 2
    ax.minorticks_off()
    ax.set_xlabel("M", fontsize=8)
    ax.set_ylabel("µs / floor", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(f"{suite} / {op}: N×K = {n}x{k} (lower is better)", fontsize=8)
    if legend:
        ax.legend(fontsize=6)
