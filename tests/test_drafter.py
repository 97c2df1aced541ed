"""DFlash drafter: forward vs an independent float64 reference, context cache semantics, YaRN amplitude options,
config parsing, and the z-lab checkpoint format (save/load round trip and load errors)."""
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from kimijax.config import ConfigError, YarnScaling
from kimijax.models.drafter import (Drafter, DrafterConfig, DrafterError, default_target_layer_ids, load_drafter,
                                    random_drafter, save_drafter)

D, V, NT = 32, 64, 6
CFG = DrafterConfig(
    hidden_size=D, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
    intermediate_size=48, rms_norm_eps=1e-6, rope_theta=50000.0,
    rope_scaling=YarnScaling(factor=64.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
                             mscale=1.0, mscale_all_dim=1.0),
    yarn_attention_factor="ratio", block_size=5, mask_token_id=V - 2, target_layer_ids=(4, 0, 2),
    num_target_layers=NT, vocab_size=V, max_position_embeddings=262144, dtype="float32")
LC = 16  # context slots


class StubTarget:
    """Just enough of the target interface: random embedding and lm_head."""
    hidden_size, vocab_size, num_layers, dtype = D, V, NT, jnp.float32

    def __init__(self, seed=0, hidden=D):
        self.hidden_size = hidden
        k1, k2 = jax.random.split(jax.random.PRNGKey(100 + seed))
        self.params = {"embed": jax.random.normal(k1, (V, hidden), jnp.float32),
                       "lm_head": jax.random.normal(k2, (V, hidden), jnp.float32) / math.sqrt(hidden)}

    def embed(self, params, tokens):
        return jnp.take(params["embed"], tokens, axis=0)

    def head(self, params, h_BTD):
        return jnp.einsum("btd,vd->btv", h_BTD, params["lm_head"], preferred_element_type=jnp.float32)


