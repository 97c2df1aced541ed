"""RMSNorm of a single row as one Pallas kernel (the decode step's norms).

Why: for one row XLA's GPU compiler emits a norm as two launches (a reduce, then a multiply), while from two rows
on it emits one Triton normalisation kernel (offline counts for an H200, D = 576 to 7168, f32 and bf16). A decode
step has one row per norm, and a Kimi layer has four norms; this kernel does the one-row case in one launch.
Passes of two or more rows keep XLA's norm (`rms_norm` below picks), so verify passes are unchanged.

Numerics: the reference's order (HF's): x in f32, x * rsqrt(mean(x^2) + eps), cast to x's dtype, times the weight
in x's dtype. Only the f32 sum's order differs from XLA's.

Implementations (`rms_norm(..., impl=...)`): "xla" (`rms_norm_ref`), "pallas" (Triton lowering, GPU),
"interpret" (the kernel in interpret mode, CPU tests). `default_impl()` is "xla" everywhere: the kernel is opt-in
(`KimiTarget(norm_impl="pallas")`, `scripts/bench_kimi.py --norm-impl pallas`) until a GPU run shows that one
small kernel beats XLA's two launches (not yet timed).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as pltriton

from pallas_kernels.tree_attention import next_pow2

IMPLS = ("xla", "pallas", "interpret")


def default_impl() -> str:
    return "xla"  # opt-in until measured (module docstring)


def rms_norm_ref(x, w, eps: float):
    """HF order: normalise in f32, cast back to the input dtype, then multiply by the weight."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * w.astype(x.dtype)


def _kernel(x_ref, w_ref, o_ref, *, D: int, eps: float):
    cols = jax.lax.broadcasted_iota(jnp.int32, x_ref.shape, 0)
    ok = cols < D
    x32 = pltriton.load(x_ref, mask=ok, other=0).astype(jnp.float32)
    w = pltriton.load(w_ref, mask=ok, other=0)
    y = x32 * jax.lax.rsqrt(jnp.sum(x32 * x32) / D + eps)
    pltriton.store(o_ref, y.astype(o_ref.dtype) * w.astype(o_ref.dtype), mask=ok)


def rms_norm_pallas(x, w, eps: float, *, interpret: bool = False):
    """One row (x of any shape with one element before the last axis) in one program."""
    D = x.shape[-1]
    if math.prod(x.shape[:-1]) != 1:
        raise ValueError(f"rms_norm_pallas normalises one row; got x of shape {x.shape}")
    Dp = max(16, next_pow2(D))  # Triton blocks are powers of two; the tail is masked
    out = pl.pallas_call(
        functools.partial(_kernel, D=D, eps=float(eps)),
        out_shape=jax.ShapeDtypeStruct((D,), x.dtype),
        in_specs=[pl.BlockSpec((Dp,), lambda: (0,)), pl.BlockSpec((Dp,), lambda: (0,))],
        out_specs=pl.BlockSpec((Dp,), lambda: (0,)),
        compiler_params=pltriton.CompilerParams(num_warps=4 if Dp <= 2048 else 8, num_stages=1),
        interpret=interpret, name="rms_norm_row",
    )(x.reshape(D), w)
    return out.reshape(x.shape)


def rms_norm(x, w, eps: float, impl: str = "xla"):
    """The model's RMSNorm: the one-row kernel for a single row when impl is a kernel, else the reference."""
    if impl not in IMPLS:
        raise ValueError(f"unknown RMSNorm impl {impl!r}: choose one of {', '.join(IMPLS)}")
    if impl == "xla" or math.prod(x.shape[:-1]) != 1:
        return rms_norm_ref(x, w, eps)
    return rms_norm_pallas(x, w, eps, interpret=impl == "interpret")
