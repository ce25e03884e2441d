"""fp8gemm.nn: Fp8Linear's edges and errors, convert and its report, state_dict round trips."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import fp8gemm
from fp8gemm.nn import ConvertReport, Fp8Linear, Fp8MoE, convert


def test_nn_is_reachable_after_import_fp8gemm():
    code = "import fp8gemm; print(fp8gemm.nn.Fp8Linear.__name__, fp8gemm.nn.convert.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Fp8Linear", "convert"]


def test_bias_is_added_in_float32_before_the_one_rounding():
    torch.manual_seed(0)
    lin = nn.Linear(320, 200)
    with torch.no_grad():
        lin.bias.mul_(1000).add_(0.3)  # a bias bf16 cannot hold exactly
    m = Fp8Linear.from_linear(lin)
    assert m.bias.dtype == torch.float32 and torch.equal(m.bias, lin.bias)
    x = torch.randn(37, 320)
    a, sa = fp8gemm.quantize_per_token(x)
    acc = fp8gemm.fp8_gemm_nt((a, sa), (m.weight, m.weight_scale), out_dtype=torch.float32)
    y = m(x)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (acc + lin.bias.detach()).to(torch.bfloat16))
    # rounding the product first, then adding a bf16 bias, rounds twice: it differs
    twice = acc.to(torch.bfloat16) + lin.bias.detach().to(torch.bfloat16)
    assert not torch.equal(y, twice)


def test_zero_features_work():
    y = Fp8Linear(0, 8)(torch.randn(3, 0))
    assert y.shape == (3, 8) and not bool(y.any())
    assert Fp8Linear(8, 0)(torch.randn(3, 8)).shape == (3, 0)
    with pytest.raises(ValueError, match="in_features must be a non-negative int, got -1"):
        Fp8Linear(-1, 8)


def test_from_linear_refuses_other_modules():
    with pytest.raises(TypeError, match="from_linear takes an nn.Linear, got Conv1d"):
        Fp8Linear.from_linear(nn.Conv1d(4, 4, 1))


def test_non_finite_weight_raises_naming_the_layer():
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    with torch.no_grad():
        model[1].weight[3, 5] = float("inf")
    with pytest.raises(ValueError, match="Fp8Linear '1': weight must be finite .* 1 NaN or Inf"):
        convert(model)
    lin = nn.Linear(16, 8)
    with torch.no_grad():
        lin.weight[0, 0] = float("nan")
    with pytest.raises(ValueError, match=r"Fp8Linear\(in_features=16, out_features=8\): weight"):
        Fp8Linear.from_linear(lin)


def test_errors_name_the_layer_and_the_constraint():
    m = Fp8Linear(320, 200, name="encoder.q")
    with pytest.raises(ValueError, match=r"Fp8Linear 'encoder.q': x must be \[\.\.\., 320\], "
                                         r"got \[4, 300\]"):
        m(torch.randn(4, 300))
    with pytest.raises(ValueError, match=r"'encoder.q': weight must be \[200, 320\]"):
        m.load_weight(torch.randn(320, 200))
    with pytest.raises(ValueError, match="bias given but the layer has bias=False"):
        Fp8Linear(8, 8, bias=False).load_weight(torch.randn(8, 8), torch.randn(8))


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.GELU(),
                         nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 64)),
                         nn.Linear(64, 10))


def test_convert_report_patterns_and_sizes():
    model = _mlp()
    report = convert(model, exclude=["0"], min_features=128)
    assert isinstance(report, ConvertReport)
    assert report.converted == ["2.0"]
    assert report.skipped == {"0": "matched exclude pattern '0'",
                              "2.1": "[64, 256] has a side under min_features=128",
                              "3": "[10, 64] has a side under min_features=128"}
    assert isinstance(model[2][0], Fp8Linear) and model[2][0].name == "2.0"
    assert isinstance(model[0], nn.Linear) and isinstance(model[3], nn.Linear)
    assert "fp8   2.0" in str(report) and "kept  3:" in str(report)
    only = convert(_mlp(), include=["2.*"], min_features=0)
    assert only.converted == ["2.0", "2.1"] and only.skipped["0"] == "not matched by include"


def test_convert_default_keeps_heads_and_shares_tied_layers():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Linear(256, 256)
            self.alias = self.body
            self.lm_head = nn.Linear(256, 1000)

    net = Net()
    report = convert(net)
    assert report.converted == ["body"]
    assert "lm_head" in report.skipped and net.alias is net.body
    with pytest.raises(TypeError, match="Fp8Linear.from_linear"):
        convert(nn.Linear(4, 4))


def test_convert_output_close_and_state_dict_round_trip():
    ref_model = _mlp()
    x = torch.randn(5, 256)
    ref = ref_model(x)
    model = _mlp()
    convert(model, min_features=0)
    y = model(x).float()
    # three fp8 layers: quantisation error of a few 1e-3 (e4m3 has a 3-bit mantissa)
    assert fp8gemm.calc_diff(y, ref) < 1e-2
    state = model.state_dict()
    assert state["0.weight"].dtype == torch.float8_e4m3fn and "0.weight_scale" in state
    fresh = nn.Sequential(nn.Linear(256, 512), nn.GELU(),
                          nn.Sequential(nn.Linear(512, 256), nn.Linear(256, 64)),
                          nn.Linear(64, 10))
    convert(fresh, min_features=0)
    fresh.load_state_dict(state)
    assert torch.equal(fresh(x), model(x))


def test_fp8_linear_compiles_fullgraph():
    m = Fp8Linear.from_linear(nn.Linear(320, 200))
    x = torch.randn(3, 5, 320)
    assert torch.equal(torch.compile(m, backend="aot_eager", fullgraph=True)(x), m(x))


def test_fp8_moe_auto_layout_compiles_fullgraph():
    torch.manual_seed(0)
    moe = Fp8MoE(4, 256, 128)
    moe.load_weights(torch.randn(4, 256, 256) / 16, torch.randn(4, 256, 128) / 16)
    x = torch.randn(6, 256)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(6)])
    wts = torch.rand(6, 2)
    got = torch.compile(moe, backend="aot_eager", fullgraph=True)(x, ids, wts)
    assert torch.equal(got, moe(x, ids, wts, layout="masked"))


def test_check_and_main_job_agree_on_a_cpu():
    if torch.cuda.is_available():
        pytest.skip("the CPU agreement is about machines without a GPU")
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "fp8gemm", "--check"], capture_output=True,
                         text=True, env=env).stdout
    # the main job runs Triton's interpreter on a CPU: --check reports that same environment
    assert "backend triton     available on cpu (Triton's CPU interpreter" in out
