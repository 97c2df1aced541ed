"""The one-row RMSNorm kernel (pallas_kernels/rms_norm.py, interpret=True) against its XLA reference, and in the
Kimi model's decode step.

Fresh random inputs per case (seed printed on failure); widths that are not powers of two (the kernel's block is
the next power of two, masked); the interpreter fills unwritten outputs with NaN, so "finite and equal to the
reference" also proves every element was written."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_inputs import fresh_seed
from pallas_kernels import rms_norm as rn


@pytest.mark.parametrize("shape,dtype", [((1, 1, 7168), jnp.bfloat16), ((1, 576), jnp.float32),
                                         ((1, 1, 1536), jnp.bfloat16), ((100,), jnp.float32),
                                         ((1, 1, 17), jnp.bfloat16)])
def test_one_row_matches_reference(shape, dtype):
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=shape) * 3, dtype)
    w = jnp.asarray(1 + 0.1 * rng.normal(size=shape[-1:]), dtype)
    y = jax.jit(lambda x, w: rn.rms_norm(x, w, 1e-6, "interpret"))(x, w)
    ref = rn.rms_norm_ref(x, w, 1e-6)
    assert y.shape == x.shape and y.dtype == x.dtype, seed
    y32, r32 = np.asarray(y, np.float32), np.asarray(ref, np.float32)
    assert np.all(np.isfinite(y32)), seed
    # the f32 sum's order is the only difference: at most one rounding step of the output dtype
    np.testing.assert_allclose(y32, r32, rtol=1e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-6, err_msg=str(seed))


def test_several_rows_take_xlas_norm():
    x = jnp.asarray(np.random.default_rng(fresh_seed()).normal(size=(2, 3, 64)), jnp.float32)
    w = jnp.ones((64,), jnp.float32)
    np.testing.assert_array_equal(np.asarray(rn.rms_norm(x, w, 1e-6, "interpret")),
                                  np.asarray(rn.rms_norm_ref(x, w, 1e-6)))


def test_bad_impl_and_shape_raise():
    x, w = jnp.ones((1, 8)), jnp.ones((8,))
    with pytest.raises(ValueError, match="unknown RMSNorm impl"):
        rn.rms_norm(x, w, 1e-6, "cuda")
    with pytest.raises(ValueError, match="one row"):
        rn.rms_norm_pallas(jnp.ones((2, 8)), w, 1e-6, interpret=True)


def test_lowers_for_the_gpu_at_kimi_width():
    from pallas_kernels.gpu_lowering import triton_ir
    S = jax.ShapeDtypeStruct
    ir = triton_ir(lambda x, w: rn.rms_norm(x, w, 1e-6, "pallas"), S((1, 1, 7168), jnp.bfloat16),
                   S((7168,), jnp.bfloat16))
    assert list(ir) == ["rms_norm_row"]


def test_kimi_decode_with_the_norm_kernel(tiny_f32, monkeypatch):
    # one request's AR step (one row per norm) through the kernel: the XLA-norm target's greedy tokens
    from kimijax import Engine
    from kimijax.target import KimiTarget

    calls = []
    kernel = rn.rms_norm_pallas
    monkeypatch.setattr(rn, "rms_norm_pallas", lambda *a, **k: calls.append(a[0].shape) or kernel(*a, **k))
    t_x = tiny_f32
    t_k = dataclasses.replace(t_x, norm_impl="interpret")
    assert t_x.norm_impl == "xla" and t_k.norm_impl == "interpret"
    out_x = Engine(t_x, None, method="ar").generate([[5, 9, 11, 3]], max_new_tokens=6, stop_ids=[])
    assert not calls
    out_k = Engine(t_k, None, method="ar").generate([[5, 9, 11, 3]], max_new_tokens=6, stop_ids=[])
    # per layer: input, q latent and post-attention norms, and the final norm (traced once per program)
    assert len(calls) >= 3 * t_x.cfg.num_hidden_layers + 1, calls
    assert [r.tokens for r in out_k] == [r.tokens for r in out_x]
    with pytest.raises(ValueError, match="unknown RMSNorm impl"):
        KimiTarget(t_x.cfg, t_x.params, norm_impl="fast")
