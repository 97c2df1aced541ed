"""INT4 compressed-tensors "pack-quantized" layout (routed experts of K2-Thinking, K2.5, K2.6).

Checkpoint layout (what the files hold; the XLA reference reads it and the two kernel layouts below):
  weight_packed  int32 [out, in/8]   element c of a row lives in word c // 8, bits 4*(c % 8) .. +3
                                     (element 0 in the least significant nibble), stored as q + 8.
  weight_scale   bf16  [out, in/32]  one symmetric scale per 32 consecutive inputs.
  weight_shape   int64 [2]           the logical [out, in].
Dequantize: W[r, c] = bf16(q[r, c]) * scale[r, c // 32], multiplied in bf16 as compressed-tensors does.

Experts of one layer are stacked on a leading E axis: packed [E, out, in/8], scale [E, out, in/32].
The Triton MoE kernel's load-time re-layout (words tiled for it, scales paired) is pallas_kernels/moe_layout.py;
the Mosaic GPU kernel's (thread words per [64, 32] tile, `to_mgpu_layout`) is pallas_kernels/moe_int4_mgpu.py.
Both keep the bytes; kimijax/target.py converts between the three layouts.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

GROUP = 32  # inputs per scale
PACK = 8  # int4 values per int32 word


def pack_int4_np(q: np.ndarray) -> np.ndarray:
    """q: int array [..., in] with values in [-8, 7] -> int32 [..., in/8] (compressed-tensors layout)."""
    q = np.asarray(q)
    if q.shape[-1] % PACK:
        raise ValueError(f"INT4 packing needs the input dim divisible by {PACK}, got {q.shape[-1]}")
    if q.min(initial=0) < -8 or q.max(initial=0) > 7:
        raise ValueError("INT4 values must lie in [-8, 7]")
    u = (q.astype(np.int64) + 8).astype(np.uint32).reshape(*q.shape[:-1], -1, PACK)
    shifts = (4 * np.arange(PACK, dtype=np.uint32))
    words = np.bitwise_or.reduce(u << shifts, axis=-1).astype(np.uint32)
    return words.view(np.int32)


def unpack_int4_np(packed: np.ndarray) -> np.ndarray:
    """int32 [..., in/8] -> int8 [..., in] with values in [-8, 7]."""
    w = np.asarray(packed).astype(np.int32).view(np.uint32)
    shifts = 4 * np.arange(PACK, dtype=np.uint32)
    nib = (w[..., None] >> shifts) & 0xF
    return (nib.astype(np.int8) - 8).reshape(*w.shape[:-1], -1)


def quantize_int4_np(w: np.ndarray, group: int = GROUP) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric min-max group quantization as the compressed-tensors observer does: -> (packed, scale bf16)."""
    import ml_dtypes

    w = np.asarray(w, np.float32)
    out, inp = w.shape[-2:]
    if inp % group:
        raise ValueError(f"input dim {inp} is not divisible by the group size {group}")
    g = w.reshape(*w.shape[:-1], inp // group, group)
    amax = np.abs(g).max(-1)
    scale = (amax / 7.5).astype(ml_dtypes.bfloat16)  # (max - min) / (qmax - qmin) with min = -max
    s32 = np.where(scale.astype(np.float32) == 0, 1.0, scale.astype(np.float32))
    q = np.clip(np.round(g / s32[..., None]), -8, 7).astype(np.int8).reshape(w.shape)
    return pack_int4_np(q), scale


def dequantize_np(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """-> float32 [..., out, in], rounded through bf16 like compressed-tensors."""
    import ml_dtypes

    q = unpack_int4_np(packed).astype(ml_dtypes.bfloat16)
    s = np.asarray(scale).astype(ml_dtypes.bfloat16)
    g = q.reshape(*s.shape, -1) * s[..., None]
    return g.reshape(q.shape).astype(np.float32)


def unpack_int4(packed: jax.Array) -> jax.Array:
    """int32 [..., in/8] -> int8 [..., in] (values in [-8, 7])."""
    w = jax.lax.bitcast_convert_type(packed, jnp.uint32)
    shifts = 4 * jnp.arange(PACK, dtype=jnp.uint32)
    nib = (w[..., None] >> shifts) & jnp.uint32(0xF)
    return (nib.astype(jnp.int8) - jnp.int8(8)).reshape(*packed.shape[:-1], packed.shape[-1] * PACK)


def dequantize(packed: jax.Array, scale: jax.Array, dtype=jnp.bfloat16) -> jax.Array:
    """[..., out, in/8] int32 + [..., out, in/32] bf16 -> [..., out, in] in `dtype` (bf16 multiply)."""
    q = unpack_int4(packed).astype(jnp.bfloat16)
    s = scale.astype(jnp.bfloat16)
    w = q.reshape(*s.shape, -1) * s[..., None]
    return w.reshape(q.shape).astype(dtype)
