"""README.md's python snippets run as written (in order, in one namespace), here on the CPU."""

import functools
import re
from pathlib import Path

import pytest
import torch

README = Path(__file__).resolve().parent.parent / "README.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_snippets():
    assert len(_snippets()) >= 4


def test_every_readme_snippet_runs(monkeypatch, capsys):
    code = "\n".join(_snippets())
    if not torch.cuda.is_available():
        # NOTE: the snippets are written for a GPU; on a CPU machine the same code runs on the
        # reference backend with "cuda" read as "cpu".
        code = code.replace('"cuda"', '"cpu"')
        # inductor compiles are covered by test_compile.py; here aot_eager keeps the test quick
        monkeypatch.setattr(torch, "compile",
                            functools.partial(torch.compile, backend="aot_eager"))
    namespace: dict = {}
    try:
        exec(compile(code, str(README), "exec"), namespace)
    except Exception as e:  # show which snippet failed
        pytest.fail(f"README snippet failed: {type(e).__name__}: {e}")
    assert "converted 1" in capsys.readouterr().out
