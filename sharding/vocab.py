"""Vocab-parallel pieces: per-depth top-K log-probs of vocab-sharded logits, merged in global vocab ids.

`topk_logprobs(logits_BLV, K, mesh)` equals `jax.lax.top_k(jax.nn.log_softmax(logits), K)` (values up to the
last f32 bit of the log-sum-exp, ids exactly, ties in ascending global id like lax.top_k) without gathering
the [B, L, V] logits: each vocab shard computes its local max / sum-exp (one pmax + one psum of [B, L]),
its local top-K, offsets the ids by its first vocab row, and the shards' K candidates ([B, L, n*K], in shard
order = ascending ids on ties) are all-gathered and reduced to the global top-K. Feed the result to
`kimijax.spec.ddtree.build_tree_from_topk`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from kimijax.spec.ddtree import chunked_top_k, topk_logprobs as ddtree_topk_logprobs
from sharding.mesh import mesh_sizes
from sharding.rules import LOGICAL_RULES, batch_axis


def vocab_axes(mesh: Mesh, V: int) -> tuple[str, ...]:
    """Mesh axes the vocab dimension is split over on this mesh (empty: not split)."""
    sizes = mesh_sizes(mesh)
    axes = tuple(a for a in LOGICAL_RULES["vocab"] if sizes[a] > 1)
    return axes if axes and V % math.prod(sizes[a] for a in axes) == 0 else ()


def topk_logprobs(logits_BLV, K: int, mesh: Mesh | None):
    """-> (log-probs [B, L, K] f32 descending, global token ids [B, L, K] int32)."""
    V = logits_BLV.shape[-1]
    axes = () if mesh is None else vocab_axes(mesh, V)
    if not axes:
        return ddtree_topk_logprobs(logits_BLV, K)  # one device: the tree builder's own top-K
    n = math.prod(mesh_sizes(mesh)[a] for a in axes)
    Vl = V // n
    k_loc = min(K, Vl)
    bat = batch_axis(mesh, logits_BLV.shape[0])
    ax = axes if len(axes) > 1 else axes[0]

    def local(lg):
        lg = lg.astype(jnp.float32)
        m = lax.pmax(jnp.max(lg, axis=-1, keepdims=True), ax)
        shifted = lg - m
        lse = jnp.log(lax.psum(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True), ax))
        v, i = chunked_top_k(shifted - lse, k_loc)  # sliced on the GPU for few rows (ddtree.TOPK_CHUNK)
        gi = i.astype(jnp.int32) + lax.axis_index(ax).astype(jnp.int32) * Vl
        allv = lax.all_gather(v, ax, axis=v.ndim - 1, tiled=True)  # [b, L, n*k_loc], shard order
        alli = lax.all_gather(gi, ax, axis=gi.ndim - 1, tiled=True)
        tv, pos = lax.top_k(allv, K)
        return tv, jnp.take_along_axis(alli, pos, axis=-1)

    spec_in = P(bat, None, ax)
    spec_out = P(bat, None, None)
    return jax.shard_map(local, mesh=mesh, in_specs=(spec_in,), out_specs=(spec_out, spec_out),
                         check_vma=False)(logits_BLV)
