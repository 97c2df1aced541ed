"""CPU tests of the Mosaic GPU INT4 MoE (interpret=True) against the XLA reference `moe_ref`.

Fresh random inputs per case (seed printed on failure).  Packed weights are random int32 words, so every
nibble value and sign pattern appears.  Sizes are chosen so the step size does not divide the work:
D = 320 is 10 scale groups and F = 192 is 6, neither a multiple of the default 8 groups per step, and
F / 64 = 3, D / 64 = 5 blocks.  The interpreter is slow (seconds per call), so the cases are few and each
covers several things at once.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from kernel_inputs import check_target_layout, fresh_seed as _seed
from kimijax.quant import dequantize, unpack_int4_np
from pallas_kernels import moe_int4 as mi
from pallas_kernels import moe_int4_mgpu as mg

E, F, D = 6, 192, 320


def _experts(rng, E=E, F=F, D=D):
    """Checkpoint-layout experts: random words (any nibble is a valid q + 8) and small positive scales."""
    def words(*shape):
        return jnp.asarray(rng.integers(-2**31, 2**31, size=shape, dtype=np.int64).astype(np.int32))

    def scales(*shape):
        return jnp.asarray(rng.uniform(0.004, 0.02, size=shape), jnp.bfloat16)

    return {"gate_packed": words(E, F, D // 8), "gate_scale": scales(E, F, D // 32),
            "up_packed": words(E, F, D // 8), "up_scale": scales(E, F, D // 32),
            "down_packed": words(E, D, F // 8), "down_scale": scales(E, D, F // 32)}


def _routing(rng, T, K, pool=None):
    """Distinct experts per token (as top-k gives) drawn from `pool`; weights differ per token."""
    pool = np.arange(E) if pool is None else np.asarray(pool)
    ids = np.stack([rng.permutation(pool)[:K] for _ in range(T)])
    w = rng.uniform(0.05, 1.0, size=(T, K)).astype(np.float32)
    return jnp.asarray(ids, jnp.int32), jnp.asarray(w)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _check(T, K, *, pool=None, ids=None, w=None, cfg=mg.Config(), relayout=True, words=False):
    seed = _seed()
    rng = np.random.default_rng(seed)
    ex = _experts(rng)
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    ids_r, w = _routing(rng, T, K, pool)
    if ids is not None:
        ids_r = jnp.asarray(ids, jnp.int32)
    if w is not None:
        w = jnp.asarray(w, jnp.float32)
    ex_k = mg.to_mgpu_layout(ex, words=words) if relayout else ex  # checkpoint layout: moe_mgpu converts it
    assert mg.supports(x, ex_k)
    y = jax.jit(functools.partial(mg.moe_mgpu, cfg=cfg, interpret=True))(x, ids_r, w, ex_k)
    y_ref = jax.jit(mi.moe_ref)(x, ids_r, w, ex)
    msg = f"seed={seed} T={T} K={K} cfg={cfg} words={words} ids={np.asarray(ids_r).tolist()}"
    assert y.shape == (T, D) and y.dtype == x.dtype, msg
    assert np.all(np.isfinite(np.asarray(y, np.float32))), msg
    assert np.linalg.norm(np.asarray(y_ref, np.float32)) > 0, msg  # a vacuous comparison would pass anything
    err = _rel(y, y_ref)
    assert err < 2e-2, f"{msg}: rel err {err:.2e}"


def test_one_token_checkpoint_layout():
    # decode's common case; also the in-call conversion from the checkpoint layout
    _check(T=1, K=4, relayout=False)


def test_one_token_repeated_expert():
    # the one-token path keeps every pair (no duplicate marks): a repeated id is computed twice, each with its weight
    _check(T=1, K=4, ids=np.array([[3, 1, 3, 3]]), words=True)


def test_one_token_zero_weight_pair_skipped():
    # a zero-weight pair is not computed at all (its down program writes zeros)
    _check(T=1, K=4, w=np.array([[0.3, 0.0, 0.7, 0.2]]), words=True, cfg=mg.Config(down_tiles=2))


def test_five_tokens_k2_empty_experts():
    # experts 0, 2, 5 never routed: their programs exit and their outputs must not leak in
    _check(T=5, K=2, pool=[1, 3, 4])


def test_sixteen_tokens_all_experts():
    # the full token width: all 16 wgmma columns are real tokens
    _check(T=16, K=4)


def test_all_tokens_on_the_same_experts():
    # every pair after the first K is a duplicate: one program per expert serves all 16 token columns,
    # and per-token weights must still come out per column
    _check(T=16, K=4, ids=np.tile([[5, 0, 3, 2]], (16, 1)))


def test_repeated_expert_within_a_token():
    # top-k never gives this, but the reference adds both weights; so must the per-token weight sum
    _check(T=5, K=2, ids=np.array([[1, 1], [0, 4], [4, 4], [2, 1], [0, 0]]))


def test_non_default_config():
    # 4 groups per step divides neither 10 nor 6 groups (falls back to 2 / 3); 2 stages.  The interpreter
    # waits on every group anyway, so wait_each_group=False only checks that the flag is accepted here
    _check(T=5, K=4, cfg=mg.Config(groups_per_step=4, stages=2, wait_each_group=False))


def test_thread_words_layout_all_tokens():
    # the thread-words weights (decoded with jnp in interpret mode; on the GPU by the inline dequant, whose
    # register mapping test_thread_words_map pins down)
    _check(T=16, K=4, words=True)


def test_thread_words_layout_empty_experts_two_down_tiles():
    _check(T=5, K=2, pool=[1, 3, 4], words=True, cfg=mg.Config(down_tiles=2, groups_per_step=4))


def test_thread_words_map():
    """Word 2 t + h of a tile holds, at bits 4 (j + 4 e), the nibble q + 8 of row 16 w + 8 h + i, column
    8 j + 2 c + e (t = 32 w + 4 i + c): the element of register (j, h) half e of thread t in Mosaic's WGMMA
    layout, which is what the GPU dequant returns for it."""
    from jax.experimental.mosaic.gpu import fragmented_array as fa

    assert fa.WGMMA_LAYOUT.registers_shape((64, 32)) == (1, 4, 1, 1, 2, 1, 1, 1, 1)  # [col tile j, row half h]
    rng = np.random.default_rng(_seed())
    q = rng.integers(-8, 8, size=(2, 64, 32))
    words = np.asarray(mg._tile_words(jnp.asarray(q, jnp.int8))).view(np.uint32)
    assert words.shape == (2, 256)
    for t in range(128):
        w, lane = divmod(t, 32)
        i, c = divmod(lane, 4)
        for h in range(2):
            for j in range(4):
                pair = (words[:, 2 * t + h] >> np.uint32(4 * j)) & np.uint32(0x000F000F)
                r = 16 * w + 8 * h + i
                np.testing.assert_array_equal(pair & 0xF, q[:, r, 8 * j + 2 * c] + 8)
                np.testing.assert_array_equal(pair >> 16, q[:, r, 8 * j + 2 * c + 1] + 8)
    np.testing.assert_array_equal(np.asarray(mg._words_tile(jnp.asarray(words.view(np.int32)))), q)


def test_routing_marks_duplicates_and_spreads_weights():
    ids = jnp.asarray([[2, 0], [0, 1], [2, 1]], jnp.int32)
    w = jnp.asarray([[0.5, 0.25], [0.125, 1.0], [2.0, 4.0]], jnp.float32)
    slot_e, wt = mg.routing(ids, w)
    # first pair routed to each expert owns it; later pairs of the same expert are inactive
    np.testing.assert_array_equal(np.asarray(slot_e), [2, 0, -1, 1, -1, -1])
    assert wt.shape == (6, mg.NB)
    want = np.zeros((6, mg.NB), np.float32)
    want[0, :3] = [0.5, 0.0, 2.0]  # expert 2, tokens 0..2
    want[1, :3] = [0.25, 0.125, 0.0]  # expert 0
    want[3, :3] = [0.0, 1.0, 4.0]  # expert 1
    np.testing.assert_array_equal(np.asarray(wt), want)


def test_layout_keeps_the_bytes():
    rng = np.random.default_rng(_seed())
    ex = _experts(rng)
    lay = mg.to_mgpu_layout(ex)
    assert set(lay) == set(mg.MGPU_KEYS)
    shapes = {"gu_q": (E, F // 64, D // 32, 128, 32), "gu_s": (E, F // 64, D // 32, 128),
              "dn_q": (E, D // 64, F // 32, 64, 32), "dn_s": (E, D // 64, F // 32, 64)}
    for k, s in shapes.items():
        assert lay[k].shape == s, k
    assert lay["gu_q"].dtype == lay["dn_q"].dtype == jnp.int4
    assert lay["gu_s"].dtype == lay["dn_s"].dtype == jnp.bfloat16

    def unblock(a):
        """[E, out/64, in/32, 64, 32] -> [E, out, in] (or the scales' [E, out/64, in/32, 64] -> [E, out, in/32])."""
        if a.ndim == 5:
            n, o, i, r, c = a.shape
            return a.transpose(0, 1, 3, 2, 4).reshape(n, o * r, i * c)
        n, o, i, r = a.shape
        return a.transpose(0, 1, 3, 2).reshape(n, o * r, i)

    gu_q = np.asarray(lay["gu_q"]).astype(np.int8)
    gu_s = np.asarray(lay["gu_s"])
    parts = {"gate": (gu_q[..., :64, :], gu_s[..., :64]), "up": (gu_q[..., 64:, :], gu_s[..., 64:]),
             "down": (np.asarray(lay["dn_q"]).astype(np.int8), np.asarray(lay["dn_s"]))}
    for name, (q_blk, s_blk) in parts.items():
        q, s = unblock(q_blk), unblock(s_blk)
        packed, scale = ex[f"{name}_packed"], ex[f"{name}_scale"]
        np.testing.assert_array_equal(q, unpack_int4_np(np.asarray(packed)), err_msg=name)
        np.testing.assert_array_equal(s.view(np.uint16), np.asarray(scale).view(np.uint16), err_msg=name)
        # dequantised as the kernel does, bf16(q * s), against the checkpoint's dequantisation
        w = (q.astype(ml_dtypes.bfloat16).reshape(*s.shape, 32) * s[..., None]).reshape(q.shape)
        np.testing.assert_array_equal(w.astype(np.float32),
                                      np.asarray(dequantize(packed, scale), np.float32), err_msg=name)


def test_more_than_max_tokens_refused():
    rng = np.random.default_rng(_seed())
    ex = _experts(rng)
    lay = mg.to_mgpu_layout(ex)
    n = mg.MAX_TOKENS
    x_max = jnp.asarray(rng.normal(size=(n, D)), jnp.bfloat16)
    x_over = jnp.asarray(rng.normal(size=(n + 1, D)), jnp.bfloat16)
    ids, w = _routing(rng, n + 1, 2)
    assert mg.supports(x_max, lay) and mg.supports(x_max, ex)
    assert not mg.supports(x_over, lay) and not mg.supports(x_over, ex)
    for experts in (lay, ex):
        with pytest.raises(ValueError, match=f"T <= {n}"):
            mg.moe_mgpu(x_over, ids, w, experts, interpret=True)


def test_token_lists_beyond_sixteen_tokens():
    # 21 tokens: per-slot token lists (each expert's tokens in blocks of 16), thread-words weights
    _check(T=21, K=3, words=True)


def test_token_lists_seventy_tokens_ragged():
    # past the old 64-token cap; 70 * 3 pairs over 6 experts: runs of ~35 pairs (2-3 slots each, a ragged last one)
    _check(T=70, K=3, words=True)


def test_token_lists_one_expert_over_several_blocks():
    # 40 tokens on the same 2 experts: each expert's run spans 3 slots (16 + 16 + 8 tokens); a repeated expert
    # within a token takes two columns
    ids = np.tile([[4, 1]], (40, 1))
    ids[7] = [2, 2]
    _check(T=40, K=2, ids=ids)


def test_routing_sorted_blocks():
    ids = jnp.asarray([[3, 1], [3, 0], [1, 3]] + [[5, 3]] * 15, jnp.int32)  # expert 3: 18 pairs -> 2 blocks
    slot_e, tok, at = mg.routing_sorted(ids, n_experts=6)
    assert slot_e.shape == (6 + 3,) and tok.shape == (9, 16) and at.shape == ids.shape
    e, tok, at = np.asarray(slot_e), np.asarray(tok), np.asarray(at)
    assert e.tolist()[:5] == [0, 1, 3, 3, 5] and (e[5:] == -1).all()
    # every pair (t, k) has its own column, in a slot of its expert, holding token t; all other columns are empty
    assert len(set(at.ravel().tolist())) == at.size
    for t in range(18):
        for k in range(2):
            s_, c = divmod(int(at[t, k]), 16)
            assert e[s_] == int(ids[t, k]) and tok[s_, c] == t, (t, k)
    used = np.zeros(tok.size, bool)
    used[at.ravel()] = True
    assert (tok.ravel()[~used] == 18).all()


@pytest.mark.parametrize("cfg,words", [(mg.Config(), False), (mg.Config(wait_each_group=False), False),
                                       (mg.Config(down_tiles=2), False), (mg.Config(vector_loads=True), False),
                                       (mg.Config(), True), (mg.Config(down_tiles=2), True)],
                         ids=["default", "nowait", "d2", "vec", "words", "words_d2"])
def test_gpu_lowering_at_kimi_width(cfg, words):
    """The GPU path (which interpret mode never runs: registers-operand wgmma, the vector-load relayout)
    lowers for CUDA on this CPU host, Mosaic's layout inference included, at full Kimi width."""
    S = jax.ShapeDtypeStruct
    E_, D_, F_ = 384, 7168, 2048
    ex = mg.layout_shapes(E_, D_, F_, words)
    for T in (1, 16, 33, 256):  # 33, 256: the per-slot token lists
        args = (S((T, D_), jnp.bfloat16), S((T, 8), jnp.int32), S((T, 8), jnp.float32), ex)
        text = jax.jit(functools.partial(mg.moe_mgpu, cfg=cfg)).trace(*args).lower(
            lowering_platforms=("cuda",)).as_text()
        assert text.count("mosaic_gpu") >= 2


# ------------------------------------------------------------------ the model runs the Mosaic kernel
def test_target_keeps_the_mgpu_layout_and_computes_the_same():
    import dataclasses

    from kimijax.config import TINY
    from kimijax.target import (KimiTarget, convert_expert_layout, params_expert_layout, random_kimi_params,
                                resolve_expert_layout)

    assert resolve_expert_layout(TINY, "mgpu_interpret") == "checkpoint"  # F = 32: not a 64-row block
    with pytest.raises(ValueError, match="mgpu expert layout"):
        KimiTarget(TINY, random_kimi_params(TINY), expert_layout="mgpu")
    # two layers (dense, MoE): one MoE layer compares the kernel alone (a second one's router could flip a
    # near-tie on the kernel's bf16 rounding)
    cfg = dataclasses.replace(TINY, hidden_size=128, moe_intermediate_size=128, intermediate_size=256,
                              dtype="float32", num_hidden_layers=2)
    p = random_kimi_params(cfg, seed=_seed() % 2**31)
    kern = KimiTarget(cfg, p, moe_impl="mgpu_interpret")  # converted to the Mosaic layout at construction
    assert kern.expert_layout == "mgpu" and params_expert_layout(kern.params) == "mgpu"
    mlp = kern.params["layers_1"]["mlp"]
    assert set(mlp) >= set(mg.MGPU_KEYS) and "gate_packed" not in mlp and mlp["gu_q"].dtype == jnp.int32
    assert kern.params["layers_0"] is p["layers_0"] and "gate_packed" in p["layers_1"]["mlp"]
    # the reference reads the Mosaic layout bit for bit, the kernel matches within bf16 rounding, back to the
    # checkpoint bit for bit; and from the Triton kernel's layout, bit for bit
    check_target_layout(cfg, p, kern, "mgpu")
    via_planar = convert_expert_layout(convert_expert_layout(p, "kernel"), "mgpu")
    for k in mg.MGPU_KEYS:
        np.testing.assert_array_equal(np.asarray(via_planar["layers_1"]["mlp"][k]), np.asarray(mlp[k]), err_msg=k)


def test_long_passes_run_in_chunks(monkeypatch):
    # prefill-sized passes: equal chunks of at most MAX_TOKENS (here 16, so 37 tokens are 3 chunks of 13 with
    # 2 padding rows), each through the kernel; the dispatch picks this path for impl "mgpu"
    monkeypatch.setattr(mg, "MAX_TOKENS", 16)
    seed = _seed()
    rng = np.random.default_rng(seed)
    ex = _experts(rng)
    T, K = 37, 2
    x = jnp.asarray(rng.normal(size=(T, D)), jnp.bfloat16)
    ids, w = _routing(rng, T, K)
    lay = mg.to_mgpu_layout(ex, words=True)
    y = jax.jit(functools.partial(mi.moe, impl="mgpu_interpret"))(x, ids, w, lay)
    y_ref = jax.jit(mi.moe_ref)(x, ids, w, ex)
    assert y.shape == (T, D) and np.all(np.isfinite(np.asarray(y, np.float32)))
    assert _rel(y, y_ref) < 2e-2, f"seed={seed}"
    # the unknown impl names the choices
    with pytest.raises(ValueError, match="mgpu_interpret"):
        mi.moe(x, ids, w, lay, impl="mosaic")
