"""Partition rules: logical axis names (carried by every parameter, see kimijax/models/common.py `param`) ->
mesh axes of a ("data", "expert", "tensor") mesh.

One table serves every layout; the mesh shape selects the layout (an axis of size 1 shards nothing):

  logical axis                     mesh axes            what it splits
  vocab                            expert, tensor       embedding and lm_head rows (vocab-parallel)
  heads / kv_heads                 tensor               MLA q_b / kv_b (absorbed W_UK, W_UV) / o_proj by head
  mlp                              tensor               dense MLP and shared-expert hidden dim
  expert                           expert               routed experts (INT4 words and scales)
  expert_mlp[_packed|_groups]      tensor               each routed expert's hidden dim F (TP-MoE)
  draft_features                   tensor               the drafter fc's input (target features; the product is
                                                        psum'ed in sharding/drafter_fc.py)
  everything else                  replicated           norms, q_a / kv_a (the latent is replicated), D

Overrides: the router (`mlp/gate` [E, D], `mlp/e_score_correction_bias` [E]) is replicated although its
first axis is named "expert": every device routes every token over all experts (top-k needs all scores).
The latent KV cache [B, L, K+R] is head-independent: it is split by batch over "data" and replicated over
"expert" and "tensor".

A dimension that its mesh axes do not divide raises ShardingError naming the tensor, the logical axis and
the mesh axis (e.g. 8 experts on a 3-way expert axis).
"""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from sharding.mesh import ShardingError, describe, mesh_sizes, parse_layout

LOGICAL_RULES: dict[str, tuple[str, ...]] = {
    "vocab": ("expert", "tensor"),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "expert": ("expert",),
    "expert_mlp": ("tensor",),
    "expert_mlp_packed": ("tensor",),
    "expert_mlp_groups": ("tensor",),
    "draft_features": ("tensor",),
}
# Parameter paths (suffixes, "/"-joined) kept replicated whatever their logical axes say.
REPLICATED_PARAMS: tuple[str, ...] = ("mlp/gate", "mlp/e_score_correction_bias")


def _is_boxed(x) -> bool:
    return hasattr(x, "names") and hasattr(x, "value")


def _path_str(path) -> str:
    return "/".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def check_layout(mesh: Mesh, layout: str | None):
    """A layout string given next to a mesh must describe that mesh."""
    if layout is None:
        return
    want = parse_layout(layout).sizes(mesh.size)
    have = mesh_sizes(mesh)
    if want != have:
        raise ShardingError(f"layout {layout!r} means {want} but the mesh is {have}")


def logical_to_spec(names, shape, mesh: Mesh, *, what: str = "tensor", strict: bool = True,
                    rules: Mapping[str, tuple[str, ...]] = LOGICAL_RULES) -> P:
    """PartitionSpec for one array with logical axis `names` and `shape` on `mesh`.

    Size-1 mesh axes are left out. A mesh axis is used by at most one dimension (the first that asks).
    strict: a non-dividing dimension raises ShardingError; otherwise that dimension is replicated."""
    sizes = mesh_sizes(mesh)
    used: set[str] = set()
    spec = []
    for dim, (name, n) in enumerate(zip(names, shape)):
        axes = tuple(a for a in rules.get(name, ()) if a in mesh.axis_names and sizes[a] > 1 and a not in used)
        k = math.prod(sizes[a] for a in axes)
        if axes and n % k:
            if strict:
                ax = " x ".join(f"{a!r} ({sizes[a]})" for a in axes)
                err = ShardingError(f"{what}: dimension {dim} ({name!r}, size {n}) is not divisible by mesh axis "
                                    f"{ax}; choose a layout whose {'/'.join(axes)} size divides {n}")
                err.key = (name, n, axes)
                raise err
            axes = ()
        used.update(axes)
        spec.append(None if not axes else axes[0] if len(axes) == 1 else axes)
    while spec and spec[-1] is None:
        spec.pop()
    return P(*spec)


def tree_shardings(boxed_tree, mesh: Mesh, *, strict: bool = True,
                   rules: Mapping[str, tuple[str, ...]] = LOGICAL_RULES,
                   replicated: tuple[str, ...] = REPLICATED_PARAMS):
    """NamedSharding per leaf of a tree of logically-named (flax `Partitioned`) leaves; unboxed structure."""

    errors: dict[tuple, list] = {}  # (logical axis, size, mesh axes) -> [first message, tensor count]

    def one(path, leaf):
        if not _is_boxed(leaf):
            return NamedSharding(mesh, P())
        ps = _path_str(path)
        if any(ps == r or ps.endswith("/" + r) for r in replicated):
            return NamedSharding(mesh, P())
        try:
            spec = logical_to_spec(leaf.names, leaf.value.shape, mesh, what=ps, strict=strict, rules=rules)
        except ShardingError as e:
            errors.setdefault(getattr(e, "key", str(e)), [str(e), 0])[1] += 1
            spec = P()
        return NamedSharding(mesh, spec)

    out = jax.tree_util.tree_map_with_path(one, boxed_tree, is_leaf=_is_boxed)
    if errors:
        msgs = [m + (f" (and {k - 1} more tensors like it)" if k > 1 else "") for m, k in errors.values()]
        raise ShardingError(f"layout {describe(mesh)} does not divide the model:\n  " + "\n  ".join(msgs))
    return out


def param_shardings(cfg_or_tree, mesh: Mesh, layout: str | None = None):
    """NamedSharding tree matching the target's params (a KimiConfig, or an abstract boxed param tree)."""
    check_layout(mesh, layout)
    tree = cfg_or_tree
    if not isinstance(tree, Mapping):  # a config: build the named abstract tree (nothing is allocated)
        from kimijax.target import abstract_params  # lazy: kimijax is the layer above
        tree = abstract_params(cfg_or_tree)
    return tree_shardings(tree, mesh, strict=True)


def drafter_shardings(cfg_or_tree, mesh: Mesh):
    """Drafter params: same rules, but a non-dividing dimension is replicated (the drafter is small)."""
    tree = cfg_or_tree
    if not isinstance(tree, Mapping):
        from kimijax.models.drafter import abstract_drafter_params
        tree = abstract_drafter_params(cfg_or_tree)
    return tree_shardings(tree, mesh, strict=False)


def batch_axis(mesh: Mesh, batch: int) -> str | None:
    """'data' when the batch splits over it, else None (a batch that does not divide is replicated)."""
    dp = mesh_sizes(mesh)["data"]
    return "data" if dp > 1 and batch % dp == 0 else None


def cache_shardings(cfg, mesh: Mesh, batch: int, n_layers: int | None = None):
    """Per-layer latent-cache shardings ([B, L, K+R]: batch over data, replicated over expert/tensor)."""
    n = cfg.num_hidden_layers if n_layers is None else n_layers
    s = NamedSharding(mesh, P(batch_axis(mesh, batch)))
    return [s] * n


def replicated(mesh: Mesh):
    return NamedSharding(mesh, P())


def place(tree, shardings):
    """device_put a (host or single-device) tree onto shardings (a matching tree or one sharding for all)."""
    if isinstance(shardings, jax.sharding.Sharding):
        return jax.tree_util.tree_map(lambda x: jax.device_put(x, shardings), tree)
    return jax.device_put(tree, shardings)


def bytes_per_device(tree) -> dict[Any, int]:
    """Bytes of `tree`'s arrays held on each device (addressable shards)."""
    out: dict[Any, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        if not isinstance(x, jax.Array):
            continue
        for s in x.addressable_shards:
            out[s.device] = out.get(s.device, 0) + int(np.prod(s.data.shape)) * x.dtype.itemsize
    return out
