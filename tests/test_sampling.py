"""kimijax.sampling: greedy / temperature / top-k / top-p sampling and its exact reference distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimijax.sampling import check_sampling_params, processed_logprobs, sample_tokens
from stats import chi2_pvalue

sample_jit = jax.jit(sample_tokens)
logprobs_jit = jax.jit(processed_logprobs)


def np_keep_set(logits, temperature, top_k, top_p):
    """Independent numpy statement of the kept set (sorted-order rule, ties to lower ids)."""
    scaled = logits.astype(np.float64) / temperature
    order = np.argsort(-scaled, kind="stable")
    V = len(logits)
    n = V if top_k <= 0 else min(top_k, V)
    kept = order[:n]
    if top_p < 1.0:
        p = np.exp(scaled[kept] - scaled[kept].max())
        p /= p.sum()
        n_p = int(np.searchsorted(np.cumsum(p), top_p) + 1)  # smallest prefix with mass >= top_p
        kept = kept[:n_p]
    return set(kept.tolist())


def test_seeded_reproducibility_and_row_independence():
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.normal(size=(6, 32)) * 2, jnp.float32)
    t = jnp.full((6,), 1.0)
    k = jnp.zeros((6,), jnp.int32)
    p = jnp.ones((6,))
    key = jax.random.key(3)
    a = sample_jit(key, logits, t, k, p)
    b = sample_jit(key, logits, t, k, p)
    np.testing.assert_array_equal(a, b)
    assert a.dtype == jnp.int32 and a.shape == (6,)
    draws = np.stack([np.asarray(sample_jit(jax.random.key(s), logits, t, k, p)) for s in range(8)])
    assert len({tuple(r) for r in draws}) > 1, "different keys should give different samples"
    # Per-row keys: a row's token does not depend on the other rows' settings (top-k on the others flips the
    # sampler onto its sort path; the plain rows must not notice).
    keys = jax.random.split(key, 6)
    base = sample_jit(keys, logits, t, k, p)
    k_mixed = k.at[1:].set(3)
    p_mixed = p.at[2].set(0.5)
    mixed = sample_jit(keys, logits, t, k_mixed, p_mixed)
    assert int(mixed[0]) == int(base[0])
    # Raw uint32 keys work too.
    raw = sample_jit(jax.random.PRNGKey(1), logits, t, k, p)
    assert raw.shape == (6,)


def test_temperature_zero_is_argmax_any_filters():
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(2, 3, 40)), jnp.float32)  # leading batch shape [2, 3]
    t = jnp.array([[0.0, 0.0, -1.0], [0.0, 0.0, 0.0]])
    k = jnp.array([[0, 5, 1], [0, 3, 0]], jnp.int32)
    p = jnp.array([[1.0, 0.3, 1.0], [0.9, 1.0, 0.1]])
    tok = sample_jit(jax.random.key(0), logits, t, k, p)
    np.testing.assert_array_equal(tok, jnp.argmax(logits, -1))
    lp = logprobs_jit(logits, t, k, p)
    np.testing.assert_array_equal(jnp.argmax(lp, -1), jnp.argmax(logits, -1))
    assert np.all(np.isfinite(lp).sum(-1) == 1)


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (1.0, 5, 1.0), (0.7, 0, 0.9), (1.3, 7, 0.6), (0.5, 0, 0.05), (1.0, 100, 1.0),
    (2.0, 1, 1.0), (1.0, 3, 0.999)])
def test_keep_sets_match_numpy(temperature, top_k, top_p):
    rng = np.random.default_rng(top_k * 7 + int(top_p * 100))
    logits = rng.normal(size=(5, 30)).astype(np.float32) * 3
    lp = np.asarray(logprobs_jit(jnp.asarray(logits), jnp.full((5,), temperature), jnp.full((5,), top_k, jnp.int32),
                                 jnp.full((5,), top_p)))
    for row in range(5):
        kept = set(np.nonzero(np.isfinite(lp[row]))[0].tolist())
        assert kept == np_keep_set(logits[row], temperature, top_k, top_p)
        assert int(np.argmax(logits[row])) in kept
        np.testing.assert_allclose(np.exp(lp[row][list(kept)]).sum(), 1.0, rtol=1e-5)
        # Within the kept set the distribution is softmax(logits / T) renormalised.
        idx = sorted(kept)
        z = logits[row][idx].astype(np.float64) / temperature
        want = z - np.log(np.exp(z - z.max()).sum()) - z.max()
        np.testing.assert_allclose(lp[row][idx], want, rtol=1e-5, atol=1e-5)


def test_top_k_ties_keep_lower_ids():
    logits = jnp.asarray([[1.0, 3.0, 3.0, 3.0, 0.0]])
    lp = logprobs_jit(logits, jnp.ones(1), jnp.array([2], jnp.int32), jnp.ones(1))
    assert np.isfinite(np.asarray(lp[0])).tolist() == [False, True, True, False, False]


def test_empirical_frequencies_match_processed_logprobs():
    rng = np.random.default_rng(2)
    V, S = 8, 20000
    settings = [(1.0, 0, 1.0), (0.7, 0, 0.9), (1.5, 4, 1.0), (0.8, 5, 0.8)]
    R = len(settings)
    logits_RV = jnp.asarray(rng.normal(size=(R, V)), jnp.float32)
    t = jnp.array([s[0] for s in settings])
    k = jnp.array([s[1] for s in settings], jnp.int32)
    p = jnp.array([s[2] for s in settings])
    toks = sample_jit(jax.random.key(11), jnp.broadcast_to(logits_RV, (S, R, V)), t, k, p)  # params broadcast
    toks = np.asarray(toks)
    probs = np.exp(np.asarray(logprobs_jit(logits_RV, t, k, p), np.float64))
    for r in range(R):
        counts = np.bincount(toks[:, r], minlength=V)
        pv = chi2_pvalue(counts, probs[r] * S,
                         impossible="sampled a token outside the kept set")
        assert pv > 0.01, (settings[r], counts, probs[r] * S, pv)


def test_check_sampling_params():
    check_sampling_params(0.0, 0, 1.0)
    check_sampling_params(np.array([0.0, 0.7]), np.array([0, 50]), np.array([1.0, 0.9]))
    with pytest.raises(ValueError, match="temperature"):
        check_sampling_params(-0.1, 0, 1.0)
    with pytest.raises(ValueError, match="top_p"):
        check_sampling_params(1.0, 0, 0.0)
    with pytest.raises(ValueError, match="top_p"):
        check_sampling_params(1.0, 0, np.array([1.0, 1.5]))
    with pytest.raises(ValueError, match="top_k"):
        check_sampling_params(1.0, -1, 1.0)
    with pytest.raises(ValueError, match="temperature"):
        check_sampling_params(float("nan"), 0, 1.0)
