"""Llama-family target (SmolLM2, Llama 2/3 without rope scaling) behind the same interface as KimiTarget.

Architecture: token embedding, N x [RMSNorm -> GQA attention with NeoX ("half") rope -> residual,
RMSNorm -> SwiGLU MLP -> residual], final RMSNorm, tied or untied lm_head. Parameters are kept in the
HF layout (q/k rows in HF order, so `apply_rope_half` is the right rotation); the GGUF loader undoes
llama.cpp's Q/K row permutation (kimijax/gguf_loading.py).

KV cache: one array per layer, [B, L, 2, Hkv, hd] in the model dtype; slot j holds the rotated key (index 0)
and the value (index 1) of the token at cache slot j. Visibility is the tree-attention rule of
`pallas_kernels.tree_attention.visibility_mask`: slots < lengths[b] always visible, the T new rows (written
at lengths..lengths+T-1 before attending) visible per the tree mask, anything else invisible.

Names: B batch, T tokens this pass, L cache slots, D model dim, H query heads, k kv heads, g query heads
per kv head, e head dim, F mlp hidden, V vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from kimijax.config import ConfigError
from kimijax.models.common import (MLP, RMSNorm, apply_rope_half, causal_rows, causal_tree_mask, in_query_chunks,
                                   param, rope_cos_sin)
from kimijax.target import TargetBase
from pallas_kernels import skinny_mlp
from pallas_kernels.gqa_attention import gqa_tree_attention, kernel_supports
from pallas_kernels.row_move import write_rows
from pallas_kernels.tree_attention import visibility_mask

_DTYPES = ("bfloat16", "float32", "float16")


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """A Llama-architecture decoder. Defaults: SmolLM2-135M-Instruct (as its GGUF metadata says)."""
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    eos_token_ids: tuple[int, ...] = (2, 0)
    bos_token_id: int | None = 1
    dtype: str = "bfloat16"

    def __post_init__(self):
        for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = getattr(self, k)
            if not isinstance(v, (int, np.integer)) or v < 1:
                raise ConfigError(f"LlamaConfig.{k}={v!r} must be a positive int")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                              f"num_key_value_heads={self.num_key_value_heads}")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even (rope rotates pairs)")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta} must be > 0")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"dtype {self.dtype!r} not in {_DTYPES}")
        bad = [i for i in self.eos_token_ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ConfigError(f"eos token id {bad[0]} outside the vocabulary [0, {self.vocab_size})")

    @property
    def q_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def inv_freq(self) -> np.ndarray:
        """Rope inverse frequencies [head_dim/2] float32 (plain rope, no scaling)."""
        e = self.head_dim
        return (1.0 / (self.rope_theta ** (np.arange(0, e, 2, dtype=np.float32) / np.float32(e)))).astype(np.float32)


SMOLLM2_135M = LlamaConfig()
#: A tiny config for tests (vocab covers the SmolLM2 tokenizer's special ids 0..16).
TINY_LLAMA = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                         max_position_embeddings=1024, eos_token_ids=(2,), dtype="float32")


def matmul_precision(dtype):
    """float32 models ask for true f32 dots (no TF32 on GPUs), so that a tree-verify pass and an AR step give
    the same greedy tokens; 16-bit models use the backend default."""
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == jnp.float32 else None


def gqa_attention(q_BTHe, k_BSke, v_BSke, mask_BTS, scale: float, precision=None):
    """Grouped-query attention: query head h reads kv head h // g (HF repeat_kv order). -> [B, T, H, e].
    mask_BTS None = causal over this pass's keys. Long prompts go in query chunks (bounded scores)."""
    B, T, H, E = q_BTHe.shape
    S, KV = k_BSke.shape[1], k_BSke.shape[2]

    def one(q_BCHe, t0, mask_BCS):
        C = q_BCHe.shape[1]
        if mask_BCS is None:
            mask_BCS = causal_rows(t0, C, S, B)
        q_BCkge = q_BCHe.reshape(B, C, KV, H // KV, E)
        s = jnp.einsum("btkge,bske->bkgts", q_BCkge, k_BSke, preferred_element_type=jnp.float32,
                       precision=precision) * scale
        s = jnp.where(mask_BCS[:, None, None], s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v_BSke.dtype)
        o = jnp.einsum("bkgts,bske->btkge", p, v_BSke, preferred_element_type=jnp.float32, precision=precision)
        return o.astype(q_BTHe.dtype).reshape(B, C, H, E)

    return in_query_chunks(one, (q_BTHe,), mask_BTS, B * H * S)


def _skinny_linear(x_BTD, w_ND, impl):
    """x @ w.T -> [B, T, N] through pallas_kernels/skinny_mlp.linear_pallas (f32 passes of <= MAX_ROWS rows)."""
    B, T, D = x_BTD.shape
    y = skinny_mlp.linear_pallas(x_BTD.reshape(B * T, D), w_ND, interpret=impl == "interpret")
    return y.reshape(B, T, -1).astype(x_BTD.dtype)


class LlamaAttention(nn.Module):
    cfg: LlamaConfig
    dtype: Any
    attn_impl: str = "xla"  # decode / verify attention over the cache: "xla", "pallas" or "interpret"
    proj_impl: str = "xla"  # experiment: the q/k/v/o projections of f32 passes of <= 64 rows as skinny kernels

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache=None, lengths_B=None, tree_mask_BTT=None, *,
                 from_cache: bool = False):
        c, dt = self.cfg, self.dtype
        D, H, KV, E = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        w_q = param(self, "q_proj", (H, E, D), ("heads", "head_dim", "embed"), dt)
        w_k = param(self, "k_proj", (KV, E, D), ("kv_heads", "head_dim", "embed"), dt)
        w_v = param(self, "v_proj", (KV, E, D), ("kv_heads", "head_dim", "embed"), dt)
        w_o = param(self, "o_proj", (D, H, E), ("embed", "heads", "head_dim"), dt, fan_in=H * E)
        B, T, _ = x_BTD.shape
        g = H // KV
        pr = matmul_precision(dt)
        # The attention kernel takes the queries grouped per kv head, [B, KV, T*g, e]: projected straight into
        # that layout (and the output projected straight from it) instead of transposing on each side.
        kernel = from_cache and self.attn_impl != "xla"
        skinny = self.proj_impl != "xla" and x_BTD.dtype == jnp.float32 and B * T <= skinny_mlp.MAX_ROWS
        with jax.named_scope("attn_proj"):
            cos, sin = rope_cos_sin(positions_BT, c.inv_freq(), 1.0)
            if skinny:  # one row's bits do not depend on the pass's other rows (skinny_mlp docstring)
                q = _skinny_linear(x_BTD, w_q.reshape(H * E, D), self.proj_impl).reshape(B, T, H, E)
                k = _skinny_linear(x_BTD, w_k.reshape(KV * E, D), self.proj_impl).reshape(B, T, KV, E)
                v = _skinny_linear(x_BTD, w_v.reshape(KV * E, D), self.proj_impl).reshape(B, T, KV, E)
                if kernel:
                    q = q.reshape(B, T, KV, g, E).transpose(0, 2, 1, 3, 4)
                    q = apply_rope_half(q, cos[:, None, :, None], sin[:, None, :, None])
                else:
                    q = apply_rope_half(q, cos[:, :, None], sin[:, :, None])
                k = apply_rope_half(k, cos[:, :, None], sin[:, :, None])
            elif kernel:
                q_BktgE = jnp.einsum("btd,kged->bktge", x_BTD, w_q.reshape(KV, g, E, D), precision=pr)
                q = apply_rope_half(q_BktgE, cos[:, None, :, None], sin[:, None, :, None])
            else:
                q = apply_rope_half(jnp.einsum("btd,hed->bthe", x_BTD, w_q, precision=pr), cos[:, :, None],
                                    sin[:, :, None])
            if not skinny:
                k = apply_rope_half(jnp.einsum("btd,ked->btke", x_BTD, w_k, precision=pr), cos[:, :, None],
                                    sin[:, :, None])
                v = jnp.einsum("btd,ked->btke", x_BTD, w_v, precision=pr)
        if cache is not None:
            cache = write_rows(cache, jnp.stack([k, v], axis=2), lengths_B)  # capacity: checked by the engine
        with jax.named_scope("attn"):
            if from_cache:  # the committed prefix plus this pass's rows, as written above
                if tree_mask_BTT is None:
                    tree_mask_BTT = causal_tree_mask(B, T)
                if kernel:  # one kernel reading the cache in place
                    o = gqa_tree_attention(q.reshape(B, KV, T * g, E), cache, lengths_B, tree_mask_BTT, E ** -0.5,
                                           impl=self.attn_impl)
                    if skinny:
                        o = o.reshape(B, KV, T, g, E).transpose(0, 2, 1, 3, 4).reshape(B, T, H * E)
                        return _skinny_linear(o, w_o.reshape(D, H * E), self.proj_impl), cache
                    return jnp.einsum("bktge,dkge->btd", o.reshape(B, KV, T, g, E), w_o.reshape(D, KV, g, E),
                                      precision=pr), cache
                mask = visibility_mask(lengths_B, tree_mask_BTT, cache.shape[1])
                o = gqa_attention(q, cache[:, :, 0], cache[:, :, 1], mask, E ** -0.5, pr)
            else:  # this pass's own tokens only (full forward, prefill from an empty cache)
                dc = dt if cache is None else cache.dtype
                o = gqa_attention(q, k.astype(dc), v.astype(dc), tree_mask_BTT, E ** -0.5, pr)
        if skinny:
            return _skinny_linear(o.reshape(B, T, H * E), w_o.reshape(D, H * E), self.proj_impl), cache
        return jnp.einsum("bthe,dhe->btd", o, w_o, precision=pr), cache


