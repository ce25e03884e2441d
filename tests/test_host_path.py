"""The host path of warm fp8_gemm_nt and grouped calls on the CUDA backend, checked on the CPU.

The CUDA backend runs on CPU tensors with its driver parts stood in for (kernel build, tensor-map
encoding, stream queries, and the launch, which records what it was given), so these tests check
the Python around the launch: the ops fast path hands warm calls to the backend's launcher, which
launches from the argument packs keyed by data pointers and falls back to the backend's general
path for anything else (new pointers, misaligned pointers, scales to convert, set_num_sms).
"""

import contextlib

import pytest
import torch

import fp8gemm
import fp8gemm.backends.cuda as cuda_backend
from fp8gemm import layout
from fp8gemm.backends.cuda import sm90_fp8_gemm_1d2d as g
from fp8gemm.backends.family import DeviceFacts
from fp8gemm.jit import driver
from fp8gemm.ops import _common, gemm, grouped

M, N, K = 64, 256, 384


class FakeKernel:
    def __init__(self, events):
        self.events = events

    def set_max_dynamic_smem(self, nbytes, device_index):
        pass

    def launch(self, config, stream, params):
        self.events.append(("launch", config, stream, params))


class Backend:
    """What the fixture stood in for, and what the CUDA backend did."""

    def __init__(self):
        self.events = []  # ("launch", launch config, stream, pack), device switches
        self.general_calls = 0  # Sm90Plan.run: the backend's general path
        self.selections = 0  # select_backend in the ops layer: its full path
        self.stream_queries = 0
        self.current_device = None  # CPU tensors: device index None

    def launches(self):
        return [e for e in self.events if e[0] == "launch"]


@pytest.fixture
def backend(monkeypatch):
    be = Backend()
    monkeypatch.setattr(_common, "values_unchecked", lambda t: True)
    monkeypatch.delenv("FP8GEMM_BACKEND", raising=False)
    monkeypatch.delenv("FP8GEMM_CHECK_VALUES", raising=False)
    monkeypatch.setattr(gemm, "_plans", {})
    monkeypatch.setattr(grouped, "_plans", {})
    monkeypatch.setattr(g, "_plans", {})
    monkeypatch.setattr(layout._SmCount, "override", None)
    monkeypatch.setattr(cuda_backend, "is_available", lambda device: True)
    monkeypatch.setattr(DeviceFacts, "of", staticmethod(lambda device: DeviceFacts(
        "H200", (9, 0), num_sms=layout._SmCount.override or 132, smem_per_block=232448)))
    monkeypatch.setattr(g.jit, "build", lambda *args, **kw: FakeKernel(be.events))

    class Lib:
        cuTensorMapEncodeTiled = staticmethod(lambda *args: 0)

    monkeypatch.setattr(driver, "lib", lambda: Lib)

    def raw_stream(index):
        be.stream_queries += 1
        return 0  # torch's default stream: launches run in the current device's context

    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", raw_stream, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: be.current_device, raising=False)
    general = g.Sm90Plan.run

    def counting(self, *args):
        be.general_calls += 1
        return general(self, *args)

    monkeypatch.setattr(g.Sm90Plan, "run", counting)
    select = grouped.select_backend

    def selecting(*args, **kw):
        be.selections += 1
        return select(*args, **kw)

    monkeypatch.setattr(grouped, "select_backend", selecting)
    return be


def operands(m=M, n=N, k=K):
    a, sa = fp8gemm.quantize_per_token(torch.randn(m, k))  # sa column-major, as the kernel reads
    b, sb = fp8gemm.quantize_per_block(torch.randn(n, k))
    return (a, sa), (b, sb), torch.empty(m, n, dtype=torch.bfloat16)


def gemm_cuda(a, b, out=None):
    return fp8gemm.fp8_gemm_nt(a, b, out, backend="cuda")


def test_warm_calls_launch_from_the_pack_cache(backend):
    a, b, out = operands()
    for _ in range(3):
        assert gemm_cuda(a, b, out) is out
    (plan,) = g._plans.values()
    launches = backend.launches()
    assert len(launches) == 3 and backend.general_calls == 1 and len(plan.packs) == 1
    assert all(cfg is plan.launch and pack is launches[0][3] for _, cfg, _, pack in launches)
    assert backend.stream_queries == 3  # once per call


