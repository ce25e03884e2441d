"""scripts/sass_kloop.py on the CPU: the mainloop it finds in a compiled 1D2D or 1D1D kernel,
counted a k-block."""

from __future__ import annotations

import pytest

from helpers import compiler_or_skip, load_script

sk = load_script("scripts/sass_kloop.py")
sw = load_script("scripts/sass_waits.py")


def test_opcode_drops_predicates_and_modifiers():
    assert sk.opcode("@!P1 FFMA.FTZ R1, R2, R3, R1") == "FFMA"
    assert sk.opcode("@!UP2 USHF.L.U32 UR13, UR4, 0x3, URZ") == "USHF"
    assert sk.opcode("@PT QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR20], RZ, !UPT") == "QGMMA"
    assert sk.opcode("BRA 0x1960") == "BRA"


def test_the_1d2d_k_loop_promotes_with_one_ffma_an_element():
    # 128x192, one 64-row wave a math warpgroup: a k-block is 4 QGMMA (K 128 in steps of 32),
    # and its promotion one FFMA per accumulator element (96 a thread), the two scales' product
    # formed once per 8-column group's scale block (a few FMUL), not once per element as the
    # 1D1D kernel must
    compiler_or_skip()
    loop = sk.k_loop(sw.parse(sw.compile_1d2d("contiguous", "7168x2048", "128x192", None)))
    assert loop is not None and loop["kblocks"] >= 1
    per = {op: n / loop["kblocks"] for op, n in loop["opcodes"].items()}
    assert per["QGMMA"] == 4 and per["FFMA"] == 96 and per.get("FMUL", 0) <= 4
    # a 256-row tile's math warpgroup runs both of its waves in a k-block: 8 QGMMA
    loop2 = sk.k_loop(sw.parse(sw.compile_1d2d("dense", "7168x2048", "256x128", None)), waves=2)
    per2 = {op: n / loop2["kblocks"] for op, n in loop2["opcodes"].items()}
    assert per2["QGMMA"] == 8 and per2["FFMA"] == 128
    # (without the waves given, the same loop counts as two k-blocks of one wave)
    assert sk.k_loop(sw.parse(sw.compile_1d2d("dense", "7168x2048", "256x128", None)))[
        "kblocks"] == 2 * loop2["kblocks"]


def test_no_loop_without_wgmma():
    from test_sass_waits import SNIPPET

    assert sk.k_loop(sw.parse(SNIPPET)) is None


def _listing(texts: list[str]) -> str:
    """A SASS listing of these instructions from address 0, 16 bytes each."""
    return "".join(f"        /*{16 * i:04x}*/                   {t} ;  /* 0x0000000000000000 */\n"
                   "                                                /* 0x000fe20000000800 */\n"
                   for i, t in enumerate(texts))


def test_kblocks_picks_the_loop_of_a_whole_turn():
    # a turn of three k-blocks unrolled (0x0-0xf0), then a loop of one k-block (0x100-0x150)
    qg = "QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR20], R24, UPT"
    turn = ([qg] * 4 + ["FFMA R1, R2, R3, R1"]) * 3 + ["BRA 0x0"]
    single = [qg] * 4 + ["FMUL R4, R5, R6", "BRA 0x100"]
    ins = sw.parse(_listing(turn + single))
    assert [i.addr for i in ins][-1] == 0x150 and ins[15].text == "BRA 0x0"
    one = sk.k_loop(ins)
    assert (one["start"], one["end"], one["kblocks"], one["instructions"]) == (0x100, 0x150, 1, 6)
    three = sk.k_loop(ins, min_kblocks=2)
    assert (three["start"], three["end"], three["kblocks"]) == (0x0, 0xf0, 3)
    assert three["opcodes"]["FFMA"] == 3 and three["instructions"] == 16
    assert sk.k_loop(ins, min_kblocks=4) is None


def test_the_1d1d_k_loop_promotes_with_two_instructions_an_element():
    # both scales vary per element (1x128 groups on A's rows and B's columns): the promotion is
    # an FMUL (sa * sb) and an FFMA an accumulator element, BLOCK_N / 2 of each a thread
    compiler_or_skip()
    loop = sk.k_loop(sw.parse(sw.compile_1d1d("wgrad", "2048", "128x152", None)))
    per = {op: n / loop["kblocks"] for op, n in loop["opcodes"].items()}
    assert per["QGMMA"] == 4 and per["FMUL"] == 76 and per["FFMA"] == 76
    grouped = sk.k_loop(sw.parse(sw.compile_1d1d("k_grouped", "7168", "128x160", None)))
    assert grouped["opcodes"]["FFMA"] / grouped["kblocks"] == 80


def test_1d1d_kind_is_checked():
    with pytest.raises(ValueError, match="wgrad or k_grouped"):
        sw.compile_1d1d("dense", "2048", "128x152", None)
