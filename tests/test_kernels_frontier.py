"""CPU tests of DDTree's frontier kernel (pallas_kernels/ddtree_frontier.py, interpret=True) against its XLA
reference, which tests/test_ddtree.py checks against the heap reference: parents, depths, ranks and scores
must be equal bit for bit. Fresh random draft logits per case (seed printed on failure): float logits, a tiny
integer alphabet (exact ties between paths), and -inf entries (prefixes that do not exist: empty slots)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_inputs import fresh_seed
from kimijax.spec import ddtree
from pallas_kernels import ddtree_frontier as df


# (L, V, budget): K = min(budget, V); ragged slot counts (N + 1 not a power of two), L and K not powers of two,
# a V smaller than the budget (trees that run out of prefixes), and the SmolLM2 round's b16 (L = 15, K = 16)
CONFIGS = [(3, 7, 5), (15, 40, 16), (4, 3, 20), (1, 9, 1), (6, 11, 9)]


@pytest.mark.parametrize("L,V,budget", CONFIGS)
@pytest.mark.parametrize("kind", ["float", "ties", "masked"])
def test_kernel_matches_reference(L, V, budget, kind):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B = 3
    if kind == "float":
        logits = (rng.normal(size=(B, L, V)) * 3).astype(np.float32)
    else:
        logits = rng.integers(-1, 2, size=(B, L, V)).astype(np.float32)
        if kind == "masked":
            logits[rng.random(size=(B, L, V)) < 0.4] = -np.inf
            logits[:, :, 0] = 0.0
    logits[0] = 0.0  # a uniform request: every path at a depth ties
    K = ddtree.tree_width(budget, V)
    top_logp, _ = jax.vmap(lambda x: ddtree.topk_logprobs(x, K, 0))(jnp.asarray(logits))
    ref = jax.jit(jax.vmap(functools.partial(df.frontier_ref, budget=budget)))(top_logp)
    got = jax.jit(jax.vmap(functools.partial(df.frontier, budget=budget, impl="interpret")))(top_logp)
    for name, r, g in zip(("parents", "depths", "ranks", "scores"), ref, got):
        assert g.shape == (B, budget + 1) and g.dtype == r.dtype, name
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r), err_msg=f"{name} seed={seed} {kind}")


def test_build_tree_takes_the_kernel():
    rng = np.random.default_rng(fresh_seed())
    logits = jnp.asarray(rng.normal(size=(5, 30)), jnp.float32)
    top_logp, top_tok = ddtree.topk_logprobs(logits, 8, 0)
    a = ddtree.build_tree_from_topk(top_logp, top_tok, 8)
    b = ddtree.build_tree_from_topk(top_logp, top_tok, 8, frontier_impl="interpret")
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    with pytest.raises(ValueError, match="impl"):
        df.frontier(top_logp, 8, impl="cuda")


@pytest.mark.parametrize("L,K,budget", [(15, 16, 16), (3, 5, 6), (4, 16, 15)])  # the last one unmasked
def test_lowers_for_the_gpu(L, K, budget):
    # the Triton lowering (never run by interpret mode), masked (ragged) and unmasked shapes
    from pallas_kernels.gpu_lowering import triton_ir

    ir = triton_ir(functools.partial(df.frontier_pallas, budget=budget), jax.ShapeDtypeStruct((L, K), jnp.float32))
    assert list(ir) == ["ddtree_frontier"]
