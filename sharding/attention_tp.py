"""The MLA tree attention on a mesh with `jax.shard_map`: a drop-in `KimiTarget.attn_fn`.

Why: a Pallas kernel is a custom call, which XLA's SPMD partitioner cannot split. Left to it under a tensor-
parallel mesh, the attention all-gathers q and every device runs all H heads (compiled offline for tp8 on 8
pretend H200s: each device's kernel took q [9, 64, 576], 8x its share of the work, in the compute-bound regime
at 64 heads). Under shard_map each device runs its own heads (H / tp, over "tensor") of its own requests
(over "data" when the batch divides), against the latent cache, which is head-independent and so replicated
over "tensor" and "expert" (sharding/rules.py): every device reads the whole cache of its requests, as the
HBM floor assumes. The kernel-or-reference choice of impl "auto" then sees the local head count.
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels.tree_attention import tree_attention
from sharding.mesh import ShardingError, mesh_sizes
from sharding.rules import batch_axis


def make_attention_fn(mesh: Mesh) -> Callable:
    """`attn_fn(q_BTHC, cache_BLC, lengths_B, tree_mask_BTT, scale, kv_rank, impl) -> (out_BTHK, lse_BTH)`,
    `pallas_kernels.tree_attention.tree_attention` with each device's heads and requests."""
    tp = mesh_sizes(mesh)["tensor"]

    def attn_fn(q_BTHC, cache_BLC, lengths_B, tree_mask_BTT, scale: float, kv_rank: int, impl: str):
        B, _, H, _ = q_BTHC.shape
        if H % tp:
            raise ShardingError(f"{H} attention heads do not divide over the {tp}-way tensor axis")
        b = batch_axis(mesh, B)
        local = functools.partial(tree_attention, scale=scale, kv_rank=kv_rank, impl=impl)
        f = jax.shard_map(local, mesh=mesh,
                          in_specs=(P(b, None, "tensor", None), P(b, None, None), P(b), P(b, None, None)),
                          out_specs=(P(b, None, "tensor", None), P(b, None, "tensor")), check_vma=False)
        return f(q_BTHC, cache_BLC, lengths_B, tree_mask_BTT)

    attn_fn.mesh = mesh
    return attn_fn
