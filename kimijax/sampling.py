"""Token sampling shared by AR decoding and speculative acceptance.

Sampling parameters are per-row arrays (not Python constants), so one compiled program serves any mix of
greedy and sampled requests. The exact distribution a row samples from is

  temperature <= 0 : greedy, a point mass on argmax(logits) (lowest id on ties);
  otherwise        : scaled = logits / temperature, then
                     top-k (k > 0): keep the k highest scaled logits (ties broken by lower token id);
                     top-p (p < 1): nucleus over softmax of the kept logits: keep the smallest prefix of the
                                    sorted order whose cumulative prob >= p (the top token always stays);
                     sample from softmax over the kept set.

`processed_logprobs` returns that distribution as log-probs (-inf outside the kept set); tests use it as the
exact reference for `sample_tokens`, and acceptance uses `sample_tokens` per tree node.

Logits may have any leading batch shape `[..., V]`; parameters broadcast against `logits.shape[:-1]`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["sample_tokens", "processed_logprobs", "check_sampling_params"]


def check_sampling_params(temperature, top_k, top_p) -> None:
    """Host-side validation; raises ValueError with the offending value. Accepts scalars or arrays."""
    t = np.asarray(temperature, np.float64)
    k = np.asarray(top_k)
    p = np.asarray(top_p, np.float64)
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {t.tolist()}")
    if k.dtype.kind not in "iub":
        if not np.all(np.isfinite(k)) or np.any(k != np.round(k)):
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k.tolist()}")
    if np.any(k < 0):
        raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {k.tolist()}")
    if not np.all(np.isfinite(p)) or np.any(p <= 0) or np.any(p > 1):
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {p.tolist()}")


def _broadcast_params(logits, temperature, top_k, top_p):
    batch = logits.shape[:-1]
    t = jnp.broadcast_to(jnp.asarray(temperature, jnp.float32), batch)
    k = jnp.broadcast_to(jnp.asarray(top_k, jnp.int32), batch)
    p = jnp.broadcast_to(jnp.asarray(top_p, jnp.float32), batch)
    return t, k, p


def _filtered_logits(logits_RV, temperature_R, top_k_R, top_p_R):
    """Temperature-scaled logits with everything outside the kept set at -inf (unnormalised), [R, V] f32.

    Greedy rows come back as scaled-by-1 logits; callers handle them with argmax.
    """
    R, V = logits_RV.shape
    greedy_R = temperature_R <= 0
    # Greedy rows divide by 1 so no inf/nan leaks into the (discarded) sampled branch.
    scaled_RV = logits_RV.astype(jnp.float32) / jnp.where(greedy_R, 1.0, temperature_R)[:, None]
    use_k_R = (top_k_R > 0) & (top_k_R < V)
    use_p_R = top_p_R < 1.0

    def filtered(scaled_RV):
        # One stable sort per row (descending, ties -> lower id first) defines both cut-offs.
        iota_RV = jax.lax.broadcasted_iota(jnp.int32, (R, V), 1)
        neg_sorted_RV, order_RV = jax.lax.sort((-scaled_RV, iota_RV), dimension=1, num_keys=1, is_stable=True)
        sorted_RV = -neg_sorted_RV
        keep_RV = jnp.where(use_k_R[:, None], iota_RV < top_k_R[:, None], True)
        # Nucleus over the renormalised top-k distribution: keep position i while the mass strictly before
        # it is < p (so the smallest prefix reaching p is kept, and position 0 always is).
        probs_RV = jax.nn.softmax(jnp.where(keep_RV, sorted_RV, -jnp.inf), axis=-1)
        mass_before_RV = jnp.cumsum(probs_RV, axis=-1) - probs_RV
        keep_RV &= jnp.where(use_p_R[:, None], mass_before_RV < top_p_R[:, None], True)
        keep_RV |= iota_RV == 0
        # Back to vocab order: scatter the sorted-order mask through the permutation.
        rows_R1 = jnp.arange(R)[:, None]
        keep_vocab_RV = jnp.zeros((R, V), bool).at[rows_R1, order_RV].set(keep_RV)
        return jnp.where(keep_vocab_RV, scaled_RV, -jnp.inf)

    # Skip the O(V log V) sort when no row filters (the common greedy / plain-temperature case). Under vmap
    # this cond becomes a select and both branches run, which is still correct.
    need_R = ~greedy_R & (use_k_R | use_p_R)
    return jax.lax.cond(jnp.any(need_R), filtered, lambda x: x, scaled_RV)


def processed_logprobs(logits_BV, temperature_B, top_k_B, top_p_B):
    """Exact log-probs [..., V] f32 of the distribution `sample_tokens` draws from (-inf outside the kept set)."""
    with jax.named_scope("processed_logprobs"):
        t, k, p = _broadcast_params(logits_BV, temperature_B, top_k_B, top_p_B)
        batch, V = logits_BV.shape[:-1], logits_BV.shape[-1]
        logits_RV = jnp.reshape(logits_BV, (-1, V))
        t_R, k_R, p_R = t.reshape(-1), k.reshape(-1), p.reshape(-1)
        logp_RV = jax.nn.log_softmax(_filtered_logits(logits_RV, t_R, k_R, p_R), axis=-1)
        argmax_R = jnp.argmax(logits_RV, axis=-1)
        onehot_RV = jnp.where(jnp.arange(V)[None, :] == argmax_R[:, None], 0.0, -jnp.inf)
        out_RV = jnp.where((t_R <= 0)[:, None], onehot_RV, logp_RV)
        return out_RV.reshape(*batch, V)


def _row_keys(key, n_rows: int):
    """Per-row keys: a single key is split into n_rows keys; an array of keys (one per row) is used as is.

    Per-row keys make a row's sample depend only on its own key, logits and parameters.
    """
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    single = key.ndim == (0 if typed else 1)
    if single:
        return jax.random.split(key, n_rows)
    return key.reshape((n_rows,) if typed else (n_rows, key.shape[-1]))


def sample_tokens(key, logits_BV, temperature_B, top_k_B, top_p_B):
    """One token per row -> int32 [...]. `key` is one PRNG key (split per row) or one key per row."""
    with jax.named_scope("sample_tokens"):
        t, k, p = _broadcast_params(logits_BV, temperature_B, top_k_B, top_p_B)
        batch, V = logits_BV.shape[:-1], logits_BV.shape[-1]
        logits_RV = jnp.reshape(logits_BV, (-1, V))
        t_R, k_R, p_R = t.reshape(-1), k.reshape(-1), p.reshape(-1)
        R = logits_RV.shape[0]
        keys_R = _row_keys(key, R)
        greedy_tok_R = jnp.argmax(logits_RV, axis=-1).astype(jnp.int32)

        def sampled():
            masked_RV = _filtered_logits(logits_RV, t_R, k_R, p_R)
            tok_R = jax.vmap(lambda kk, row: jax.random.categorical(kk, row))(keys_R, masked_RV)
            return jnp.where(t_R <= 0, greedy_tok_R, tok_R.astype(jnp.int32))

        # All-greedy batches (the common case) skip the R x V random draw entirely.
        tok_R = jax.lax.cond(jnp.all(t_R <= 0), lambda: greedy_tok_R, sampled)
        return tok_R.reshape(batch)
