"""Kimi K2 MoE block: noaux_tc sigmoid router, routed experts (INT4 or bf16), one shared expert.

Router (HF / DeepSeek-V3 "noaux_tc"): scores = sigmoid(x W_gate^T) in f32; e_score_correction_bias is
added only to choose experts (optionally within the best `topk_group` of `n_group` groups, a group scored
by the sum of its top-2 biased scores); the combine weights are the unbiased scores of the chosen experts,
normalised (norm_topk_prob) and multiplied by routed_scaling_factor. The shared expert is not scaled.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from kimijax.config import KimiConfig
from kimijax.models.common import MLP, param
from pallas_kernels.moe_int4 import moe


def route(x_TD, w_gate_ED, bias_E, cfg: KimiConfig):
    """-> (expert ids [T, k] int32, combine weights [T, k] f32)."""
    logits_TE = jnp.einsum("td,ed->te", x_TD.astype(jnp.float32), w_gate_ED.astype(jnp.float32))
    s_TE = jax.nn.sigmoid(logits_TE)
    sel_TE = s_TE + bias_E.astype(jnp.float32)[None]
    if cfg.n_group > 1:
        T, E = sel_TE.shape
        g_TGe = sel_TE.reshape(T, cfg.n_group, E // cfg.n_group)
        gscore_TG = jnp.sum(jax.lax.top_k(g_TGe, min(2, E // cfg.n_group))[0], axis=-1)
        _, gidx = jax.lax.top_k(gscore_TG, cfg.topk_group)
        keep_TG = jnp.zeros(gscore_TG.shape, bool).at[jnp.arange(T)[:, None], gidx].set(True)
        sel_TE = jnp.where(jnp.repeat(keep_TG, E // cfg.n_group, axis=1), sel_TE, -jnp.inf)
    _, ids_Tk = jax.lax.top_k(sel_TE, cfg.num_experts_per_tok)
    w_Tk = jnp.take_along_axis(s_TE, ids_Tk, axis=1)
    if cfg.norm_topk_prob:
        # The k-term sum as adds, so it fuses with the gather and the scaling (a reduce over k is a launch of
        # its own per layer: offline count at T = 1).
        w_Tk = w_Tk / (functools.reduce(jnp.add, [w_Tk[:, j:j + 1] for j in range(w_Tk.shape[1])]) + 1e-20)
    return ids_Tk.astype(jnp.int32), w_Tk * cfg.routed_scaling_factor


class MoE(nn.Module):
    cfg: KimiConfig
    dtype: jnp.dtype
    moe_impl: str = "xla"
    expert_fn: Any = None  # optional override (e.g. sharding.moe_ep): fn(x_TD, ids_Tk, w_Tk, experts, impl) -> y_TD
    # INT4 experts as stored: "checkpoint" (compressed-tensors, kimijax/quant.py), "kernel" (the Triton
    # kernel's tiled planar words + transposed, paired scale words, pallas_kernels/moe_int4.py) or "mgpu" (the
    # Mosaic GPU kernel's thread words, pallas_kernels/moe_int4_mgpu.py); made once by KimiTarget
    expert_layout: str = "checkpoint"

    @nn.compact
    def __call__(self, x_BTD):
        c = self.cfg
        D, F, E = c.hidden_size, c.moe_intermediate_size, c.n_routed_experts
        w_gate_ED = param(self, "gate", (E, D), ("expert", "embed"), self.dtype)
        bias_E = param(self, "e_score_correction_bias", (E,), ("expert",), jnp.float32, init="small")
        if c.experts_int4 and self.expert_layout == "kernel":
            G = c.quant_group_size
            experts = {
                "gate_planar": param(self, "gate_planar", (E, F * D // 128, 16), ("expert", "expert_mlp", "embed_packed"), jnp.int32, init="bits"),
                "gate_scale_t": param(self, "gate_scale_t", (E, D // (2 * G), F), ("expert", "embed_groups", "expert_mlp"), jnp.int32, init="int4_scale_pairs", fan_in=D),
                "up_planar": param(self, "up_planar", (E, F * D // 128, 16), ("expert", "expert_mlp", "embed_packed"), jnp.int32, init="bits"),
                "up_scale_t": param(self, "up_scale_t", (E, D // (2 * G), F), ("expert", "embed_groups", "expert_mlp"), jnp.int32, init="int4_scale_pairs", fan_in=D),
                "down_planar": param(self, "down_planar", (E, D * F // 128, 16), ("expert", "expert_mlp_packed", "embed"), jnp.int32, init="bits"),
                "down_scale_t": param(self, "down_scale_t", (E, F // (2 * G), D), ("expert", "expert_mlp_groups", "embed"), jnp.int32, init="int4_scale_pairs", fan_in=F),
            }
        elif c.experts_int4 and self.expert_layout == "mgpu":
            experts = {  # thread words and their bf16 scales (pallas_kernels/moe_int4_mgpu.py)
                "gu_q": param(self, "gu_q", (E, F // 64, D // 32, 2, 256), ("expert", "expert_mlp", "embed_groups", "tile", "tile"), jnp.int32, init="bits"),
                "gu_s": param(self, "gu_s", (E, F // 64, D // 32, 128), ("expert", "expert_mlp", "embed_groups", "tile"), jnp.bfloat16, init="int4_scale", fan_in=D),
                "dn_q": param(self, "dn_q", (E, D // 64, F // 32, 256), ("expert", "embed", "expert_mlp_groups", "tile"), jnp.int32, init="bits"),
                "dn_s": param(self, "dn_s", (E, D // 64, F // 32, 64), ("expert", "embed", "expert_mlp_groups", "tile"), jnp.bfloat16, init="int4_scale", fan_in=F),
            }
        elif c.experts_int4:
            G = c.quant_group_size
            experts = {
                "gate_packed": param(self, "gate_packed", (E, F, D // 8), ("expert", "expert_mlp", "embed_packed"), jnp.int32, init="bits"),
                "gate_scale": param(self, "gate_scale", (E, F, D // G), ("expert", "expert_mlp", "embed_groups"), jnp.bfloat16, init="int4_scale", fan_in=D),
                "up_packed": param(self, "up_packed", (E, F, D // 8), ("expert", "expert_mlp", "embed_packed"), jnp.int32, init="bits"),
                "up_scale": param(self, "up_scale", (E, F, D // G), ("expert", "expert_mlp", "embed_groups"), jnp.bfloat16, init="int4_scale", fan_in=D),
                "down_packed": param(self, "down_packed", (E, D, F // 8), ("expert", "embed", "expert_mlp_packed"), jnp.int32, init="bits"),
                "down_scale": param(self, "down_scale", (E, D, F // G), ("expert", "embed", "expert_mlp_groups"), jnp.bfloat16, init="int4_scale", fan_in=F),
            }
        else:
            experts = {
                "gate": param(self, "gate_proj", (E, F, D), ("expert", "expert_mlp", "embed"), self.dtype),
                "up": param(self, "up_proj", (E, F, D), ("expert", "expert_mlp", "embed"), self.dtype),
                "down": param(self, "down_proj", (E, D, F), ("expert", "embed", "expert_mlp"), self.dtype),
            }
        B, T, _ = x_BTD.shape
        x_TD = x_BTD.reshape(B * T, D)
        with jax.named_scope("router"):
            ids_Tk, w_Tk = route(x_TD, w_gate_ED, bias_E, c)
        with jax.named_scope("experts"):
            if self.expert_fn is not None:
                y_TD = self.expert_fn(x_TD, ids_Tk, w_Tk, experts, self.moe_impl)
            else:
                y_TD = moe(x_TD, ids_Tk, w_Tk, experts, impl=self.moe_impl)
        with jax.named_scope("shared_expert"):
            shared = MLP(D, F * c.n_shared_experts, self.dtype, name="shared_experts")(x_BTD) if c.n_shared_experts else 0
        self.sow("intermediates", "expert_ids", ids_Tk.reshape(B, T, -1))
        return y_TD.reshape(B, T, D) + shared