def test_new_pointers_get_new_packs(backend):
    a, b, out = operands()
    out2 = torch.empty_like(out)
    a2 = (a[0].clone(), a[1])
    gemm_cuda(a, b, out)
    gemm_cuda(a, b, out2)
    gemm_cuda(a2, b, out)
    gemm_cuda(a, b, out)  # the first pointers again: the first pack
    (plan,) = g._plans.values()
    packs = [e[3] for e in backend.launches()]
    assert len(plan.packs) == 3 and len(set(map(id, packs[:3]))) == 3 and packs[3] is packs[0]
    assert backend.general_calls == 3


def test_out_none_allocates_on_the_fast_path(backend):
    a, b, _ = operands()
    ys = [gemm_cuda(a, b) for _ in range(3)]
    assert all(y.shape == (M, N) and y.dtype == torch.bfloat16 for y in ys)
    assert len(backend.launches()) == 3 and len(gemm._plans) == 1


def test_misaligned_pointers_take_the_copying_path_every_call(backend):
    a, b, _ = operands()
    buf = torch.zeros(M * N + 8, dtype=torch.bfloat16)
    out_odd = buf[1:1 + M * N].view(M, N)  # contiguous, 2 bytes past a 16-byte boundary
    assert out_odd.data_ptr() % 16
    for _ in range(3):
        gemm_cuda(a, b, out_odd)
    assert len(backend.launches()) == 3 and backend.general_calls == 3
    (plan,) = g._plans.values()
    assert all(key[4] % 16 == 0 for key in plan.packs)  # packs hold the aligned copy's pointer


def test_row_major_a_scales_are_converted_every_call(backend):
    (a_t, sa), b, out = operands()
    sa_rm = sa.contiguous()
    for _ in range(2):
        gemm_cuda((a_t, sa_rm), b, out)
    assert len(backend.launches()) == 2 and backend.general_calls == 2


def test_set_num_sms_rebuilds_the_plan_of_a_warm_signature(backend, monkeypatch):
    a, b, out = operands(m=4096, n=1024)  # 32 x 8 tiles or more: the grid is the SM count
    gemm_cuda(a, b, out)
    first = next(iter(g._plans.values()))
    monkeypatch.setattr(layout._SmCount, "override", 66)
    gemm_cuda(a, b, out)
    gemm_cuda(a, b, out)
    second = list(g._plans.values())[-1]
    assert second is not first and second.cfg.grid <= 66 < first.cfg.grid
    assert [e[1] for e in backend.launches()] == [first.launch, second.launch, second.launch]
    assert backend.general_calls == 2  # the call after set_num_sms, not the one after that


def test_launch_switches_to_the_tensors_device_for_the_default_stream(backend, monkeypatch):
    @contextlib.contextmanager
    def fake_device(index):
        backend.events.append(("enter", index))
        yield
        backend.events.append(("exit", index))

    monkeypatch.setattr(torch.cuda, "device", fake_device)
    a, b, out = operands()
    gemm_cuda(a, b, out)
    backend.current_device = 1  # another device made current; the tensors' index is None
    gemm_cuda(a, b, out)
    kinds = [e[0] for e in backend.events]
    assert kinds == ["launch", "enter", "launch", "exit"] and backend.events[1] == ("enter", None)


def test_one_key_holds_signatures_of_equal_sizes(backend):
    """The plan key has element counts, not shapes: [64, 384] x [256, 384] and [32, 768] x
    [128, 768] share it, and the metadata guard tells them apart."""
    x = operands(64, 256, 384)
    y = operands(32, 128, 768)
    for _ in range(2):
        gemm_cuda(*x)
        gemm_cuda(*y)
    assert len(gemm._plans) == 1 and len(next(iter(gemm._plans.values()))) == 2
    assert backend.general_calls == 2
    by_shape = {(p.m, p.n, p.k): p.launch for p in g._plans.values()}
    expected = [by_shape[(64, 256, 384)], by_shape[(32, 128, 768)]] * 2
    assert [e[1] for e in backend.launches()] == expected


def test_a_launch_error_on_a_warm_call_is_raised_not_retried(backend, monkeypatch):
    a, b, out = operands()
    gemm_cuda(a, b, out)

    def failing(self, config, stream, params):
        raise driver.DriverError("cuLaunchKernelEx failed")

    monkeypatch.setattr(FakeKernel, "launch", failing)
    with pytest.raises(driver.DriverError):
        gemm_cuda(a, b, out)
    assert backend.general_calls == 1


