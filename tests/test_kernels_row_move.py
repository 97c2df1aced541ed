"""The one-launch cache commit (pallas_kernels/row_move.py, interpret=True) against its XLA reference.

Fresh random caches and accepted paths per case (seed printed on failure): several caches of different
shapes and dtypes in one call (as a model's layer caches, Kimi's latent rows are not a multiple of the
kernel's 128-wide pieces), requests that accept nothing, some and everything.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_inputs import fresh_seed
from pallas_kernels import row_move as rm


def _case(rng, B, L, P):
    """Per request: committed length S, accepted count n (1..P), and a strictly increasing path (path[0] = 0,
    path[j] >= j) into the P + extra tree slots after S."""
    S = rng.integers(0, L - 3 * P, size=B)
    n = rng.integers(1, P + 1, size=B)
    src = []
    for b in range(B):
        path = np.concatenate([[0], np.sort(rng.choice(np.arange(1, 2 * P), P - 1, replace=False))])
        src.append(S[b] + path)
    return (jnp.asarray(np.array(src), jnp.int32), jnp.asarray(S, jnp.int32), jnp.asarray(n, jnp.int32))


@pytest.mark.parametrize("B,P", [(1, 5), (3, 17)])
def test_matches_reference(B, P):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    L = 80
    caches = [jnp.asarray(rng.normal(size=(B, L, 2, 3, 64)), jnp.float32),  # SmolLM2's K/V rows (384)
              jnp.asarray(rng.normal(size=(B, L, 576)), jnp.bfloat16),  # Kimi's latent rows
              jnp.asarray(rng.normal(size=(B, L, 7)), jnp.float32)]
    src, dst, n = _case(rng, B, L, P)
    want = jax.jit(rm.move_rows_ref)(caches, src, dst, n)
    got = jax.jit(functools.partial(rm.move_rows, impl="interpret"))(caches, src, dst, n)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32),
                                      err_msg=f"seed={seed} cache {i}")
    # and the rows really moved where n > 1 (a vacuous reference would pass anything)
    b = int(np.argmax(np.asarray(n)))
    j = int(n[b]) - 1
    np.testing.assert_array_equal(np.asarray(got[0][b, int(dst[b]) + j]), np.asarray(caches[0][b, int(src[b, j])]))


def test_nothing_accepted_leaves_caches_alone():
    rng = np.random.default_rng(fresh_seed())
    c = [jnp.asarray(rng.normal(size=(2, 30, 9)), jnp.float32)]
    src, dst, _ = _case(rng, 2, 30, 4)
    out = rm.move_rows(c, src, dst, jnp.zeros((2,), jnp.int32), impl="interpret")
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(c[0]))


def test_unknown_impl():
    with pytest.raises(ValueError, match="unknown move_rows impl"):
        rm.move_rows([], jnp.zeros((1, 1), jnp.int32), jnp.zeros((1,), jnp.int32), jnp.ones((1,), jnp.int32), "cuda")


def test_lowers_for_the_gpu():
    # the Triton lowering (never run by interpret mode): masked tail pieces, 30 caches in one kernel
    from pallas_kernels.gpu_lowering import triton_ir

    S = jax.ShapeDtypeStruct
    caches = [S((1, 1024, 2, 3, 64), jnp.float32)] * 30
    ir = triton_ir(lambda c, s, d, n: rm.move_rows_pallas(c, s, d, n), caches, S((1, 17), jnp.int32),
                   S((1,), jnp.int32), S((1,), jnp.int32))
    assert list(ir) == ["move_rows"]
    ir = triton_ir(lambda c, s, d, n: rm.move_rows_pallas(c, s, d, n), [S((4, 512, 576), jnp.bfloat16)] * 3,
                   S((4, 9), jnp.int32), S((4,), jnp.int32), S((4,), jnp.int32))
    assert list(ir) == ["move_rows"]


@pytest.mark.parametrize("B", [1, 3])
def test_write_rows_is_a_per_request_update_slice(B):
    """The model's cache write: one request takes the plain update-slice path, several the vmapped one; both
    are dynamic_update_slice per request (a start past the end is clamped so the rows fit)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    L, T = 40, 7
    cache = jnp.asarray(rng.normal(size=(B, L, 2, 3)), jnp.bfloat16)
    rows = jnp.asarray(rng.normal(size=(B, T, 2, 3)), jnp.float32)
    for start in (rng.integers(0, L - T + 1, size=B), np.full(B, L - 2)):
        start = jnp.asarray(start, jnp.int32)
        want = jnp.stack([jax.lax.dynamic_update_slice_in_dim(cache[b], rows[b].astype(cache.dtype), start[b], 0)
                          for b in range(B)])
        got = jax.jit(rm.write_rows)(cache, rows, start)
        assert got.dtype == cache.dtype
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=f"seed {seed}")
