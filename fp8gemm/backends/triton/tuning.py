"""Autotuning of a kernel family's configs (FP8GEMM_AUTOTUNE=1): time the family's candidates on
the caller's tensors once per problem and store the winner, per family, as JSON in
FP8GEMM_CACHE_DIR (one file shared by every process that uses the directory).
"""

from __future__ import annotations

import contextlib
import json
import threading
from dataclasses import MISSING, asdict, fields
from pathlib import Path

import torch
import triton

try:
    import fcntl
except ImportError:  # not POSIX: the autotune file is written without a cross-process lock
    fcntl = None

from ..._files import write_atomic
from ..._settings import settings
from ...problem import GemmProblem
from ..family import DeviceFacts, KernelFamily

__all__ = ["autotune", "config_from_json", "load_tuned", "store_tuned"]


def config_from_json(cls: type, d: dict):
    """The `cls` config of a stored entry; ValueError / TypeError where the entry is not one."""
    if not isinstance(d, dict):
        raise TypeError(f"a stored config must be a JSON object, got {type(d).__name__}")
    fs = fields(cls)
    names = {f.name for f in fs}
    required = {f.name for f in fs if f.default is MISSING}
    if not required <= set(d) <= names:
        raise ValueError(f"{cls.__name__} fields must be {sorted(names)}, got {sorted(d)}")
    # NOTE: the annotations are strings (postponed evaluation): "bool" or "int".
    kinds = {f.name: f.type for f in fs}
    return cls(**{k: (bool(v) if kinds[k] == "bool" else int(v)) for k, v in d.items()})


def autotune(family: KernelFamily, problem: GemmProblem, facts: DeviceFacts, args: tuple):
    """Time every candidate of `family` on the caller's tensors `args` = (a, sa, b, sb, out, c,
    index) (into a scratch output, so `out` and a `c` that aliases it stay as they are) and
    return the fastest; candidates that fail to compile (out of shared memory or registers) are
    skipped."""
    from triton.testing import do_bench

    a, sa, b, sb, out, c, idx = args
    scratch = torch.empty_like(out)
    best = None
    for cfg in family.candidate_configs(problem, facts):
        def run(cfg=cfg):
            family.run(cfg, problem, a, sa, b, sb, scratch, c, idx)
        try:
            run()
            t = do_bench(run, warmup=5, rep=25, return_mode="median")
        except (triton.runtime.errors.OutOfResources, triton.CompilationError, RuntimeError):
            continue
        if best is None or t < best[0]:
            best = (t, cfg)
    if best is None:
        raise RuntimeError(f"no {family.name} config compiles for {problem}")
    return best[1]


# --------------------------------------------------------------------------------------------
# The cache: {"<device>|sm<cc>|<SMs> SMs|triton <version>|<family>|<problem>": {config fields}}
# in one JSON file per cache directory.

_tuned_lock = threading.Lock()
_tuned: dict[str, dict[str, dict]] | None = None  # cache file path -> its entries, as last read


def _cache_file() -> Path:
    return settings.cache_dir / "triton_autotune.json"


def _key(family: KernelFamily, problem: GemmProblem, facts: DeviceFacts) -> str:
    # NOTE: the SM count is part of the key: set_num_sms caps it, and a config's persistent grid
    # (num_programs) is sized for it.
    return (f"{facts.name}|sm{facts.capability[0]}{facts.capability[1]}|{facts.num_sms} SMs|"
            f"triton {triton.__version__}|{family.name}|{problem}")


def _read_file(path: Path) -> dict[str, dict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def load_tuned(family: KernelFamily, problem: GemmProblem, facts: DeviceFacts):
    """The stored config of `family` for `problem` on this device, or None. A miss re-reads the
    file (another process may have tuned the problem since); invalid entries count as misses."""
    global _tuned
    key, path = _key(family, problem, facts), _cache_file()
    with _tuned_lock:
        if _tuned is None:
            _tuned = {}
        entries = _tuned.get(str(path))
        if entries is None or key not in entries:
            entries = _tuned[str(path)] = _read_file(path)
        d = entries.get(key)
    if d is None:
        return None
    try:
        return config_from_json(family.Config, d)
    except (TypeError, ValueError):
        return None


@contextlib.contextmanager
def _file_lock(path: Path):
    """An exclusive advisory lock on `path` + ".lock" across processes (POSIX; elsewhere none)."""
    if fcntl is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def store_tuned(family: KernelFamily, problem: GemmProblem, facts: DeviceFacts, cfg) -> None:
    """Merge one entry into the JSON file: read, merge and write (atomically: temp file + rename)
    under a lock file, so concurrent processes keep each other's entries."""
    global _tuned
    path = _cache_file()
    with _tuned_lock, _file_lock(path):
        current = _read_file(path)
        current[_key(family, problem, facts)] = asdict(cfg)
        write_atomic(path, json.dumps(current, indent=1, sort_keys=True).encode())
        if _tuned is None:
            _tuned = {}
        _tuned[str(path)] = current
