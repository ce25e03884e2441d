"""Ahead-of-time compilation of a Triton kernel for a target without a GPU (the compile checks
of the quantisation and MoE kernels: tests and scripts/triton_compile_check.py)."""

from __future__ import annotations

import triton


def compile_ahead(fn, consts: dict, target, num_warps: int = 4, **types: str):
    """(name, compiled kernel) of `fn` with `consts` as constexprs, `types` the types of those
    of its arguments that are not int32 (names it does not have are ignored), for `target` (a
    triton.backends.compiler.GPUTarget)."""
    from triton.compiler import ASTSource

    sig = {name: types.get(name, "i32") for name in fn.arg_names}
    sig.update({name: "constexpr" for name in consts})
    return fn.__name__, triton.compile(ASTSource(fn, sig, consts), target=target,
                                       options=dict(num_warps=num_warps))
