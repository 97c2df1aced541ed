"""The INT4 MoE kernel's expert layout (pallas_kernels/moe_int4.py), made once at load time, and its inverse.

Checkpoint layout (kimijax/quant.py): packed int32 [E, out, in/8] (element c in nibble c % 8 of word c // 8,
stored as q + 8) and bf16 scales [E, out, in/32].  Kernel layout (keys `*_planar`, `*_scale_t`):
  gate/up words int32 [E, F*D/128, 16], scales int32 [E, D/64, F];
  down words    int32 [E, D*F/128, 16], scales int32 [E, F/64, D].
Words: the inputs of each row are cut into superblocks of 128 (= 4 scale groups of 32) held in 16 int32 words;
nibble 4*b + i (bits 4(4b+i) .. +3, still q + 8) of word m of superblock s is input 128*s + 32*i + 2*m + b.
So one 32-bit shift + and/or turns nibbles i and i+4 of a word into the bf16 pair (128 + v of inputs 2m, 2m+1
of plane i), already packed as the tensor cores want it; a bf16x2 fma subtracts 136 (exact).  Plane i of a
superblock is scale group 4*s + i.  The [rows, 16] words of one superblock of a block of rows are stored
contiguously (`_tile`: 64-row blocks for gate/up, block-major; 128-row blocks of D for down, superblock-major,
so a tensor-parallel split of F is a split of the row axis in both), so a kernel loop iteration reads one
4-8 KB piece instead of `rows` 64-byte pieces a row apart (measured 1.08-1.10x).
Scales: transposed and paired: word (j, r) holds the bf16 scales of groups 2j (low 16 bits) and 2j + 1
(high) of row r, so a plane pair's scales for a tile of rows are one contiguous load of 32-bit words.  Why
32-bit: Triton's software pipeliner only turns loads of >= 4 bytes per thread into asynchronous copies
(cp.async); as [rows] bf16 vectors the scale loads stayed synchronous and every loop iteration waited on a
global-memory round trip (offline SASS, scripts/triton_sass.py moe: 16 LDG.U16 per iteration; paired words: all
loads LDGSTS), 1.3-1.55x slower (BENCHMARKS.md).  Byte counts equal the checkpoint's.  The layout needs D
and F (per tensor-parallel shard) divisible by 128.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kimijax.quant import dequantize

SB = 128  # inputs per INT4 superblock (16 words, 4 planes = 4 scale groups of 32)
_CKPT_KEYS = ("gate_packed", "gate_scale", "up_packed", "up_scale", "down_packed", "down_scale")
_PLANAR_KEYS = ("gate_planar", "gate_scale_t", "up_planar", "up_scale_t", "down_planar", "down_scale_t")


def checkpoint_shapes(E: int, D: int, F: int, group: int = 32) -> dict:
    """ShapeDtypeStructs of E INT4 experts of width D, F in the checkpoint layout (for eval_shape / lowering)."""
    S = jax.ShapeDtypeStruct
    gu = {"packed": S((E, F, D // 8), jnp.int32), "scale": S((E, F, D // group), jnp.bfloat16)}
    dn = {"packed": S((E, D, F // 8), jnp.int32), "scale": S((E, D, F // group), jnp.bfloat16)}
    return {f"{n}_{k}": v for n, part in (("gate", gu), ("up", gu), ("down", dn)) for k, v in part.items()}


def _pack_nibbles(u8):
    """uint [..., n*8] (values 0..15) -> int32 [..., n], element 8w + i in nibble i of word w."""
    v = u8.astype(jnp.uint32).reshape(*u8.shape[:-1], -1, 8) << (4 * jnp.arange(8, dtype=jnp.uint32))
    return lax.bitcast_convert_type(jnp.sum(v, axis=-1, dtype=jnp.uint32), jnp.int32)  # disjoint bits


def _nibbles(packed):
    """int32 [..., n] -> uint8 [..., n*8] in word order (nibble i of word w -> position 8w + i)."""
    w = lax.bitcast_convert_type(packed, jnp.uint32)
    nib = (w[..., None] >> (4 * jnp.arange(8, dtype=jnp.uint32))) & jnp.uint32(0xF)
    return nib.astype(jnp.uint8).reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def _to_planar(packed):
    """checkpoint packing [..., in/8] -> kernel packing (same shape; module docstring)."""
    n = _nibbles(packed)  # [..., in], element c at c
    s = n.reshape(*n.shape[:-1], -1, 4, 16, 2)  # [..., sb, i, m, b] = input 128 sb + 32 i + 2 m + b
    s = jnp.moveaxis(s, -3, -1)  # [..., sb, m, b, i]: word m, nibble 4 b + i
    return _pack_nibbles(s.reshape(n.shape))


def _from_planar(planar):
    """kernel packing -> checkpoint packing (same shape)."""
    n = _nibbles(planar).reshape(*planar.shape[:-1], -1, 16, 2, 4)  # [..., sb, m, b, i]
    n = jnp.moveaxis(n, -1, -3).reshape(*planar.shape[:-1], planar.shape[-1] * 8)  # element order
    return _pack_nibbles(n)


def _pair_scales(scale_t):
    """bf16 [..., G, out] -> int32 [..., G/2, out]: word (j, r) holds the scale of group 2j in its low 16 bits
    and of group 2j + 1 in its high 16 bits (so the kernel loads 32-bit scale words: see module docstring)."""
    *lead, G, O = scale_t.shape
    pairs = jnp.moveaxis(scale_t.reshape(*lead, G // 2, 2, O), -2, -1)  # [..., G/2, out, 2]
    return lax.bitcast_convert_type(pairs, jnp.int32)


def _unpair_scales(words):
    """Inverse of `_pair_scales`: int32 [..., G/2, out] -> bf16 [..., G, out]."""
    *lead, G2, O = words.shape
    return jnp.moveaxis(lax.bitcast_convert_type(words, jnp.bfloat16), -1, -2).reshape(*lead, 2 * G2, O)


def _scales_to_kernel(scale):  # checkpoint [..., out, in/32] bf16 -> kernel [..., in/64, out] int32 words
    return _pair_scales(jnp.swapaxes(scale, -1, -2))


def _scales_to_checkpoint(words):
    return jnp.swapaxes(_unpair_scales(words), -1, -2)


def _tile(planar, rows: int, sb_major: bool):
    """One expert's planar words [out, in/8] -> [out*in/128, 16]: the [rows, 16] tile of row block b and
    superblock s is stored contiguously, tiles ordered (b, s) or, sb_major, (s, b).  A loop iteration of the
    kernel then reads one 4-8 KB piece instead of `rows` 64-byte pieces a row apart (measured 1.08-1.10x at
    T = 9 / 65).  gate/up: 64-row blocks, block-major (a tensor-parallel split of F splits this axis);
    down: 128-row blocks of D, superblock-major (its superblocks run along F, which tensor parallelism splits)."""
    out, w = planar.shape
    t = planar.reshape(out // rows, rows, w // 16, 16)  # [b, r, s, m]
    t = jnp.transpose(t, (2, 0, 1, 3) if sb_major else (0, 2, 1, 3))
    return t.reshape(out * w // 16, 16)


def _untile(tiled, out: int, rows: int, sb_major: bool):
    """Inverse of `_tile` -> [out, in/8]."""
    w = tiled.shape[0] * 16 // out
    nb, ns = out // rows, w // 16
    t = tiled.reshape((ns, nb, rows, 16) if sb_major else (nb, ns, rows, 16))
    t = jnp.transpose(t, (1, 2, 0, 3) if sb_major else (0, 2, 1, 3))  # -> [b, r, s, m]
    return t.reshape(out, w)


TILE_GU, TILE_DN = 64, 128  # rows per weight tile of gate/up and of down (the kernel's default blocks)
_TILING = {"gate": (TILE_GU, False), "up": (TILE_GU, False), "down": (TILE_DN, True)}


def _words_to_kernel(name):
    rows, sb_major = _TILING[name]
    return lambda packed: _tile(_to_planar(packed), rows, sb_major)


def _words_to_checkpoint(name, out):
    rows, sb_major = _TILING[name]
    return lambda tiled: _from_planar(_untile(tiled, out, rows, sb_major))


def _convert(experts: dict, src: tuple, dst: tuple, words_fn, scales_fn) -> dict:
    """src keys -> dst keys (both in _PLANAR_KEYS order: words, scales per matrix): words through
    words_fn(name, scales) one expert at a time (lax.map: the temporary is one expert's nibbles, not the
    layer's), scales through scales_fn."""
    out = {}
    for j, name in enumerate(("gate", "up", "down")):
        words, scales = experts[src[2 * j]], experts[src[2 * j + 1]]
        out[dst[2 * j]] = lax.map(words_fn(name, scales), words)
        out[dst[2 * j + 1]] = scales_fn(scales)
    return out


def relayout_for_kernel(experts: dict) -> dict:
    """One-time load-time re-layout of an INT4 expert dict into the kernel layout (module docstring).
    bf16 dicts and dicts already in the kernel layout are returned unchanged."""
    if "gate_packed" not in experts:
        return experts
    return _convert(experts, _CKPT_KEYS, _PLANAR_KEYS, lambda name, _: _words_to_kernel(name), _scales_to_kernel)


def relayout_to_checkpoint(experts: dict) -> dict:
    """Inverse of `relayout_for_kernel` (for savers): kernel layout -> checkpoint layout, bit for bit."""
    if "gate_planar" not in experts:
        return experts
    return _convert(experts, _PLANAR_KEYS, _CKPT_KEYS,
                    lambda name, scales: _words_to_checkpoint(name, scales.shape[-1]), _scales_to_checkpoint)


def kernel_layout_ok(D: int, F: int, tp: int = 1) -> bool:
    """Whether experts of width D x F can take the kernel layout with F split `tp` ways (tensor parallel):
    superblocks of 128 inputs must not straddle a row end or an F shard."""
    return D % SB == 0 and F % tp == 0 and (F // tp) % SB == 0


def dequant_expert(name, tiled, scale_t, dtype):
    """One expert's `name` matrix, kernel layout -> [out, in] (same numerics as kimijax.quant.dequantize)."""
    packed = _words_to_checkpoint(name, scale_t.shape[-1])(tiled)
    return dequantize(packed, _scales_to_checkpoint(scale_t), dtype)


