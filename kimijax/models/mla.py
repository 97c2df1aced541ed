"""Multi-head latent attention (MLA) of Kimi K2 / DeepSeek-V3, with YaRN rope.

Two paths that compute the same function:
  naive     per-head K/V expanded from the latent (HF's form): prefill and parity with HF.
  absorbed  MQA over the latent cache (W_UK folded into the query, W_UV into the output): decode and
            tree verify. One cache row per token per layer: [c_kv (K) | rotated k_pe (R)] = K + R values.

Names: B batch, T tokens this pass, L cache slots, D model dim, H heads, Q q_lora rank, K kv_lora rank,
N nope dim, R rope dim, V v_head dim, C = K + R.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimijax.config import KimiConfig
from kimijax.models.common import (apply_rope_interleaved, causal_rows, in_query_chunks, param, rms_norm,
                                   rope_cos_sin, yarn_inv_freq)
from pallas_kernels.row_move import write_rows
from pallas_kernels.tree_attention import tree_attention


def naive_attention(q_nope_BTHN, q_pe_BTHR, k_nope_BSHN, k_pe_BSR, v_BSHV, mask_BTS, scale: float, dt):
    """Softmax attention of T queries over this pass's S = T keys; mask_BTS None = causal. Queries go in chunks
    (common.in_query_chunks) so the [B, H, chunk, S] scores stay bounded."""
    B, _, H, _ = q_nope_BTHN.shape
    S = k_nope_BSHN.shape[1]

    def one(q_nope_BCHN, q_pe_BCHR, t0, mask_BCS):
        s_BHCS = (jnp.einsum("bthn,bshn->bhts", q_nope_BCHN, k_nope_BSHN, preferred_element_type=jnp.float32)
                  + jnp.einsum("bthr,bsr->bhts", q_pe_BCHR, k_pe_BSR, preferred_element_type=jnp.float32))
        s_BHCS = s_BHCS * scale
        if mask_BCS is None:
            mask_BCS = causal_rows(t0, q_nope_BCHN.shape[1], S, B)
        s_BHCS = jnp.where(mask_BCS[:, None], s_BHCS, -jnp.inf)
        p_BHCS = jax.nn.softmax(s_BHCS, axis=-1).astype(dt)
        return jnp.einsum("bhts,bshv->bthv", p_BHCS, v_BSHV)

    return in_query_chunks(one, (q_nope_BTHN, q_pe_BTHR), mask_BTS, B * H * S)


class MLA(nn.Module):
    cfg: KimiConfig
    dtype: jnp.dtype
    attn_impl: str = "xla"
    attn_fn: Any = None  # tree_attention's stand-in on a mesh (sharding/attention_tp.py); None: tree_attention
    norm_impl: str = "xla"  # the q latent norm (pallas_kernels/rms_norm.py)

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache_BLC=None, lengths_B=None, tree_mask_BTT=None,
                 *, absorbed: bool = False):
        c = self.cfg
        D, H, Q, K = c.hidden_size, c.num_attention_heads, c.q_lora_rank, c.kv_lora_rank
        N, R, V = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        dt = self.dtype
        w_qa_QD = param(self, "q_a_proj", (Q, D), ("q_lora", "embed"), dt)
        w_qa_norm = param(self, "q_a_layernorm", (Q,), ("norm",), dt, init="ones")
        w_qb_HEQ = param(self, "q_b_proj", (H, N + R, Q), ("heads", "qk_dim", "q_lora"), dt)
        w_kva_CD = param(self, "kv_a_proj_with_mqa", (K + R, D), ("latent", "embed"), dt)
        w_kva_norm = param(self, "kv_a_layernorm", (K,), ("norm",), dt, init="ones")
        w_kvb_HMK = param(self, "kv_b_proj", (H, N + V, K), ("heads", "kv_dim", "kv_lora"), dt)
        w_o_DHV = param(self, "o_proj", (D, H, V), ("embed", "heads", "v_dim"), dt, fan_in=H * V)

        with jax.named_scope("mla_proj"):
            # q_a and kv_a as one GEMM. XLA merges the two dots itself from two rows on, not for one row; the
            # concatenate fuses into the GEMM (no weight copy): offline, a layer at T=1 is one launch fewer
            both = jnp.einsum("btd,cd->btc", x_BTD, jnp.concatenate([w_qa_QD, w_kva_CD]))
            qa_BTQ, kva_BTC = both[..., :Q], both[..., Q:]
            cq_BTQ = rms_norm(qa_BTQ, w_qa_norm, c.latent_norm_eps, self.norm_impl)
            q_BTHE = jnp.einsum("btq,heq->bthe", cq_BTQ, w_qb_HEQ)
            q_nope_BTHN, q_pe_BTHR = q_BTHE[..., :N], q_BTHE[..., N:]
            # XLA's norm here: its multiply fuses into the cache write (a kernel would add the slice's launch)
            ckv_BTK = rms_norm(kva_BTC[..., :K], w_kva_norm, c.latent_norm_eps)
            inv_freq, amp = yarn_inv_freq(R, c.rope_theta, c.rope_scaling)
            cos_BTr, sin_BTr = rope_cos_sin(positions_BT, inv_freq, amp)
            q_pe_BTHR = apply_rope_interleaved(q_pe_BTHR, cos_BTr[:, :, None], sin_BTr[:, :, None])
            k_pe_BTR = apply_rope_interleaved(kva_BTC[..., K:], cos_BTr, sin_BTr)
            rows_BTC = jnp.concatenate([ckv_BTK, k_pe_BTR], axis=-1)

        if cache_BLC is not None:
            cache_BLC = write_rows(cache_BLC, rows_BTC, lengths_B)  # capacity: checked on the host

        scale = c.softmax_scale
        w_uk_HNK, w_uv_HVK = w_kvb_HMK[:, :N], w_kvb_HMK[:, N:]
        if absorbed:
            with jax.named_scope("mla_absorbed"):
                q_lat_BTHK = jnp.einsum("bthn,hnk->bthk", q_nope_BTHN, w_uk_HNK)
                q_cat_BTHC = jnp.concatenate([q_lat_BTHK, q_pe_BTHR], axis=-1)
                attend = self.attn_fn or tree_attention
                o_lat_BTHK, _ = attend(q_cat_BTHC, cache_BLC, lengths_B, tree_mask_BTT, scale, K, impl=self.attn_impl)
                o_BTHV = jnp.einsum("bthk,hvk->bthv", o_lat_BTHK.astype(dt), w_uv_HVK)
        else:
            with jax.named_scope("mla_naive"):
                # HF's form over this pass's own tokens (prefill from an empty cache / full forward).
                k_nope_BSHN = jnp.einsum("bsk,hnk->bshn", ckv_BTK, w_uk_HNK)
                v_BSHV = jnp.einsum("bsk,hvk->bshv", ckv_BTK, w_uv_HVK)
                o_BTHV = naive_attention(q_nope_BTHN, q_pe_BTHR, k_nope_BSHN, k_pe_BTR, v_BSHV, tree_mask_BTT,
                                         scale, dt)
        out_BTD = jnp.einsum("bthv,dhv->btd", o_BTHV, w_o_DHV)
        return out_BTD, cache_BLC
