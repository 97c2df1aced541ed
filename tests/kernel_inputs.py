"""Shared by the attention-kernel tests: a fresh seed per case (printed on failure) and random tree masks."""

from __future__ import annotations

import numpy as np

_SEEDS = np.random.SeedSequence()


def fresh_seed() -> int:
    return int(_SEEDS.spawn(1)[0].generate_state(1)[0])


def random_tree(rng, T: int) -> np.ndarray:
    """Ancestor-or-self mask [T, T] of a random tree (node i's parent is a random earlier node)."""
    anc = np.eye(T, dtype=bool)
    for i in range(1, T):
        anc[i] |= anc[rng.integers(0, i)]
    return anc