class LlamaLayer(nn.Module):
    cfg: LlamaConfig
    dtype: Any
    attn_impl: str = "xla"
    mlp_impl: str = "xla"
    proj_impl: str = "xla"

    @nn.compact
    def __call__(self, x_BTD, positions_BT, cache, lengths_B, tree_mask_BTT, from_cache):
        c = self.cfg
        h = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="input_layernorm")(x_BTD)
        attn = LlamaAttention(c, self.dtype, self.attn_impl, self.proj_impl, name="self_attn")
        a, cache = attn(h, positions_BT, cache, lengths_B, tree_mask_BTT, from_cache=from_cache)
        x_BTD = x_BTD + a
        h = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="post_attention_layernorm")(x_BTD)
        with jax.named_scope("mlp"):
            f = MLP(c.hidden_size, c.intermediate_size, self.dtype, matmul_precision(self.dtype), self.mlp_impl,
                    name="mlp")(h)
        return x_BTD + f, cache


class Llama(nn.Module):
    """Param tree: embed_tokens [V, D], layers_{i}/{input_layernorm, self_attn/{q,k,v,o}_proj,
    post_attention_layernorm, mlp/{gate,up,down}_proj}, norm, and lm_head [V, D] when untied."""
    cfg: LlamaConfig
    attn_impl: str = "xla"
    mlp_impl: str = "xla"
    proj_impl: str = "xla"

    @property
    def dtype(self):
        return jnp.dtype(self.cfg.dtype)

    def setup(self):
        c = self.cfg
        self.embed_tokens = param(self, "embed_tokens", (c.vocab_size, c.hidden_size), ("vocab", "embed"),
                                  self.dtype, init="normal")
        self.layers = [LlamaLayer(c, self.dtype, self.attn_impl, self.mlp_impl, self.proj_impl, name=f"layers_{i}")
                       for i in range(c.num_hidden_layers)]
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps, self.dtype, name="norm")
        if not c.tie_word_embeddings:
            self.lm_head = param(self, "lm_head", (c.vocab_size, c.hidden_size), ("vocab", "embed"), self.dtype)

    def embed(self, tokens_BT):
        return jnp.take(self.embed_tokens, tokens_BT, axis=0)

    def logits(self, h_BTD, exact: bool = True):
        """lm_head (the embedding when tied) over already-normed hidden states -> f32 logits.
        exact=False lets a float32 model use the backend's fast dot (TF32 on GPUs): for draft logits only."""
        w = self.embed_tokens if self.cfg.tie_word_embeddings else self.lm_head
        return jnp.einsum("btd,vd->btv", h_BTD.astype(w.dtype), w, preferred_element_type=jnp.float32,
                          precision=matmul_precision(w.dtype) if exact else None)

    def __call__(self, tokens_BT, positions_BT, caches=None, lengths_B=None, tree_mask_BTT=None, *,
                 from_cache: bool = False, capture_layers: tuple[int, ...] = ()):
        """-> (final normed hidden [B,T,D], caches or None, captured [len(capture_layers), B, T, D])."""
        x_BTD = self.embed(tokens_BT)
        outs = {}
        new_caches = []
        want = set(capture_layers)
        for i, layer in enumerate(self.layers):
            with jax.named_scope(f"layer_{i}"):
                x_BTD, cache = layer(x_BTD, positions_BT, None if caches is None else caches[i], lengths_B,
                                     tree_mask_BTT, from_cache)
            new_caches.append(cache)
            if i in want:
                outs[i] = x_BTD
        cap = jnp.stack([outs[l] for l in capture_layers]) if capture_layers \
            else jnp.zeros((0,) + x_BTD.shape, x_BTD.dtype)
        return self.norm(x_BTD), (None if caches is None else new_caches), cap

    def init_all(self, tokens_BT):
        """Touches every parameter (used by init)."""
        h, _, _ = self(tokens_BT, jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape))
        return self.logits(h)


