"""Post-passes over the machine code (SASS) of an sm_90 cubin.

`FfmaYield`: in long runs of independent FFMA instructions, let the warp scheduler switch warps.

NOTE: why. ptxas marks an operand that the next instruction reads again with a *reuse* flag (the
value stays in the operand cache, saving a register-file read) and then also sets the instruction's
no-yield hint, since a warp switch would drop that cache. In a kernel where one warpgroup promotes
its wgmma results with a run of dozens of FFMAs while another warpgroup on the same SM
sub-partitions waits to issue its next wgmma, that hint keeps the scheduler on the FFMA warp and
the tensor cores idle. Clearing the reuse flags (always correct: the operand is read from the
register file instead) and with them the no-yield hint on the first part of each run lets the
other warps in. DeepGEMM reported this for its FP8 kernels; the pass here is written from the
encoding facts below and checked against cuobjdump by tests/test_sass.py.

Encoding facts used (sm_90, every instruction is 16 bytes, two little-endian 64-bit words):
- low word bits 0-11: opcode with operand form; 0x223 is FFMA Rd, Ra, Rb, Rc (all registers);
- high word bit 45: the no-yield hint ptxas sets together with reuse flags;
- high word bits 58-61: operand reuse flags (one per source slot).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from . import elf

__all__ = ["FfmaYield", "ffma_runs", "INSTRUCTION_BYTES"]

INSTRUCTION_BYTES = 16
_OPCODE_MASK = 0xFFF
_FFMA_RRR = 0x223
_NO_YIELD = 1 << 45
_REUSE = 0xF << 58


def _is_ffma(low: int) -> bool:
    return low & _OPCODE_MASK == _FFMA_RRR


def ffma_runs(text: bytes, min_run: int) -> list[tuple[int, int]]:
    """(first instruction index, length) of every run of >= min_run consecutive register FFMAs."""
    runs, start = [], None
    count = len(text) // INSTRUCTION_BYTES
    for i in range(count + 1):
        is_ffma = i < count and _is_ffma(struct.unpack_from("<Q", text, i * INSTRUCTION_BYTES)[0])
        if is_ffma and start is None:
            start = i
        elif not is_ffma and start is not None:
            if i - start >= min_run:
                runs.append((start, i - start))
            start = None
    return runs


@dataclass(frozen=True)
class FfmaYield:
    """In each run of >= min_run FFMAs, clear the reuse flags and the no-yield hint of the first
    `fraction` of the run (0 < fraction <= 1). `key` goes into the kernel cache key."""

    fraction: float
    min_run: int = 16

    def __post_init__(self) -> None:
        if not 0.0 < self.fraction <= 1.0:
            raise ValueError(f"fraction must be in (0, 1], got {self.fraction}")
        if self.min_run < 1:
            raise ValueError(f"min_run must be >= 1, got {self.min_run}")

    @property
    def key(self) -> str:
        return f"ffma-yield-v1:{self.fraction:.4f}:{self.min_run}"

    def apply(self, cubin: bytes) -> tuple[bytes, int]:
        """(patched cubin, number of instructions changed). Touches only `.text.*` sections."""
        data = bytearray(cubin)
        changed = 0
        for sec in elf.sections(cubin):
            if not sec.name.startswith(".text.") or sec.sh_type == 8:
                continue
            text = bytes(data[sec.offset:sec.offset + sec.size])
            for start, length in ffma_runs(text, self.min_run):
                # NOTE: at least one instruction, never past the run (rounding of small runs).
                head = max(1, min(length, round(length * self.fraction)))
                for i in range(start, start + head):
                    pos = sec.offset + i * INSTRUCTION_BYTES + 8
                    (high,) = struct.unpack_from("<Q", data, pos)
                    if high & _REUSE:
                        struct.pack_into("<Q", data, pos, high & ~(_REUSE | _NO_YIELD))
                        changed += 1
        return bytes(data), changed
