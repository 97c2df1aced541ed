"""Cache rows: the models' cache write (`write_rows`, XLA) and the spec round's cache commit as one kernel
(move the accepted tree rows of every layer's cache).

After a verify, the K/V (or latent) rows of the tree's N+1 nodes sit at slots S..S+N of each layer's cache;
the accepted path's rows must move to S..S+n-1. XLA does this as one fusion per layer cache (a gather plus
an in-place dynamic-update-slice): 30 launches per round for SmolLM2, 61 for Kimi K2.6, each moving a few
KB (scripts/offline_gpu.py counts them; BENCHMARKS.md "Launches per round, counted offline"). Here one
Pallas kernel moves them all: grid (B, caches), program (b, l) copies request b's n_b rows of cache l in
place (the caches are aliased inputs and outputs), row j from slot src[b, j] to slot dst[b] + j, in
pieces of at most `chunk` elements.

No hazards: the path is strictly increasing with path[j] >= j, so a row's source slot is never an earlier
row's destination, and rows are copied in order (the reference reads every source row before writing).

Implementations: "xla" `move_rows_ref`; "pallas" the kernel (GPU); "interpret" the kernel on the CPU. The
round uses "xla" until a GPU run measures the kernel (`kimijax.RoundKernels(commit=...)`, an Engine argument).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

CHUNK = 128  # row elements per load / store on the GPU at most (pieces are the largest power of two <= 128
#              dividing the row: 128 for SmolLM2's 384-wide K/V rows, 64 for Kimi's 576-wide latent rows)


def write_rows(cache_BL, rows_BT, start_B):
    """cache[b, start_B[b] + t] = rows[b, t] (dynamic_update_slice semantics per request: a start is clamped so
    the rows fit). One request is a plain dynamic-update-slice: vmapped, it becomes a scatter, which XLA turns
    back into an update-slice guarded by a read of the old rows, one more launch per cache (offline count)."""
    rows_BT = rows_BT.astype(cache_BL.dtype)
    if cache_BL.shape[0] == 1:
        return lax.dynamic_update_slice_in_dim(cache_BL, rows_BT, start_B[0], axis=1)
    return jax.vmap(lambda c, r, s: lax.dynamic_update_slice_in_dim(c, r, s, axis=0))(cache_BL, rows_BT, start_B)


def move_rows_ref(caches, src_BP, dst_B, n_B):
    """XLA reference: caches[l][b, dst_B[b] + j] = caches[l][b, src_BP[b, j]] for j < n_B[b]; rows j >= n_B[b]
    are rewritten unchanged (static shapes). src must be increasing with src[b, j] >= dst[b] + j."""
    P = src_BP.shape[1]
    j_P = jnp.arange(P, dtype=jnp.int32)
    dst_BP = dst_B[:, None] + j_P[None]
    src_BP = jnp.where(j_P[None] < n_B[:, None], src_BP, dst_BP)

    def one(c):
        rows = jnp.take_along_axis(c, src_BP.reshape(src_BP.shape + (1,) * (c.ndim - 2)), axis=1)
        return write_rows(c, rows, dst_B)

    return [one(c) for c in caches]


def move_rows_pallas(caches, src_BP, dst_B, n_B, *, interpret: bool = False, chunk: int = CHUNK):
    """`move_rows_ref` as one kernel launch for all caches (each [B, L, ...], any dtype; shapes may differ)."""
    if not caches:
        return []
    B, P = src_BP.shape
    shapes = [c.shape for c in caches]
    flat = [c.reshape(c.shape[0], c.shape[1], -1) for c in caches]
    widths = [f.shape[2] for f in flat]
    nc = len(flat)

    def kernel(src_ref, dst_ref, n_ref, *refs):
        outs = refs[nc:]  # aliased to the inputs: read and write through the outputs
        b, l = pl.program_id(0), pl.program_id(1)
        n, d0 = n_ref[b], dst_ref[b]
        for i in range(nc):
            R = widths[i]
            # pieces that tile the row exactly (Triton wants power-of-two shapes; interpret mode takes any)
            w = R if interpret else math.gcd(R, chunk)

            @pl.when(l == i)
            def _(ref=outs[i], R=R, w=w):
                def row(j, carry):
                    s = src_ref[b, j]
                    for c0 in range(0, R, w):
                        ref[b, d0 + j, pl.ds(c0, w)] = ref[b, s, pl.ds(c0, w)]
                    return carry

                lax.fori_loop(0, jnp.minimum(n, P), row, 0)

    out = pl.pallas_call(
        kernel,
        grid=(B, nc),
        out_shape=[jax.ShapeDtypeStruct(f.shape, f.dtype) for f in flat],
        input_output_aliases={3 + i: i for i in range(nc)},
        interpret=interpret,
        name="move_rows",
    )(src_BP.astype(jnp.int32), dst_B.astype(jnp.int32), n_B.astype(jnp.int32), *flat)
    return [o.reshape(s) for o, s in zip(out, shapes)]


def move_rows(caches, src_BP, dst_B, n_B, impl: str = "xla"):
    """Dispatch: "xla" (reference), "pallas" (GPU kernel), "interpret" (the kernel on the CPU)."""
    if impl == "xla":
        return move_rows_ref(caches, src_BP, dst_B, n_B)
    if impl in ("pallas", "interpret"):
        return move_rows_pallas(caches, src_BP, dst_B, n_B, interpret=impl == "interpret")
    raise ValueError(f"unknown move_rows impl {impl!r}: choose xla, pallas or interpret")


__all__ = ["move_rows", "move_rows_pallas", "move_rows_ref", "write_rows"]
