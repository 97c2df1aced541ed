"""Shared by the kernel tests: a fresh seed per case (printed on failure), random tree masks, and the check that
a Kimi target computes the same with its experts in a kernel's layout."""

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


def check_target_layout(cfg, params, kern, layout: str):
    """`kern` (a KimiTarget whose MoE kernel keeps its experts in `layout`) against the checkpoint layout: the XLA
    reference reading `layout` gives the checkpoint's logits bit for bit, the kernel within bf16 rounding, and
    the experts convert back to the checkpoint's bytes."""
    from kimijax.target import KimiTarget, convert_expert_layout

    ckpt = KimiTarget(cfg, params)
    ref = KimiTarget(cfg, params, moe_impl="xla", expert_layout=layout)
    toks = np.random.default_rng(0).integers(3, cfg.vocab_size, size=(2, 7))
    l_ckpt = np.asarray(ckpt.forward(toks))
    np.testing.assert_array_equal(np.asarray(ref.forward(toks)), l_ckpt)
    np.testing.assert_allclose(np.asarray(kern.forward(toks)), l_ckpt, atol=5e-2, rtol=5e-2)
    back = convert_expert_layout(kern.params, "checkpoint")
    for k, v in params["layers_1"]["mlp"].items():
        np.testing.assert_array_equal(np.asarray(back["layers_1"]["mlp"][k]), np.asarray(v), err_msg=k)
