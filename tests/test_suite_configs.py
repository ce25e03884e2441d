"""scripts/suite_configs.py: the CUDA backend's pick for every bench case, on the CPU."""

import pytest

from fp8gemm.bench.impls import case_problem
from fp8gemm.bench.suites import all_suite_names, suite_cases
from helpers import load_script


def _script():
    return load_script("scripts/suite_configs.py")


@pytest.mark.parametrize("suite", all_suite_names())
def test_a_line_per_case_with_its_family(suite):
    mod = _script()
    cases = [c for c in suite_cases(suite) if c.op != "moe_layer"]
    lines = mod.case_lines(suite)
    assert len(lines) == len(cases)
    for c, line in zip(cases, lines):
        assert line.startswith(f"{suite}/{c.op} {c.m}x{c.n}x{c.k}"), line
        assert " sm90_" in line or "not the CUDA backend's" in line, line


def test_moe_layer_cases_have_no_one_problem():
    moe = next(c for s in all_suite_names() for c in suite_cases(s) if c.op == "moe_layer")
    with pytest.raises(ValueError, match="pipeline"):
        case_problem(moe)


def test_main_prints_the_chosen_suites(capsys):
    assert _script().main(["deepseek-dense", "--sms", "66"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) == len(suite_cases("deepseek-dense"))
    assert all(line.startswith("deepseek-dense/dense ") for line in out)
