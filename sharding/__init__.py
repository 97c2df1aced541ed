"""Sharding for kimijax: meshes and named layouts (mesh.py), logical-axis partition rules (rules.py),
expert-parallel routed experts (moe_ep.py), vocab-parallel top-K (vocab.py), HLO collective accounting
(hlo.py) and the layout comparison CLI (experiments.py, the one module here that imports kimijax at load).

    from sharding import make_mesh
    target = kimijax.load_target("/models/Kimi-K2.6", mesh=make_mesh("ep8"), layout="ep8")
"""

from sharding.mesh import AXES, Layout, ShardingError, describe, layout_devices, make_mesh, mesh_sizes, parse_layout
from sharding.moe_ep import make_expert_fn
from sharding.rules import (LOGICAL_RULES, bytes_per_device, cache_shardings, drafter_shardings, param_shardings,
                            tree_shardings)

__all__ = ["AXES", "Layout", "ShardingError", "make_mesh", "parse_layout", "layout_devices", "mesh_sizes",
           "describe", "LOGICAL_RULES", "param_shardings", "drafter_shardings", "cache_shardings", "tree_shardings",
           "bytes_per_device", "make_expert_fn"]
