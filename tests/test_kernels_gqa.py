"""CPU tests of the Pallas GQA tree-attention kernel (interpret=True) against its XLA reference.

Fresh random inputs per case (seed printed on failure). The Pallas interpreter fills output buffers it was not
told to write with NaN, so finite outputs equal to the reference also prove every element was written. Sizes
are not multiples of the blocks (T*g rows vs block_m, L vs block_k and the split)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from kernel_inputs import fresh_seed, random_tree
from pallas_kernels import gqa_attention as ga


def _inputs(seed, B, L, T, KV, g, E, dtype=jnp.float32, lengths=None):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, KV, T * g, E)), dtype)
    cache = jnp.asarray(rng.normal(size=(B, L, 2, KV, E)), dtype)
    lengths = rng.integers(0, L - T + 1, size=B) if lengths is None else lengths
    tree = np.stack([random_tree(rng, T) for _ in range(B)])
    return q, cache, jnp.asarray(lengths, jnp.int32), jnp.asarray(tree)


def _check(B, L, T, KV, g, E, dtype=jnp.float32, tol=2e-6, lengths=None, **kw):
    seed = fresh_seed()
    q, cache, lengths, tree = _inputs(seed, B, L, T, KV, g, E, dtype, lengths)
    scale = E ** -0.5
    out = jax.jit(functools.partial(ga.gqa_tree_attention_pallas, scale=scale, interpret=True, **kw))(
        q, cache, lengths, tree)
    f32 = lambda x: x.astype(jnp.float32)
    ref = ga.gqa_tree_attention_ref(f32(q), f32(cache), lengths, tree, scale, lax.Precision.HIGHEST)
    out, ref = np.asarray(out, np.float32), np.asarray(ref)
    msg = f"seed={seed} B={B} L={L} T={T} KV={KV} g={g} E={E} {kw}"
    assert out.shape == (B, KV, T * g, E) and np.all(np.isfinite(out)), msg
    err = np.max(np.abs(out - ref))
    assert err < tol, f"{msg}: max err {err:.2e}"


def test_default_impl_is_xla_on_cpu():
    assert ga.default_impl() == "xla"


@pytest.mark.parametrize("B,L,T,KV,g,E,kw", [
    (1, 100, 1, 3, 3, 64, {}),                       # AR step at SmolLM2 head shape, one split
    (2, 203, 17, 3, 3, 64, {}),                      # 17-node verify, 51 rows vs 16-row blocks
    (3, 77, 5, 2, 4, 32, dict(num_splits=3)),        # split combine, L not a multiple of block_k
    (2, 333, 9, 1, 5, 16, dict(keys_per_split=64, block_m=32, block_k=32)),
    (1, 70, 33, 2, 2, 32, {}),                       # two mask words
])
def test_kernel_matches_reference_f32(B, L, T, KV, g, E, kw):
    _check(B, L, T, KV, g, E, **kw)


def test_kernel_bf16():
    _check(2, 130, 9, 3, 3, 64, jnp.bfloat16, tol=2e-2, num_splits=2)


def test_empty_prefix_and_full_cache():
    _check(2, 40, 7, 2, 3, 32, lengths=[0, 33])  # no committed keys / the tree rows end at slot L


def test_row_that_sees_nothing_is_zero():
    q, cache, lengths, tree = _inputs(fresh_seed(), 1, 20, 3, 1, 2, 16, lengths=[0])
    tree = tree.at[0, 1].set(False)  # node 1 sees no key at all (empty prefix, no ancestors, not itself)
    out = ga.gqa_tree_attention_pallas(q, cache, lengths, tree, 0.25, interpret=True)
    assert np.all(np.asarray(out)[0, 0, 2:4] == 0.0) and np.all(np.isfinite(np.asarray(out)))


def test_dispatch():
    q, cache, lengths, tree = _inputs(fresh_seed(), 1, 30, 3, 2, 2, 16)
    a = ga.gqa_tree_attention(q, cache, lengths, tree, 0.25, impl="xla", precision=lax.Precision.HIGHEST)
    b = ga.gqa_tree_attention(q, cache, lengths, tree, 0.25, impl="interpret")
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6)
    with pytest.raises(ValueError, match="unknown GQA attention impl"):
        ga.gqa_tree_attention(q, cache, lengths, tree, 0.25, impl="cuda")


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_lowers_for_the_gpu(dtype):
    # the Triton lowering (never run by interpret mode) at SmolLM2's shapes: AR step and a 17-node verify
    from pallas_kernels.gpu_lowering import triton_ir

    S = jax.ShapeDtypeStruct
    for T, L in ((1, 640), (17, 640)):
        ir = triton_ir(functools.partial(ga.gqa_tree_attention_pallas, scale=0.125), S((1, 3, T * 3, 64), dtype),
                       S((1, L, 2, 3, 64), dtype), S((1,), jnp.int32), S((1, T, T), jnp.bool_))
        assert list(ir) == ["gqa_tree_attention"] and ir["gqa_tree_attention"].count("tt.dot") == 4


def test_default_splits():
    assert ga.default_splits(3, 640) == 10  # B=1 AR step at SmolLM2 shape: 64 keys per split
    assert ga.default_splits(12, 640) == 10  # 17-node verify (4 row blocks)
    assert ga.default_splits(96, 1024) == 3  # B=32: the grid is nearly full already
    assert ga.default_splits(128 * 3 * 4, 8192) == 1  # B=128 verify: no combine
    assert ga.default_splits(3, 40) == 1
