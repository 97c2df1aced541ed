"""Parity with HF transformers 4.57 DeepseekV3 on tiny random checkpoints (tests/fixtures, made by
scripts/make_fixtures.py): K2.6 nested layout with INT4 experts packed by compressed-tensors, flat K2 layout
with bf16 experts and beta_fast=1, and group-limited routing. float32: max relative error <= 2e-3."""
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kimijax
from kimijax.models.common import causal_tree_mask

FIX = Path(__file__).parent / "fixtures"
NAMES = ["k26_int4", "k2_flat_bf16", "k2_groups"]


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module", params=NAMES)
def case(request):
    exp = dict(np.load(FIX / request.param / "expected.npz"))
    t32 = kimijax.load_target(FIX / request.param, dtype="float32", progress=False)
    return request.param, t32, exp


def test_logits_match_hf_float32(case):
    name, t, exp = case
    got = np.asarray(kimijax.forward(t, exp["tokens"]))
    assert got.dtype == np.float32 and got.shape == exp["logits"].shape
    assert _rel(got, exp["logits"]) <= 2e-3, name
    np.testing.assert_array_equal(got.argmax(-1), exp["logits"].argmax(-1))


def test_hidden_states_after_each_layer_match_hf(case):
    name, t, exp = case
    toks = jnp.asarray(exp["tokens"])
    B, T = toks.shape
    n = t.num_layers
    pos = jnp.broadcast_to(jnp.arange(T), (B, T))
    _, _, cap = t.module.apply({"params": t.params}, toks, pos, capture_layers=tuple(range(n)))
    for l in range(n):  # output of decoder layer l == HF hidden_states[l + 1]
        assert _rel(np.asarray(cap[l]), exp["hidden_states"][l + 1]) <= 2e-3, (name, l)


def test_router_choices_match_hf(case):
    name, t, exp = case
    toks = jnp.asarray(exp["tokens"])
    B, T = toks.shape
    _, _, _, ids = t.verify(t.params, t.init_cache(B, T), toks, jnp.broadcast_to(jnp.arange(T), (B, T)),
                            jnp.zeros((B,), jnp.int32), causal_tree_mask(B, T), with_experts=True)
    np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), exp["router_topk_idx"])


def test_absorbed_decode_matches_hf(case):
    """Prefill half the tokens, then decode the rest one at a time through the latent cache."""
    name, t, exp = case
    toks = jnp.asarray(exp["tokens"])
    B, T = toks.shape
    P = T // 2
    lens = jnp.full((B,), P, jnp.int32)
    last, caches, _ = t.prefill(t.params, t.init_cache(B, 16), toks[:, :P], lens)
    assert _rel(np.asarray(last), exp["logits"][:, P - 1]) <= 2e-3
    step = jax.jit(t.verify)
    for i in range(P, T):
        lg, caches, _ = step(t.params, caches, toks[:, i:i + 1], lens[:, None], lens, jnp.ones((B, 1, 1), bool))
        assert _rel(np.asarray(lg[:, 0]), exp["logits"][:, i]) <= 2e-3, (name, i)
        lens = lens + 1


def test_bf16_tolerance(case):
    """The bf16 model (the serving dtype) stays close to HF's float32 logits."""
    name, _, exp = case
    t16 = kimijax.load_target(FIX / name, progress=False)
    got = np.asarray(kimijax.forward(t16, exp["tokens"]))
    assert _rel(got, exp["logits"]) <= 0.05, name
