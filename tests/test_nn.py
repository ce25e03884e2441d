"""fp8gemm.nn: Fp8Linear's edges and errors, convert and its report, state_dict round trips."""

import subprocess
import sys

import pytest
import torch
from torch import nn

import fp8gemm
from fp8gemm.nn import ConvertReport, Fp8Linear, Fp8MoE, convert
from helpers import E4M3, QUANT_TOL


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


# --- pre-quantised checkpoints (DeepSeek-V3 style: fp8 `weight` beside `weight_scale_inv`) -------

class _CheckpointFp8Linear(nn.Linear):
    """The shape of a fine-grained FP8 layer of a loaded checkpoint (transformers' FP8Linear):
    an nn.Linear whose weight is fp8, with 128x128 block scales `weight_scale_inv` and
    `block_size`."""

    def __init__(self, q, scale, bias=None, block_size=(128, 128)):
        super().__init__(q.shape[1], q.shape[0], bias=bias is not None)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.weight_scale_inv = nn.Parameter(scale, requires_grad=False)
        self.block_size = block_size
        if bias is not None:
            self.bias = nn.Parameter(bias)


def _checkpoint_weight(n=300, k=260, fmt="e4m3", seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-2, 1, k)
    # power-of-two scales (as DeepSeek-V3.1's): the block's largest element is not at fmt max, so
    # quantising the dequantised weight again would change scales and bits
    return fp8gemm.quantize_per_block(w, fmt, pow2_scales=True)


def _bits(t):
    return t.view(torch.uint8)


def test_convert_takes_a_prequantised_layer_as_it_is():
    q, s = _checkpoint_weight()
    bias = torch.randn(300)
    model = nn.Sequential(_CheckpointFp8Linear(q, s, bias), nn.ReLU())
    report = convert(model)
    assert report.converted == ["0"] and isinstance(model[0], Fp8Linear)
    assert report.prequantised == ["0"] and "fp8   0 (pre-quantised, kept as stored)" in str(report)
    assert torch.equal(_bits(model[0].weight), _bits(q)) and torch.equal(model[0].weight_scale, s)
    x = torch.randn(9, 260)
    a, sa = fp8gemm.quantize_per_token(x)
    acc = fp8gemm.fp8_gemm_nt((a, sa), (q, s), out_dtype=torch.float32)
    assert torch.equal(model[0](x), (acc + bias).to(torch.bfloat16))
    requantised = fp8gemm.quantize_per_block(fp8gemm.dequantize_per_block(q, s, torch.float32))
    assert not torch.equal(requantised[1], s)  # what loading through bf16 would have changed
    trainable = Fp8Linear.from_linear(_CheckpointFp8Linear(q, s), trainable=True)
    assert torch.equal(trainable.weight, fp8gemm.dequantize_per_block(q, s))


def test_prequantised_weight_errors_name_the_layer_and_the_constraint():
    q, s = _checkpoint_weight()
    m = Fp8Linear(260, 300, name="mlp.up")
    with pytest.raises(ValueError, match=r"'mlp.up': weight is fp8 \(torch.float8_e4m3fn\) and "
                                         r"needs its 128x128 block scales \[3, 3\]"):
        m.load_weight(q)
    with pytest.raises(ValueError, match=r"weight_scale must be \[3, 3\] \(one per 128x128 block "
                                         r"of weight \[300, 260\]\) or one per tensor, got "
                                         r"\[3, 2\]"):
        m.load_weight(q, weight_scale=s[:, :2])
    bad = s.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="weight_scale must be finite, got 1 NaN"):
        m.load_weight(q, weight_scale=bad)
    nan = q.clone()
    _bits(nan)[5, 7] = 0x7F
    with pytest.raises(ValueError, match="weight must be finite, got 1 NaN or Inf code"):
        m.load_weight(nan, weight_scale=s)
    q5, s5 = _checkpoint_weight(fmt="e5m2")
    with pytest.raises(TypeError, match=r"weight is torch.float8_e5m2 but the module stores "
                                        r"torch.float8_e4m3fn \(fmt='e4m3'\)"):
        m.load_weight(q5, weight_scale=s5)
    Fp8Linear(260, 300, fmt="e5m2").load_weight(q5, weight_scale=s5)  # its own format: taken
    with pytest.raises(ValueError, match="weight_scale goes with an fp8 weight"):
        m.load_weight(torch.randn(300, 260), weight_scale=s)
    with pytest.raises(ValueError, match=r"scaled per \[1, 128\] block; Fp8Linear takes 128x128"):
        Fp8Linear.from_linear(_CheckpointFp8Linear(q, s, block_size=(1, 128)))
    # (unchanged by any of the failed loads)
    assert not bool(m.weight.float().any())


