"""Backend selection, FP8GEMM_BACKEND, FP8GEMM_PRINT_CONFIGS, and the problem description
(scale shape -> recipe) that selection keys on."""

from __future__ import annotations

import pytest
import torch

import fp8gemm
from fp8gemm import backends
from fp8gemm.ops import _common
from fp8gemm.problem import GemmKind, GemmProblem, Recipe
from helpers import E4M3, E5M2, make_a, make_b, padded_view

M, N, K = 37, 200, 320
A = make_a(M, K, "1x128")
B = make_b(N, K, "128x128")


@pytest.fixture
def fresh(clean_env, monkeypatch):
    """No FP8GEMM_* variables and an empty choice cache (restored afterwards)."""
    monkeypatch.setattr(backends, "_chosen", {})
    return clean_env


def problem(m=M, kind=GemmKind.DENSE):
    return GemmProblem(kind, m, N, K, 1, E4M3, E4M3, Recipe.GROUP, Recipe.BLOCK, torch.bfloat16)


def test_auto_on_cpu_picks_reference(fresh):
    mod = backends.select_backend(problem(), torch.device("cpu"))
    assert mod.NAME == "reference"
    out = fp8gemm.fp8_gemm_nt(A, B)  # backend="auto" through the op
    assert out.shape == (M, N) and torch.isfinite(out).all()


def test_env_overrides_auto(fresh):
    fresh.setenv("FP8GEMM_BACKEND", "reference")
    assert backends.select_backend(problem(), torch.device("cpu")).NAME == "reference"
    # a backend that cannot run here: auto would have fallen back, the override must not
    fresh.setenv("FP8GEMM_BACKEND", "cuda")
    with pytest.raises(ValueError, match=r"^backend='cuda' cannot run dense M=37"):
        fp8gemm.fp8_gemm_nt(A, B)
    with pytest.raises(ValueError, match=r"^backend='cuda' cannot run"):
        fp8gemm.m_grouped_fp8_gemm_nt_masked(make_a(M, K, "1x128", lead=2),
                                             make_b(N, K, "128x128", groups=2), None,
                                             torch.tensor([3, 5], dtype=torch.int32))
    # an explicit backend= argument wins over the variable
    assert fp8gemm.fp8_gemm_nt(A, B, backend="reference").shape == (M, N)
    fresh.setenv("FP8GEMM_BACKEND", "fastest")
    with pytest.raises(ValueError, match=r"^FP8GEMM_BACKEND must be one of .*got 'fastest'"):
        fp8gemm.fp8_gemm_nt(A, B)
    fresh.setenv("FP8GEMM_BACKEND", "auto")
    assert fp8gemm.fp8_gemm_nt(A, B).shape == (M, N)


def test_explicit_backend_that_cannot_run(fresh):
    with pytest.raises(ValueError, match=r"^backend='cuda' cannot run dense .*: "):
        backends.select_backend(problem(), torch.device("cpu"), "cuda")
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        backends.select_backend(problem(), torch.device("cpu"), "Reference ")
    with pytest.raises(ValueError, match=r"^backend must be one of"):
        backends.get_backend("cublas")


def test_backend_modules_keep_the_contract():
    """Every backend that imports here keeps the contract of backends/__init__.py (a function for
    each kind its supports() accepts); one that does not import says why."""
    for name in backends.NAMES:
        mod = backends.get_backend(name)
        if mod is None:
            assert backends.load_error(name)
            continue
        assert mod.NAME == name
        assert callable(mod.is_available) and callable(mod.supports), name
        for kind, f in ((GemmKind.DENSE, "fp8_gemm_nt"),
                        (GemmKind.CONTIGUOUS, "m_grouped_fp8_gemm_nt_contiguous"),
                        (GemmKind.OFFSETS, "m_grouped_fp8_gemm_nt_offsets"),
                        (GemmKind.MASKED, "m_grouped_fp8_gemm_nt_masked")):
            # a kind's function may be absent only where supports() refuses that kind
            assert callable(getattr(mod, f, None)) or mod.supports(problem(kind=kind)), (name, f)
    ref = backends.get_backend("reference")
    assert ref.is_available(torch.device("cpu")) and ref.supports(problem()) is None


