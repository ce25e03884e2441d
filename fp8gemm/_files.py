"""Atomic file writes for the on-disk caches (compiled kernels, autotune results)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

__all__ = ["write_atomic"]


def write_atomic(path: Path, data: bytes, *, durable: bool = False) -> None:
    """Write `data` to a temporary file beside `path` and rename it over `path`: os.replace is
    atomic on POSIX, so a concurrent reader sees the old file or the new one, never a mix.
    durable=True also fsyncs before the rename (for entries worth keeping across a crash)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
