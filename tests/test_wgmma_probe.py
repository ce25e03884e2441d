"""scripts/wgmma_probe.py: its probe kernels compile for sm_90a as the mainloop they stand for
(every k-block's wgmma issued as written, none serialised by ptxas, nothing spilled)."""

import re
import subprocess

import pytest

from helpers import compiler_or_skip, load_script


def _script():
    return load_script("scripts/wgmma_probe.py")


# (probe, wgmma per k-block: 4 k-steps per chain)
CASES = [("2wg n160 promote1", 4), ("2wg n128 promote2 2 chains", 8),
         ("2wg n128 promote2 pipelined", 4), ("1wg n128 + ffma wg", 4), ("2wg n128", 4),
         ("2wg n160 promote1 turns 2 chains", 8)]


@pytest.mark.parametrize("name,per_kblock", CASES)
def test_probe_compiles_as_its_mainloop(name, per_kblock, tmp_path, monkeypatch):
    """Every k-block in the SASS is its wgmma and one wait (ptxas may unroll the loop), none
    serialised (C75xx), none dropped as dead code, nothing spilled."""
    compiler_or_skip()
    monkeypatch.setenv("FP8GEMM_CACHE_DIR", str(tmp_path / "cache"))
    mod = _script()
    probe = next(p for p in mod.PROBES if p.name == name)
    _, compiled, _, _ = mod.jit.compile_cached('#include "wgmma_probe.cuh"\n', probe.name_expr(),
                                               mod.INCLUDE_DIRS)
    assert not re.search(r"C75\d\d", compiled.log), compiled.log
    spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", compiled.log)]
    assert not spills or max(spills) == 0, compiled.log
    tool = mod.jit.cuobjdump_path()
    if tool is None:
        pytest.skip("no cuobjdump to read the SASS")
    cubin = tmp_path / "probe.cubin"
    cubin.write_bytes(compiled.cubin)
    sass = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True).stdout
    wgmma = len(re.findall(r"\bQGMMA\.64x\d+x32", sass))
    waits = len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    assert "HGMMA" not in sass, f"{name}: ptxas replaced dead wgmma by placeholders"
    assert wgmma > 0 and wgmma % per_kblock == 0 and waits == wgmma // per_kblock, \
        f"{name}: {wgmma} wgmma, {waits} waits"


def test_probe_smem_fits_and_names_are_unique():
    mod = _script()
    assert len({p.name for p in mod.PROBES}) == len(mod.PROBES)
    for p in mod.PROBES:
        assert p.smem() <= 227 * 1024 and p.threads <= mod.MAX_WGS * 128, p
        assert p.n % (8 * p.chains) == 0 and (not p.pipelined or p.chains == 1), p


def test_summary_units():
    """Two math warpgroups at N = 128 that take 640 cycles a k-block run the tensor cores 80 % of
    the time (512 cycles of MMA); an FFMA warpgroup that did 100 iterations of 128 FFMA a thread
    in 64000 cycles issued 25.6 FFMA a cycle."""
    mod = load_script("scripts/wgmma_probe.py")
    probe = next(p for p in mod.PROBES if p.name == "2wg n128 + ffma wg")
    iters = 1000
    cta = [[640 * iters, iters], [640 * iters, iters], [64000, 100], [0, 0]]
    row = mod.summarise(probe, [cta] * 3, iters, us=400.0)
    assert row["cycles_per_kblock"] == 640 and row["ideal_cycles"] == 512
    assert row["tensor_share"] == 0.8 and row["ffma_per_cycle"] == 25.6
    assert row["clock_ghz"] == 1.6