@pytest.mark.parametrize("torch_guard", [True, False], ids=["torch", "python"])
def test_metadata_guard(torch_guard, monkeypatch):
    if not torch_guard:
        monkeypatch.setattr(_common, "_TensorGuards", None)
    elif _common._TensorGuards is None:
        pytest.skip("this torch has no torch._C._dynamo.guards.TensorGuards")
    x = torch.empty(8, 16)
    s = torch.empty(4, 8).t()
    check = _common.metadata_guard((x, s))
    assert check(x, s) and check(torch.empty(8, 16), torch.empty(4, 8).t())
    assert not check(x, s.contiguous())  # strides
    assert not check(x[:4], s)  # shape
    assert not check(x.double(), s)  # dtype
    assert not check(x.to("meta"), s)  # device


def test_fast_path_with_the_python_guard(backend, monkeypatch):
    monkeypatch.setattr(_common, "_TensorGuards", None)
    (a_t, sa), b, out = operands()
    for _ in range(2):
        gemm_cuda((a_t, sa), b, out)
    gemm_cuda((a_t, sa.contiguous()), b, out)  # same sizes, other strides: the full path
    assert len(backend.launches()) == 3 and backend.general_calls == 2
    assert len(gemm._plans) == 1 and len(next(iter(gemm._plans.values()))) == 2


# --- grouped ops ----------------------------------------------------------------------------------
G = 4
KINDS = ("contiguous", "offsets", "masked")