@dataclasses.dataclass
class LlamaTarget(TargetBase):
    """A Llama-family target with KimiTarget's interface (see kimijax/target.py)."""
    PREFILL_MODE = {"from_cache": False}
    cfg: LlamaConfig
    params: Any
    tokenizer: Any = None
    name: str = "llama"
    random_weights: bool = False
    source: str = ""
    attn_impl: str | None = None  # None: the kernel on GPU, the XLA reference elsewhere (KIMIJAX_KERNELS overrides)
    # "xla", or the experimental skinny MLP kernels ("pallas" / "interpret") for f32 passes of <= 256 rows (decode
    # steps, verifies up to C=32 b4); XLA until a GPU run shows they pay (pallas_kernels/skinny_mlp.py)
    mlp_impl: str = "xla"
    proj_impl: str = "xla"  # the same experiment for the attention's q/k/v/o projections (skinny_mlp.linear_pallas)

    def __post_init__(self):
        if self.attn_impl is None:
            from kimijax.loading import default_kernel_impl
            self.attn_impl = default_kernel_impl("gqa_attention")
            if self.attn_impl == "pallas" and not kernel_supports(self.cfg.head_dim):
                self.attn_impl = "xla"  # the default falls back; an explicit "pallas" is refused below
        if self.attn_impl not in ("xla", "pallas", "interpret"):
            raise ConfigError(f"attn_impl {self.attn_impl!r} must be xla, pallas or interpret")
        if self.attn_impl == "pallas" and not kernel_supports(self.cfg.head_dim):
            raise ConfigError(f"the GQA attention kernel needs a power-of-two head_dim >= 16, this model has "
                              f"{self.cfg.head_dim}: use attn_impl='xla'")
        for k in ("mlp_impl", "proj_impl"):
            if getattr(self, k) not in ("xla", "pallas", "interpret"):
                raise ConfigError(f"{k} {getattr(self, k)!r} must be xla, pallas or interpret")
        self.module = Llama(self.cfg, self.attn_impl, self.mlp_impl, self.proj_impl)
        self._forward = jax.jit(self._forward_fn)

    def init_cache(self, B: int, L: int):
        c = self.cfg
        return [jnp.zeros((B, L, 2, c.num_key_value_heads, c.head_dim), self.dtype) for _ in range(self.num_layers)]

    # ---- pure functions (TargetBase: embed, head, prefill, forward)
    def draft_head(self, params, h_BTD):
        """The lm_head for the drafter's logits. Those only rank draft candidates, which the exact target then
        verifies, so they need no true-f32 dot: at C=32 x 15 draft slots x 49k vocab the f32 dot took 0.6 ms of
        a 6.8 ms DDTree round on the H200 (benchmarks/2026-12-04 profile), TF32 tensor cores do it far faster."""
        return self._apply(params, h_BTD, False, method=Llama.logits)

    def verify(self, params, caches, tokens_BT, positions_BT, lengths_B, tree_mask_BTT, capture=(),
               with_experts: bool = False):
        """T new tokens at cache slots lengths..lengths+T-1 over the committed cache, tree-masked.
        -> (logits [B,T,V] f32, caches, captured[, expert ids: empty, a dense model has none])."""
        h, caches, cap = self._apply(params, tokens_BT, positions_BT, caches, lengths_B, tree_mask_BTT,
                                     from_cache=True, capture_layers=tuple(capture))
        logits = self.head(params, h)
        if with_experts:
            return logits, caches, cap, jnp.zeros((0,), jnp.int32)
        return logits, caches, cap


