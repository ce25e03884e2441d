"""Expert parallelism (fp8gemm.distributed.Fp8EPMoE) against the same layer in one process.

The multi-process tests spawn 2 and 4 CPU processes with the gloo backend (reference GEMMs):
each runs every scenario below on its share of the tokens and saves what it got; the parent
checks, per scenario, that the rows each rank's experts received are exactly the rows the
one-process layer routes to those experts (fp8 bytes, scales, order), that the outputs are
within the EP tolerance of the one-process Fp8MoE on all tokens, and that the decode path's
capacity drops are the ones its policy names. One spawn per group size keeps the test short
(starting a process costs seconds here); a deadline turns a hang into a failure.
"""

from __future__ import annotations

import datetime
import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fp8gemm
from fp8gemm.distributed import Fp8EPMoE, WireFormat
from fp8gemm.nn import Fp8MoE
from helpers import TOLERANCES, assert_close_diff

EP_DIFF = TOLERANCES["moe layer", "expert parallel"].bound
HIDDEN, INTER, EXPERTS_PER_RANK, TOPK = 200, 72, 2, 3  # H, I not multiples of 128
DEADLINE_S = 120  # a spawn that has not finished by then is a hang


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(g: int):
    gen = torch.Generator().manual_seed(1)
    return (torch.randn(g, 2 * INTER, HIDDEN, generator=gen) / 16,
            torch.randn(g, HIDDEN, INTER, generator=gen) / 16)


def _routing(gen, t: int, g: int, probs: torch.Tensor | None = None):
    """Distinct top-k experts per token drawn with weights `probs` (skewed loads), softmax
    router weights."""
    probs = torch.ones(g) if probs is None else probs
    ids = torch.stack([torch.multinomial(probs, TOPK, generator=gen) for _ in range(t)])
    return ids.to(torch.int32), torch.softmax(torch.randn(t, TOPK, generator=gen), -1)


def scenarios(world: int) -> list[dict]:
    """Every case, built the same way in the parent and in each rank (a seeded generator)."""
    g = world * EXPERTS_PER_RANK
    gen = torch.Generator().manual_seed(world)
    out = []

    def case(name, layout, tokens, probs=None, edit=None, **kw):
        t = sum(tokens)
        x = torch.randn(t, HIDDEN, generator=gen).to(torch.bfloat16)
        ids, wts = _routing(gen, t, g, probs)
        if edit is not None:
            edit(ids)
        out.append(dict(name=name, layout=layout, tokens=tokens, x=x, ids=ids, wts=wts, **kw))

    skew = torch.tensor([8.0, 4.0] + [1.0] * (g - 4) + [0.0, 0.0])  # the last 2 experts empty

    def dropped_ids(ids):  # ids outside [0, G): experts held nowhere; a token with none left
        ids[0, 0], ids[1, 2], ids[-1, :] = -1, g, -1

    uneven = [13, 5, 21, 8][:world]
    case("uneven loads", "contiguous", uneven, skew, dropped_ids)
    case("rank without tokens", "contiguous", [9, 0, 14, 0][:world])
    # rank 0's experts only (a token may pick one twice: two slots, two rows), the other
    # ranks' experts empty
    case("every row to rank 0", "contiguous", [6] * world,
         edit=lambda ids: ids.remainder_(EXPERTS_PER_RANK))
    case("decode, default capacity", "masked", [7] * world, skew, dropped_ids)
    case("decode, a rank of padding tokens", "masked", [5] * world,
         edit=lambda ids: ids[5:10].fill_(-1))  # rank 1's tokens route nowhere
    case("decode, over capacity", "masked", [10] * world, skew, capacity=4, expert_capacity=6)
    return out