# ---------------------------------------------------------------- independent float64 reference
def ref_inv_freq(E, theta, y: YarnScaling):
    base = theta ** (np.arange(0, E, 2, dtype=np.float64) / E)
    extrap, interp = 1.0 / base, 1.0 / (y.factor * base)

    def dim_of(n_rot):  # the dimension whose wavelength makes n_rot turns over the original context
        return E * math.log(y.original_max_position_embeddings / (n_rot * 2 * math.pi)) / (2 * math.log(theta))

    lo, hi = max(math.floor(dim_of(y.beta_fast)), 0), min(math.ceil(dim_of(y.beta_slow)), E - 1)
    hi = hi + 0.001 if lo == hi else hi
    interp_w = np.clip((np.arange(E // 2) - lo) / (hi - lo), 0.0, 1.0)
    return interp * interp_w + extrap * (1.0 - interp_w)


def ref_rope(x, pos, inv, amp):
    """x [..., T, heads, E], pos [T]: NeoX halves."""
    ang = pos[:, None].astype(np.float64) * inv[None]
    c, s = (amp * np.cos(ang))[:, None], (amp * np.sin(ang))[:, None]
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return np.concatenate([a * c - b * s, b * c + a * s], axis=-1)


def ref_rms(x, w, eps=1e-6):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def hf_tensors(drafter, tmp_path):
    """The drafter's weights in the checkpoint layout ([out, in] matrices), as float64."""
    p = save_drafter(drafter, tmp_path / "ref_ckpt", dtype="float32")
    return {k: v.astype(np.float64) for k, v in load_file(str(p / "model.safetensors")).items()}


def ref_draft_logits(W, cfg, tgt, feats_nSD, S, bonus, window, amp):
    """One request: context features for positions 0..S-1 -> logits [bs-1, V] by explicit loops."""
    H, KV, E, bs = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.block_size
    G = H // KV
    inv = ref_inv_freq(E, cfg.rope_theta, cfg.rope_scaling)
    emb = np.asarray(tgt.params["embed"], np.float64)
    head = np.asarray(tgt.params["lm_head"], np.float64)
    fused = np.concatenate([feats_nSD[l, :S] for l in range(feats_nSD.shape[0])], axis=-1)  # layer-id order
    ctx = ref_rms(fused @ W["fc.weight"].T, W["hidden_norm.weight"])
    ctx_pos = np.arange(S)
    x = emb[[bonus] + [cfg.mask_token_id] * (bs - 1)]
    pos = S + np.arange(bs)
    lo = 0 if window is None else max(0, S - window)
    for l in range(cfg.num_hidden_layers):
        p = f"layers.{l}."
        wq, wk, wv, wo = (W[p + f"self_attn.{n}_proj.weight"] for n in "qkvo")
        qn, kn = W[p + "self_attn.q_norm.weight"], W[p + "self_attn.k_norm.weight"]
        kc = ref_rope(ref_rms((ctx @ wk.T).reshape(S, KV, E), kn), ctx_pos, inv, amp)
        vc = (ctx @ wv.T).reshape(S, KV, E)
        h = ref_rms(x, W[p + "input_layernorm.weight"])
        q = ref_rope(ref_rms((h @ wq.T).reshape(bs, H, E), qn), pos, inv, amp)
        kb = ref_rope(ref_rms((h @ wk.T).reshape(bs, KV, E), kn), pos, inv, amp)
        vb = (h @ wv.T).reshape(bs, KV, E)
        sw = cfg.layer_window(l)
        causal = cfg.layer_causal(l)
        out = np.zeros((bs, H, E))
        for hh in range(H):
            j = hh // G
            for i in range(bs):
                keys, vals = [], []
                for c in range(lo, S):
                    if sw is None or pos[i] - c < sw:
                        keys.append(kc[c, j]), vals.append(vc[c, j])
                for s in range(bs):
                    if causal and s > i:
                        continue
                    if sw is not None and (abs(i - s) >= sw):
                        continue
                    keys.append(kb[s, j]), vals.append(vb[s, j])
                sc = np.array(keys) @ q[i, hh] / math.sqrt(E)
                pr = np.exp(sc - sc.max())
                out[i, hh] = (pr / pr.sum()) @ np.array(vals)
        x = x + out.reshape(bs, H * E) @ wo.T
        h2 = ref_rms(x, W[p + "post_attention_layernorm.weight"])
        g, u = h2 @ W[p + "mlp.gate_proj.weight"].T, h2 @ W[p + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ W[p + "mlp.down_proj.weight"].T
    x = ref_rms(x, W["norm.weight"])
    return x[1:] @ head.T


# ---------------------------------------------------------------- fixtures
# One random init and one compiled program per (config, window, shapes): this box is small.
TGT = StubTarget()
SLIDING = dataclasses.replace(CFG, layer_types=("sliding_attention", "full_attention"), sliding_window=3)
_JIT: dict = {}


@pytest.fixture(scope="module")
def base():
    return random_drafter(CFG, TGT, seed=1)


def drafter(base, cfg=CFG):
    params = base.params
    if cfg.dtype != base.cfg.dtype:
        params = jax.tree_util.tree_map(lambda x: x.astype(cfg.dtype), params)
    return Drafter(cfg, params)


def logits(d, cache, S, bonus, window=None):
    key = ("logits", d.cfg, window)
    if key not in _JIT:
        dd = Drafter(d.cfg, None)
        _JIT[key] = jax.jit(lambda dp, tp, c, s, b: dd.draft_logits(dp, TGT, tp, c, s, b, window=window))
    return _JIT[key](d.params, TGT.params, cache, jnp.asarray(S, jnp.int32), jnp.asarray(bonus, jnp.int32))


def extend(d, cache, feats, start):
    key = ("extend", d.cfg)
    if key not in _JIT:
        _JIT[key] = jax.jit(Drafter(d.cfg, None).extend_context)
    return _JIT[key](d.params, cache, feats, jnp.full((feats.shape[1],), start, jnp.int32))


def _feats(seed, T=13, B=2):
    return jax.random.normal(jax.random.PRNGKey(seed), (len(CFG.target_layer_ids), B, T, D), jnp.float32) * 2.0


def _fill(d, feats, split=5):
    """Write the context in two chunks (rows 0..split-1 then split..T-1) for both requests."""
    cache = d.init_cache(feats.shape[1], LC)
    cache = extend(d, cache, feats[:, :, :split].astype(d.dtype), 0)
    return extend(d, cache, feats[:, :, split:].astype(d.dtype), split)


# ---------------------------------------------------------------- forward parity
S2, BONUS2 = np.array([13, 7]), np.array([3, 17])


@pytest.mark.parametrize("cfg,window", [(CFG, None), (CFG, 4), (CFG, 10), (CFG, 64), (SLIDING, None),
                                        (SLIDING, 6)])
def test_forward_matches_reference(cfg, window, base, tmp_path):
    d = drafter(base, cfg)
    feats = _feats(2)
    got = logits(d, _fill(d, feats), S2, BONUS2, window)
    assert got.shape == (2, cfg.block_size - 1, V) and got.dtype == jnp.float32
    W = hf_tensors(d, tmp_path)
    f64 = np.asarray(feats, np.float64)
    for b in range(2):
        want = ref_draft_logits(W, cfg, TGT, f64[:, b], int(S2[b]), int(BONUS2[b]), window, cfg.rope_amplitude)
        np.testing.assert_allclose(np.asarray(got[b]), want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_draft_logits_first_depths(base):
    # depths=n: the first n rows of the full block's logits (the block still runs whole), for SpecRound's
    # budget-N trees; out-of-range n is an error, not a silent clip.
    cache = _fill(base, _feats(2))
    full = np.asarray(logits(base, cache, S2, BONUS2))
    f = jax.jit(lambda dp, tp, c, s, b: base.draft_logits(dp, TGT, tp, c, s, b, depths=3))
    got = np.asarray(f(base.params, TGT.params, cache, jnp.asarray(S2, jnp.int32), jnp.asarray(BONUS2, jnp.int32)))
    assert got.shape == (2, 3, V)
    np.testing.assert_allclose(got, full[:, :3], rtol=1e-6, atol=1e-6)
    for bad in (0, base.cfg.block_size):
        with pytest.raises(DrafterError, match="depths"):
            base.draft_logits(base.params, TGT, TGT.params, cache, S2, BONUS2, depths=bad)


def test_window_changes_only_long_contexts(base):
    cache = _fill(base, _feats(2))
    full = logits(base, cache, S2, BONUS2)
    w10 = logits(base, cache, S2, BONUS2, window=10)
    np.testing.assert_allclose(np.asarray(w10[1]), np.asarray(full[1]), rtol=1e-6, atol=1e-6)  # S=7 < 10
    assert np.abs(np.asarray(w10[0] - full[0])).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(logits(base, cache, S2, BONUS2, window=64)), np.asarray(full))


def test_context_rows_independent_of_later_slots(base):
    d = base
    feats = _feats(4)
    bonus = np.array([1, 2])
    early = extend(d, d.init_cache(2, LC), feats[:, :, :5], 0)
    before = logits(d, early, [5, 5], bonus)
    later = extend(d, early, feats[:, :, 5:], 5)
    for a, b in zip(early, later):  # slots < 5 untouched
        np.testing.assert_array_equal(np.asarray(a[:, :5]), np.asarray(b[:, :5]))
    after = logits(d, later, [5, 5], bonus)
    np.testing.assert_array_equal(np.asarray(before), np.asarray(after))
    # a row depends only on its own token and position: one pass over 13 tokens = two chunked passes
    pos = jnp.broadcast_to(jnp.arange(13, dtype=jnp.int32), (2, 13))
    whole = d.context_kv(d.params, feats, pos)
    for a, b in zip(whole, later):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b[:, :13]), rtol=1e-5, atol=1e-5)
    # more committed context changes the draft of that request only
    more = logits(d, later, [9, 5], bonus)
    assert np.abs(np.asarray(more[0] - before[0])).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(more[1]), np.asarray(before[1]))


def test_bonus_in_slot_zero_matters(base):
    out = logits(base, _fill(base, _feats(6)), [13, 13], [3, 4])
    assert np.abs(np.asarray(out[0] - out[1])).max() > 1e-3


# ---------------------------------------------------------------- YaRN amplitude
def test_yarn_amplitude_options(base, tmp_path):
    legacy = 1 + 0.1 * math.log(64)
    assert legacy == pytest.approx(1.4158883, abs=1e-6)
    cfg_r = CFG
    cfg_l = dataclasses.replace(CFG, yarn_attention_factor="legacy")
    cfg_f = dataclasses.replace(CFG, yarn_attention_factor=1.25)
    assert cfg_r.rope_amplitude == pytest.approx(1.0)  # mscale == mscale_all_dim: ratio 1
    assert cfg_l.rope_amplitude == pytest.approx(legacy, abs=1e-9)
    assert cfg_f.rope_amplitude == 1.25
    no_rope = dataclasses.replace(CFG, rope_scaling=None, yarn_attention_factor="legacy")
    assert no_rope.rope_amplitude == 1.0
    # HF falls back to 1 + 0.1 ln(factor) when mscale / mscale_all_dim are absent
    hf = CFG.to_hf()
    for k in ("mscale", "mscale_all_dim"):
        hf["rope_scaling"].pop(k)
    assert DrafterConfig.from_hf(hf).rope_amplitude == pytest.approx(legacy)

    feats = _feats(8)
    W = hf_tensors(base, tmp_path)
    outs = {}
    for name, cfg, amp in (("ratio", cfg_r, 1.0), ("legacy", cfg_l, legacy)):
        d = drafter(base, cfg)
        outs[name] = np.asarray(logits(d, _fill(d, feats), S2, BONUS2))
        want = ref_draft_logits(W, cfg, TGT, np.asarray(feats, np.float64)[:, 0], 13, 3, None, amp)
        np.testing.assert_allclose(outs[name][0], want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
    assert np.abs(outs["ratio"] - outs["legacy"]).max() > 1e-3


# ---------------------------------------------------------------- config
KIMI_HF = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": 7168, "num_hidden_layers": 6,
    "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 18432,
    "vocab_size": 163840, "num_target_layers": 61, "block_size": 8, "max_position_embeddings": 262144,
    "rope_theta": 50000, "rms_norm_eps": 1e-6, "hidden_act": "silu", "attention_bias": False,
    "tie_word_embeddings": False,
    "rope_scaling": {"type": "yarn", "factor": 64, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1},
    "dflash_config": {"target_layer_ids": [1, 12, 24, 35, 47, 58], "mask_token_id": 163838},
    "layer_types": ["full_attention"] * 6, "sliding_window": None,
}


def test_config_from_hf_kimi():
    cfg = DrafterConfig.from_hf(KIMI_HF)
    assert cfg == DrafterConfig()
    assert cfg.rope_amplitude == pytest.approx(1.0)
    assert DrafterConfig.from_hf(KIMI_HF, yarn_attention_factor="legacy").rope_amplitude == pytest.approx(1.4158883)
    for c in (cfg, CFG, SLIDING, dataclasses.replace(CFG, is_causal=True, input_embedding_scale=2.0,
                                                     final_logit_softcapping=30.0)):
        assert DrafterConfig.from_hf(c.to_hf(), dtype=c.dtype) == c
    legacy = dataclasses.replace(cfg, yarn_attention_factor="legacy")
    back = DrafterConfig.from_hf(legacy.to_hf())  # written as an explicit attention_factor
    assert back.rope_amplitude == pytest.approx(legacy.rope_amplitude)


def test_default_target_layer_ids():
    assert default_target_layer_ids(61, 6) == (1, 12, 24, 35, 47, 58)
    assert default_target_layer_ids(36, 5) == (1, 9, 17, 25, 33)
    assert default_target_layer_ids(64, 5) == (1, 16, 31, 46, 61)
    assert default_target_layer_ids(40, 1) == (20,)
    hf = json.loads(json.dumps(KIMI_HF))
    del hf["dflash_config"]["target_layer_ids"]
    assert DrafterConfig.from_hf(hf).target_layer_ids == (1, 12, 24, 35, 47, 58)


@pytest.mark.parametrize("edit,msg", [
    (lambda h: h["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda h: h.update(architectures=["DFlash2DraftModel"]), "DFlash2"),
    (lambda h: h.update(layer_types=["sliding_attention"] * 6), "sliding_window"),
    (lambda h: h.update(layer_types=["linear_attention"] * 6), "linear_attention"),
    (lambda h: h["rope_scaling"].update(type="llama3"), "llama3"),
    (lambda h: h.update(hidden_act="gelu"), "hidden_act"),
    (lambda h: h.update(attention_bias=True), "attention_bias"),
    (lambda h: h["dflash_config"].update(target_layer_ids=[1, 61]), "num_target_layers"),
    (lambda h: h.pop("intermediate_size"), "intermediate_size"),
])
def test_config_errors(edit, msg):
    hf = json.loads(json.dumps(KIMI_HF))
    edit(hf)
    with pytest.raises(ConfigError, match=msg):
        DrafterConfig.from_hf(hf)


def test_sliding_layers_parse():
    hf = json.loads(json.dumps(KIMI_HF))
    hf.update(layer_types=["sliding_attention"] * 5 + ["full_attention"], sliding_window=2048)
    cfg = DrafterConfig.from_hf(hf)
    assert cfg.layer_window(0) == 2048 and cfg.layer_causal(0)
    assert cfg.layer_window(5) is None and not cfg.layer_causal(5)


# ---------------------------------------------------------------- checkpoints
BF16 = dataclasses.replace(CFG, dtype="bfloat16")


@pytest.fixture(scope="module")
def saved(base, tmp_path_factory):
    d = drafter(base, BF16)
    return d, save_drafter(d, tmp_path_factory.mktemp("drafter") / "dr")


def _assert_same_params(a, b):
    jax.tree_util.tree_map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)


def test_save_load_round_trip(saved, tmp_path):
    d, p = saved
    hf = json.loads((p / "config.json").read_text())
    assert hf["dflash_config"]["target_layer_ids"] == [4, 0, 2] and hf["block_size"] == 5
    t = load_file(str(p / "model.safetensors"))
    assert t["layers.1.self_attn.q_proj.weight"].shape == (32, 32) and t["fc.weight"].shape == (32, 96)
    assert t["fc.weight"].dtype == np.dtype("bfloat16")
    d2 = load_drafter(p, TGT, dtype="bfloat16")
    assert d2.cfg == d.cfg
    _assert_same_params(d.params, d2.params)
    feats = _feats(12)
    a = logits(d, _fill(d, feats), S2, BONUS2)
    b = logits(d2, _fill(d2, feats), S2, BONUS2)
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert np.isfinite(np.asarray(a)).all()
    # default dtype follows the target; the YaRN option can be overridden at load
    d3 = load_drafter(p, TGT, yarn_attention_factor="legacy")
    assert d3.cfg.dtype == "float32" and d3.cfg.rope_amplitude == pytest.approx(1.4158883)

    # index + shards
    names = sorted(t)
    sh = tmp_path / "sharded"
    sh.mkdir()
    (sh / "config.json").write_text((p / "config.json").read_text())
    files = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    save_file({n: t[n] for n in names[0::2]}, str(sh / files[0]))
    save_file({n: t[n] for n in names[1::2]}, str(sh / files[1]))
    wm = {n: files[i % 2] for i, n in enumerate(names)}
    (sh / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    _assert_same_params(d.params, load_drafter(sh, TGT, dtype="bfloat16").params)


def _edited(saved, tmp_path, tensors=None, config=None):
    _, src = saved
    t = load_file(str(src / "model.safetensors"))
    hf = json.loads((src / "config.json").read_text())
    if tensors:
        tensors(t)
    if config:
        config(hf)
    out = tmp_path / "edited"
    out.mkdir()
    save_file(t, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(hf))
    return out


@pytest.mark.parametrize("tensors,config,target_kw,msg", [
    (lambda t: t.pop("layers.1.mlp.up_proj.weight"), None, {}, "lacks tensor 'layers.1.mlp.up_proj.weight'"),
    (lambda t: t.update({"layers.0.self_attn.k_proj.weight": np.zeros((16, 31), np.float32)}), None, {},
     r"'layers.0.self_attn.k_proj.weight' has shape \[16, 31\]; expected \[16, 32\]"),
    (lambda t: t.update({"lm_head.weight": np.zeros((V, D), np.float32)}), None, {}, "unexpected tensor 'lm_head"),
    (lambda t: t.update({"norm.weight": np.zeros((D,), np.int32)}), None, {}, "'norm.weight' has dtype I32"),
    (None, None, {"hidden": 48}, "hidden_size=32 != target hidden_size=48"),
    (None, lambda h: h["dflash_config"].update(mask_token_id=V), {}, f"mask_token_id={V}"),
    (None, lambda h: h.update(num_target_layers=NT + 1), {}, "num_target_layers"),
    (None, lambda h: h["rope_scaling"].update(type="dynamic", rope_type="dynamic"), {}, "config.json.*dynamic"),
])
def test_load_errors(tensors, config, target_kw, msg, saved, tmp_path):
    p = _edited(saved, tmp_path, tensors, config)
    target = StubTarget(**target_kw) if target_kw else TGT
    with pytest.raises(DrafterError, match=msg):
        load_drafter(p, target)


def test_load_missing_files(tmp_path):
    with pytest.raises(DrafterError, match="config.json"):
        load_drafter(tmp_path, TGT)
    (tmp_path / "config.json").write_text(json.dumps(CFG.to_hf()))
    with pytest.raises(DrafterError, match="model.safetensors"):
        load_drafter(tmp_path, TGT)