def test_per_tensor_scales_become_the_block_grid():
    """A checkpoint scaled per tensor (per expert for Fp8MoE) loads exactly: every block takes
    the one scale, the fp8 codes stay."""
    gen = torch.Generator().manual_seed(5)
    q, s = fp8gemm.quantize_per_tensor(torch.randn(300, 260, generator=gen))
    for scale in (s, s.reshape(()), s.reshape(1, 1)):
        m = Fp8Linear(260, 300, bias=False)
        m.load_weight(q, weight_scale=scale)
        assert torch.equal(m.weight_scale, s.expand(3, 3)) and torch.equal(_bits(m.weight), _bits(q))
    m.load_state_dict({"weight": q, "weight_scale": s})
    assert torch.equal(m.weight_scale, s.expand(3, 3))
    moe = Fp8MoE(2, 256, 128)
    w13, s13 = fp8gemm.quantize_per_tensor(torch.randn(2, 256, 256, generator=gen))
    w2 = torch.randn(2, 256, 128, generator=gen)
    per_expert = torch.tensor([0.5, 0.25])
    moe.load_weights(w13, w2, w13_scale=per_expert)
    assert torch.equal(moe.w13_scale, per_expert.reshape(2, 1, 1).expand(2, 2, 2))


def test_state_dict_of_a_checkpoint_loads_in_any_form():
    q, s = _checkpoint_weight()
    bias = torch.randn(300)
    x = torch.randn(5, 260)
    want = Fp8Linear(260, 300)
    want.load_weight(q, bias, weight_scale=s)
    # DeepSeek-V3's names: weight_scale_inv is the block scale
    m = Fp8Linear(260, 300)
    m.load_state_dict({"weight": q, "weight_scale_inv": s, "bias": bias})
    assert torch.equal(m(x), want(x)) and torch.equal(m.weight_scale, s)
    # a float checkpoint into an inference layer: quantised as load_weight quantises
    w = torch.randn(300, 260)
    m.load_state_dict({"weight": w.bfloat16(), "bias": bias})
    qb, sb = fp8gemm.quantize_per_block(w.bfloat16())
    assert torch.equal(_bits(m.weight), _bits(qb)) and torch.equal(m.weight_scale, sb)
    # fp8 into a trainable layer: dequantised into the master weight
    t = Fp8Linear(260, 300, trainable=True)
    t.load_state_dict({"weight": q, "weight_scale": s, "bias": bias})
    assert torch.equal(t.weight, fp8gemm.dequantize_per_block(q, s))
    assert set(t.state_dict()) == {"weight", "bias"}
    with pytest.raises(ValueError, match=r"weight is fp8 .* needs its 128x128 block scales"):
        Fp8Linear(260, 300).load_state_dict({"weight": q, "bias": bias}, strict=False)
    with pytest.raises(ValueError, match="has both weight_scale and weight_scale_inv"):
        m.load_state_dict({"weight": q, "weight_scale": s, "weight_scale_inv": s, "bias": bias})
    with pytest.raises(ValueError, match="weight_scale goes with an fp8 weight; a torch.float32 weight"):
        m.load_state_dict({"weight": w, "weight_scale": s, "bias": bias})


def test_meta_state_dicts_load_without_value_checks():
    """A skeleton's state dict (meta tensors, assign=True) has no values to check or quantise:
    it loads as shapes and dtypes, in any of the forms above."""
    with torch.device("meta"):
        skeleton = Fp8Linear(260, 300)
    m = Fp8Linear(260, 300)
    m.load_state_dict(skeleton.state_dict(), assign=True)
    assert m.weight.is_meta and m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.is_meta
    m = Fp8Linear(260, 300)
    m.load_state_dict({"weight": torch.empty(300, 260, device="meta"),
                       "bias": torch.empty(300, device="meta")}, assign=True)
    assert m.weight.is_meta and m.weight.dtype == torch.float8_e4m3fn
    assert m.weight_scale.shape == (3, 3) and m.weight_scale.is_meta