def _expected_drops(c: dict, world: int):
    """The capacity policy, written out: a source keeps its first `capacity` slots for each
    rank in (token, slot) order; an expert keeps the first `expert_capacity` of the rows it
    receives in (source, token, slot) order. -> (ids with dropped slots set to -1,
    [[sent dropped, received dropped] per rank])."""
    ids, cap, ecap = c["ids"].clone(), c["capacity"], c["expert_capacity"]
    g, l = world * EXPERTS_PER_RANK, EXPERTS_PER_RANK
    starts = [sum(c["tokens"][:r]) for r in range(world)]
    drops = [[0, 0] for _ in range(world)]
    kept_by_expert = {e: [] for e in range(g)}
    for s in range(world):
        sent = [0] * world
        for t in range(starts[s], starts[s] + c["tokens"][s]):
            for k in range(TOPK):
                e = int(ids[t, k])
                if not 0 <= e < g:
                    continue
                if sent[e // l] == cap:
                    ids[t, k] = -1
                    drops[s][0] += 1
                    continue
                sent[e // l] += 1
                kept_by_expert[e].append((t, k))
    for e, slots in kept_by_expert.items():
        for t, k in slots[ecap:]:
            ids[t, k] = -1
            drops[e // l][1] += 1
    return ids, drops


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        torch.set_num_threads(1)
        os.environ["FP8GEMM_BACKEND"] = "reference"
        ep = Fp8EPMoE(world * EXPERTS_PER_RANK, HIDDEN, INTER)
        ep.load_weights(*_weights(world * EXPERTS_PER_RANK))
        results = []
        for c in scenarios(world):
            lo = sum(c["tokens"][:rank])
            part = slice(lo, lo + c["tokens"][rank])
            step = ep.dispatch(c["x"][part], c["ids"][part], c["wts"][part], layout=c["layout"],
                               capacity=c.get("capacity"),
                               expert_capacity=c.get("expert_capacity"))
            index = step.experts.m_indices if c["layout"] == "contiguous" else None
            results.append(dict(y=ep.combine(step, ep.compute(step)),
                                counts=step.tokens_per_expert.clone(),
                                a=step.a.reshape(-1, HIDDEN).view(torch.uint8).clone(),
                                sa=step.sa.reshape(-1, step.sa.shape[-1]).clone(),
                                m_indices=index, dropped=step.dropped.clone()))
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        # NOTE: every rank done before any tears down: a rank that closed its gloo connections
        # while a peer was still in its last collective aborted that peer ("terminate called
        # without an active exception") in one CI run.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _spawn(world: int, out_dir: str) -> list[list[dict]]:
    ctx = mp.start_processes(_worker, args=(world, _free_port(), out_dir), nprocs=world,
                             join=False, start_method="spawn")
    deadline = time.monotonic() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            pytest.fail(f"{world} gloo processes did not finish within {DEADLINE_S} s (a hang)")
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(world)]


def _one_process(world: int, c: dict, ids: torch.Tensor) -> torch.Tensor:
    moe = Fp8MoE(world * EXPERTS_PER_RANK, HIDDEN, INTER)
    moe.load_weights(*_weights(world * EXPERTS_PER_RANK))
    return moe(c["x"], ids, c["wts"], layout="contiguous")


def _expected_rows(c: dict, ids: torch.Tensor, rank: int):
    """The quantised rows (fp8 bytes, scales) each of `rank`'s experts computes, in order."""
    a, sa = fp8gemm.quantize_per_token(c["x"], col_major_scales=False)
    rows = []
    for e in range(rank * EXPERTS_PER_RANK, (rank + 1) * EXPERTS_PER_RANK):
        tok = [t for t in range(ids.shape[0]) for k in range(TOPK) if int(ids[t, k]) == e]
        rows.append((a[tok].view(torch.uint8), sa[tok]))
    return rows


@pytest.mark.parametrize("world", (2, 4))
def test_ep_matches_one_process(world, tmp_path, clean_env):
    clean_env.setenv("FP8GEMM_BACKEND", "reference")
    got = _spawn(world, str(tmp_path))
    for i, c in enumerate(scenarios(world)):
        if c["layout"] == "masked" and "capacity" in c:
            ids, drops = _expected_drops(c, world)
        else:
            ids, drops = c["ids"], [[0, 0]] * world
        ref = _one_process(world, c, ids)
        y = torch.cat([got[r][i]["y"] for r in range(world)])
        assert y.shape == ref.shape and y.dtype == ref.dtype, c["name"]
        assert_close_diff(y, ref, EP_DIFF, c["name"])
        for r in range(world):
            res = got[r][i]
            assert res["dropped"].tolist() == drops[r], (c["name"], r)
            expect = _expected_rows(c, ids, r)
            assert res["counts"].tolist() == [len(sa) for _, sa in expect], (c["name"], r)
            for l, (ea, esa) in enumerate(expect):
                if c["layout"] == "masked":  # expert l's rows: l * Mmax + 0 .. count
                    mmax = res["a"].shape[0] // EXPERTS_PER_RANK
                    sel = torch.arange(l * mmax, l * mmax + len(esa))
                else:
                    sel = (res["m_indices"] == l).nonzero().flatten()
                assert torch.equal(res["a"][sel], ea), (c["name"], r, l)
                assert torch.equal(res["sa"][sel], esa), (c["name"], r, l)
        if c["name"] == "rank without tokens":
            assert got[1][i]["y"].shape == (0, HIDDEN)
        if c["name"] == "every row to rank 0":
            assert all(got[r][i]["counts"].sum() == 0 for r in range(1, world))
        if c["name"] == "decode, over capacity":
            assert sum(sum(d) for d in drops) > 0  # the case does overflow


# ---------------------------------------------------------------------------------------------
# One process: the wire format and argument checks (a 1-rank gloo group)


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("hidden", (1, 200, 256, 7168))
def test_wire_rows_roundtrip(hidden):
    x = torch.randn(5, hidden)
    a, sa = fp8gemm.quantize_per_token(x, col_major_scales=False)
    wire = WireFormat(hidden)
    rows = wire.pack(a, sa)
    assert rows.dtype == torch.uint8 and rows.shape == (5, wire.row_bytes)
    assert wire.row_bytes % 16 == 0 and wire.scale_offset % 16 == 0
    wire.write_ids(rows, torch.tensor([[3, -1], [0, 1]]), torch.tensor([[7, 9], [0, 2]]))
    ga, gsa, ids = wire.unpack(rows)
    assert torch.equal(ga.view(torch.uint8), a.view(torch.uint8)) and torch.equal(gsa, sa)
    assert ids.tolist() == [0, 2, -1, 7, -1]  # rows 2 and 4 empty, slot (0, 1) had no row


def test_ep_one_rank_equals_fp8_moe(one_rank_group):
    g = 4
    moe, ep = Fp8MoE(g, HIDDEN, INTER), Fp8EPMoE(g, HIDDEN, INTER)
    moe.load_weights(*_weights(g))
    ep.load_weights(*_weights(g))
    x = torch.randn(11, HIDDEN, dtype=torch.bfloat16)
    ids, wts = _routing(torch.Generator().manual_seed(0), 11, g)
    for layout in ("contiguous", "masked"):
        assert_close_diff(ep(x, ids, wts, layout=layout), moe(x, ids, wts, layout=layout),
                          EP_DIFF, layout)
    assert ep(x, ids, wts).dtype == torch.bfloat16
    assert ep(x.float(), ids, wts).dtype == torch.float32
    # capacity 0: every slot dropped (and counted), the output zero; a batch of no tokens
    step = ep.dispatch(x, ids, wts, layout="masked", capacity=0)
    assert step.dropped.tolist() == [11 * TOPK, 0]
    assert torch.equal(ep.combine(step, ep.compute(step)), torch.zeros_like(x))
    step = ep.dispatch(x, ids, wts, layout="masked", capacity=40, expert_capacity=0)
    assert step.dropped.tolist() == [0, 11 * TOPK]
    assert torch.equal(ep.combine(step, ep.compute(step)), torch.zeros_like(x))
    for layout in ("contiguous", "masked"):
        assert ep(x[:0], ids[:0], wts[:0], layout=layout).shape == (0, HIDDEN)


def test_ep_argument_checks(one_rank_group):
    with pytest.raises(ValueError, match="num_experts must be a positive multiple"):
        Fp8EPMoE(0, HIDDEN, INTER)
    ep = Fp8EPMoE(2, HIDDEN, INTER)
    x, ids, wts = torch.randn(3, HIDDEN), torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1)
    with pytest.raises(ValueError, match="^x must be"):
        ep(x[:, :10], ids, wts)
    with pytest.raises(TypeError, match="^topk_ids must be"):
        ep(x, ids.float(), wts)
    with pytest.raises(ValueError, match="^topk_weights must"):
        ep(x, ids, wts[:2])
    with pytest.raises(ValueError, match="^layout must be"):
        ep(x, ids, wts, layout="offsets")
    with pytest.raises(ValueError, match="^capacity is for layout='masked'"):
        ep(x, ids, wts, layout="contiguous", capacity=4)
    with pytest.raises(ValueError, match="^capacity must be a non-negative int"):
        ep(x, ids, wts, layout="masked", capacity=-1)
    with pytest.raises(ValueError, match="must hold all 2 experts"):
        ep.load_weights(torch.zeros(3, 2 * INTER, HIDDEN), torch.zeros(3, HIDDEN, INTER))


def test_ep_needs_a_process_group():
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(ValueError, match="initialised torch.distributed process group"):
        Fp8EPMoE(2, HIDDEN, INTER)


# ---------------------------------------------------------------------------------------------
# GPU: a 1-process NCCL group on one Hopper GPU


@pytest.fixture
def nccl_group(gpu_device):
    if not dist.is_nccl_available():
        pytest.skip("this torch build has no NCCL")
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0,
                            world_size=1, device_id=dev)
    yield dev
    dist.destroy_process_group()


