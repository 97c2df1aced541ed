"""Pieces shared by the targets and the drafter: RMSNorm, SwiGLU MLP, YaRN rope, parameter helpers."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kimijax.config import YarnScaling, yarn_mscale
from pallas_kernels import skinny_mlp
from pallas_kernels.rms_norm import rms_norm  # noqa: F401  (re-exported: the models' norm)


def param(mod: nn.Module, name: str, shape, axes, dtype, init: str = "fan_in", fan_in: int | None = None):
    """A parameter with logical axis names (sharding/rules.py maps them to mesh axes)."""
    if init == "ones":
        fn = lambda key, s, d: jnp.ones(s, d)
    elif init == "zeros":
        fn = lambda key, s, d: jnp.zeros(s, d)
    elif init == "bits":  # packed INT4 words: any 32 random bits are 8 valid nibbles
        fn = lambda key, s, d: jax.lax.bitcast_convert_type(jax.random.bits(key, s, jnp.uint32), jnp.int32)
    elif init == "int4_scale":  # q in [-8, 7] has std ~4.6; scale so weights have std 1/sqrt(fan_in)
        fn = lambda key, s, d: ((jnp.abs(jax.random.normal(key, s, jnp.float32)) * 0.5 + 0.75) / (
            4.6 * math.sqrt(fan_in))).astype(d)  # bf16 like the checkpoint (an f32 x bf16 product stays f32)
    elif init == "int4_scale_pairs":  # the same scales as int32 words of two bf16 (the MoE kernel's layout)
        def fn(key, s, d):
            pairs = ((jnp.abs(jax.random.normal(key, (*s, 2), jnp.float32)) * 0.5 + 0.75) / (
                4.6 * math.sqrt(fan_in))).astype(jnp.bfloat16)
            return jax.lax.bitcast_convert_type(pairs, d)
    elif init == "small":  # router bias: small, so random models route ~uniformly like trained ones
        fn = lambda key, s, d: (0.01 * jax.random.normal(key, s, jnp.float32)).astype(d)
    elif init == "normal":
        fn = lambda key, s, d: jax.random.normal(key, s, jnp.float32).astype(d)
    else:
        fi = fan_in if fan_in is not None else shape[-1]
        fn = lambda key, s, d: (jax.random.normal(key, s, jnp.float32) / math.sqrt(fi)).astype(d)
    return mod.param(name, nn.with_logical_partitioning(lambda key: fn(key, tuple(shape), dtype), axes))


class RMSNorm(nn.Module):
    dim: int
    eps: float
    dtype: jnp.dtype
    axis_name: str = "norm"
    impl: str = "xla"  # "pallas": one kernel for a single row (pallas_kernels/rms_norm.py); passes of 2+ rows: XLA

    @nn.compact
    def __call__(self, x):
        w = param(self, "weight", (self.dim,), (self.axis_name,), self.dtype, init="ones")
        return rms_norm(x, w, self.eps, self.impl)


# f32 attention-score elements per query chunk (1 GiB): a long prompt's [B, H, T, T] scores would not fit (Kimi,
# B=8 x 4k tokens x 64 heads: 34 GB), so prefill walks the queries in chunks of at most this many scores.
SCORE_ELEMS = 1 << 28


def causal_rows(t0, C: int, S: int, B: int):
    """bool [B, C, S]: query t0 + i of this pass sees keys 0 .. t0 + i (built per chunk, never [T, T])."""
    return jnp.broadcast_to((t0 + jnp.arange(C))[:, None] >= jnp.arange(S)[None, :], (B, C, S))


def in_query_chunks(one, qs, mask_BTS, scores_per_query: int):
    """one(*q_chunks, t0, mask_chunk) over chunks of the T queries (axis 1 of each array in qs and of mask_BTS,
    which may be None), sized so a chunk's scores stay within SCORE_ELEMS; outputs [B, chunk, ...] are joined on
    axis 1. A single chunk is one plain call. Padded query rows repeat the last row and are dropped."""
    B, T = qs[0].shape[:2]
    chunk = max(1, min(T, SCORE_ELEMS // max(1, scores_per_query)))
    n = -(-T // chunk)
    if n == 1:
        return one(*qs, 0, mask_BTS)
    pad = n * chunk - T

    def split(x):  # [B, T, ...] -> [n, B, chunk, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), mode="edge")
        return jnp.moveaxis(x.reshape(B, n, chunk, *x.shape[2:]), 1, 0)

    xs = (tuple(split(q) for q in qs), jnp.arange(n) * chunk, None if mask_BTS is None else split(mask_BTS))
    o = jax.lax.map(lambda a: one(*a[0], a[1], a[2]), xs)
    return jnp.moveaxis(o, 0, 1).reshape(B, n * chunk, *o.shape[3:])[:, :T]


def swiglu(x_BTD, w_gate_FD, w_up_FD, w_down_DF, precision=None):
    g = jnp.einsum("btd,fd->btf", x_BTD, w_gate_FD, precision=precision)
    u = jnp.einsum("btd,fd->btf", x_BTD, w_up_FD, precision=precision)
    return jnp.einsum("btf,df->btd", jax.nn.silu(g) * u, w_down_DF, precision=precision)


class MLP(nn.Module):
    """down(silu(gate x) * up x); weights stored [out, in] as in the checkpoint."""
    dim: int
    hidden: int
    dtype: jnp.dtype
    precision: Any = None  # dot precision (the f32 Llama target asks for HIGHEST); None = backend default
    impl: str = "xla"  # "pallas" / "interpret": pallas_kernels/skinny_mlp.py for f32 passes of <= 256 rows

    @nn.compact
    def __call__(self, x_BTD):
        g = param(self, "gate_proj", (self.hidden, self.dim), ("mlp", "embed"), self.dtype)
        u = param(self, "up_proj", (self.hidden, self.dim), ("mlp", "embed"), self.dtype)
        d = param(self, "down_proj", (self.dim, self.hidden), ("embed", "mlp"), self.dtype)
        B, T, D = x_BTD.shape
        if self.impl != "xla" and x_BTD.dtype == jnp.float32 and B * T <= skinny_mlp.MAX_ROWS:
            y = skinny_mlp.swiglu(x_BTD.reshape(B * T, D), g, u, d, impl=self.impl)
            return y.reshape(B, T, D).astype(x_BTD.dtype)
        return swiglu(x_BTD, g, u, d, self.precision)


# ---------------------------------------------------------------- rope
def yarn_inv_freq(dim: int, base: float, yarn: YarnScaling | None) -> tuple[np.ndarray, float]:
    """(inv_freq [dim/2] float32, cos/sin amplitude) exactly as HF `_compute_yarn_parameters` computes them."""
    pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    ext = (1.0 / pos_freqs).astype(np.float32)
    if yarn is None:
        return ext, 1.0
    f = yarn.factor
    inter = (1.0 / (np.float32(f) * pos_freqs)).astype(np.float32)

    def corr(n_rot):
        return (dim * math.log(yarn.original_max_position_embeddings / (n_rot * 2 * math.pi))) / (2 * math.log(base))

    low = max(math.floor(corr(yarn.beta_fast)), 0)
    high = min(math.ceil(corr(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extrap_w = (1 - ramp).astype(np.float32)
    inv = (inter * (1 - extrap_w) + ext * extrap_w).astype(np.float32)
    if yarn.mscale and yarn.mscale_all_dim:
        amp = yarn_mscale(f, yarn.mscale) / yarn_mscale(f, yarn.mscale_all_dim)
    else:
        amp = yarn_mscale(f)
    return inv, float(amp)


def rope_cos_sin(positions, inv_freq: np.ndarray, amplitude: float):
    """positions [...] int -> cos, sin [..., dim/2] float32."""
    ang = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    return jnp.cos(ang) * amplitude, jnp.sin(ang) * amplitude


def apply_rope_interleaved(x, cos, sin):
    """GPT-J layout: dims (2j, 2j+1) form pair j. x [..., R]; cos/sin broadcastable to [..., R/2]."""
    x32 = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, 2)
    a, b = x32[..., 0], x32[..., 1]
    out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1)
    return out.reshape(x.shape).astype(x.dtype)


def apply_rope_half(x, cos, sin):
    """NeoX layout: dim j pairs with dim j + R/2 (Llama, Qwen3/DFlash drafters): (a, b) -> (a cos - b sin,
    b cos + a sin). Written as x * cos + swap(x) * (-sin, sin) over a [2, R/2] view (the same products and sums;
    XLA may contract them into FMAs differently, an ulp-level change) because a concatenate of the two halves
    became its own kernel on the GPU, once per layer and pass."""
    x32 = x.astype(jnp.float32)
    h = x.shape[-1] // 2
    x2 = x32.reshape(*x.shape[:-1], 2, h)
    sin2 = jnp.stack([-sin, sin], axis=-2)  # [..., 2, h]: built once per pass from the positions
    out = x2 * cos[..., None, :] + x2[..., ::-1, :] * sin2
    return out.reshape(x.shape).astype(x.dtype)


def causal_tree_mask(B: int, T: int):
    """Plain causal mask for T new tokens, in the tree-mask format the attention takes: bool [B, T, T]."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((T, T), bool)), (B, T, T))