# ---------------------------------------------------------------- random weights (tests, benchmarks)
def abstract_llama_params(cfg: LlamaConfig):
    """ShapeDtypeStructs with logical axis names (boxed), without allocating anything."""
    module = Llama(cfg)
    toks = jnp.zeros((1, 2), jnp.int32)
    return jax.eval_shape(lambda k: module.init(k, toks, method=Llama.init_all), jax.random.PRNGKey(0))["params"]


def random_llama_params(cfg: LlamaConfig, seed: int = 0):
    """Random weights drawn on the host (numpy; nothing to compile): matrices ~ N(0, 1/fan_in), the embedding
    ~ N(0, 1), norm weights 1 + N(0, 0.1^2) (perturbed around 1 so that a dropped norm shows in tests)."""
    from flax.core import meta

    rng = np.random.default_rng(seed)
    dt = jnp.dtype(cfg.dtype)

    def draw(path, leaf):
        names = [getattr(p, "key", str(p)) for p in path]
        shape = tuple(leaf.shape)
        if names[-1] == "weight":
            a = 1.0 + 0.1 * rng.standard_normal(shape, np.float32)
        elif names[-1] == "embed_tokens":
            a = rng.standard_normal(shape, np.float32)
        else:
            fan_in = int(np.prod(shape[1:])) if names[-1] == "o_proj" else shape[-1]
            a = rng.standard_normal(shape, np.float32) / np.sqrt(fan_in)
        return jnp.asarray(a.astype(dt))

    return jax.tree_util.tree_map_with_path(draw, meta.unbox(abstract_llama_params(cfg)))


def random_llama_target(cfg: LlamaConfig = TINY_LLAMA, seed: int = 0, tokenizer=None,
                        attn_impl: str | None = None, mlp_impl: str = "xla") -> LlamaTarget:
    """A LlamaTarget with random weights (tests with tiny configs, benchmarks at real shapes)."""
    return LlamaTarget(cfg, random_llama_params(cfg, seed), tokenizer=tokenizer, name="llama-random",
                       random_weights=True, source="random", attn_impl=attn_impl, mlp_impl=mlp_impl)


__all__ = ["LlamaConfig", "Llama", "LlamaTarget", "SMOLLM2_135M", "TINY_LLAMA", "gqa_attention",
           "abstract_llama_params", "random_llama_params", "random_llama_target"]