@pytest.mark.gpu
def test_ep_nccl_one_rank_and_decode_graph(nccl_group):
    """The layer over NCCL equals the one-GPU Fp8MoE at prefill (contiguous) and decode
    (masked); the decode step captured as one CUDA graph replays new inputs as eager does."""
    dev = nccl_group
    g, h, i, t = 8, 512, 256, 64
    w13, w2 = torch.randn(g, 2 * i, h, device=dev) / 16, torch.randn(g, h, i, device=dev) / 16
    moe, ep = Fp8MoE(g, h, i, device=dev), Fp8EPMoE(g, h, i, device=dev)
    moe.load_weights(w13, w2)
    ep.load_weights(w13, w2)
    x = torch.randn(t, h, device=dev, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(g, device=dev)[:TOPK] for _ in range(t)]).int()
    wts = torch.softmax(torch.randn(t, TOPK, device=dev), -1)
    for layout in ("contiguous", "masked"):
        assert_close_diff(ep(x, ids, wts, layout=layout), moe(x, ids, wts, layout=layout),
                          EP_DIFF, layout)

    sx, sids, swts = x.clone(), ids.clone(), wts.clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (kernels compiled, NCCL communicator made)
        for _ in range(2):
            ep(sx, sids, swts, layout="masked")
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = ep(sx, sids, swts)  # "auto" picks masked while capturing
    x2 = torch.randn_like(x)
    ids2 = torch.stack([torch.randperm(g, device=dev)[:TOPK] for _ in range(t)]).int()
    sx.copy_(x2)
    sids.copy_(ids2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, ep(x2, ids2, wts, layout="masked"))
    assert_close_diff(out, moe(x2, ids2, wts, layout="masked"), EP_DIFF, "graph replay")
