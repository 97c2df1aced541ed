"""The drafter's context projection with its input dimension split over "tensor": each device multiplies its slice
of the concatenated target features [B, T, n*D] by its slice of `fc` [D, n*D] (sharding/rules.py, logical axis
"draft_features") and one psum (f32) adds the partial products. The features are replicated, so slicing them costs
nothing; each device reads 1/tp of fc (6 x 7168 x 7168 bf16 = 617 MB for the Kimi drafter) per context step.
Why shard_map and not the rule alone: left to GSPMD, a split fc resharded the drafter around it (tiny8, tp8:
13 -> 32 all-reduces + 3 all-to-alls per round); here it is exactly one all-reduce of [B, T, D] per call.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import Mesh, PartitionSpec as P

from sharding.mesh import mesh_sizes
from sharding.rules import LOGICAL_RULES, batch_axis


def fc_axis(mesh: Mesh | None, F: int) -> str | None:
    """The mesh axis fc's input dimension F is split over on this mesh, or None (no mesh, size 1, not dividing)."""
    if mesh is None:
        return None
    sizes = mesh_sizes(mesh)
    axes = [a for a in LOGICAL_RULES.get("draft_features", ()) if sizes.get(a, 1) > 1]
    if len(axes) != 1 or F % sizes[axes[0]]:
        return None
    return axes[0]


def project_features(feats_BTF, fc_DF, mesh: Mesh):
    """feats [B, T, F] x fc [D, F] -> [B, T, D] in float32, summed over the F shards (requires fc_axis)."""
    ax = fc_axis(mesh, feats_BTF.shape[-1])
    if ax is None:
        raise ValueError(f"fc's input dimension {feats_BTF.shape[-1]} is not split on this mesh")
    bat = batch_axis(mesh, feats_BTF.shape[0])

    def local(x_BTF, w_Df):
        # the features enter replicated and are sliced here: a split in_spec would propagate back into the
        # target's residual stream (its layers then ran on D-split activations with extra collectives)
        Fl = w_Df.shape[1]
        x_BTf = lax.dynamic_slice_in_dim(x_BTF, lax.axis_index(ax) * Fl, Fl, axis=2)
        part = jnp.einsum("btf,df->btd", x_BTf.astype(w_Df.dtype), w_Df, preferred_element_type=jnp.float32)
        return lax.psum(part, ax)

    return jax.shard_map(local, mesh=mesh, in_specs=(P(bat), P(None, ax)), out_specs=P(bat),
                         check_vma=False)(feats_BTF, fc_DF)