def test_prefixed_checkpoint_loads_into_a_converted_model():
    """A whole model's checkpoint (prefixed keys, DeepSeek-V3 names) into a bf16 skeleton that
    convert() turned into Fp8Linear layers."""
    layers = [_checkpoint_weight(256, 256, seed=i) for i in range(2)]
    state = {}
    for i, (q, s) in enumerate(layers):
        state[f"blocks.{i}.proj.weight"] = q
        state[f"blocks.{i}.proj.weight_scale_inv"] = s
        state[f"blocks.{i}.proj.bias"] = torch.zeros(256)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(256, 256)

    model = nn.Module()
    model.blocks = nn.ModuleList([Block(), Block()])
    convert(model)
    model.load_state_dict(state)
    for i, (q, s) in enumerate(layers):
        proj = model.blocks[i].proj
        assert torch.equal(_bits(proj.weight), _bits(q)) and torch.equal(proj.weight_scale, s)


def test_moe_takes_prequantised_experts():
    """Per-expert W1, W3 and W2 of a checkpoint, each with its block scales: W1 and W3 stack into
    w13 (I % 128 == 0), stored bit for bit; the state dict takes `_scale_inv` names."""
    g, h, i = 3, 256, 256
    w1, w3, w2 = ([_checkpoint_weight(n, k, seed=10 * e + j) for e in range(g)]
                  for j, (n, k) in enumerate(((i, h), (i, h), (h, i))))
    q13 = torch.stack([torch.cat([w1[e][0], w3[e][0]]) for e in range(g)])
    s13 = torch.stack([torch.cat([w1[e][1], w3[e][1]]) for e in range(g)])
    q2, s2 = torch.stack([w[0] for w in w2]), torch.stack([w[1] for w in w2])
    moe = Fp8MoE(g, h, i)
    moe.load_weights(q13, q2, w13_scale=s13, w2_scale=s2)
    assert torch.equal(_bits(moe.w13), _bits(q13)) and torch.equal(moe.w2_scale, s2)
    x = torch.randn(7, h)
    ids = torch.stack([torch.randperm(g)[:2] for _ in range(7)])
    wts = torch.rand(7, 2)
    # against float64 on the checkpoint's real weights: only x and silu(W1 x) * W3 x are rounded
    # to e4m3 (h13 and y to bf16), so the error is about two e4m3 roundings
    d13 = fp8gemm.dequantize_per_block(q13, s13, torch.float64)
    d2 = fp8gemm.dequantize_per_block(q2, s2, torch.float64)
    ref = torch.zeros(7, h, dtype=torch.float64)
    for t in range(7):
        for e, wt in zip(ids[t].tolist(), wts[t].tolist()):
            h13 = d13[e] @ x[t].double()
            ref[t] += wt * (d2[e] @ (nn.functional.silu(h13[:i]) * h13[i:]))
    assert fp8gemm.calc_diff(moe(x, ids, wts), ref) < 2 * QUANT_TOL[E4M3]
    fresh = Fp8MoE(g, h, i)
    fresh.load_state_dict({"w13": q13, "w13_scale_inv": s13, "w2": q2, "w2_scale_inv": s2})
    assert torch.equal(fresh(x, ids, wts), moe(x, ids, wts))
    trainable = Fp8MoE(g, h, i, trainable=True)
    trainable.load_weights(q13, q2, w13_scale=s13, w2_scale=s2)
    assert torch.equal(trainable.w2, fp8gemm.dequantize_per_block(q2, s2))
    with pytest.raises(ValueError, match=r"Fp8MoE: w13 is fp8 .* needs its 128x128 block scales "
                                         r"\[3, 4, 2\]"):
        moe.load_weights(q13, q2, w2_scale=s2)
    # I = 192: W1's and W3's last 64-row blocks cannot stack into one 128-row block of w13
    odd = Fp8MoE(1, 256, 192)
    gate, up = _checkpoint_weight(192, 256), _checkpoint_weight(192, 256, seed=1)
    with pytest.raises(ValueError, match=r"w13_scale must be \[1, 3, 2\] \(one per 128x128 "
                                         r"block of w13 \[1, 384, 256\]\) or one per tensor, "
                                         r"got \[1, 4, 2\]"):
        odd.load_weights(torch.cat([gate[0], up[0]])[None], torch.zeros(1, 256, 192),
                         w13_scale=torch.cat([gate[1], up[1]])[None])
