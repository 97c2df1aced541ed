"""Expert-parallel routed experts with `jax.shard_map`: a drop-in `KimiTarget.expert_fn`.

Routed expert weights are split over the mesh: experts over "expert" (each device owns E/ep whole experts)
and, inside each expert, the hidden dim F over "tensor" (TP-MoE); tokens are split over "data" when their
count divides it, else replicated. Routing runs outside (replicated router), so every device knows every
token's k experts and weights.

dispatch = "psum" (works on every backend, the default on CPU):
  each device runs the routed-expert computation (the Pallas INT4 kernel via `pallas_kernels.moe_int4.moe`,
  or its XLA reference) for the tokens of its data shard against its local expert slice only: pairs routed
  to a non-local expert get weight 0 and a local expert id already in use (so no extra expert weights are
  read; a device with no local pair skips the computation), then one psum over ("expert", "tensor")
  combines the partial outputs. Communication per MoE layer: an all-reduce of [T/dp, D].
dispatch = "a2a" (fixed-capacity all-to-all; runs on CPU too, selected explicitly):
  the T tokens (replicated over "expert") are cut into ep slices; each device sends its slice's (token,
  expert) pairs to the owners of the experts with `lax.all_to_all` in fixed-capacity buffers (T/ep * k rows
  per peer), the owners run their local experts, results come back by a second all_to_all, are combined
  with the routing weights, psum'ed over "tensor" and all-gathered over "expert".
dispatch = "ragged": the same exchange with `lax.ragged_all_to_all` (only the used rows move; pairs sorted
  by owner). ragged_all_to_all is UNIMPLEMENTED on XLA:CPU, so off GPU an all_gather-based emulation with the
  same arguments stands in (chosen by backend): the bookkeeping is tested on CPU, the collective itself only
  on GPU.
dispatch = "auto": "psum" (see README: psum is the layout that needs no dispatch at decode sizes).
"""

from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from pallas_kernels.moe_int4 import moe, num_experts
from sharding.mesh import ShardingError, mesh_sizes
from sharding.rules import logical_to_spec

# Logical axes of the routed-expert dict leaves, checkpoint (packed), kernel (planar), mgpu and bf16 layouts.
EXPERT_AXES: dict[str, tuple[str, ...]] = {
    "gate_packed": ("expert", "expert_mlp", "embed_packed"),
    "gate_scale": ("expert", "expert_mlp", "embed_groups"),
    "up_packed": ("expert", "expert_mlp", "embed_packed"),
    "up_scale": ("expert", "expert_mlp", "embed_groups"),
    "down_packed": ("expert", "embed", "expert_mlp_packed"),
    "down_scale": ("expert", "embed", "expert_mlp_groups"),
    "gate_planar": ("expert", "expert_mlp", "embed_packed"),
    "gate_scale_t": ("expert", "embed_groups", "expert_mlp"),
    "up_planar": ("expert", "expert_mlp", "embed_packed"),
    "up_scale_t": ("expert", "embed_groups", "expert_mlp"),
    "down_planar": ("expert", "expert_mlp_packed", "embed"),  # tiles superblock-major: F splits axis 1
    "down_scale_t": ("expert", "expert_mlp_groups", "embed"),
    # Mosaic layout (pallas_kernels/moe_int4_mgpu.py): F's 64-row blocks (gate/up) and 32-input groups (down)
    # split over the tensor axis; the tile dimensions stay whole
    "gu_q": ("expert", "expert_mlp", "embed_groups", "tile", "tile"),
    "gu_s": ("expert", "expert_mlp", "embed_groups", "tile"),
    "dn_q": ("expert", "embed", "expert_mlp_groups", "tile"),
    "dn_s": ("expert", "embed", "expert_mlp_groups", "tile"),
    "gate": ("expert", "expert_mlp", "embed"),
    "up": ("expert", "expert_mlp", "embed"),
    "down": ("expert", "embed", "expert_mlp"),
}


