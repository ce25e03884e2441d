"""Just enough ELF64 reading to check a cubin and list its kernels (no external tools)."""

from __future__ import annotations

import struct

__all__ = ["is_elf", "section_names", "kernel_names"]

_MAGIC = b"\x7fELF"
_SHT_NOBITS = 8


def is_elf(data: bytes) -> bool:
    """ELF magic, 64-bit class, little-endian: what every cubin starts with."""
    return len(data) >= 64 and data[:4] == _MAGIC and data[4] == 2 and data[5] == 1


def section_names(data: bytes) -> list[str]:
    """Names of all sections; raises ValueError on a truncated or malformed file."""
    if not is_elf(data):
        raise ValueError("not a 64-bit little-endian ELF file")
    try:
        (e_shoff,) = struct.unpack_from("<Q", data, 0x28)
        e_shentsize, e_shnum, e_shstrndx = struct.unpack_from("<HHH", data, 0x3A)
        if e_shentsize < 64 or e_shoff + e_shnum * e_shentsize > len(data) or e_shstrndx >= e_shnum:
            raise ValueError("section header table out of range")

        def header(i: int) -> tuple[int, int, int, int]:
            base = e_shoff + i * e_shentsize
            name, sh_type = struct.unpack_from("<II", data, base)
            offset, size = struct.unpack_from("<QQ", data, base + 0x18)
            return name, sh_type, offset, size

        _, _, str_off, str_size = header(e_shstrndx)
        if str_off + str_size > len(data):
            raise ValueError("string table out of range")
        strtab = data[str_off:str_off + str_size]
        names = []
        for i in range(e_shnum):
            name_off, sh_type, off, size = header(i)
            end = strtab.find(b"\x00", name_off)
            if end < 0:
                raise ValueError("unterminated section name")
            names.append(strtab[name_off:end].decode(errors="replace"))
            # NOTE: NOBITS sections (.bss, .nv.shared.*, .nv.local.*) have a size but no bytes
            # in the file.
            if sh_type != _SHT_NOBITS and off + size > len(data):
                raise ValueError(f"section {names[-1]!r} out of range")
        return names
    except struct.error as e:
        raise ValueError(f"truncated ELF: {e}") from e


def kernel_names(data: bytes) -> list[str]:
    """Kernel symbols of a cubin: every `.text.<name>` section holds one function's code, and
    the `.nv.info.<name>` section marks it as an entry point."""
    names = section_names(data)
    info = {n[len(".nv.info."):] for n in names if n.startswith(".nv.info.")}
    return [n[len(".text."):] for n in names if n.startswith(".text.") and n[len(".text."):] in info]
