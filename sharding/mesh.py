"""Device meshes for kimijax: one 3-axis mesh ("data", "expert", "tensor") per layout.

A layout string names the size of each axis:  tpN  (tensor: attention heads, dense/shared MLP hidden, each
routed expert's hidden dim, vocab),  epN  (expert: routed experts, vocab),  dpN  (data: the batch; weights
replicated).  Parts can be combined in any order: "tp4ep2", "ep4tp2", "dp2ep4".  Axes that are not named get
size 1, except "data": when the named axes use fewer devices than given, the remaining factor becomes data
parallelism ("ep4" on 8 devices = ep4 x dp2: data-parallel attention, experts 4-way).  "single" is one
device (the reference layout).  The tensor axis is innermost, so tensor-parallel groups are neighbouring
devices (same NVLink island / same host).

Named layouts on 8 devices:  tp8 (dp1 ep1 tp8), ep8 (dp1 ep8 tp1), ep4 (dp2 ep4 tp1), tp4ep2 (dp1 ep2 tp4),
tp2ep4 (dp1 ep4 tp2).  The same spellings work for any device count (tp4 on 4 GPUs, ep16 on 16, ...).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

AXES = ("data", "expert", "tensor")
_PART = re.compile(r"(dp|ep|tp)(\d+)")
_AXIS_OF = {"dp": "data", "ep": "expert", "tp": "tensor"}


class ShardingError(ValueError):
    """A layout that cannot be built on these devices, or that does not divide the model."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """Axis sizes of a layout (data, expert, tensor); `data=None` = whatever the device count leaves."""
    name: str
    data: int | None
    expert: int
    tensor: int

    @property
    def model_parallel(self) -> int:
        return self.expert * self.tensor

    def sizes(self, n_devices: int) -> dict[str, int]:
        mp = self.model_parallel
        if self.data is None:
            if n_devices % mp:
                raise ShardingError(f"layout {self.name!r} needs a multiple of {mp} devices (expert {self.expert} x "
                                    f"tensor {self.tensor}), got {n_devices}")
            data = n_devices // mp
        else:
            data = self.data
            if data * mp != n_devices:
                raise ShardingError(f"layout {self.name!r} needs {data * mp} devices (data {data} x expert "
                                    f"{self.expert} x tensor {self.tensor}), got {n_devices}")
        return {"data": data, "expert": self.expert, "tensor": self.tensor}

    def canonical(self, n_devices: int) -> str:
        s = self.sizes(n_devices)
        return f"dp{s['data']}ep{s['expert']}tp{s['tensor']}"


def parse_layout(layout: str) -> Layout:
    """'tp8' | 'ep8' | 'ep4' | 'tp4ep2' | 'dp2ep4' | 'single' | ... -> Layout (see the module docstring)."""
    name = str(layout).strip().lower()
    if name in ("single", "none", "1"):
        return Layout(name, 1, 1, 1)
    parts = _PART.findall(name)
    if not parts or "".join(p + n for p, n in parts) != name:
        raise ShardingError(f"cannot parse layout {layout!r}: expected parts tpN / epN / dpN (e.g. tp8, ep8, ep4, "
                            f"tp4ep2, dp2ep4) or 'single'")
    sizes = {}
    for p, n in parts:
        if p in sizes:
            raise ShardingError(f"layout {layout!r} names {p} twice")
        if int(n) < 1:
            raise ShardingError(f"layout {layout!r}: {p}{n} must be >= 1")
        sizes[p] = int(n)
    return Layout(name, sizes.get("dp"), sizes.get("ep", 1), sizes.get("tp", 1))


def layout_devices(layout: str | Layout) -> int:
    """The fewest devices a layout runs on (the data axis of size 1 unless it is given)."""
    lay = parse_layout(layout) if isinstance(layout, str) else layout
    return (lay.data or 1) * lay.model_parallel


def make_mesh(layout: str | Layout, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A ("data", "expert", "tensor") mesh for `layout` over `devices` (default: every device, all processes).

    The product of the axis sizes must equal the device count (the data axis absorbs the rest when the layout
    does not name it); otherwise a ShardingError says what the layout needs. Axis types are Auto, so
    parameters and caches placed with NamedSharding drive GSPMD propagation through the unannotated model.
    """
    lay = parse_layout(layout) if isinstance(layout, str) else layout
    devs = list(jax.devices() if devices is None else devices)
    if not devs:
        raise ShardingError("no devices")
    sizes = lay.sizes(len(devs))
    shape = tuple(sizes[a] for a in AXES)
    if devices is None:
        # jax.make_mesh orders devices for the physical topology (NVLink islands, hosts).
        mesh = jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * len(AXES), devices=devs)
    else:
        mesh = Mesh(np.asarray(devs, dtype=object).reshape(shape), AXES, axis_types=(AxisType.Auto,) * len(AXES))
    return mesh


def mesh_sizes(mesh: Mesh) -> dict[str, int]:
    """Axis sizes of a kimijax mesh (axes it lacks count as size 1)."""
    return {a: int(mesh.shape[a]) if a in mesh.axis_names else 1 for a in AXES}


def describe(mesh: Mesh) -> str:
    s = mesh_sizes(mesh)
    return f"dp{s['data']}ep{s['expert']}tp{s['tensor']} ({math.prod(s.values())} devices)"
