"""scripts/ncu_stalls.py on the CPU: a source-page CSV of Nsight Compute read, grouped by how many
times each instruction ran, and the k-loop's samples divided by the work."""

from __future__ import annotations

import gzip

import pytest

from helpers import load_script

ns = load_script("scripts/ncu_stalls.py")

_COLUMNS = ["Address", "Source", "Warp Stall Sampling (All Samples)",
            "Warp Stall Sampling (Not-issued Samples)", "Instructions Executed",
            "stall_barrier", "stall_long_sb", "stall_selected", "stall_wait",
            "stall_barrier (Not Issued)"]


def _table(name: str, rows: list[tuple]) -> list[str]:
    """A kernel's block of the CSV: the name line, the header, a line an instruction
    (address, source, executed, {reason: samples})."""
    lines = [f'"Kernel Name","{name}",', ",".join(f'"{c}"' for c in _COLUMNS)]
    for addr, src, executed, stalls in rows:
        total = sum(stalls.values())
        cells = [addr, src, f"{total:,}", "0", f"{executed:,}",
                 *(str(stalls.get(r, 0)) for r in ("barrier", "long_sb", "selected", "wait")),
                 "999"]  # a not-issued column, which must not count
        lines.append(",".join(f'"{c}"' for c in cells))
    return lines


# A k-loop of 1000 k-blocks (its body and its barrier's retry branch, run 900 times), a producer
# loop run 100 times and a prologue run once.
_OURS = [("0x10", "LDC R1, c[0x0][0x28]", 8, {"selected": 1}),
         ("0x20", "SYNCS.PHASECHK.TRANS64.TRYWAIT P1, [UR20], R24", 1000, {"wait": 2}),
         ("0x30", "@!P1 BRA 0x90", 900, {"long_sb": 30}),
         ("0x40", "QGMMA.64x192x32.F32.E4M3.E4M3 R24, gdesc[UR20], RZ, !UPT", 1000,
          {"selected": 5}),
         ("0x50", "WARPGROUP.DEPBAR.LE gsb0, 0x0", 1000, {"barrier": 50}),
         ("0x60", "FFMA R12, R25, R207, R12", 1000, {"selected": 10, "wait": 3}),
         ("0x70", "UTMALDG.2D [UR8], [UR4]", 100, {"wait": 7})]


@pytest.fixture
def csv_file(tmp_path):
    text = "\n".join(["==PROF== Connected to process 1", *_table("void k<1>(int)", _OURS),
                      *_table("void other()", [("0x10", "EXIT", 4, {"selected": 1})])])
    path = tmp_path / "ncu_x_sass.csv.gz"
    with gzip.open(path, "wt") as f:
        f.write(text + "\n")
    return path


def test_reads_every_kernel_without_the_not_issued_columns(csv_file):
    kernels = ns.read(csv_file)
    assert [k.name for k in kernels] == ["void k<1>(int)", "void other()"]
    ours = kernels[0].instrs
    assert len(ours) == len(_OURS) and ours[2].executed == 900
    total, reasons = ns.sums(ours)
    assert total == 108 and reasons == {"barrier": 50, "long_sb": 30, "selected": 16, "wait": 12}


def test_the_k_loop_is_the_qgmma_classes_and_the_barrier_retry_beside_them(csv_file):
    instrs = ns.read(csv_file)[0].instrs
    by_count = ns.classes(instrs)
    assert sorted(by_count) == [8, 100, 900, 1000]
    loop = ns.k_loop(instrs)
    # the body (1000) and the retry branch (900), not the producer's loop nor the prologue
    assert sorted({i.executed for i in loop}) == [900, 1000]
    assert ns.sums(loop)[0] == 30 + 2 + 5 + 50 + 13
    assert ns.k_loop([i for i in instrs if "QGMMA" not in i.source]) == []


def test_report_divides_the_k_loop_by_the_units(csv_file, capsys):
    assert ns.units("1000x192") == 192000
    assert ns.main([str(csv_file), "--per", "1000x100"]) == 0
    out = capsys.readouterr().out
    # 100 samples in the k-loop over 100000 units: 1000 per million
    assert "k-loop per million units: 1000.0" in out
    assert "x      1000" in out and "WARPGROUP.DEPBAR" in out
    with pytest.raises(SystemExit):
        ns.main([str(csv_file), "--per", "1,2"])
