"""Model internals: absorbed == naive MLA, cached decode == full recompute, router, hidden-state capture."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax.config import TINY
from kimijax.models.common import causal_tree_mask
from kimijax.models.moe import route
from kimijax.target import KimiTarget, compact_caches, random_kimi_params


def _toks(B, T, V, seed=1):
    return jax.random.randint(jax.random.PRNGKey(seed), (B, T), 0, V)


def test_absorbed_equals_naive(tiny_f32):
    t = tiny_f32
    toks = _toks(2, 11, t.vocab_size)
    full = t.forward(toks)
    pos = jnp.broadcast_to(jnp.arange(11), (2, 11))
    logits, _, _ = jax.jit(t.verify)(t.params, t.init_cache(2, 16), toks, pos, jnp.zeros(2, jnp.int32),
                                     causal_tree_mask(2, 11))
    np.testing.assert_allclose(np.asarray(logits), np.asarray(full), atol=2e-5, rtol=2e-5)


def test_cached_decode_equals_full_recompute(tiny_f32):
    t = tiny_f32
    toks = _toks(2, 12, t.vocab_size, seed=3)
    full = np.asarray(t.forward(toks))
    lens = jnp.array([5, 7], jnp.int32)
    # right-padded prompts of different lengths
    _, caches, _ = jax.jit(t.prefill)(t.params, t.init_cache(2, 32), toks[:, :8], lens)
    step = jax.jit(t.verify)
    for i in range(4):
        cur = jnp.stack([toks[0, 5 + i], toks[1, 7 + i]])[:, None]
        logits, caches, _ = step(t.params, caches, cur, lens[:, None], lens, jnp.ones((2, 1, 1), bool))
        np.testing.assert_allclose(np.asarray(logits[0, 0]), full[0, 5 + i], atol=2e-5, rtol=2e-5)
        np.testing.assert_allclose(np.asarray(logits[1, 0]), full[1, 7 + i], atol=2e-5, rtol=2e-5)
        lens = lens + 1


def test_tree_mask_verify_and_compaction(tiny_f32):
    """A 2-branch tree verified in one pass equals each branch run causally; compaction keeps the path."""
    t = tiny_f32
    toks = _toks(1, 6, t.vocab_size, seed=5)
    a, b, c = 11, 22, 33
    # tree: root r (pos S) -> a (S+1) -> b (S+2); root -> c (S+1)
    tree_tokens = jnp.array([[toks[0, 5], a, c, b]])
    depths = jnp.array([[0, 1, 1, 2]])
    anc = jnp.array([[[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]], bool)
    lens = jnp.array([5], jnp.int32)
    _, caches, _ = jax.jit(t.prefill)(t.params, t.init_cache(1, 32), toks[:, :5], lens)
    verify = jax.jit(t.verify)
    logits, caches_v, _ = verify(t.params, caches, tree_tokens, lens[:, None] + depths, lens, anc)
    path1 = t.forward(jnp.concatenate([toks[:, :6], jnp.array([[a, b]])], 1))
    path2 = t.forward(jnp.concatenate([toks[:, :6], jnp.array([[c]])], 1))
    np.testing.assert_allclose(logits[0, 0], path1[0, 5], atol=2e-5)
    np.testing.assert_allclose(logits[0, 1], path1[0, 6], atol=2e-5)
    np.testing.assert_allclose(logits[0, 3], path1[0, 7], atol=2e-5)
    np.testing.assert_allclose(logits[0, 2], path2[0, 6], atol=2e-5)
    # accept root, a, b: rows S+0, S+1, S+3 -> S+0, S+1, S+2; then one more token decodes correctly
    caches_c = jax.jit(compact_caches)(caches_v, lens, jnp.array([[0, 1, 3, 0]]), jnp.array([3]))
    lens2 = lens + 3
    nxt = jnp.array([[7]])
    l2, _, _ = jax.jit(t.verify)(t.params, caches_c, nxt, lens2[:, None], lens2, jnp.ones((1, 1, 1), bool))
    ref = t.forward(jnp.concatenate([toks[:, :6], jnp.array([[a, b, 7]])], 1))
    np.testing.assert_allclose(l2[0, 0], ref[0, 8], atol=2e-5)


def test_hidden_capture_layers(tiny_f32):
    t = tiny_f32
    toks = _toks(1, 4, t.vocab_size)
    _, _, cap = t.prefill(t.params, t.init_cache(1, 8), toks, jnp.array([4]), (2, 0))
    assert cap.shape == (2, 1, 4, t.hidden_size)
    _, _, cap0 = t.prefill(t.params, t.init_cache(1, 8), toks, jnp.array([4]), (0,))
    np.testing.assert_array_equal(cap[1], cap0[0])


def _route_numpy(x, w, bias, cfg):
    s = 1 / (1 + np.exp(-(x.astype(np.float64) @ w.T.astype(np.float64))))
    sel = s + bias
    E = s.shape[1]
    out_ids, out_w = [], []
    for t in range(s.shape[0]):
        row = sel[t].copy()
        if cfg.n_group > 1:
            g = row.reshape(cfg.n_group, -1)
            gs = np.sort(g, axis=1)[:, -2:].sum(1)
            keep = np.argsort(-gs, kind="stable")[: cfg.topk_group]
            mask = np.zeros(cfg.n_group, bool)
            mask[keep] = True
            row = np.where(np.repeat(mask, E // cfg.n_group), row, -np.inf)
        ids = np.argsort(-row, kind="stable")[: cfg.num_experts_per_tok]
        ww = s[t, ids]
        ww = ww / ww.sum() * cfg.routed_scaling_factor
        order = np.argsort(ids)
        out_ids.append(ids[order])
        out_w.append(ww[order])
    return np.array(out_ids), np.array(out_w)


@pytest.mark.parametrize("n_group,topk_group,E,k", [(1, 1, 8, 2), (4, 2, 16, 4), (4, 1, 16, 3)])
def test_router_matches_numpy(n_group, topk_group, E, k):
    cfg = dataclasses.replace(TINY, n_routed_experts=E, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group)
    rng = np.random.default_rng(E + k)
    x = rng.normal(size=(20, 64)).astype(np.float32)
    w = rng.normal(size=(E, 64)).astype(np.float32) * 0.3
    bias = rng.normal(size=(E,)).astype(np.float32) * 0.2
    ids, ww = route(jnp.asarray(x), jnp.asarray(w), jnp.asarray(bias), cfg)
    ids, ww = np.asarray(ids), np.asarray(ww)
    order = np.argsort(ids, axis=1)
    ref_ids, ref_w = _route_numpy(x, w, bias, cfg)
    np.testing.assert_array_equal(np.take_along_axis(ids, order, 1), ref_ids)
    np.testing.assert_allclose(np.take_along_axis(ww, order, 1), ref_w, rtol=1e-5)


def test_bf16_model_close_to_f32():
    cfg = dataclasses.replace(TINY, dtype="float32")
    p = random_kimi_params(cfg, seed=2)
    t32 = KimiTarget(cfg, p)
    t16 = KimiTarget(dataclasses.replace(cfg, dtype="bfloat16"),
                     jax.tree_util.tree_map(lambda a: a.astype(jnp.bfloat16) if a.dtype == jnp.float32 and a.ndim > 1 else a, p))
    toks = _toks(1, 8, cfg.vocab_size)
    a, b = np.asarray(t32.forward(toks)), np.asarray(t16.forward(toks))
    assert np.abs(a - b).max() / np.abs(a).max() < 0.05


def test_prefill_in_query_chunks_equals_one_pass(tiny_f32, monkeypatch):
    """Long prompts walk the naive-MLA queries in chunks (bounded [B, H, chunk, T] scores): same logits and
    cache rows as one pass, also when the chunk does not divide the prompt."""
    import kimijax.models.common as common

    t = tiny_f32
    toks = jnp.asarray(np.random.default_rng(2).integers(3, t.cfg.vocab_size - 1, size=(2, 37)))
    lens = jnp.array([37, 20], jnp.int32)
    full = np.asarray(t.forward(toks))
    l0, c0, _ = t.prefill(t.params, t.init_cache(2, 48), toks, lens)
    monkeypatch.setattr(common, "SCORE_ELEMS", 2 * t.cfg.num_attention_heads * 37 * 5)  # 5-query chunks
    chunked = KimiTarget(t.cfg, t.params)
    np.testing.assert_allclose(np.asarray(chunked.forward(toks)), full, atol=2e-5, rtol=1e-5)
    l1, c1, _ = chunked.prefill(chunked.params, chunked.init_cache(2, 48), toks, lens)
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), atol=2e-5, rtol=1e-5)
    for a, b in zip(c0, c1):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
