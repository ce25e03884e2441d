"""Kernel families: the unit the compiled backends are built from.

A family is one kernel (a template the JIT instantiates per shape) with everything the host needs
to run it. It owns

- `name`, and `Config`: its frozen config dataclass (hashable, a cache key, prints readably);
- `supports(problem) -> str | None`: None when it runs the problem, else why not;
- `declines(problem, facts) -> str | None`: why a supported problem is left to a later family
  of the table on this device (its model says another kernel is faster there); default never;
- `select_config(problem, facts) -> Config`: the heuristic, a pure function, cached;
- `candidate_configs(problem, facts) -> list[Config]`: what autotuning and sweeps try;
- `run(config, problem, a, sa, b, sb, out, c=None, index=None)`: the one public way to run a
  given config on tensors as the backend contract hands them over (`index`: m_indices, offsets
  or masked_m of the grouped kinds). Tests, sweeps and autotuning go through it.

A backend lists its families in order of preference (`FAMILIES`); `choose_family` is its
`supports`: the first family that takes the problem, or every family's reason. Adding a kernel is
adding a module with one family and a row in that table.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from ..layout import get_num_sms
from ..problem import GemmProblem

__all__ = ["DeviceFacts", "KernelFamily", "choose_family"]


@dataclass(frozen=True)
class DeviceFacts:
    """What heuristics read off a device. `num_sms` honours `set_num_sms`."""

    name: str
    capability: tuple[int, int]
    num_sms: int
    smem_per_block: int  # dynamic shared memory a block may use after opting in, bytes
    interpreter: bool = False  # Triton's CPU interpreter (fixed small facts)

    @staticmethod
    def of(device: torch.device) -> "DeviceFacts":
        """Facts of a CUDA device, read from the driver once per device and SM cap."""
        index = device.index if device.index is not None else torch.cuda.current_device()
        return _facts(index, get_num_sms(index))


@functools.lru_cache(maxsize=64)
def _facts(index: int, num_sms: int) -> DeviceFacts:
    p = torch.cuda.get_device_properties(index)
    smem = int(getattr(p, "shared_memory_per_block_optin", 0) or 99 * 1024)
    facts = DeviceFacts(p.name, (p.major, p.minor), p.multi_processor_count, smem)
    return replace(facts, num_sms=min(num_sms, facts.num_sms))


class KernelFamily:
    """Base of a family (see the module docstring); subclasses define every method."""

    name: str = ""
    Config: type = object

    def supports(self, problem: GemmProblem) -> str | None:
        raise NotImplementedError

    def declines(self, problem: GemmProblem, facts: DeviceFacts) -> str | None:
        return None

    def select_config(self, problem: GemmProblem, facts: DeviceFacts) -> Any:
        raise NotImplementedError

    def candidate_configs(self, problem: GemmProblem, facts: DeviceFacts) -> list:
        raise NotImplementedError

    def run(self, config: Any, problem: GemmProblem, a: torch.Tensor, sa: torch.Tensor,
            b: torch.Tensor, sb: torch.Tensor, out: torch.Tensor, c: torch.Tensor | None = None,
            index: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<kernel family {self.name}>"


def choose_family(families: Sequence[KernelFamily],
                  problem: GemmProblem) -> tuple[KernelFamily | None, str | None]:
    """(the first family that takes `problem`, None), or (None, every family's reason)."""
    reasons = []
    for fam in families:
        why = fam.supports(problem)
        if why is None:
            return fam, None
        reasons.append(f"{fam.name}: {why}")
    return None, "; ".join(reasons) or "no kernel family"
