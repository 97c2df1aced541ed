"""kimijax: JAX/XLA inference for Kimi K2.6 with DFlash drafting and DDTree tree-speculative decoding.

Public API:
  load_target(path_or_preset)          Kimi K2.x target from a HF checkpoint dir, an orbax save or a preset
  forward(target, tokens_BT)           full-sequence f32 logits [B, T, V] (no cache)
  Engine(target, drafter=None, method="ar"|"dflash"|"ddtree", budget=8, topk_cap=None, draft_window=None,
         round_kernels=RoundKernels(tree="xla", commit="xla"))   # opt-in round kernels (experiments)
      .generate(prompts, max_new_tokens=..., temperature=0.0, top_p=1.0, top_k=0, seed=0)
  load_drafter(path, target)           DFlash drafter (z-lab checkpoint format)

Shape-suffix glossary (names like x_BTD, w_HNK): B batch, T tokens in this pass, S committed length,
L cache slots, D model dim, H heads, Q q_lora rank, K kv_lora (latent) rank, R rope dim, N nope dim
(attention) or tree nodes (spec), V vocab (or v_head dim in attention), C latent row (K + R),
E experts, F expert hidden, k experts per token, M output buffer, P path length.
"""

from __future__ import annotations

import jax.numpy as jnp

from kimijax.config import KimiConfig, ConfigError
from kimijax.loading import CheckpointError, load_target, save_params
from kimijax.engine import Engine, EngineError, GenerationResult
from kimijax.spec.kernels import RoundKernels


def forward(target, tokens_BT):
    """Full-sequence forward without a cache -> float32 logits [B, T, V]."""
    return target.forward(jnp.asarray(tokens_BT, jnp.int32))


def load_drafter(path, target, **kw):
    from kimijax.models.drafter import load_drafter as _load
    return _load(path, target, **kw)


__all__ = ["KimiConfig", "ConfigError", "CheckpointError", "EngineError", "Engine", "GenerationResult", "RoundKernels",
           "load_target", "load_drafter", "forward", "save_params"]