def expert_specs(experts: dict, mesh: Mesh) -> dict:
    """PartitionSpec per expert-dict leaf (the same rules as sharding/rules.py)."""
    out = {}
    for k, v in experts.items():
        if k not in EXPERT_AXES:
            raise ShardingError(f"routed-expert tensor {k!r} has no partition rule in sharding/moe_ep.py")
        out[k] = logical_to_spec(EXPERT_AXES[k], v.shape, mesh, what=f"experts/{k}")
    tp = mesh_sizes(mesh)["tensor"]
    if tp > 1 and "gate_planar" in experts:  # planar superblocks (128 inputs) must not straddle F shards
        F = experts["gate_scale_t"].shape[2]
        if (F // tp) % 128:
            raise ShardingError(f"kernel-layout experts: F={F} split {tp}-way leaves {F // tp} rows per shard, "
                                f"not a multiple of the 128-input superblock")
    return out


def _localize(ids_Tk, w_Tk, e0, E_loc):
    """Map routed pairs onto this device's experts: non-local pairs -> weight 0 and a local id in use."""
    loc = ids_Tk - e0
    is_local = (loc >= 0) & (loc < E_loc)
    fill = jnp.minimum(jnp.min(jnp.where(is_local, loc, E_loc)), E_loc - 1)
    ids_l = jnp.where(is_local, loc, fill).astype(jnp.int32)
    w_l = jnp.where(is_local, w_Tk, 0.0).astype(w_Tk.dtype)
    return ids_l, w_l, jnp.any(is_local)


def _local_moe(x, ids, w, ex, impl, any_local):
    return lax.cond(any_local, lambda: moe(x, ids, w, ex, impl=impl), lambda: jnp.zeros_like(x))


def make_expert_fn(mesh: Mesh, dispatch: str = "auto", impl: str | None = None) -> Callable:
    """`expert_fn(x_TD, ids_Tk, w_Tk, experts, impl) -> y_TD` running the routed experts over `mesh`.

    impl (optional) overrides the per-device MoE implementation the model passes ("xla" | "pallas" |
    "interpret")."""
    if dispatch == "auto":
        dispatch = "psum"
    if dispatch not in ("psum", "a2a", "ragged"):
        raise ValueError(f"unknown MoE dispatch {dispatch!r}: choose auto, psum, a2a or ragged")
    sizes = mesh_sizes(mesh)
    dp, ep, tp = sizes["data"], sizes["expert"], sizes["tensor"]
    override = impl

    def expert_fn(x_TD, ids_Tk, w_Tk, experts, impl):
        impl = override or impl
        T = x_TD.shape[0]
        especs = expert_specs(experts, mesh)
        E = num_experts(experts)
        if E % ep:
            raise ShardingError(f"{E} routed experts do not divide over the {ep}-way expert axis")
        E_loc = E // ep
        tok = "data" if dp > 1 and T % dp == 0 else None
        tspec = P(tok, None)
        mode = dispatch
        if mode != "psum" and (ep == 1 or (T // (dp if tok else 1)) % ep):
            mode = "psum"  # nothing to exchange, or the token slice does not split over the expert axis

        if mode == "psum":
            def local(x, ids, w, ex):
                e0 = lax.axis_index("expert") * E_loc
                ids_l, w_l, any_local = _localize(ids, w, e0, E_loc)
                y = _local_moe(x, ids_l, w_l, ex, impl, any_local)
                return lax.psum(y, ("expert", "tensor")) if ep * tp > 1 else y
        else:
            exchange = _a2a_exchange if mode == "a2a" else _ragged_exchange

            def local(x, ids, w, ex):
                y = exchange(x, ids, w, ex, impl=impl, ep=ep, E_loc=E_loc)
                return lax.psum(y, "tensor") if tp > 1 else y

        f = jax.shard_map(local, mesh=mesh, in_specs=(tspec, tspec, tspec, especs), out_specs=tspec,
                          check_vma=False)
        return f(x_TD, ids_Tk, w_Tk, experts)

    expert_fn.mesh = mesh
    expert_fn.dispatch = dispatch
    return expert_fn


# ---------------------------------------------------------------- all-to-all dispatch
def _my_slice(x, ep):
    """This device's 1/ep slice of the (replicated over "expert") token rows."""
    n = x.shape[0] // ep
    return lax.dynamic_slice_in_dim(x, lax.axis_index("expert") * n, n, axis=0)


def _a2a_exchange(x, ids, w, ex, *, impl, ep, E_loc):
    """Fixed-capacity dispatch/combine with lax.all_to_all (see the module docstring)."""
    xs, ids_s, w_s = _my_slice(x, ep), _my_slice(ids, ep), _my_slice(w, ep)
    n, k = ids_s.shape
    C = n * k  # capacity per destination: every pair could go to one peer
    pair_tok = jnp.repeat(jnp.arange(n, dtype=jnp.int32), k)
    pair_e = ids_s.reshape(-1)
    dest = pair_e // E_loc
    # slot of each pair in its destination's buffer: rank among the pairs with the same destination
    onehot = (dest[:, None] == jnp.arange(ep)[None, :]).astype(jnp.int32)  # [n*k, ep]
    slot = jnp.take_along_axis(jnp.cumsum(onehot, axis=0) - 1, dest[:, None], axis=1)[:, 0]
    send_x = jnp.zeros((ep, C, x.shape[1]), x.dtype).at[dest, slot].set(xs[pair_tok])
    send_e = jnp.full((ep, C), -1, jnp.int32).at[dest, slot].set(pair_e - dest * E_loc)
    recv_x = lax.all_to_all(send_x, "expert", 0, 0, tiled=False)  # [ep (source), C, D]
    recv_e = lax.all_to_all(send_e, "expert", 0, 0, tiled=False)
    rx, re = recv_x.reshape(ep * C, -1), recv_e.reshape(ep * C)
    live = re >= 0
    fill = jnp.minimum(jnp.min(jnp.where(live, re, E_loc)), E_loc - 1)
    y = _local_moe(rx, jnp.where(live, re, fill)[:, None], live.astype(jnp.float32)[:, None], ex, impl,
                   jnp.any(live))
    back = lax.all_to_all(y.reshape(ep, C, -1), "expert", 0, 0, tiled=False)  # [ep (owner), C, D]
    y_pairs = back[dest, slot].astype(jnp.float32) * w_s.reshape(-1)[:, None]
    y_s = jnp.zeros((n, x.shape[1]), jnp.float32).at[pair_tok].add(y_pairs).astype(x.dtype)
    return lax.all_gather(y_s, "expert", axis=0, tiled=True)


def _ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, ep):
    """lax.ragged_all_to_all on GPU; elsewhere an emulation (all_gather of the operand and the offsets)."""
    if jax.default_backend() == "gpu":
        return lax.ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes,
                                     axis_name=axis_name)
    me = lax.axis_index(axis_name)
    ops = lax.all_gather(operand, axis_name)  # [ep (sender), rows, ...]
    start = lax.all_gather(output_offsets, axis_name)[:, me]  # where sender s writes into my output
    size = lax.all_gather(send_sizes, axis_name)[:, me]
    src0 = lax.all_gather(input_offsets, axis_name)[:, me]
    r = jnp.arange(output.shape[0], dtype=jnp.int32)
    hit = (r[None] >= start[:, None]) & (r[None] < (start + size)[:, None])  # [ep, rows]
    sender = jnp.argmax(hit, axis=0)
    src = jnp.clip(src0[sender] + r - start[sender], 0, operand.shape[0] - 1)
    rows = ops[sender, src]
    keep = jnp.any(hit, axis=0).reshape((-1,) + (1,) * (output.ndim - 1))
    return jnp.where(keep, rows, output)


def _ragged_exchange(x, ids, w, ex, *, impl, ep, E_loc):
    """Dispatch/combine with lax.ragged_all_to_all: pairs sorted by owner, only used rows move (GPU)."""
    xs, ids_s, w_s = _my_slice(x, ep), _my_slice(ids, ep), _my_slice(w, ep)
    n, k = ids_s.shape
    P_ = n * k
    pair_e = ids_s.reshape(-1)
    order = jnp.argsort(pair_e, stable=True)  # sorted by expert = grouped by owner
    s_e = pair_e[order]
    s_tok = (order // k).astype(jnp.int32)
    dest = s_e // E_loc
    send_sizes = jnp.sum(dest[None, :] == jnp.arange(ep)[:, None], axis=1).astype(jnp.int32)  # [ep]
    input_offsets = (jnp.cumsum(send_sizes) - send_sizes).astype(jnp.int32)
    # every peer's send sizes to every peer: recv_sizes[j] = what peer j sends me
    all_sizes = lax.all_gather(send_sizes, "expert")  # [ep (sender), ep (receiver)]
    me = lax.axis_index("expert")
    recv_sizes = all_sizes[:, me]
    # where my rows land in peer j's buffer: after the rows that senders < me send to j
    output_offsets = jnp.sum(jnp.where(jnp.arange(ep)[:, None] < me, all_sizes, 0), axis=0).astype(jnp.int32)
    cap = ep * P_  # receive buffer (worst case: every peer sends all its pairs to me)
    r2a = functools.partial(_ragged_all_to_all, ep=ep)
    rx = r2a(xs[s_tok], jnp.zeros((cap, x.shape[1]), x.dtype), input_offsets, send_sizes,
                               output_offsets, recv_sizes, axis_name="expert")
    re = r2a((s_e - dest * E_loc).astype(jnp.int32), jnp.full((cap,), -1, jnp.int32),
                               input_offsets, send_sizes, output_offsets, recv_sizes, axis_name="expert")
    live = re >= 0
    fill = jnp.minimum(jnp.min(jnp.where(live, re, E_loc)), E_loc - 1)
    y = _local_moe(rx, jnp.where(live, re, fill)[:, None], live.astype(jnp.float32)[:, None], ex, impl,
                   jnp.any(live))
    # send results back: I return recv_sizes[j] rows to peer j, from my offsets; they land at its input_offsets
    back_in_off = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
    back_out_off = lax.all_gather(input_offsets, "expert")[:, me]  # where peer j expects my rows
    back = r2a(y, jnp.zeros((P_, x.shape[1]), x.dtype), back_in_off, recv_sizes,
                                 back_out_off, send_sizes, axis_name="expert")
    y_pairs = back.astype(jnp.float32) * w_s.reshape(-1)[order][:, None]
    y_s = jnp.zeros((n, x.shape[1]), jnp.float32).at[s_tok].add(y_pairs).astype(x.dtype)
    return lax.all_gather(y_s, "expert", axis=0, tiled=True)
