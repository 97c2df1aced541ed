"""CPU tests of the skinny SwiGLU MLP kernels (interpret=True) against their XLA reference.

Fresh random inputs per case (seed printed on failure). The Pallas interpreter fills output buffers it was not
told to write with NaN, so a finite output equal to the reference also proves every element was written. Sizes
are not multiples of the blocks (D vs block_k and block_d, F vs block_f and the splits, M vs the 16-row tile and
the 64-row blocks)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_inputs import fresh_seed
from pallas_kernels import skinny_mlp as sm


def _inputs(seed, M, D, F):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(M, D)), jnp.float32)
    w = [jnp.asarray(rng.normal(size=s) / np.sqrt(s[1]), jnp.float32) for s in [(F, D), (F, D), (D, F)]]
    return x, w


@pytest.mark.parametrize("M,D,F,kw", [
    (1, 64, 64, {}),                                   # one AR row, everything divides
    (5, 72, 200, {}),                                  # ragged D and F
    (17, 96, 144, dict(splits=3)),                     # a 17-node verify; F / 3 splits is not a block_k multiple
    (33, 80, 100, dict(block_f=32, block_d=32)),       # 33 rows -> a 64-row tile
    (3, 40, 24, dict(block_k=16, splits=8)),           # more splits than F has chunks: 2 splits of 16 run
    (150, 72, 100, dict(splits=2)),                    # a C=32 verify's size: 3 row blocks of 64, the last ragged
])
def test_matches_reference(M, D, F, kw):
    seed = fresh_seed()
    x, w = _inputs(seed, M, D, F)
    out = jax.jit(functools.partial(sm.swiglu_pallas, interpret=True, **kw))(x, *w)
    ref = sm.swiglu_ref(x, *w)
    msg = f"seed={seed} M={M} D={D} F={F} {kw}"
    assert out.shape == (M, D) and out.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(out))), msg
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-6 * float(jnp.max(jnp.abs(ref))),
                               err_msg=msg)


@pytest.mark.parametrize("M,N,K,kw", [
    (1, 48, 64, {}),                                   # one AR row, everything divides
    (17, 40, 72, dict(splits=2)),                      # ragged N and K; K / 2 splits is not a block_k multiple
    (9, 100, 24, dict(block_n=32, block_k=16, splits=4)),
    (70, 40, 48, dict(splits=2)),                      # 2 row blocks, the second of 6 rows
])
def test_linear_matches_reference(M, N, K, kw):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(M, K)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(N, K)) / np.sqrt(K), jnp.float32)
    out = jax.jit(functools.partial(sm.linear_pallas, interpret=True, **kw))(x, w)
    ref = jnp.einsum("mk,nk->mn", x, w, precision=jax.lax.Precision.HIGHEST)
    msg = f"seed={seed} M={M} N={N} K={K} {kw}"
    assert out.shape == (M, N) and bool(jnp.all(jnp.isfinite(out))), msg
    np.testing.assert_allclose(np.asarray(out), np.asarray(ref), rtol=2e-5, atol=2e-6 * float(jnp.max(jnp.abs(ref))),
                               err_msg=msg)
    with pytest.raises(ValueError, match="does not fit"):
        sm.linear_pallas(x, w.T, interpret=True)


def test_dispatch_and_errors():
    x, w = _inputs(fresh_seed(), 4, 32, 48)
    np.testing.assert_allclose(np.asarray(sm.swiglu(x, *w, impl="interpret")), np.asarray(sm.swiglu(x, *w)),
                               rtol=2e-5, atol=1e-6)
    with pytest.raises(ValueError, match="impl"):
        sm.swiglu(x, *w, impl="cuda")
    with pytest.raises(ValueError, match="rows"):
        sm.swiglu_pallas(jnp.zeros((sm.MAX_ROWS + 1, 32)), *w, interpret=True)
    with pytest.raises(ValueError, match="block_f"):
        sm.swiglu_pallas(x, *w, block_f=24, interpret=True)
    with pytest.raises(ValueError, match="do not fit"):
        sm.swiglu_pallas(x, w[0], w[1], w[2].T, interpret=True)


@pytest.mark.parametrize("M", [1, 17, 160])
def test_lowers_for_the_gpu(M):
    # the Triton lowering (never run by interpret mode) at SmolLM2's MLP, and at a ragged size (masked path)
    from pallas_kernels.gpu_lowering import triton_ir

    S = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    for D, F in ((576, 1536), (72, 200)):
        ir = triton_ir(sm.swiglu_pallas, S(M, D), S(F, D), S(F, D), S(D, F))
        assert sorted(ir) == ["skinny_mlp_down", "skinny_mlp_gate_up"]
        assert ir["skinny_mlp_gate_up"].count("tt.dot") == 2 and ir["skinny_mlp_down"].count("tt.dot") == 1


def test_rows_do_not_depend_on_the_pass():
    # a row's bits are the same alone (an AR step), among 17 (a verify) and in the third 64-row block of a C=32
    # verify: every block sums over K in the same order (interpret mode; the GPU check is skinny_mlp's __main__)
    seed = fresh_seed()
    x, w = _inputs(seed, 150, 72, 100)
    f = jax.jit(functools.partial(sm.swiglu_pallas, interpret=True, splits=2))
    many = np.asarray(f(x, *w))
    np.testing.assert_array_equal(np.asarray(f(x[:17], *w)), many[:17], err_msg=f"seed={seed}")
    for i in (0, 63, 64, 149):
        np.testing.assert_array_equal(np.asarray(f(x[i:i + 1], *w))[0], many[i], err_msg=f"seed={seed} row {i}")
