"""Speculative decoding end to end through the Engine: lossless for greedy (token for token against the
teacher-forced target) and for sampling (exact distribution, chi-square), with real and oracle drafters."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimijax
from kimijax import Engine, RoundKernels
from kimijax.config import TINY
from kimijax.models.drafter import DrafterConfig, random_drafter
from kimijax.target import KimiTarget, random_kimi_params


def _drafter_cfg(cfg, block=4):
    return DrafterConfig(hidden_size=cfg.hidden_size, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, intermediate_size=96, block_size=block,
                         mask_token_id=cfg.vocab_size - 1, target_layer_ids=(0, 2), num_target_layers=3,
                         vocab_size=cfg.vocab_size, dtype=cfg.dtype)


@pytest.fixture(scope="module")
def setup(tiny_f32):
    d = random_drafter(_drafter_cfg(tiny_f32.cfg), tiny_f32, seed=1)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, size=n).tolist() for n in (7, 3, 12, 5)]
    return tiny_f32, d, prompts


class OracleDrafter:
    """A real drafter whose logits are overridden by a noisy oracle of the greedy continuation, so trees get
    accepted deep and on side branches (compaction and context append are exercised)."""

    def __init__(self, inner, seqs_BM, noise: float):
        self.inner, self.cfg, self.noise = inner, inner.cfg, noise
        self.params = {"inner": inner.params, "seq": jnp.asarray(seqs_BM)}

    def init_cache(self, B, L):
        return self.inner.init_cache(B, L)

    def context_kv(self, dp, feats, pos):
        return self.inner.context_kv(dp["inner"], feats, pos)

    def append_context(self, dcache, rows, start):
        return self.inner.append_context(dcache, rows, start)

    def draft_logits(self, dp, target, tparams, dcache, S_B, bonus_B, window=None, depths=None):
        real = self.inner.draft_logits(dp["inner"], target, tparams, dcache, S_B, bonus_B, window, depths)
        B, L, V = real.shape
        seq = dp["seq"]
        pos = jnp.clip(S_B[:, None] + 1 + jnp.arange(L)[None], 0, seq.shape[1] - 1)
        tok = jnp.take_along_axis(seq, pos, axis=1)
        key = jax.random.fold_in(jax.random.PRNGKey(3), jnp.sum(S_B))
        return jax.nn.one_hot(tok, V) * 10.0 + self.noise * jax.random.normal(key, real.shape) + 1e-3 * real


def _check_teacher_forced(target, prompt, new):
    logits = np.asarray(kimijax.forward(target, np.array([prompt + new])))[0]
    for i, tok in enumerate(new):
        assert int(np.argmax(logits[len(prompt) - 1 + i])) == tok, f"emitted token {i} is not the target's argmax"


def test_greedy_ddtree_and_chain_are_lossless(setup):
    target, d, prompts = setup
    ar = Engine(target).generate(prompts, max_new_tokens=14, stop_ids=[])
    for p, r in zip(prompts, ar):
        _check_teacher_forced(target, p, r.tokens)
    for method, budget in [("dflash", 1), ("ddtree", 1), ("ddtree", 2), ("ddtree", 3), ("ddtree", 4), ("ddtree", 8),
                           ("ddtree", 16), ("ddtree", 32), ("ddtree", 64), ("ddtree", 128)]:
        batch = prompts if budget in (1, 8, 128) else prompts[:1]
        res = Engine(target, d, method=method, budget=budget).generate(batch, max_new_tokens=14, stop_ids=[])
        for a, r in zip(ar, res):
            assert r.tokens == a.tokens, (method, budget)
            assert sum(r.acceptance_lengths) == 14 - 1  # every emitted token after the first came from a round


def _ar_and_sequences(target, prompts, max_new_tokens):
    """AR's results for `prompts`, and each prompt + its AR answer as one row of an oracle drafter's [B, 64]."""
    ar = Engine(target).generate(prompts, max_new_tokens=max_new_tokens, stop_ids=[])
    seqs = np.zeros((len(prompts), 64), np.int32)
    for b, (p, r) in enumerate(zip(prompts, ar)):
        seqs[b, : len(p) + len(r.tokens)] = p + r.tokens
    return ar, seqs


@pytest.mark.parametrize("method,budget", [("dflash", 0), ("ddtree", 6), ("ddtree", 32)])
def test_oracle_drafter_accepts_full_blocks(setup, method, budget):
    target, d, prompts = setup
    ar, seqs = _ar_and_sequences(target, prompts, 40)
    oracle = OracleDrafter(d, seqs, noise=0.0 if method == "dflash" else 2.5)
    eng = Engine(target, oracle, method=method, budget=max(budget, 1))
    res = eng.generate(prompts, max_new_tokens=40, stop_ids=[])
    for p, a, r in zip(prompts, ar, res):
        assert r.tokens == a.tokens
        _check_teacher_forced(target, p, r.tokens)
    block = d.cfg.block_size
    acc = [x for r in res for x in r.acceptance_lengths]
    assert max(acc) == block  # full blocks: bonus + all drafted depths
    if method == "dflash":
        assert np.mean(acc[:-1]) > block - 0.5  # a noiseless oracle chain is accepted (nearly) always
    assert eng.last_stats["mean_acceptance"] > 1.5


def test_stop_token_inside_accepted_path(setup):
    target, d, prompts = setup
    ar = Engine(target).generate(prompts[:1], max_new_tokens=30, stop_ids=[])[0].tokens
    stop = ar[9]
    first = ar.index(stop)
    seqs = np.zeros((1, 64), np.int32)
    seqs[0, : len(prompts[0]) + 30] = prompts[0] + ar
    oracle = OracleDrafter(d, seqs, noise=0.0)
    res = Engine(target, oracle, method="ddtree", budget=8).generate(prompts[:1], max_new_tokens=30, stop_ids=[stop])
    assert res[0].tokens == ar[: first + 1] and res[0].finish_reason == "stop"
    assert max(res[0].acceptance_lengths) > 1  # the stop came inside a multi-token path


def test_max_new_tokens_cuts_inside_a_path(setup):
    target, d, prompts = setup
    ar, seqs = _ar_and_sequences(target, prompts, 9)
    res = Engine(target, OracleDrafter(d, seqs, 0.0), method="dflash").generate(prompts, max_new_tokens=9, stop_ids=[])
    assert [r.tokens for r in res] == [r.tokens for r in ar]
    assert all(r.finish_reason == "length" for r in res)


def _chi2_sf(x, k):
    return float(jax.scipy.special.gammaincc(k / 2.0, x / 2.0))


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.7, 0.9)])
def test_sampling_is_lossless(temperature, top_p):
    """DDTree sampling: the joint of the 2nd and 3rd emitted tokens (both from a tree round) matches the exact
    target distribution on a tiny vocab (chi-square, 20k samples)."""
    V = 8
    cfg = dataclasses.replace(TINY, vocab_size=V, dtype="float32", eos_token_ids=(V + 5,), bos_token_id=0, pad_token_id=0)
    params = random_kimi_params(cfg, seed=11)
    params["lm_head"] = params["lm_head"] * 0.5  # softer distributions: every cell gets mass
    target = KimiTarget(cfg, params)
    dcfg = dataclasses.replace(_drafter_cfg(cfg), mask_token_id=V - 1)
    d = random_drafter(dcfg, target, seed=2)
    prompt = [1, 4, 2]
    n = 20000
    res = Engine(target, d, method="ddtree", budget=6).generate([prompt] * n, max_new_tokens=3, temperature=temperature,
                                                                top_p=top_p, seed=5, stop_ids=[])
    toks = np.array([r.tokens for r in res])
    assert toks.shape == (n, 3)
    # exact target distribution (same processing as the sampler)
    from kimijax.sampling import processed_logprobs

    def probs(seqs):
        lg = np.asarray(kimijax.forward(target, np.array(seqs)))[:, -1]
        m = len(seqs)
        return np.exp(np.asarray(processed_logprobs(jnp.asarray(lg), jnp.full((m,), temperature), jnp.zeros((m,), jnp.int32),
                                                    jnp.full((m,), top_p))))
    p1 = probs([prompt])[0]
    p2 = probs([prompt + [a] for a in range(V)])  # [a, b]
    p3 = probs([prompt + [a, b] for a in range(V) for b in range(V)]).reshape(V, V, V)
    joint = np.einsum("a,ab,abc->bc", p1, p2, p3).reshape(-1)
    counts = np.bincount(toks[:, 1] * V + toks[:, 2], minlength=V * V)
    exp = joint * n
    keep = exp >= 5
    obs_k = np.append(counts[keep], counts[~keep].sum())
    exp_k = np.append(exp[keep], exp[~keep].sum())
    if exp_k[-1] == 0:
        obs_k, exp_k = obs_k[:-1], exp_k[:-1]
    assert counts[exp == 0].sum() == 0  # nothing outside the kept (top-p) set
    chi2 = float(((obs_k - exp_k) ** 2 / exp_k).sum())
    p = _chi2_sf(chi2, len(obs_k) - 1)
    assert p > 0.01, (chi2, len(obs_k), p)
    # trees were actually accepted (not just bonus samples)
    assert np.mean([r.acceptance_lengths[0] for r in res]) > 1.2


def test_draft_window_ring_cache_equals_full_cache(setup, monkeypatch):
    """With a draft window W the drafter's context cache is a ring of W + block slots: prompts longer than the
    ring and rounds that wrap it draft exactly what a whole-context cache read through the same window drafts."""
    from kimijax.spec.round import SpecRound

    target, d, _ = setup
    W, L = 5, 64
    r = SpecRound(target, d, "ddtree", 4, None, W)
    assert r.drafter_cache_len(L) == W + r.max_commit < 12
    rng = np.random.default_rng(4)
    feats = lambda T: jnp.asarray(rng.normal(size=(len(d.cfg.target_layer_ids), 2, T, target.hidden_size)),
                                  jnp.float32)
    cap, lens = feats(12), jnp.array([12, 7], jnp.int32)
    ring = r.init_state(d.params, cap, lens, L)["dcache"]
    monkeypatch.setattr(SpecRound, "drafter_cache_len", lambda self, L: L)
    full = r.init_state(d.params, cap, lens, L)["dcache"]
    assert ring[0].shape[1] == W + r.max_commit and full[0].shape[1] == L
    S = lens
    draft = jax.jit(lambda dc, s, b: d.draft_logits(d.params, target, target.params, dc, s, b, window=W))
    for step in range(6):
        bonus = jnp.asarray(rng.integers(3, 500, size=2), jnp.int32)
        np.testing.assert_array_equal(np.asarray(draft(ring, S, bonus)), np.asarray(draft(full, S, bonus)))
        rows = feats(r.max_commit)  # one round appends block rows at S; only n of them become committed
        ring = d.extend_context(d.params, ring, rows, S)
        full = d.extend_context(d.params, full, rows, S)
        S = S + jnp.asarray(rng.integers(1, r.max_commit + 1, size=2), jnp.int32)


def test_one_kernel_commit_is_lossless(setup):
    """The commit's cache compaction as one kernel for all layers (pallas_kernels/row_move.py, interpret mode)
    with an oracle drafter, so deep paths and side branches are moved: same tokens as AR."""
    target, d, prompts = setup
    ar, seqs = _ar_and_sequences(target, prompts[:2], 24)
    oracle = OracleDrafter(d, seqs, noise=2.5)
    res = Engine(target, oracle, method="ddtree", budget=6, round_kernels=RoundKernels(commit="interpret")).generate(
        prompts[:2], max_new_tokens=24, stop_ids=[])
    assert [r.tokens for r in res] == [a.tokens for a in ar]
    assert max(x for r in res for x in r.acceptance_lengths) > 2


def test_one_kernel_tree_is_lossless(setup):
    """The tree's best-first pops as one kernel (pallas_kernels/ddtree_frontier.py, interpret mode) inside the
    Engine's round: same tokens as AR, and the same acceptance lengths as the XLA pops (the same trees). One
    drafter object for both: the compiled programs are keyed by the round's kernels too."""
    target, d, prompts = setup
    ar, seqs = _ar_and_sequences(target, prompts[:2], 24)
    oracle = OracleDrafter(d, seqs, noise=2.5)
    runs, programs = [], []
    for impl in ("xla", "interpret"):
        eng = Engine(target, oracle, method="ddtree", budget=6, round_kernels=RoundKernels(tree=impl))
        runs.append(eng.generate(prompts[:2], max_new_tokens=24, stop_ids=[]))
        programs.append(eng._compiled)
    assert programs[0] is not programs[1]  # the interpret run compiled its own round
    assert [r.tokens for r in runs[1]] == [a.tokens for a in ar]
    assert [r.acceptance_lengths for r in runs[1]] == [r.acceptance_lengths for r in runs[0]]
