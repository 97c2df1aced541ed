"""Kimi K2.x target (DeepSeek-V3 architecture): embedding, MLA + dense/MoE decoder layers, final norm, lm_head.

One pass serves every use: full-sequence forward (no cache), prefill (naive MLA, writes the latent cache
from slot 0), and decode / tree verify (absorbed MLA over the cache with a tree mask). It returns the final
normed hidden states, the updated per-layer caches, and the residual stream after chosen layers (the
drafter's context features; layer l's output = HF hidden_states[l + 1]).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimijax.config import KimiConfig
from kimijax.models.common import MLP, RMSNorm, param
from kimijax.models.mla import MLA
from kimijax.models.moe import MoE


class DecoderLayer(nn.Module):
    cfg: KimiConfig
    moe: bool
    dtype: jnp.dtype
    attn_impl: str = "xla"
    moe_impl: str = "xla"
    expert_fn: Any = None
    expert_layout: str = "checkpoint"
    attn_fn: Any = None
    norm_impl: str = "xla"

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache, lengths_B, tree_mask_BTT, absorbed):
        c = self.cfg
        h = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, impl=self.norm_impl, name="input_layernorm")(x_BTD)
        a, cache = MLA(c, self.dtype, self.attn_impl, self.attn_fn, self.norm_impl, name="self_attn")(
            h, positions_BT, cache, lengths_B, tree_mask_BTT, absorbed=absorbed)
        x_BTD = x_BTD + a
        h = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, impl=self.norm_impl,
                    name="post_attention_layernorm")(x_BTD)
        if self.moe:
            f = MoE(c, self.dtype, self.moe_impl, self.expert_fn, self.expert_layout, name="mlp")(h)
        else:
            with jax.named_scope("dense_mlp"):
                f = MLP(c.hidden_size, c.intermediate_size, self.dtype, name="mlp")(h)
        return x_BTD + f, cache


class Kimi(nn.Module):
    cfg: KimiConfig
    attn_impl: str = "xla"
    moe_impl: str = "xla"
    expert_fn: Any = None  # routed-expert override, e.g. expert-parallel dispatch from sharding/moe_ep.py
    expert_layout: str = "checkpoint"  # INT4 routed experts: "checkpoint", "kernel" or "mgpu" (see models/moe.py)
    attn_fn: Any = None  # tree-attention override, e.g. heads split over a mesh from sharding/attention_tp.py
    norm_impl: str = "xla"  # "pallas": one-row norms as one kernel (pallas_kernels/rms_norm.py)

    @property
    def dtype(self):
        return jnp.dtype(self.cfg.dtype)

    def setup(self):
        c = self.cfg
        self.embed_tokens = param(self, "embed_tokens", (c.vocab_size, c.hidden_size), ("vocab", "embed"),
                                  self.dtype, init="normal")
        self.layers = [DecoderLayer(c, c.is_moe_layer(i), self.dtype, self.attn_impl, self.moe_impl,
                                    self.expert_fn, self.expert_layout, self.attn_fn, self.norm_impl,
                                    name=f"layers_{i}")
                       for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, impl=self.norm_impl, name="norm")
        self.lm_head = param(self, "lm_head", (c.vocab_size, c.hidden_size), ("vocab", "embed"), self.dtype)

    def embed(self, tokens_BT):
        return jnp.take(self.embed_tokens, tokens_BT, axis=0)

    def logits(self, h_BTD):
        """Untied lm_head over already-normed hidden states -> f32 logits."""
        return jnp.einsum("btd,vd->btv", h_BTD, self.lm_head, preferred_element_type=jnp.float32)

    def __call__(self, tokens_BT, positions_BT, caches=None, lengths_B=None, tree_mask_BTT=None, *,
                 absorbed: bool = False, capture_layers: tuple[int, ...] = ()):
        """-> (final normed hidden [B,T,D], caches or None, captured [len(capture_layers), B, T, D])."""
        x_BTD = self.embed(tokens_BT)
        captured = []
        new_caches = []
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x_BTD, cache = layer(x_BTD, positions_BT, None if caches is None else caches[i], lengths_B,
                                     tree_mask_BTT, absorbed)
            new_caches.append(cache)
            if i in capture_layers:
                captured.append(x_BTD)
        cap = jnp.stack([captured[sorted(set(capture_layers)).index(l)] for l in capture_layers]) if capture_layers \
            else jnp.zeros((0,) + x_BTD.shape, x_BTD.dtype)
        return self.norm(x_BTD), (None if caches is None else new_caches), cap

    def init_all(self, tokens_BT):
        """Touches every parameter (used by init)."""
        h, _, _ = self(tokens_BT, jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape))
        return self.logits(h)
