"""Disk cache of compiled cubins.

One entry is one file, ``<cache_dir>/cubin/<key[:2]>/<key>.cubin``:

    FP8GEMM-CUBIN-1\\n
    {"kernel": ..., "sha256": ..., "compiler": ..., "seconds": ...}\\n
    <cubin bytes>

Writes go to a temporary file in the same directory and are renamed over the entry
(`os.replace` is atomic on POSIX), so a reader sees a whole entry or none, and processes that
compile the same kernel at once simply race to write identical entries. A reader checks the
magic line, the cubin's SHA-256, its ELF header and that the recorded kernel is in it; a bad
entry is removed and rebuilt.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from .._files import write_atomic
from . import elf

__all__ = ["CacheEntry", "entry_path", "read_entry", "write_entry", "hash_key"]

_MAGIC = b"FP8GEMM-CUBIN-1\n"


@dataclass(frozen=True)
class CacheEntry:
    cubin: bytes
    kernel_name: str
    meta: dict


def hash_key(parts: dict) -> str:
    """SHA-256 of a JSON-serialisable description of everything that shapes a binary."""
    blob = json.dumps(parts, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def entry_path(cache_dir: Path, key: str) -> Path:
    return Path(cache_dir) / "cubin" / key[:2] / f"{key}.cubin"


def read_entry(path: Path) -> CacheEntry | None:
    """The entry at `path`, or None when it is missing. A corrupt entry is deleted (best effort)
    and reported as missing, so the caller rebuilds it."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError:
        return None
    try:
        if not data.startswith(_MAGIC):
            raise ValueError("bad magic")
        nl = data.index(b"\n", len(_MAGIC))
        meta = json.loads(data[len(_MAGIC):nl])
        cubin = data[nl + 1:]
        if hashlib.sha256(cubin).hexdigest() != meta["sha256"]:
            raise ValueError("checksum mismatch")
        if not elf.is_elf(cubin):
            raise ValueError("not an ELF cubin")
        # The header is outside the checksum: its kernel name must name a kernel of the cubin.
        if str(meta["kernel"]) not in elf.kernel_names(cubin):
            raise ValueError("kernel not in the cubin")
        return CacheEntry(cubin, str(meta["kernel"]), meta)
    except (ValueError, KeyError, TypeError, json.JSONDecodeError):
        try:
            path.unlink()
        except OSError:
            pass
        return None


def write_entry(path: Path, cubin: bytes, kernel_name: str, meta: dict) -> None:
    """Write atomically; concurrent writers of the same key each rename a complete file."""
    full = dict(meta, kernel=kernel_name, sha256=hashlib.sha256(cubin).hexdigest())
    header = _MAGIC + json.dumps(full, sort_keys=True).encode() + b"\n"
    write_atomic(path, header + cubin, durable=True)


def write_text_atomic(path: Path, text: str) -> None:
    """Side files (ptxas log, SASS dump) with the same atomic rename."""
    write_atomic(path, text.encode())