class Grouped:
    """Operands of one grouped kind and a call of its op on the CUDA backend. Masked groups hold
    384 rows by default: past the 256 expected rows of the masked small-M family, so that the
    grouped 1D2D family, whose plans these tests read, takes them."""

    def __init__(self, kind, groups=G, rows=None, n=N, k=K):
        rows = rows or (384 if kind == "masked" else 128)
        self.kind = kind
        self.b = fp8gemm.quantize_per_block(torch.randn(groups, n, k))
        if kind == "masked":
            self.a = fp8gemm.quantize_per_token(torch.randn(groups, rows, k))
            self.index = torch.full((groups,), rows // 2, dtype=torch.int32)
            self.out_shape = (groups, rows, n)
        else:
            self.a = fp8gemm.quantize_per_token(torch.randn(groups * rows, k))
            if kind == "contiguous":
                self.index = torch.arange(groups * rows, dtype=torch.int32) // rows
            else:
                self.index = torch.arange(groups + 1, dtype=torch.int32) * rows
            self.out_shape = (groups * rows, n)

    def out(self):
        return torch.empty(self.out_shape, dtype=torch.bfloat16)

    def __call__(self, out=None, a=None, index=None, expected_m=None):
        a = self.a if a is None else a
        index = self.index if index is None else index
        if self.kind == "contiguous":
            return fp8gemm.m_grouped_fp8_gemm_nt_contiguous(a, self.b, out, index, backend="cuda")
        if self.kind == "offsets":
            return fp8gemm.m_grouped_fp8_gemm_nt_offsets(a, self.b, out, index, backend="cuda")
        return fp8gemm.m_grouped_fp8_gemm_nt_masked(a, self.b, out, index, expected_m,
                                                    backend="cuda")


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_warm_calls_launch_from_the_pack_cache(backend, kind):
    call = Grouped(kind)
    out = call.out()
    for _ in range(3):
        assert call(out) is out
    (plan,) = g._plans.values()
    launches = backend.launches()
    assert plan.kind.value == kind and plan.groups == G
    assert len(launches) == 3 and backend.general_calls == 1 and len(plan.packs) == 1
    assert backend.selections == 1 and len(grouped._plans) == 1
    assert all(cfg is plan.launch and pack is launches[0][3] for _, cfg, _, pack in launches)
    (key,) = plan.packs
    assert key[5] == call.index.data_ptr()  # the index tensor is part of the pack


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_new_pointers_and_index_tensors_get_new_packs(backend, kind):
    call = Grouped(kind)
    out, out2 = call.out(), call.out()
    a2 = (call.a[0].clone(), call.a[1])
    index2 = call.index.clone()
    call(out)
    call(out2)
    call(out, a=a2)
    call(out, index=index2)
    call(out)  # the first pointers again: the first pack
    (plan,) = g._plans.values()
    packs = [e[3] for e in backend.launches()]
    assert len(plan.packs) == 4 and len(set(map(id, packs[:4]))) == 4 and packs[4] is packs[0]
    assert backend.general_calls == 4 and backend.selections == 1


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_out_none_allocates_zeros_on_the_fast_path(backend, kind, monkeypatch):
    call = Grouped(kind)
    call()
    # Poison fresh float tensors: an output allocated uninitialised would show NaN (the fake
    # kernel writes nothing, so every row is one no group wrote).
    empty = torch.empty

    def poisoned(*args, **kw):
        t = empty(*args, **kw)
        return t.fill_(float("nan")) if t.dtype in (torch.bfloat16, torch.float32) else t

    monkeypatch.setattr(torch, "empty", poisoned)
    ys = [call() for _ in range(3)]
    assert backend.selections == 1 and len(backend.launches()) == 4
    assert len({y.data_ptr() for y in ys}) == 3
    for y in ys:
        assert y.shape == call.out_shape and y.dtype == torch.bfloat16
        assert not y.any()


def test_grouped_set_num_sms_rebuilds_the_plan_of_a_warm_signature(backend, monkeypatch):
    call = Grouped("contiguous", groups=8, rows=512, n=1024)  # 4096 x 1024: a grid of every SM
    out = call.out()
    call(out)
    first = next(iter(g._plans.values()))
    monkeypatch.setattr(layout._SmCount, "override", 66)
    call(out)
    call(out)
    second = list(g._plans.values())[-1]
    assert second is not first and second.cfg.grid <= 66 < first.cfg.grid
    assert [e[1] for e in backend.launches()] == [first.launch, second.launch, second.launch]
    assert backend.general_calls == 2 and backend.selections == 1


@pytest.mark.parametrize("kind", KINDS)
def test_grouped_misaligned_out_takes_the_copying_path_every_call(backend, kind):
    call = Grouped(kind)
    numel = torch.Size(call.out_shape).numel()
    buf = torch.full((numel + 8,), 7.0, dtype=torch.bfloat16)
    out_odd = buf[1:1 + numel].view(call.out_shape)  # contiguous, 2 bytes past 16 bytes
    assert out_odd.data_ptr() % 16
    for _ in range(3):
        call(out_odd)
    assert len(backend.launches()) == 3 and backend.general_calls == 3
    assert backend.selections == 1
    (plan,) = g._plans.values()
    assert all(key[4] % 16 == 0 for key in plan.packs)  # packs hold the aligned copy's pointer
    assert bool((out_odd == 7).all())  # rows no group wrote keep their values through the copy


def test_masked_expected_m_picks_another_plan(backend):
    call = Grouped("masked", rows=512)
    out = call.out()
    for _ in range(2):
        call(out, expected_m=300)
        call(out, expected_m=512)
    small, large = g._plans.values()
    assert small.cfg != large.cfg  # expected_m chose the config
    assert [e[1] for e in backend.launches()] == [small.launch, large.launch] * 2
    assert backend.general_calls == 2 and backend.selections == 2 and len(grouped._plans) == 2


def test_grouped_other_shapes_and_strides_miss_the_guard(backend):
    """The key has element counts: B [4, 256, K] and [2, 512, K] share it (offsets [5] and [3]),
    and the guard tells them apart; A scales of other strides miss too (and are converted)."""
    x = Grouped("offsets", groups=4, rows=128, n=256)
    y = Grouped("offsets", groups=2, rows=256, n=512)
    for _ in range(2):
        x(x.out())
        y(y.out())
    assert len(grouped._plans) == 1 and len(next(iter(grouped._plans.values()))) == 2
    assert backend.selections == 2
    by_groups = {p.groups: p.launch for p in g._plans.values()}
    assert [e[1] for e in backend.launches()] == [by_groups[4], by_groups[2]] * 2
    a_t, sa = x.a
    x(x.out(), a=(a_t, sa.contiguous()))  # row-major scales: the full path
    assert backend.selections == 3 and len(next(iter(grouped._plans.values()))) == 3


def test_grouped_strided_index_is_not_remembered(backend):
    call = Grouped("contiguous")
    out = call.out()
    strided = torch.empty(2 * call.index.numel(), dtype=torch.int32)[::2]
    strided.copy_(call.index)
    for _ in range(2):
        call(out, index=strided)
    assert backend.selections == 2 and not grouped._plans