def test_print_configs_once_per_new_problem(fresh, capsys):
    fresh.setenv("FP8GEMM_PRINT_CONFIGS", "1")
    fp8gemm.fp8_gemm_nt(A, B)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1
    assert "dense M=37 N=200 K=320" in lines[0] and "backend reference" in lines[0]
    assert "A=e4m3/1x128 B=e4m3/128x128 -> bf16" in lines[0]
    fp8gemm.fp8_gemm_nt(A, B)  # the same problem again: silent
    fp8gemm.fp8_gemm_nt(A, B, out=torch.empty(M, N, dtype=torch.bfloat16))
    assert capsys.readouterr().out == ""
    fp8gemm.fp8_gemm_nt(make_a(M + 1, K, "1x128"), B)  # a new shape
    fp8gemm.fp8_gemm_nt(A, B, out_dtype=torch.float32)  # a new output dtype
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and "M=38" in lines[0] and "-> fp32" in lines[1]


def test_no_print_by_default(fresh, capsys):
    fp8gemm.fp8_gemm_nt(A, B)
    fp8gemm.m_grouped_fp8_gemm_nt_offsets(A, make_b(N, K, "128x128", groups=2), None,
                                          torch.tensor([0, 10, M], dtype=torch.int32))
    assert capsys.readouterr().out == ""


def test_print_configs_grouped(fresh, capsys):
    fresh.setenv("FP8GEMM_PRINT_CONFIGS", "1")
    a = make_a(M, K, "row", E5M2, lead=3)
    fp8gemm.m_grouped_fp8_gemm_nt_masked(a, make_b(N, K, "row", groups=3), None,
                                         torch.tensor([1, 2, 3], dtype=torch.int32), 4)
    line, = capsys.readouterr().out.splitlines()
    assert "masked G=3 M=37 N=200 K=320 expected_m=4" in line
    assert "A=e5m2/row B=e4m3/row" in line and "backend reference" in line


# ---------------------------------------------------------------------------------------------
# The scale's shape says the recipe


@pytest.mark.parametrize("shape,recipe,norm", [
    ((), Recipe.TENSOR, (1,)), ((1,), Recipe.TENSOR, (1,)),
    ((M,), Recipe.ROW, (M,)), ((M, 1), Recipe.ROW, (M,)),
    ((M, 3), Recipe.GROUP, (M, 3)),
])
def test_a_scale_recipes(shape, recipe, norm):
    r, s = _common.resolve_a_scale("a", torch.ones(shape), (), M, K, torch.device("cpu"))
    assert r is recipe and tuple(s.shape) == norm


@pytest.mark.parametrize("shape,recipe,norm", [
    ((), Recipe.TENSOR, (1,)), ((1,), Recipe.TENSOR, (1,)),
    ((N,), Recipe.ROW, (N,)), ((N, 1), Recipe.ROW, (N,)),
    ((2, 3), Recipe.BLOCK, (2, 3)), ((N, 3), Recipe.GROUP, (N, 3)),
])
def test_b_scale_recipes(shape, recipe, norm):
    r, s = _common.resolve_b_scale("b", torch.ones(shape), (), N, K, torch.device("cpu"))
    assert r is recipe and tuple(s.shape) == norm


@pytest.mark.parametrize("shape,recipe,norm", [
    ((), Recipe.TENSOR, (4,)), ((1,), Recipe.TENSOR, (4,)), ((4,), Recipe.TENSOR, (4,)),
    ((4, 1), Recipe.TENSOR, (4,)), ((4, N), Recipe.ROW, (4, N)), ((4, N, 1), Recipe.ROW, (4, N)),
    ((4, 2, 3), Recipe.BLOCK, (4, 2, 3)), ((4, N, 3), Recipe.GROUP, (4, N, 3)),
])
def test_grouped_b_scale_recipes(shape, recipe, norm):
    r, s = _common.resolve_b_scale("b", torch.ones(shape), (4,), N, K, torch.device("cpu"))
    assert r is recipe and tuple(s.shape) == norm


def test_problem_is_a_readable_hashable_key():
    p, q = problem(), problem()
    assert p == q and hash(p) == hash(q) and len({p, q, problem(m=1)}) == 2
    with pytest.raises(AttributeError):
        p.m = 5  # frozen
    assert str(p) == "dense M=37 N=200 K=320 A=e4m3/1x128 B=e4m3/128x128 -> bf16"


# ---------------------------------------------------------------------------------------------
# What the ops layer hands a backend (the contract in backends/__init__.py)


