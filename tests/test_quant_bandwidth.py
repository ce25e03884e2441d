"""scripts/quant_bandwidth.py on the CPU: the bytes it counts and the check that gates timing."""

from __future__ import annotations

import torch

from helpers import load_script

qb = load_script("scripts/quant_bandwidth.py")


def test_moved_bytes_are_input_output_and_scales_once():
    x = torch.randn(300, 260, dtype=torch.bfloat16)
    for op in qb.OPS:
        fn, _ = qb.quantiser(op, "e4m3")
        q, s = fn(x)
        assert qb.moved_bytes(op, 300, 260) == 2 * x.numel() + q.numel() + 4 * s.numel(), op


def test_agrees_takes_one_step_on_few_elements_only():
    x = torch.randn(256, 512, dtype=torch.bfloat16)
    fn, twin = qb.quantiser("per_token", "e4m3")
    q, s = fn(x)
    tq, ts = twin(x)
    assert qb.agrees(q, s, tq, ts)
    codes = tq.view(torch.uint8).clone()
    flat = codes.view(-1)
    few = torch.arange(0, flat.numel(), 1000)
    mag = flat[few] & 0x7F
    flat[few] = torch.where(mag > 0, flat[few] - 1, flat[few] + 1)  # one step toward / from 0
    assert qb.agrees(codes.view(tq.dtype), s, tq, ts)
    two = tq.view(torch.uint8).clone()
    two.view(-1)[5] ^= 0x02  # a code two apart: two steps away
    assert not qb.agrees(two.view(tq.dtype), s, tq, ts)
    many = tq.view(torch.uint8).clone()
    m = many.view(-1)
    idx = torch.arange(0, m.numel(), 50)  # 2 % of the elements one step away
    m[idx] = torch.where((m[idx] & 0x7F) > 0, m[idx] - 1, m[idx] + 1)
    assert not qb.agrees(many.view(tq.dtype), s, tq, ts)
    assert not qb.agrees(q, s * 2, tq, ts)
    # scales one float32 rounding apart (the GPU's silu) agree; 1e-5 apart do not
    assert qb.agrees(q, s * (1 + 2 ** -23), tq, ts)
    assert not qb.agrees(q, s * (1 + 1e-5), tq, ts)
