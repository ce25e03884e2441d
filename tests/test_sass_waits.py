"""scripts/sass_waits.py on the CPU: the control bits it reads from cuobjdump's SASS, and where a
compiled 1D2D kernel first waits for each global load."""

from __future__ import annotations

import re

from helpers import compiler_or_skip, load_script

sw = load_script("scripts/sass_waits.py")

# cuobjdump -sass of a contiguous 1D2D kernel (128x192): two layout loads, each moved to a
# uniform register (R2UR) at once, which waits for the load's scoreboard (SB2, SB3).
SNIPPET = """
        /*2830*/              @!P0 LDG.E.CONSTANT R4, desc[UR36][R4.64] ;                       /* 0x0000002404048981 */
                                                                                                /* 0x000ea8000c1e9900 */
        /*2840*/                   IMAD.U32 R6, RZ, RZ, UR14 ;                                  /* 0x0000000eff067e24 */
                                                                                                /* 0x000fe2000f8e00ff */
        /*2850*/                   @!UP3 ULDC UR14, c[0x0][0x228] ;                             /* 0x00008a00000ebab9 */
                                                                                                /* 0x000fe20000000800 */
        /*2860*/                   IMAD.U32 R7, RZ, RZ, UR15 ;                                  /* 0x0000000fff077e24 */
                                                                                                /* 0x000fe2000f8e00ff */
        /*2870*/                   @!UP2 ULDC UR15, c[0x0][0x228] ;                             /* 0x00008a00000faab9 */
                                                                                                /* 0x000fc80000000800 */
        /*2880*/              @!P1 LDG.E.CONSTANT R6, desc[UR36][R6.64] ;                       /* 0x0000002406069981 */
                                                                                                /* 0x000ee2000c1e9900 */
        /*2890*/              @!P0 R2UR UR4, R4 ;                                               /* 0x00000000040482ca */
                                                                                                /* 0x004fe400000e0000 */
        /*28a0*/              @!P1 R2UR UR5, R6 ;                                               /* 0x00000000060592ca */
                                                                                                /* 0x008fd600000e0000 */
        /*28b0*/                   @!UP3 UISETP.GE.U32.AND UP0, UPT, UR4, UR14, UPT ;           /* 0x0000000e0400b28c */
                                                                                                /* 0x000fc8000bf06070 */
"""


def test_control_bits_and_first_waits():
    ins = sw.parse(SNIPPET)
    assert [i.addr for i in ins] == list(range(0x2830, 0x28c0, 0x10))
    ld0, ld1, mv0, mv1 = ins[0], ins[5], ins[6], ins[7]
    assert ld0.text.startswith("@!P0 LDG.E.CONSTANT R4") and ld0.write_sb == 2
    assert ld1.write_sb == 3 and ld1.stall == 1
    assert mv0.wait_mask == 1 << 2 and mv1.wait_mask == 1 << 3
    # an instruction with no result scoreboard sets none, and waits on none
    assert ins[1].write_sb == sw.NO_SCOREBOARD and ins[1].wait_mask == 0
    waits = sw.load_waits(ins)
    assert [(w["load"].addr, w["waiter"].addr, w["distance"]) for w in waits] == \
        [(0x2830, 0x2890, 6), (0x2880, 0x28a0, 2)]
    # without the waiting instructions, nothing after a load waits on it
    tail = sw.load_waits(ins[:6])
    assert tail[0]["waiter"] is None and tail[1]["distance"] is None
    assert sw.report("snippet", SNIPPET, within=4) == 1
    assert sw.report("snippet", SNIPPET, within=None) == 2


def test_the_next_tiles_b_scales_load_is_waited_on_a_tile_later():
    # the math warps load the next tile's B scales at a tile's start and store them to shared
    # memory at the next one: in code order, the first wait on that load is the STS, well
    # after the load (not right after it, where the warp would stall for the round trip)
    compiler_or_skip()
    waits = sw.load_waits(sw.parse(sw.compile_1d2d("contiguous", "7168x2048", "128x192", None)))
    to_smem = [w for w in waits if w["waiter"] and re.search(r"\bSTS\b", w["waiter"].text)]
    assert to_smem and all(w["distance"] > 16 for w in to_smem), \
        [(hex(w["load"].addr), w["distance"]) for w in to_smem]
