"""Shared pytest setup.

- `@pytest.mark.gpu` tests run only where torch sees a CUDA device of compute capability (9, 0)
  (H100/H200/H800, sm_90a); elsewhere they are skipped with a reason.
- Every test starts from the same random seed.
- `clean_env` removes the FP8GEMM_* variables for a test that must not see the caller's.
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import hopper_available


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper (sm_90) GPU; skipped without one")


def pytest_collection_modifyitems(config, items):
    if hopper_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU of compute capability 9.0 (Hopper)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def clean_env(monkeypatch):
    """Remove every FP8GEMM_* environment variable for the test (restored afterwards)."""
    for name in list(os.environ):
        if name.startswith("FP8GEMM_"):
            monkeypatch.delenv(name)
    return monkeypatch


@pytest.fixture
def gpu_device():
    """torch.device("cuda") for `gpu` tests (which are skipped without a Hopper GPU)."""
    if not hopper_available():
        pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)")
    return torch.device("cuda")
