"""CPU tests of the Pallas tree-attention kernel (interpret=True) against the XLA reference.

Every case draws fresh random inputs (a new seed per case, printed on failure).  The Pallas interpreter
fills output buffers it was not told to write with NaN, so "every element finite and equal to the
reference" also proves every output element was written.  Sizes are deliberately not multiples of the
block sizes (odd T, L, B; T*H not a multiple of block_m; L not a multiple of block_k or the split).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kernel_inputs import fresh_seed, random_tree
from pallas_kernels import tree_attention as ta

K_LAT, R_PE = 64, 8  # C = 72: a small stand-in for 512 + 64


def _inputs(seed, B, L, T, H, *, lengths=None, tree=None):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.normal(size=(B, T, H, K_LAT + R_PE)), jnp.bfloat16)
    cache = jnp.asarray(rng.normal(size=(B, L, K_LAT + R_PE)), jnp.bfloat16)
    if lengths is None:
        lengths = rng.integers(0, L - T + 1, size=B)
    if tree is None:
        tree = np.stack([random_tree(rng, T) for _ in range(B)])
    return q, cache, jnp.asarray(lengths, jnp.int32), jnp.asarray(tree, bool)


def _ref_f32(q, cache, lengths, tree, scale):
    """Reference on f32-upcast inputs (higher precision than the kernel's bf16 operands)."""
    return ta.tree_attention_ref(q.astype(jnp.float32), cache.astype(jnp.float32), lengths, tree, scale, K_LAT)


def _check(seed, B, L, T, H, scale=0.2, **kw):
    args = _inputs(seed, B, L, T, H, lengths=kw.pop("lengths", None), tree=kw.pop("tree", None))
    f = jax.jit(functools.partial(ta.tree_attention_pallas, scale=scale, kv_rank=K_LAT, interpret=True, **kw))
    out, lse = f(*args)
    ref, lse_ref = _ref_f32(*args, scale)
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    lse, lse_ref = np.asarray(lse), np.asarray(lse_ref)
    assert out.shape == (B, T, H, K_LAT) and lse.shape == (B, T, H)
    seen = np.isfinite(lse_ref)  # rows with at least one visible key
    msg = f"seed={seed} B={B} L={L} T={T} H={H} {kw}"
    assert np.all(np.isfinite(out)), msg
    assert np.all(np.isfinite(lse[seen])), msg
    err = np.linalg.norm((out - ref)[seen]) / np.linalg.norm(ref[seen])
    assert err < 1e-2, f"{msg}: rel err {err:.2e}"
    np.testing.assert_allclose(lse[seen], lse_ref[seen], atol=2e-2, rtol=2e-3, err_msg=msg)
    # rows that see nothing: output 0, lse -inf (the reference gives NaN there)
    assert np.all(out[~seen] == 0.0) and np.all(lse[~seen] == -np.inf), msg
    return out, lse


def test_default_impl_is_xla_on_cpu():
    assert ta.default_impl() == "xla"


def test_auto_picks_per_measured_shape(monkeypatch):
    # the H200 crossover (BENCHMARKS.md): kernel at small B*T*L, reference once compute-bound, kernel again
    # when the reference's f32 scores would pass 2 GiB
    H = 64
    for B, L, T in ((1, 4096, 1), (1, 4096, 9), (1, 32768, 1), (32, 4096, 1)):
        assert not ta.auto_uses_reference(B, T, H, L), (B, L, T)
    # ... and from T = 17 (by kernel time inside a round)
    for B, L, T in ((1, 32768, 9), (32, 4096, 9), (128, 2048, 9), (1, 131072, 17), (1, 4096, 17), (1, 2048, 33)):
        assert ta.auto_uses_reference(B, T, H, L), (B, L, T)
    assert not ta.auto_uses_reference(128, 17, H, 32768)  # 18 GB of scores
    # the dispatch: the reference where it picks it, bit for bit; else the kernel
    rng = np.random.default_rng(fresh_seed())
    q = jnp.asarray(rng.normal(size=(1, 9, 2, 48)), jnp.float32)
    cache = jnp.asarray(rng.normal(size=(1, 300, 48)), jnp.float32)
    args = (q, cache, jnp.array([100], jnp.int32), jnp.tril(jnp.ones((1, 9, 9), bool)), 0.3, 32)
    monkeypatch.setattr(ta, "AUTO_XLA_MIN_WORK", 1)
    np.testing.assert_array_equal(np.asarray(ta.tree_attention(*args, impl="auto")[0]),
                                  np.asarray(ta.tree_attention_ref(*args)[0]))
    monkeypatch.setattr(ta, "AUTO_MAX_SCORE_BYTES", 0)
    monkeypatch.setattr(ta, "tree_attention_pallas", lambda *a, **k: "kernel")
    assert ta.tree_attention(*args, impl="auto") == "kernel"


def test_single_split_odd_sizes():
    # T*H = 20 (block_m 32 -> padded rows), L = 101 (not a multiple of block_k 32)
    _check(fresh_seed(), B=3, L=101, T=5, H=4)


def test_split_k_combine():
    # 3 splits of 80 keys over L = 203 with block_k 16; lengths random (some splits empty)
    _check(fresh_seed(), B=2, L=203, T=7, H=4, num_splits=3, block_k=16)


def test_many_splits_block_m_16():
    _check(fresh_seed(), B=1, L=333, T=9, H=3, num_splits=5, block_m=16, block_k=16)


@pytest.mark.parametrize("T,H,splits", [(1, 4, 7), (9, 3, 20)])
def test_splits_merged_by_the_combine_kernel(T, H, splits):
    # the whole attention with combine="pallas": some splits see no key at all (short committed lengths)
    _check(fresh_seed(), B=3, L=333, T=T, H=H, num_splits=splits, block_k=16, combine="pallas",
           lengths=[0, 100, 333 - T])


def test_value_splits_and_transposed():
    # two programs per row block, each accumulating half of the value columns; S^T / O^T orientation
    seed = fresh_seed()
    _check(seed, B=2, L=150, T=5, H=4, value_splits=2, num_splits=2, block_k=16)
    _check(seed, B=2, L=150, T=5, H=4, value_splits=2, transposed=True, block_k=32)


def test_decode_t1():
    _check(fresh_seed(), B=5, L=77, T=1, H=4, num_splits=2)


def test_t33_two_mask_words():
    # T = 33 > 32: the tree mask needs two int32 words per row; the tree block spans several key blocks
    _check(fresh_seed(), B=1, L=130, T=33, H=2, block_k=16, num_splits=2)


def test_t129_five_mask_words():
    _check(fresh_seed(), B=1, L=200, T=129, H=1, block_m=64, block_k=32)


def test_full_cache_and_empty_prefix():
    seed = fresh_seed()
    # request 0: no committed prefix (only the tree block); request 1: the tree block ends at slot L-1
    _check(seed, B=2, L=90, T=6, H=4, lengths=[0, 84], num_splits=2, block_k=16)


def test_fully_masked_tree_rows():
    """Tree rows with no visible key at all (length 0, padded tree entries): output 0 and lse -inf."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    T = 7
    tree = np.stack([random_tree(rng, T) for _ in range(2)])
    tree[0, 4:] = False  # padded tree entries of request 0 see nothing (length 0)
    tree[1, 2] = False  # request 1 has a prefix, so its masked row still sees the prefix
    _check(seed, B=2, L=64, T=T, H=4, lengths=[0, 20], tree=tree, num_splits=2, block_k=16)


def test_dispatch_matches_kernel():
    seed = fresh_seed()
    args = _inputs(seed, 2, 50, 3, 4)
    a = ta.tree_attention(*args, 0.3, K_LAT, impl="interpret")
    b = ta.tree_attention_pallas(*args, 0.3, K_LAT, interpret=True)
    np.testing.assert_array_equal(np.asarray(a[0], np.float32), np.asarray(b[0], np.float32))
    r = ta.tree_attention(*args, 0.3, K_LAT, impl="xla")
    assert r[0].dtype == a[0].dtype == jnp.bfloat16
    with pytest.raises(ValueError):
        ta.tree_attention(*args, 0.3, K_LAT, impl="nope")


def test_pack_tree_mask():
    rng = np.random.default_rng(fresh_seed())
    m = rng.random((2, 40, 40)) < 0.5
    words = np.asarray(ta.pack_tree_mask(jnp.asarray(m))).view(np.uint32)
    u = np.arange(40)
    bits = (words[:, :, u // 32] >> (u % 32)) & 1
    np.testing.assert_array_equal(bits.astype(bool), m)


def test_combine_splits_forms_agree():
    """The split merge's two forms (weights summed as a column of the outputs, or on their own) give the same
    merge, including splits that saw nothing (lse -inf) and a row that no split saw (0, lse -inf)."""
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    o = jnp.asarray(rng.normal(size=(2, 5, 7, 6)), jnp.float32)  # [B, S, rows, E], split axis 1
    lse = rng.normal(size=(2, 5, 7)) * 3
    lse[0, 1:3, 2] = -np.inf
    lse[1, :, 4] = -np.inf
    lse = jnp.asarray(lse, jnp.float32)
    (o1, l1), (o2, l2) = (ta.combine_splits(o, lse, axis=1, weights_column=c) for c in (False, True))
    np.testing.assert_allclose(np.asarray(o2), np.asarray(o1), rtol=1e-6, atol=1e-6, err_msg=f"seed {seed}")
    np.testing.assert_allclose(np.asarray(l2), np.asarray(l1), rtol=1e-6, atol=1e-6, err_msg=f"seed {seed}")
    assert np.all(np.asarray(o1[1, 4]) == 0) and np.isneginf(np.asarray(l1[1, 4]))


@pytest.mark.parametrize("block_m", [16, 32])
def test_tp8_heads_in_small_row_blocks(block_m):
    # 8 heads per device (tensor parallel over 8 GPUs): T*H = 72 rows in blocks of 16 / 32, the last one padded
    _check(fresh_seed(), 3, 203, 9, 8, block_m=block_m, block_k=32)


@pytest.mark.parametrize("heads,kw", [(64, {}), (8, {}), (8, {"block_m": 16}), (8, {"block_m": 32, "num_warps": 8})])
def test_kernel_lowers_for_the_gpu_at_full_width(heads, kw):
    # the Triton lowering (never run by interpret mode) at Kimi width: C = 576, 512 latent columns
    from pallas_kernels.gpu_lowering import triton_ir
    S = jax.ShapeDtypeStruct
    fn = functools.partial(ta.tree_attention_pallas, scale=0.07, kv_rank=512, **kw)
    ir = triton_ir(fn, S((2, 9, heads, 576), jnp.bfloat16), S((2, 4096, 576), jnp.bfloat16), S((2,), jnp.int32),
                   S((2, 9, 9), jnp.bool_))
    assert list(ir) == ["tree_attention"] and "tt.dot" in ir["tree_attention"]
    ir = triton_ir(functools.partial(fn, combine="pallas"), S((2, 9, heads, 576), jnp.bfloat16),
                   S((2, 4096, 576), jnp.bfloat16), S((2,), jnp.int32), S((2, 9, 9), jnp.bool_))
    assert list(ir) == ["tree_attention", "tree_attention_combine"]  # 4k keys: several splits


@pytest.mark.parametrize("S", [2, 13, 37])
def test_split_combine_kernel(S):
    # the splits' log-sum-exp merge as one kernel against combine_splits: splits that saw nothing (lse -inf),
    # a row no split saw (output 0, lse -inf), S not a multiple of the kernel's 16-split chunks
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    B, M, K = 2, 48, 64
    o = jnp.asarray(rng.normal(size=(B, S, M, K)), jnp.float32)
    lse = rng.normal(size=(B, S, M)) * 4
    lse[rng.random(lse.shape) < 0.3] = -np.inf
    lse[1, :, 5] = -np.inf
    lse = jnp.asarray(lse, jnp.float32)
    out, lse_out = jax.jit(lambda o, l: ta.combine_splits_pallas(o, l, jnp.bfloat16, interpret=True))(o, lse)
    ref, ref_lse = ta.combine_splits(o, lse, axis=1)
    assert out.dtype == jnp.bfloat16 and out.shape == (B, M, K) and lse_out.shape == (B, M)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref.astype(jnp.bfloat16), np.float32),
                               rtol=1e-2, atol=1e-2, err_msg=str(seed))
    np.testing.assert_allclose(np.asarray(lse_out), np.asarray(ref_lse), rtol=1e-5, atol=1e-5, err_msg=str(seed))
    assert np.all(np.asarray(out[1, 5], np.float32) == 0) and np.asarray(lse_out)[1, 5] == -np.inf
