"""`RoundKernels`: which opt-in kernels a speculative round uses (an Engine argument). A module of its own so that
`kimijax/__init__.py` can export it without importing the round at package import: the round imports the models,
which import pallas_kernels, which import kimijax.quant (a cycle when pallas_kernels is imported first)."""

from __future__ import annotations

import dataclasses

IMPLS = ("xla", "pallas", "interpret")


@dataclasses.dataclass(frozen=True)
class RoundKernels:
    """Opt-in kernels for a round's small stages; XLA until a GPU run shows they pay (`--tree-impl` /
    `--commit-impl` in scripts/profile_round.py and bench_e2e.py). Each is "xla", "pallas" or "interpret".

    tree    the tree's N best-first pops: XLA (2 launches per node) or one kernel per request
            (pallas_kernels/ddtree_frontier.py: a SmolLM2 b16 round's tree stage 40 -> 9 launches, counted offline)
    commit  the cache compaction: one fusion per layer cache, or all caches in one kernel
            (pallas_kernels/row_move.py: a SmolLM2 b16 round's commit 49 -> 20 launches, counted offline)
    """
    tree: str = "xla"
    commit: str = "xla"

    def __post_init__(self):
        for name in ("tree", "commit"):
            if getattr(self, name) not in IMPLS:
                raise ValueError(f"RoundKernels.{name}={getattr(self, name)!r}: choose one of {', '.join(IMPLS)}")