_NORMALISED = {  # recipe -> normalised scale shape (without a leading [G]) for rows x K
    Recipe.TENSOR: lambda rows, k: (1,), Recipe.ROW: lambda rows, k: (rows,),
    Recipe.GROUP: lambda rows, k: (rows, -(-k // 128)),
    Recipe.BLOCK: lambda rows, k: (-(-rows // 128), -(-k // 128)),
}


class _SpyBackend:
    """Checks every call against the backend contract, then runs the reference."""

    NAME = "spy"

    def __init__(self):
        self.ref, self.calls = backends.get_backend("reference"), []

    def _check(self, a, sa, b, sb, out, idx, problem):
        for t in (a, b, out):
            assert t.is_contiguous()
        for s in (sa, sb):
            assert s.dtype == torch.float32
        g = problem.groups
        masked = problem.kind is GemmKind.MASKED
        a_shape = _NORMALISED[problem.a_recipe](problem.m, problem.k)
        if masked and problem.a_recipe is not Recipe.TENSOR:
            a_shape = (g,) + a_shape
        b_shape = _NORMALISED[problem.b_recipe](problem.n, problem.k)
        if problem.kind is not GemmKind.DENSE:
            b_shape = (g,) if problem.b_recipe is Recipe.TENSOR else (g,) + b_shape
        assert tuple(sa.shape) == a_shape and tuple(sb.shape) == b_shape
        if idx is not None:
            assert idx.dtype == torch.int32 and idx.is_contiguous()
        assert min(problem.m, problem.n, problem.k) > 0
        self.calls.append(problem.kind)

    def fp8_gemm_nt(self, a, sa, b, sb, out, c, problem):
        self._check(a, sa, b, sb, out, None, problem)
        self.ref.fp8_gemm_nt(a, sa, b, sb, out, c, problem)

    def m_grouped_fp8_gemm_nt_contiguous(self, a, sa, b, sb, out, idx, problem):
        self._check(a, sa, b, sb, out, idx, problem)
        self.ref.m_grouped_fp8_gemm_nt_contiguous(a, sa, b, sb, out, idx, problem)

    def m_grouped_fp8_gemm_nt_offsets(self, a, sa, b, sb, out, idx, problem):
        self._check(a, sa, b, sb, out, idx, problem)
        self.ref.m_grouped_fp8_gemm_nt_offsets(a, sa, b, sb, out, idx, problem)

    def m_grouped_fp8_gemm_nt_masked(self, a, sa, b, sb, out, idx, problem):
        self._check(a, sa, b, sb, out, idx, problem)
        self.ref.m_grouped_fp8_gemm_nt_masked(a, sa, b, sb, out, idx, problem)


@pytest.mark.parametrize("ra", ("tensor", "row", "1x128"))
@pytest.mark.parametrize("rb", ("tensor", "row", "128x128", "1x128"))
def test_backends_get_normalised_contiguous_inputs(ra, rb, monkeypatch):
    """Strided a/b/out/index tensors and every scale spelling reach the backend as the contract
    says: contiguous a, b, out; float32 scales in Recipe's normalised shapes; contiguous int32
    indices; no empty dimension."""
    import fp8gemm.ops.gemm as gemm_mod
    import fp8gemm.ops.grouped as grouped_mod

    spy = _SpyBackend()
    monkeypatch.setattr(gemm_mod, "select_backend", lambda *args: spy)
    monkeypatch.setattr(grouped_mod, "select_backend", lambda *args: spy)
    g = 3
    a, b = make_a(M, K, ra), make_b(N, K, rb)
    # other spellings of the same scales: [] for per-tensor, [M, 1] for per-row A
    respell = {"tensor": lambda s: s.reshape(()), "row": lambda s: s.reshape(-1, 1)}
    a = (padded_view(a[0]), respell.get(ra, lambda s: s)(a[1]))
    b = (padded_view(b[0]), b[1].reshape(()) if rb == "tensor" else b[1])
    out = padded_view(torch.zeros(M, N))
    fp8gemm.fp8_gemm_nt(a, b, out)
    bg = make_b(N, K, rb, groups=g)
    bg = (padded_view(bg[0]), bg[1])
    idx = torch.zeros(2 * M, dtype=torch.int32)[::2]  # a strided view
    fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a, bg, out, idx)
    offs = torch.tensor([0, 9, 5, 9, 5, 9, M], dtype=torch.int32)[::2]  # [0, 5, 5, M], strided
    fp8gemm.m_grouped_fp8_gemm_nt_offsets(a, bg, out, offs)
    am = make_a(M, K, ra, lead=g)
    mm = torch.tensor([1, 9, 2, 9, 3, 9], dtype=torch.int32)[::2]
    fp8gemm.m_grouped_fp8_gemm_nt_masked((padded_view(am[0]), am[1]), bg,
                                         padded_view(torch.zeros(g, M, N)), mm)
    assert spy.calls == [GemmKind.DENSE, GemmKind.CONTIGUOUS, GemmKind.OFFSETS, GemmKind.MASKED]
